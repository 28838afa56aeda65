"""The planner's search by the time model: the budget, the candidate nests (`ladder`s
in a few `dim_orders`), a plan's `Request`, the choice and why (`docs/design.md`)."""

import contextlib
import dataclasses
import itertools as it
import math
import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from .._errors import SpecError
from .._jaxpr import lockstep
from .._progress_bar import Progress
from .._resolve import Call
from .._text import fmt_bytes, fmt_seconds
from .cost import Compiler, Reference
from .model import TimeModel
from .plan import Plan, PlanCandidate, ScanNest, ShardDim, split_leaves


Sizes = dict[str, int]
Names = tuple[str, ...]
Candidates = tuple[PlanCandidate, ...]
Steps = list[PlanCandidate]  # a ladder: largest block first
MemoryBudget = int | float | None  # bytes, or a fraction of device memory in (0, 1]

DEFAULT_BUDGET_FRACTION = 0.5  # the budget of `plan="auto"` without `memory_budget`
MAX_ORDERS = 24  # the most dim orders measured mode searches: all of up to 4 dims
MAX_COMPILES = 12  # planning that has compiled this many searches no further ladder
# A block predicted (uncorrected and corrected) within this fraction of the budget is
# not compiled to check it: predictions are within 0.35-3x of XLA's on the benchmarks.
SAFE_FRACTION = 1 / 8
MATERIAL = 1.05  # est. this much faster is worth a compile: less is within model error
SEARCH_VERSION = 17  # bumped when the search chooses otherwise: older plans unused


def resolve_budget(memory_budget: MemoryBudget) -> tuple[int, str]:
    """The budget in bytes, and where it came from: as given, or a fraction of the
    first device's memory (of physical RAM where the device reports none)."""
    if isinstance(memory_budget, int):
        return memory_budget, f"memory_budget={memory_budget}"
    fraction = DEFAULT_BUDGET_FRACTION if memory_budget is None else memory_budget
    device, total = jax.local_devices()[0], 0
    with contextlib.suppress(Exception):  # some backends do not implement it
        total = int((device.memory_stats() or {}).get("bytes_limit") or 0)
    where, platform = f"memory of {device}", device.platform
    if not total:
        where = f"physical RAM (os.sysconf), as {platform} reports no device memory"
        with contextlib.suppress(ValueError, OSError, AttributeError):  # Windows
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if total <= 0:
        raise SpecError(
            f"`filter_multi_vmap(..., plan='auto')`: a fractional `memory_budget` "
            f"needs the memory size of {device}, which is unavailable, and so is the "
            "size of physical RAM; give the budget in bytes as an `int`."
        )
    source = f"memory_budget={fraction:g} of {fmt_bytes(total)} {where}"
    return int(total * fraction), "default " * (memory_budget is None) + source


