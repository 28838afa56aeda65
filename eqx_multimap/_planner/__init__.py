"""The planner behind `plan="auto"`. Each module imports only those before it:
`model` (the time model), `plan` (a plan and its text), `cost` (a candidate's memory
and costs, compiled, predicted or timed), `space` (the candidates, the budget, the
reasons), `search` (which to compile, which to choose), `cache` (plans on disk) and
`planner` (`Planner`, which owns the caches and the time model)."""

from .model import TimeModel as TimeModel
from .plan import Plan as Plan
from .planner import (
    default_planner as default_planner,
    describe_fixed as describe_fixed,
    plan_options as plan_options,
    PlanMode as PlanMode,
    Planner as Planner,
)
