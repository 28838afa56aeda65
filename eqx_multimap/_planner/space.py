"""The planner's search space and its words: the budget, the candidate nests
(`ladder`s, in a few `dim_orders`), a plan's `Request`, and the texts that say why."""

import contextlib
import dataclasses
import itertools as it
import math
import os
from typing import Any, NamedTuple

import jax

from .._errors import SpecError
from .._resolve import Call
from .._text import fmt_bytes, fmt_seconds
from .model import TimeModel
from .plan import Plan, PlanCandidate, ScanNest, ShardDim


Sizes = dict[str, int]
Names = tuple[str, ...]
Candidates = tuple[PlanCandidate, ...]
MemoryBudget = int | float | None
"""Bytes as an `int`, a fraction of device memory as a `float` in `(0, 1]`."""

DEFAULT_BUDGET_FRACTION = 0.5
"""The budget when `plan="auto"` is given without `memory_budget`."""


def check_budget(plan: Any, memory_budget: Any) -> None:
    """Check `memory_budget=` when decorating: it needs `plan=`; bytes or a fraction."""
    b = memory_budget
    if plan is None:
        raise SpecError(
            f"`filter_multi_vmap(..., memory_budget={b!r})` is only used by the "
            "planner: pass `plan='auto'` too, or drop `memory_budget`."
        )
    is_bytes = isinstance(b, int) and not isinstance(b, bool) and b >= 1
    if not (is_bytes or isinstance(b, float) and 0.0 < b <= 1.0):
        raise SpecError(
            "`filter_multi_vmap(..., memory_budget=...)` must be a positive `int` "
            "(bytes) or a `float` in (0, 1] (a fraction of device memory), but got "
            f"{b!r} of type `{type(b).__name__}`; e.g. `memory_budget=2**30` is 1 GiB."
        )


def resolve_budget(memory_budget: MemoryBudget) -> tuple[int, str]:
    """The budget in bytes, and where it came from: as given, or a fraction of the
    first device's memory (of physical RAM where the device reports none)."""
    if isinstance(memory_budget, int):
        return memory_budget, f"memory_budget={memory_budget}"
    fraction = DEFAULT_BUDGET_FRACTION if memory_budget is None else memory_budget
    device, total = jax.local_devices()[0], 0
    with contextlib.suppress(Exception):  # some backends do not implement it
        total = int((device.memory_stats() or {}).get("bytes_limit") or 0)
    where = f"memory of {device}"
    if not total:
        where = (
            f"physical RAM (os.sysconf), as {device.platform} reports no device memory"
        )
        with contextlib.suppress(ValueError, OSError, AttributeError):  # Windows
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if total <= 0:
        raise SpecError(
            f"`filter_multi_vmap(..., plan='auto')`: a fractional `memory_budget` "
            f"needs the memory size of {device}, which is unavailable, and so is the "
            "size of physical RAM; give the budget in bytes as an `int`."
        )
    given = "default " if memory_budget is None else ""
    return int(total * fraction), (
        f"{given}memory_budget={fraction:g} of {fmt_bytes(total)} {where}"
    )


