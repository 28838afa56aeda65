"""The planner behind `plan="auto"`: which dims to scan, in which order, in which
chunks, under a memory budget. Read in this order (each module imports only those
before it):

- `model`: the time model and its calibration, per machine.
- `plan`: a plan, its candidates, and how `explain` prints them.
- `cost`: compiling a candidate for its memory and costs, predicting the others
  from full vmap, and timing them (measured mode).
- `space`: the candidates (ladders of chunk sizes per dim order), the budget, the
  request, and why a candidate was not chosen.
- `search`: which candidates to compile, and which to choose.
- `cache`: plans on disk.
- `planner`: `Planner`, which owns the caches and the time model.
"""

from .model import TimeModel as TimeModel
from .plan import Plan as Plan
from .planner import (
    default_planner as default_planner,
    describe_fixed as describe_fixed,
    plan_options as plan_options,
    PlanMode as PlanMode,
    Planner as Planner,
)