def chunk_options(n: int) -> list[int | None]:
    """Chunk sizes for a dim of size `n`, largest first, then `None` (one at a time):
    `n / 2, n / 4, ...`, each moved to a divisor within `sqrt(2)` (no remainder)."""
    pairs = [(d, n // d) for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    divisors = {x for pair in pairs for x in pair if 2 <= x <= n // 2}
    out, m = [], 2
    while n // m >= 2:
        ideal = n / m
        near = [d for d in divisors if ideal / 2**0.5 <= d <= ideal * 2**0.5]
        c = min(near, key=lambda d: abs(math.log(d / ideal))) if near else n // m
        out.append(c)
        m *= 2
    return [*dict.fromkeys(out), None]


def candidate(scan: ScanNest, vmap: Names, sizes: Sizes, source: str) -> PlanCandidate:
    """A nest, with the elements of one loop iteration and the number of iterations."""
    block = math.prod(sizes[n] for n in vmap) * math.prod(k or 1 for _, k in scan)
    trips = math.prod(max(1, sizes[n] // k) if k else sizes[n] for n, k in scan)
    return PlanCandidate(scan, vmap, block, trips, source)


def ladder(
    order: Names, layout: Names, sizes: Sizes, fixed: ScanNest = (), frozen: Names = ()
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
    return sorted(out, key=lambda c: -c.block)  # stable: fewer scanned first on ties


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
    orders = [layout, inputs, tuple(sorted(layout, key=lambda n: -sizes[n]))]
    if every:
        orders += it.islice(it.permutations(layout), MAX_ORDERS)
    return list(dict.fromkeys(orders))[: MAX_ORDERS if every else None]


def localize(call: Call) -> tuple[dict[str, int], tuple[ShardDim, ...]]:
    """The mapped sizes as one device sees them, and the dims `shard=` splits
    outside the nest: the planner plans one device's nest."""
    if (sp := call.shard) is None:
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


def fixed_dims(call: Call) -> Names:
    """The mapped dims not planned: given, used in collectives, or split by inputs."""
    return given_dims(call) + collective_dims(call) + (*call.split,)


@dataclasses.dataclass(frozen=True)
class Request:
    """What one plan is for: `localize`'s sizes and shards, the budget and its source,
    and how it is timed (`values`: on the call's own values; `short`: a short list)."""

    call: Call
    sizes: Sizes
    shard: tuple[ShardDim, ...]
    budget: int
    source: str
    backward: bool
    model: TimeModel
    cap: float  # measured mode's (`measure.Tuner`)
    measure: bool = False
    values: bool = False
    short: bool = False


def plan_for(
    call: Call, sizes: Sizes, chosen: PlanCandidate, cands: Candidates, **fields: Any
) -> Plan:
    """The `Plan` of `call` at its mapped `sizes` (as one device sees them)."""
    every = tuple({**call.sizes, **sizes}.items())
    fields.update(local=split_leaves(call)[1])  # inputs split over other mesh axes
    return Plan(call.fun_name, sizes=every, chosen=chosen, candidates=cands, **fields)


def auto_plan(
    request: Request, chosen: PlanCandidate, cands: Candidates, **fields: Any
) -> Plan:
    """The `Plan` of `plan="auto"`: planned now, or read from the disk cache."""
    r, call = request, request.call
    fields.update(auto=True, budget_bytes=r.budget, budget_source=r.source)
    fields.update(shard=r.shard, backward=r.backward, given=given_dims(call))
    split = tuple(n for n in call.mapped if n in call.split)
    fields.update(collective=collective_dims(call), split=split)
    return plan_for(call, r.sizes, chosen, cands, **fields)


class Choice(NamedTuple):
    """The chosen, those compared, measured times by key, a note if timing failed."""

    chosen: PlanCandidate
    compared: list[PlanCandidate]
    timed: dict[tuple, float]
    note: str = ""


def why_chosen(c: PlanCandidate, timed: dict[tuple, float], n: int) -> str:
    """Why `c` won: the fastest of those `timed`, or est. fastest of the `n` fitting."""
    if (t := timed.get(c.key)) is not None:
        rest = sorted(v for k, v in timed.items() if k != c.key)
        nxt = f"; next {fmt_seconds(rest[0])}" if rest else ""
        which = f"the fastest of the {len(timed)}" if rest else "the only one"
        return f"{which} timed (measured {fmt_seconds(t)}{nxt})"
    if c.temp_bytes is None:
        return "nothing to compile"
    only = "the only candidate that fits and was costed"
    return only if n <= 1 else f"the fastest by the time model of the {n} that fit"


def summary(
    choice: Choice, full: PlanCandidate, searched: bool, free: bool, request: Request
) -> str:
    """One sentence: what was chosen, and why."""
    chosen, compared, timed, measure_note = choice
    temp, b = fmt_bytes(full.temp_bytes or 0), fmt_bytes(request.budget)
    whole = "full vmap" if full.source == "full vmap" else "vmapping every planned dim"
    why, how = f"{whole} fits ({temp} <= {b})", why_chosen(chosen, timed, len(compared))
    fast = request.model.fastest if request.model.levels else math.inf
    if not free:
        why = "every mapped dim has a strategy given, so there was nothing to plan"
        how = f"it needs {temp} of the {b} budget"
    elif not searched:
        why += " and its working set is within the fastest levels of memory"
        how = how if timed else "nothing else was compiled"
    elif not full.fits:
        why = f"{whole} needs {temp} > {b} budget"
    elif not timed and (full.working_set or 0) > fast:
        ws, top = fmt_bytes(full.working_set or 0), fmt_bytes(fast)
        why += f" but its working set ({ws}) is past the fastest {top} of memory"
    if free and searched:
        if not timed and len(compared) <= 1 and chosen.key == full.key:
            how = f"no other block predicted to fit is est. {MATERIAL - 1:.0%} "
            how += "faster by the time model, so none was compiled"
        how += ", its temporaries predicted far within the budget" * chosen.predicted
    how += f" ({measure_note})" * bool(measure_note)  # could not measure
    return f"Chose {chosen.nest(request.sizes)}: {why}; {how}."


class NoFit(Exception):
    """No candidate fits: the smallest compiled, and how many were."""

    def __init__(self, request: "Request", smallest: PlanCandidate, n: int):
        super().__init__(no_fit_message(request, smallest, n))
        self.smallest, self.n = smallest, n


def no_fit_message(request: Request, smallest: PlanCandidate, n: int) -> str:
    call, sizes = request.call, request.sizes
    under = " under differentiation" if request.backward else ""
    hint = " (or give fewer dims a strategy in `scan=`/`vmap=`)"
    return (
        f"`{call.fun_name}` with `plan={call.options.plan.mode}`: no nest fits "
        f"`memory_budget={call.options.plan.memory_budget!r}` "
        f"({fmt_bytes(request.budget)} of temporary memory){under}. The smallest of "
        f"the {n} compiled candidates needs {fmt_bytes(smallest.temp_bytes or 0)} "
        f"for {smallest.nest(sizes)}. Raise `memory_budget`, or map fewer dims"
        f"{hint if given_dims(call) else ''}."
    ) + "".join(
        f" Dim '{n}' is never scanned: {where}; `shard={{{n!r}: ...}}` would map it "
        "device by device."
        for n, where in call.split.items()
    )


class Search:
    """One planning run: each candidate compiled at most once; why each won or lost."""

    ref: Reference  # full vmap's figures, the others' basis (from `_choose`)
    start: float  # when `run` began

    def __init__(self, request: Request, progress: Progress):
        self.request, self.call, self.model = request, request.call, request.model
        self.sizes, self.budget, r = request.sizes, request.budget, request
        self.compiler = Compiler(r.call, r.sizes, r.model, r.backward, progress.step)
        self.considered: dict[tuple, PlanCandidate] = {}  # full vmap, then by block
        self.known: dict[tuple, PlanCandidate] = {}  # compiled, or taken as predicted
        self.notes: dict[tuple, str] = {}  # why one not compiled was not chosen
        self.lockstep = False  # a vmapped block runs a while loop in lockstep
        self.searched = False  # the model searched the ladders

    def memory(self, c: PlanCandidate) -> PlanCandidate:
        if c.key not in self.known:
            temp = self.compiler.memory(c)
            fits = temp <= self.budget
            self.known[c.key] = dataclasses.replace(c, temp_bytes=temp, fits=fits)
        return self.known[c.key]

    def costed(self, c: PlanCandidate) -> PlanCandidate:
        c = self.memory(c)
        if c.fits and c.seconds is None:
            self.known[c.key] = self.compiler.predicted_costs(c, self.ref)
        return self.known[c.key]

    def prediction(self, steps: Steps, c: PlanCandidate) -> float:
        """`c`'s temporaries predicted, scaled as XLA's figure for the step compiled
        nearest it (by block; those scanning the same dims first) was to its own."""
        known = (self.known.get(s.key) for s in steps)
        compiled = [k for k in known if k and not k.predicted]
        if not compiled:
            return float(self.ref.temp_bytes(c))
        other = lambda k: [n for n, _ in k.scan] != [n for n, _ in c.scan]
        far = lambda k: abs(math.log(max(k.block, 1) / max(c.block, 1)))
        near = min(compiled, key=lambda k: (other(k), far(k)))
        ratio = (near.temp_bytes or 0) / max(self.ref.temp_bytes(near), 1)
        return self.ref.temp_bytes(c) * ratio

    def cautious(self, steps: Steps, c: PlanCandidate) -> int | float:
        """The larger of `prediction` and the uncorrected one: a fusion XLA makes at
        one block and not at the next breaks a neighbour's ratio."""
        return max(self.prediction(steps, c), self.ref.temp_bytes(c))

    def seconds_at(self, c: PlanCandidate) -> float:
        return self.compiler.predicted_costs(c, self.ref).seconds or 0.0

    def taken(self, steps: Steps, c: PlanCandidate, why: str) -> None:
        """Cost `c`, its temporaries `cautious`ly predicted if not compiled."""
        if c.key in self.known:
            self.costed(c)
        else:
            temp = int(self.cautious(steps, c))
            guess = dataclasses.replace(c, temp_bytes=temp, fits=True, predicted=True)
            self.known[c.key] = self.compiler.predicted_costs(guess, self.ref)
            self.notes[c.key] = why

    def note(self, c: PlanCandidate, why: str) -> None:
        if c.key not in self.known:
            self.notes.setdefault(c.key, why)

    def search(self, steps: Steps, full: PlanCandidate) -> None:
        """Cost the ladder's largest block that fits the budget (`j`), its largest
        inside each cache level, their ties and, in lockstep, its smallest."""
        j = 0 if full.fits else self.first_within(steps)
        if j is None:
            for c in steps:
                self.note(c, "not compiled: a smaller block is over budget")
            return
        ws = [self.ref.working_set(c) for c in steps]
        edges = {j: "the largest block of its ladder that fits the budget"}
        if self.lockstep:
            edges[len(steps) - 1] = (
                "the smallest block: the body's while loop runs in lockstep when "
                "vmapped, each block as long as its slowest element"
            )
        for size, _ in self.model.levels:
            i = next((i for i in range(j, len(steps)) if ws[i] <= size), None)
            if i is not None and i not in edges:
                fit = f"({fmt_bytes(ws[i])}) fits {fmt_bytes(size)} of cache"
                edges[i] = f"the largest block of its ladder whose working set {fit}"
        last = self.model.levels[-1][0] if self.model.levels else math.inf
        past = "past the last level of cache, where the est. bandwidth falls with it"
        for i in (i for i in range(j, len(steps)) if ws[i] > last):  # each costed
            edges.setdefault(i, f"its working set ({fmt_bytes(ws[i])}) {past}")
        for e, why in edges.items():
            for c in (c for c in steps if c.block == steps[e].block):
                self.taken(steps, c, why)
        for i, c in enumerate(steps):
            why = "a larger block than one over budget, or predicted to be"
            if i >= j:
                e = steps[max(k for k in edges if k <= i)].nest(self.sizes)
                why = f"a smaller block than {e}, whose working set fits the same "
                why += "level of the memory hierarchy: more loop trips"
            self.note(c, f"not compiled: {why}")

    def first_within(self, steps: Steps) -> int | None:
        """The first step (largest block) that fits: the largest predicted to is
        compiled until one fits and the next larger does not (or, scanning the same
        dims, is predicted not to), unless one is `take_predicted`."""
        lo, hi = 0, len(steps)  # the answer is in steps[lo:hi], or None
        while lo < hi:
            guesses = [self.prediction(steps, steps[i]) for i in range(lo, hi)]
            within = [lo + k for k, t in enumerate(guesses) if t <= self.budget]
            if (taken := self.take_predicted(steps, within)) is not None:
                return taken
            i = within[0] if within else hi - 1
            c = self.memory(steps[i])
            if not c.fits:
                lo = i + 1
                continue
            hi, prev = i, steps[i - 1]
            same = [n for n, _ in prev.scan] == [n for n, _ in c.scan]
            if i == lo or same and self.prediction(steps, prev) > self.budget:
                break
        return hi if hi < len(steps) else None

    def take_predicted(self, steps: Steps, within: list[int]) -> int | None:
        """The largest of `within` `cautious`ly predicted within `SAFE_FRACTION` of the
        budget, taken uncompiled if est. at most `MATERIAL` slower than all larger."""
        safe = self.budget * SAFE_FRACTION
        s = next((i for i in within if self.cautious(steps, steps[i]) <= safe), None)
        if s is None:
            return None
        c, larger = steps[s], within[: within.index(s)]
        fastest = min((self.seconds_at(steps[i]) for i in larger), default=math.inf)
        if self.seconds_at(c) > MATERIAL * fastest:
            return None
        why = f"not compiled: predicted to fit, est. at most {MATERIAL - 1:.0%} "
        why += f"faster than {c.nest(self.sizes)}, which needs no compile"
        for i in larger:
            self.note(steps[i], why)
        self.taken(steps, c, "far within the budget")
        return s

    def skipped(self, steps: Steps) -> str | None:
        """Why a ladder is not searched (`None` if it is): past `MAX_COMPILES`, or
        no block is est. `MATERIAL`ly faster than the best."""
        if self.compiler.n_compiled >= MAX_COMPILES:
            return f"not compiled: beyond the compile cap ({MAX_COMPILES} compiles)"
        costed = [c for c in self.known.values() if c.fits and c.seconds]
        if not costed:
            return None
        best = min(costed, key=lambda c: c.seconds or 0.0)
        for c in steps:
            fits = self.prediction(steps, c) <= self.budget
            if fits and self.seconds_at(c) * MATERIAL < (best.seconds or 0.0):
                return None
        return (
            "not compiled: no block of its ladder predicted to fit is est. "
            f"{MATERIAL - 1:.0%} faster than {best.nest(self.sizes)} (its loop "
            "trips and working set predicted from full vmap's)"
        )

    def run(self, measure: Callable | None = None) -> Plan:
        """Plan the call; raises `NoFit` if no candidate fits the budget. `measure`
        (`measure.measured`) times candidates to choose from the model's choice."""
        self.start = time.perf_counter()  # measuring's cap counts from here too
        call, sizes = self.call, self.sizes
        fixed, frozen = call.options.scan, fixed_dims(call)  # given scans: outermost
        free = tuple(n for n in call.mapped if n not in frozen)
        given = call.options.vmap + call.options.scan_names
        rest = tuple(n for n in dim_orders(call, sizes)[0] if n not in given)
        layout = call.options.vmap + rest  # vmapped: `vmap=`'s, then in output order
        full = candidate(fixed, layout, sizes, "given scans" if fixed else "full vmap")
        orders = dim_orders(call, sizes, free) if free else []
        ladders = [ladder(o, layout, sizes, fixed, frozen) for o in orders]
        self.considered[full.key] = full
        for c in sorted((c for s in ladders for c in s), key=lambda c: -c.block):
            self.considered.setdefault(c.key, c)
        if any(sizes[n] == 0 for n in call.mapped):  # nothing runs: nothing compiled
            choice, empty = Choice(full, [], {}), "a mapped dim has size 0"
            for c in self.considered.values():
                self.note(c, f"not compiled: {empty}")
            text = f"Chose {full.nest(sizes)}: {empty}, so nothing runs and nothing "
            text += "was compiled."
        else:
            choice, timed, short = self._choose(full, ladders), "", self.request.short
            if measure is not None and free and not short:  # every order of the dims
                orders = dim_orders(call, sizes, free, every=True)
                ladders = [ladder(o, layout, sizes, fixed, frozen) for o in orders]
                for c in (c for steps in ladders for c in steps):
                    self.considered.setdefault(c.key, c)
            if measure is not None and free and (self.searched or not short):
                choice, timed = measure(self, full, ladders, choice.chosen)
            f = self.known[full.key]
            text = summary(choice, f, self.searched, bool(free), self.request) + timed
        candidates = tuple(self.reasoned(c, choice) for c in self.considered.values())
        chosen = next(c for c in candidates if c.key == choice.chosen.key)
        ran = bool(choice.timed)
        made_up = "short" if self.request.short else "inputs"
        basis = ("arguments" if self.request.values else made_up) if ran else "model"
        return auto_plan(
            self.request, chosen, candidates, n_compiled=self.compiler.n_compiled,
            seconds=time.perf_counter() - self.start,
            checkpoint=self.compiler.build(chosen.spec).checkpoint,
            time_model=self.model, summary=text, measured=ran, basis=basis,
            searched=self.searched,
        )  # fmt: skip

    def reasoned(self, c: PlanCandidate, choice: Choice) -> PlanCandidate:
        """`c` as known, with the reason it was, or was not, chosen (and its time)."""
        c, note, budget = self.known.get(c.key, c), self.notes.get(c.key), self.budget
        chosen, compared, timed, _ = choice
        t, mine = timed.get(c.key), timed.get(chosen.key)
        if c.key == chosen.key:
            why = "chosen: " + why_chosen(c, timed, len(compared))
            if c.predicted:
                far = f"not compiled: {note or 'far within the budget'}"
                why += f"; its temporaries predicted from full vmap's, {far}"
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
            est = f"{c.seconds / chosen.seconds:.2f}x the chosen's, by the time model"
            why = (note or "not timed") if timed else f"slower (est. {est})"
        else:
            why = note or "fits, not costed: smaller than the largest block that fits"
        return dataclasses.replace(c, measured=t, reason=why)

    def _choose(self, full: PlanCandidate, ladders: list[Steps]) -> Choice:
        """Search the ladders by the time model: its choice."""
        self.ref = self.compiler.reference(self.memory(full))
        self.lockstep = lockstep(self.compiler.jaxprs[full.spec])
        f = self.costed(full)
        self.searched = bool(ladders) and (
            not f.fits or (f.working_set or 0) > self.model.fastest or self.lockstep
        )
        for i, steps in enumerate(ladders if self.searched else []):
            # The first ladder is searched if full vmap does not fit, and in lockstep
            # (the estimate cannot see a larger block's waste); others unless skipped.
            first = i == 0 and (self.lockstep or not f.fits)
            why = None if first else self.skipped(steps)
            if why is None:
                self.search(steps, f)
            for c in steps if why else []:
                self.note(c, why)
        ws, cache = fmt_bytes(f.working_set or 0), fmt_bytes(self.model.fastest)
        kept = f"full vmap fits, and its working set ({ws}) is within the fastest "
        kept += f"{cache} of memory"
        for c in self.considered.values() if not self.searched else ():
            self.note(c, f"not compiled: {kept}: nothing else needed")
        return self.pick()

    def pick(self) -> Choice:
        """The fastest costed that fits (in lockstep, a block of one element if est.
        at most `MATERIAL` slower: a larger block's waste depends on the data), first
        compiled if only predicted to fit, and not within `SAFE_FRACTION`."""
        slow = MATERIAL if self.lockstep else 1.0  # a block of more than one element's
        rank = lambda c: (c.seconds or 0.0) * (slow if c.block > 1 else 1.0)
        while True:
            fitting = [c for c in self.known.values() if c.fits and c.seconds]
            if not fitting:
                smallest = min(self.known.values(), key=lambda c: c.temp_bytes or 0)
                raise NoFit(self.request, smallest, len(self.known))
            c = min(fitting, key=rank)
            if self.checked(c) is c:
                return Choice(c, fitting, {})

    def checked(self, c: PlanCandidate) -> PlanCandidate:
        """`c` costed, compiled unless predicted within `SAFE_FRACTION` of budget."""
        k = self.known.get(c.key)
        if k and k.predicted and (k.temp_bytes or 0) > self.budget * SAFE_FRACTION:
            del self.known[c.key]  # compiled now, and costed again if it fits
            self.notes.pop(c.key, None)
            c = dataclasses.replace(c, predicted=False, seconds=None)
        return self.costed(c)