def chunk_options(n: int) -> list[int | None]:
    """Chunk sizes for a dim of size `n`, largest first (`None`: one at a time):
    `n / m` for `m = 2, 4, 8, ...`, moved to a divisor within `sqrt(2)` if any (no
    remainder block)."""
    pairs = [(d, n // d) for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    divisors = {x for pair in pairs for x in pair if 2 <= x <= n // 2}
    out: list[int] = []
    m = 2
    while n // m >= 2:
        ideal = n / m
        near = [d for d in divisors if ideal / 2**0.5 <= d <= ideal * 2**0.5]
        c = min(near, key=lambda d: abs(math.log(d / ideal))) if near else n // m
        out.append(c)
        m *= 2
    return [*dict.fromkeys(out), None]


def block_and_trips(scan: ScanNest, vmap: Names, sizes: Sizes) -> tuple[int, int]:
    """The elements of one loop iteration, and the number of iterations."""
    block = math.prod(sizes[n] for n in vmap) * math.prod(k or 1 for _, k in scan)
    trips = math.prod(max(1, sizes[n] // k) if k else sizes[n] for n, k in scan)
    return block, trips


def candidate(scan: ScanNest, vmap: Names, sizes: Sizes, source: str) -> PlanCandidate:
    return PlanCandidate(scan, vmap, *block_and_trips(scan, vmap, sizes), source)


def ladder(
    order: Names,
    layout: Names,
    sizes: Sizes,
    fixed: ScanNest = (),
    frozen: frozenset[str] = frozenset(),
) -> list[PlanCandidate]:
    """Scanned candidates, largest block first (full vmap excluded): inside the
    `fixed` scans, a prefix of `order` (`frozen` dims and dims of size 1 skipped)
    scanned, its last dim in chunks; the other dims vmapped in `layout`'s order."""
    scannable = [n for n in order if sizes[n] > 1 and n not in frozen]
    out = []
    for k, inner in enumerate(scannable):
        scanned = {n for n, _ in fixed}.union(scannable[: k + 1])
        vmap = tuple(n for n in layout if n not in scanned)
        for chunk in chunk_options(sizes[inner]):
            scan = fixed + tuple((n, None) for n in scannable[:k]) + ((inner, chunk),)
            out.append(candidate(scan, vmap, sizes, "ladder"))
    out.sort(key=lambda c: -c.block)  # stable: fewer scanned dims first on ties
    return out


MAX_ORDERS = 24
"""The most dim orders measured mode searches (every order of up to 4 dims)."""


def dim_orders(
    call: Call, sizes: Sizes, names: Names | None = None, every: bool = False
) -> list[Names]:
    """Orders to scan the mapped dims (or `names`) in: the first output's (the
    layout: stacking needs no transpose), the inputs' (slicing a leading axis needs no
    copy), largest first (fewest scans); with `every`, all others, to `MAX_ORDERS`."""
    mapped = call.mapped if names is None else names
    names_out = call.out.dims[0].names if call.out.dims else ()
    first = [n for n in names_out if n in mapped]
    layout = tuple(first) + tuple(n for n in mapped if n not in first)
    inputs = tuple(n for n in call.check.seen if n in mapped)
    inputs += tuple(n for n in mapped if n not in inputs)
    by_size = tuple(sorted(layout, key=lambda n: -sizes[n]))
    orders = [layout, inputs, by_size]
    if every:
        orders += it.islice(it.permutations(layout), MAX_ORDERS)
    return list(dict.fromkeys(orders))[: MAX_ORDERS if every else None]


def localize(call: Call) -> tuple[dict[str, int], tuple[ShardDim, ...]]:
    """The mapped sizes as one device sees them, and the dims `shard=` splits
    outside the nest: the planner plans one device's nest."""
    sp = call.shard
    if sp is None:
        return call.mapped_sizes, ()
    shards = lambda axes: math.prod(sp.mesh.shape[a] for a in axes)
    dims = tuple(
        ShardDim(name, sp.sizes[name], axes, shards(axes), sp.local_sizes[name])
        for name, axes in sp.dims
    )
    return {n: sp.local_sizes[n] for n in call.mapped}, dims


def given_dims(call: Call) -> Names:
    """The mapped dims whose strategy the user gave, in nest order."""
    named = {*call.options.scan_names, *call.options.vmap, *call.options.shard_names}
    return tuple(n for n in call.given_nest().dims if n in named)


def collective_dims(call: Call) -> Names:
    """The mapped dims the body uses in collectives: never scanned."""
    return tuple(n for n in call.mapped if n in call.collective_dims)


@dataclasses.dataclass(frozen=True)
class Request:
    """What one plan is for: `localize`'s sizes and shards, the budget and its source,
    and how it is planned (`model_key`: the time model in the disk cache's keys,
    `None` for its constants; `values`: measured mode times the call's own)."""

    call: Call
    sizes: Sizes
    shard: tuple[ShardDim, ...]
    budget: int
    source: str
    backward: bool
    model: TimeModel
    measure: bool = False
    model_key: Any = None
    values: bool = False


def plan_for(
    call: Call, sizes: Sizes, chosen: PlanCandidate, cands: Candidates, **fields: Any
) -> Plan:
    """The `Plan` of `call` at its mapped `sizes` (as one device sees them)."""
    every = tuple({**call.sizes, **sizes}.items())
    return Plan(call.fun_name, sizes=every, chosen=chosen, candidates=cands, **fields)


def auto_plan(
    request: Request, chosen: PlanCandidate, cands: Candidates, **fields: Any
) -> Plan:
    """The `Plan` of `plan="auto"`: planned now, or read from the disk cache."""
    r, call = request, request.call
    fields.update(auto=True, budget_bytes=r.budget, budget_source=r.source)
    fields.update(shard=r.shard, backward=r.backward, given=given_dims(call))
    fields.update(collective=collective_dims(call))
    return plan_for(call, r.sizes, chosen, cands, **fields)


class Choice(NamedTuple):
    """What the search chose, those it compared, their measured times by key
    (measured mode), and a note when timing was impossible."""

    chosen: PlanCandidate
    compared: list[PlanCandidate]
    timed: dict[tuple, float]
    note: str = ""


def _why_chosen(c: PlanCandidate, timed: dict[tuple, float], n: int) -> str:
    """Why `c` was chosen: it measured fastest of those `timed`, or is est. fastest
    of the `n` that fit."""
    t = timed.get(c.key)
    if t is not None:
        rest = sorted(v for k, v in timed.items() if k != c.key)
        nxt = f"; next {fmt_seconds(rest[0])}" if rest else ""
        return f"the fastest of the {len(timed)} timed (measured {fmt_seconds(t)}{nxt})"
    if c.temp_bytes is None:
        return "nothing to compile"
    if n <= 1:
        return "the only candidate that fits and was costed"
    return f"the fastest by the time model of the {n} that fit"


def summary(
    choice: Choice, full: PlanCandidate, searched: bool, free: bool, request: Request
) -> str:
    """One sentence: what was chosen, and why."""
    chosen, compared, timed, measure_note = choice
    head = f"Chose {chosen.nest(request.sizes)}: "
    temp, b = fmt_bytes(full.temp_bytes or 0), fmt_bytes(request.budget)
    whole = "full vmap" if full.source == "full vmap" else "vmapping every planned dim"
    fast = request.model.fastest if request.model.levels else math.inf
    if not free:
        return head + (
            "every mapped dim has a strategy given, so there was nothing to plan; it "
            f"needs {temp} of the {b} budget."
        )
    if not searched:
        return (
            f"{head}{whole} fits ({temp} <= {b}) and its working set is within the "
            "fastest levels of memory; nothing else was compiled."
        )
    why = f"{whole} fits ({temp} <= {b})"
    if not full.fits:
        why = f"{whole} needs {temp} > {b} budget"
    elif not timed and (full.working_set or 0) > fast:
        ws, top = fmt_bytes(full.working_set or 0), fmt_bytes(fast)
        why += f" but its working set ({ws}) is past the fastest {top} of memory"
    how = _why_chosen(chosen, timed, len(compared))
    if chosen.predicted:
        how += ", its temporaries predicted far within the budget"
    note = f" ({measure_note})" if measure_note else ""  # could not measure
    return f"{head}{why}; {how}{note}."


def with_reason(
    c: PlanCandidate, choice: Choice, note: str | None, budget: int
) -> PlanCandidate:
    """`c` with the reason it was, or was not, chosen (and its measured time)."""
    chosen, compared, timed, _ = choice
    t, mine = timed.get(c.key), timed.get(chosen.key)
    if c.key == chosen.key:
        why = "chosen: " + _why_chosen(c, timed, len(compared))
        if c.predicted:
            far = note or "far within the budget"
            why += f"; its temporaries predicted from full vmap's, not compiled: {far}"
    elif t is not None and mine is not None and c.fits is not False:
        why = f"slower: measured {fmt_seconds(t)} vs {fmt_seconds(mine)}"
        why += "; its memory not compiled" * (c.temp_bytes is None)
    elif c.temp_bytes is None:
        why = note or "not compiled"
    elif not c.fits:
        a, b = fmt_bytes(c.temp_bytes), fmt_bytes(budget)
        if a == b:  # in bytes when the two would print alike
            a, b = f"{c.temp_bytes:,} B", f"{budget:,} B"
        why = f"over budget: {a} > {b}"
    elif c.seconds is not None and chosen.seconds is not None:
        why = f"slower (est. {c.seconds / chosen.seconds:.2f}x the chosen's, by the time model)"
        if timed:  # measured mode
            why = note or "not timed"
    else:
        why = note or "fits, not costed: smaller than the largest block that fits"
    return dataclasses.replace(c, measured=t, reason=why)


class NoFit(Exception):
    """No candidate fits the budget: the message, the smallest candidate compiled,
    and how many were."""

    def __init__(self, message: str, smallest: PlanCandidate, n: int):
        super().__init__(message)
        self.smallest, self.n = smallest, n


def no_fit_message(request: Request, smallest: PlanCandidate, n: int) -> str:
    """The `SpecError` message when no candidate fits the budget."""
    call, sizes = request.call, request.sizes
    under = " under differentiation" if request.backward else ""
    hint = " (or give fewer dims a strategy in `scan=`/`vmap=`)"
    return (
        f"`{call.fun_name}` with `plan='auto'`: no nest fits "
        f"`memory_budget={call.options.plan.memory_budget!r}` "
        f"({fmt_bytes(request.budget)} of temporary memory){under}. The smallest of "
        f"the {n} compiled candidates needs {fmt_bytes(smallest.temp_bytes or 0)} "
        f"for {smallest.nest(sizes)}. Raise `memory_budget`, or map fewer dims"
        f"{hint if given_dims(call) else ''}."
    )
