"""The planner behind `plan="auto"`: its modules, each importing only those before
it, are listed in `docs/design.md`."""

from .model import TimeModel as TimeModel
from .plan import Plan as Plan
from .planner import (
    default_planner as default_planner,
    describe_fixed as describe_fixed,
    plan_options as plan_options,
    PlanMode as PlanMode,
    Planner as Planner,
)
