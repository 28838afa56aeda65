"""The planner behind `plan="auto"` (`docs/design.md` lists its modules in order)."""

from .model import TimeModel as TimeModel
from .plan import Plan as Plan
from .planner import (
    default_planner as default_planner,
    plan_options as plan_options,
    PlanMode as PlanMode,
    Planner as Planner,
)
