"""What one plan is for (`Request`), and the `Plan` made for it (`plan_for`): by
the search or read back from the disk cache (`auto_plan`), or of a fixed nest."""

import dataclasses
from typing import Any

from ._candidates import collective_dims, given_dims
from ._plan import dims_of, Plan, PlanCandidate, ShardDim
from ._resolve import Call
from ._time_model import TimeModel


@dataclasses.dataclass(frozen=True)
class Request:
    """What one plan is for: a resolved call; its mapped sizes as one device sees
    them and its sharded dims (`localize`); the memory budget and where it came
    from; whether the nest is differentiated; the time model; whether the planner
    measures; and the time model as the disk cache's keys hold it (`None`: its
    constants)."""

    call: Call
    sizes: dict[str, int]
    shard: tuple[ShardDim, ...]
    budget: int
    source: str
    backward: bool
    model: TimeModel
    measure: bool = False
    model_key: Any = None


def plan_for(
    call: Call,
    sizes: dict[str, int],
    chosen: PlanCandidate,
    candidates: tuple[PlanCandidate, ...],
    **fields: Any,
) -> Plan:
    """The `Plan` of `call` at its mapped `sizes` (as one device sees them): the
    nest chosen among `candidates`, and the other `fields` of `Plan`."""
    return Plan(
        fun_name=call.fun_name,
        sizes=tuple({**call.sizes, **sizes}.items()),
        dims=dims_of(chosen, sizes),
        chosen=chosen,
        candidates=candidates,
        **fields,
    )


def auto_plan(
    request: Request,
    chosen: PlanCandidate,
    candidates: tuple[PlanCandidate, ...],
    **fields: Any,
) -> Plan:
    """The `Plan` of `plan="auto"`: planned now, or read from the disk cache."""
    call = request.call
    return plan_for(
        call,
        request.sizes,
        chosen,
        candidates,
        auto=True,
        budget_bytes=request.budget,
        budget_source=request.source,
        shard=request.shard,
        backward=request.backward,
        given=given_dims(call),
        collective=collective_dims(call),
        **fields,
    )
