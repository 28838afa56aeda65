"""Why a plan is what it is: its summary sentence, a reason per candidate, and the
error when no candidate fits."""

import dataclasses

from ._budget import over_budget
from ._candidates import given_dims
from ._measure import KEEP_WITHIN, MAX_MEASURED
from ._plan import PlanCandidate
from ._resolve import Call
from ._time_model import TimeModel
from ._timing import fmt_bytes, fmt_seconds


def summary(
    chosen: PlanCandidate,
    full: PlanCandidate,
    compared: list[PlanCandidate],
    timed: dict[tuple, float],
    searched: bool,
    free: bool,
    budget: int,
    model: TimeModel,
    sizes: dict[str, int],
    measure_note: str,
) -> str:
    """One sentence: what was chosen, and why."""
    nest = chosen.nest(sizes)
    temp, b = fmt_bytes(full.temp_bytes or 0), fmt_bytes(budget)
    if not free:
        return (
            f"Chose {nest}: every mapped dim has a strategy given (`scan=`, `vmap=`, "
            f"`shard=`), so there was nothing to plan; it needs {temp} of the {b} "
            "budget."
        )
    whole = "full vmap" if full.source == "full vmap" else "vmapping every planned dim"
    if not searched:
        return (
            f"Chose {nest}: {whole} fits the budget ({temp} <= {b}) and reuses its "
            "temporaries from call to call, so nothing else was compiled."
        )
    if not full.fits:
        why = f"{whole} needs {temp} > {b} budget"
    elif full.fresh_bytes:
        threshold = fmt_bytes(model.fresh_threshold or 0)
        why = (
            f"{whole} fits ({temp} <= {b}) but allocates {temp} afresh on every "
            f"call (above {threshold})"
        )
    else:
        why = f"{whole} fits ({temp} <= {b})"
    n = len(compared)
    if timed and timed[chosen.key] > min(timed.values()):
        how = (
            f"of the {n} candidates that fit and were timed, this one, the time "
            f"model's choice, measured {fmt_seconds(timed[chosen.key])}, within "
            f"{KEEP_WITHIN}x of the fastest ({fmt_seconds(min(timed.values()))}), "
            "so it was kept"
        )
    elif timed:
        others = sorted(t for k, t in timed.items() if k != chosen.key)
        nxt = f"; next {fmt_seconds(others[0])}" if others else ""
        how = (
            f"of the {n} candidates that fit and were timed, this one was the "
            f"fastest (measured {fmt_seconds(timed[chosen.key])}{nxt})"
        )
    elif n == 1:
        reuses = ""
        if model.fresh_threshold is not None and not chosen.fresh_bytes:
            reuses = " and reuses its temporaries from call to call"
        how = (
            f"it is the largest block that fits{reuses}, and the only candidate "
            "costed (smaller blocks loop more)"
        )
        if chosen.predicted:
            how = (
                f"it is the largest block predicted far within its limits{reuses} "
                "(larger ones that fit are est. at most 5% faster: not worth a "
                "compile), and the only candidate costed"
            )
        if measure_note:
            how += f" ({measure_note})"
    else:
        how = (
            f"of the {n} candidates that fit and were costed, this one is the "
            "fastest by the time model's estimate"
        )
        if measure_note:
            how += f" ({measure_note})"
    return f"Chose {nest}: {why}; {how}."


def with_reason(
    c: PlanCandidate,
    chosen: PlanCandidate,
    note: str | None,
    timed: dict[tuple, float],
    measure: bool,
    budget: int,
    compared: list[PlanCandidate],
) -> PlanCandidate:
    """`c` with the reason it was, or was not, chosen (and its measured time)."""
    measured = timed.get(c.key)
    c = dataclasses.replace(c, measured=measured)
    if c.key == chosen.key:
        if measured is not None and measured > min(timed.values()):
            why = (
                f"chosen: the time model's choice, measured within {KEEP_WITHIN}x "
                f"of the fastest ({fmt_seconds(measured)} vs "
                f"{fmt_seconds(min(timed.values()))})"
            )
        elif measured is not None:
            why = f"chosen: fastest measured ({fmt_seconds(measured)})"
        elif c.temp_bytes is None:
            why = "chosen: nothing to compile"
        elif len(compared) <= 1:
            why = "chosen: the only candidate that fits and was costed"
        else:
            why = "chosen: fastest by the estimate"
        if c.predicted:
            far = note or "far within the budget"
            why += f"; its temporaries predicted from full vmap's, not compiled: {far}"
        return dataclasses.replace(c, reason=why)
    if c.temp_bytes is None:
        return dataclasses.replace(c, reason=note or "not compiled")
    if not c.fits:
        return dataclasses.replace(
            c,
            reason=f"over budget: {over_budget(c.temp_bytes, budget)}",
        )
    if measured is not None and chosen.key in timed:
        vs = f"measured {fmt_seconds(measured)} vs {fmt_seconds(timed[chosen.key])}"
        why = (
            f"faster, {vs}, but within {KEEP_WITHIN}x: the time model's choice "
            "was kept"
            if measured < timed[chosen.key]
            else f"slower: {vs}"
        )
    elif c.seconds is not None and chosen.seconds is not None:
        est = f"est. {fmt_seconds(c.seconds)} vs {fmt_seconds(chosen.seconds)}"
        why = (
            f"not measured: {est}, not among the {MAX_MEASURED} measured"
            if measure and timed
            else f"slower ({est})"
        )
    else:
        why = note or (
            "fits, not costed: a smaller block than the largest that fits in its ladder"
        )
    return dataclasses.replace(c, reason=why)


class NoFit(Exception):
    """No candidate fits the budget: the error's message, the smallest candidate
    compiled, and how many were."""

    def __init__(self, message: str, smallest: PlanCandidate, n: int):
        super().__init__(message)
        self.smallest = smallest
        self.n = n


def no_fit_message(
    call: Call,
    budget: int,
    smallest: PlanCandidate,
    n: int,
    sizes: dict[str, int],
    backward: bool,
) -> str:
    """The `SpecError` message when no candidate fits the budget."""
    what = "the derivative (reverse mode) of " if backward else ""
    given = ""
    if given_dims(call):
        given = " (or give fewer dims a strategy in `scan=`/`vmap=`)"
    return (
        f"`{call.fun_name}` with `plan='auto'`: no nest fits "
        f"`memory_budget={call.options.plan.memory_budget!r}` ({fmt_bytes(budget)} "
        f"of temporary memory){' under differentiation' if backward else ''}. The "
        f"smallest of the {n} compiled candidates needs "
        f"{fmt_bytes(smallest.temp_bytes or 0)} for {what}{smallest.nest(sizes)}. "
        f"Raise `memory_budget`, or map fewer dims{given}."
    )
