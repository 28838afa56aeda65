"""The planner's search: which candidate nests it compiles, and which it chooses.

A plan picks, for the mapped dims of one call signature that no strategy names,
which to scan, in which order and with which chunk sizes; the rest are vmapped. Dims
named by `scan=`, `vmap=` or `shard=` keep the strategy given (the given scans
outermost, in their order, with their chunks), and dims that the body uses in
collectives are never scanned. Candidates (`_candidates`) are
compiled and costed by `_costing`; their temporary memory must fit the budget.

The search is bounded:

1. Full vmap (of the planned dims) is compiled first and chosen if it fits, unless
   its temporaries are allocated afresh on every call (see 3.) or the planner
   measures.
2. Otherwise the candidates form ladders, one per order of the dims (the output's
   layout, the inputs' layout, by size): scan a prefix of the dims of size > 1, the
   outer ones one element at a time and the last one in chunks from a small
   geometric set (about `n/2, n/4, ...`, moved to a nearby divisor of `n` when there
   is one, so that no remainder block is needed). A ladder is sorted by the number
   of elements of one loop iteration (the block), which temporary memory grows
   with, close to affinely. The largest block that fits is found by prediction
   (`predict`, `Search.first_within`): from the blocks compiled so far (at first,
   full vmap alone) the largest block predicted to fit is compiled; the prediction
   is refined until a block fits and the next larger one is known, or predicted,
   not to. Every block the search chooses was compiled and fits. The boundary
   candidate (and those with the same block in the same ladder) gets its costs,
   and the cheapest by estimated time (`TimeModel.seconds`) wins.
3. On CPU, temporaries above the fresh threshold (glibc's malloc hands blocks that
   big out as fresh `mmap`s) are page-faulted in again on *every* call. So when the
   largest fitting block of a ladder (or full vmap) is above the threshold, the
   same search finds its largest block below it, and that one is costed instead:
   by the time model, its reuse of the heap saves more than the loop trips it adds.
4. With `Planner(measure=True)`, up to `MAX_MEASURED` candidates that fit (among
   every block that fits in the ladders searched: the model's best estimates, and
   an even spread over the rest, `measured_pool`) are run on fresh inputs of the
   call's shapes, side by side, and the fastest wins unless the model's own choice
   measured within `KEEP_WITHIN` of it: the model cannot see what the chunk shape
   does to XLA:CPU's code, and timings of near-equal nests shift with the load.

Every candidate compiled outside measured mode is compiled for its analyses only
(`_costing.ANALYSIS_OPTIONS`). With `shard=`, the plan is of the local nest of one
device (`localize`): the sharded dims keep their strategy, at their local sizes,
and the budget is per device.
"""

import dataclasses
import time
from typing import Any

from ._candidates import (
    candidate,
    collective_dims,
    dim_orders,
    given_dims,
    ladder,
)
from ._costing import Compiler
from ._measure import KEEP_WITHIN, MAX_MEASURED, measured_pool, time_candidates
from ._plan import dims_of, Plan, PlanCandidate, ShardDim
from ._progress import Progress
from ._reasons import no_fit_message, NoFit, summary, with_reason
from ._resolve import Call
from ._time_model import TimeModel
from ._timing import fmt_bytes, fmt_seconds


# Once planning has compiled this many programs (candidates and loop bodies), it
# searches no further ladders.
MAX_COMPILES = 12
# Bumped whenever the search changes what it chooses: plans on disk from another
# version are not used.
SEARCH_VERSION = 4


@dataclasses.dataclass
class Ladder:
    """One ladder, as searched: the index of its largest block that fits (`j`) and
    of its largest below the fresh threshold (`k`)."""

    steps: list[PlanCandidate]
    searched: bool = False
    j: int | None = None
    k: int | None = None

    @property
    def edge(self) -> int | None:
        """The boundary block that is costed: `k` if there is one, else `j`."""
        return self.k if self.k is not None else self.j


def predict(points: list[tuple[int, int]], block: int) -> float | None:
    """The temporary bytes of a block of a ladder, from the line through the two
    compiled blocks nearest it (`(block, bytes)` pairs): temporaries grow close to
    affinely with the block along one ladder. With one block compiled,
    proportionally to the block; `None` with none."""
    distinct = sorted(dict(points).items(), key=lambda p: abs(p[0] - block))
    if not distinct:
        return None
    if len(distinct) == 1:
        ((b0, t0),) = distinct
        return t0 * block / max(b0, 1)
    (b0, t0), (b1, t1) = distinct[:2]
    return t0 + (t1 - t0) * (block - b0) / (b1 - b0)


class Search:
    """One planning run: compiles candidates (each at most once), remembers what it
    learnt about each, and says why each was or was not chosen."""

    def __init__(
        self,
        call: Call,
        sizes: dict[str, int],
        budget: int,
        model: TimeModel,
        backward: bool,
        measure: bool,
        progress: Progress,
    ):
        self.call = call
        self.sizes = sizes
        self.budget = budget
        self.model = model
        self.measure = measure
        self.progress = progress
        self.compiler = Compiler(
            call, sizes, model, backward, progress.step, runs=measure
        )
        self.known: dict[tuple, PlanCandidate] = {}  # by key: compiled ones
        self.notes: dict[tuple, str] = {}  # by key: why an uncompiled one was not
        # By key: temporaries predicted above a limit, for blocks not compiled.
        self.predicted: dict[tuple, int] = {}

    def memory(self, c: PlanCandidate) -> PlanCandidate:
        if c.key not in self.known:
            temp = self.compiler.memory(c)
            self.known[c.key] = dataclasses.replace(
                c, temp_bytes=temp, fits=temp <= self.budget
            )
        return self.known[c.key]

    def costed(self, c: PlanCandidate) -> PlanCandidate:
        c = self.memory(c)
        if c.fits and c.seconds is None:
            self.known[c.key] = self.compiler.costs(c)
        return self.known[c.key]

    def fits(self, c: PlanCandidate) -> bool:
        return bool(self.memory(c).fits)

    def fresh(self, c: PlanCandidate) -> bool:
        return bool(self.model.fresh(self.memory(c).temp_bytes or 0))

    def note(self, c: PlanCandidate, why: str) -> None:
        if c.key not in self.known:
            self.notes.setdefault(c.key, why)

    def search(self, lad: Ladder, full: PlanCandidate) -> None:
        """Find the ladder's largest block that fits, and (if that one allocates
        afresh per call) its largest block below the fresh threshold; cost the
        latter if there is one (a block that allocates afresh loses to it by the
        time model: its page faults cost more than the loop trips it saves), else
        the former."""
        steps = lad.steps
        lad.searched = True
        threshold = self.model.fresh_threshold
        k, all_fresh = None, False
        if full.fits:
            # Memory grows with the block: if full vmap fits, every step does.
            j: int | None = 0
            if threshold is not None and full.fresh_bytes:
                k = self.first_within(steps, 0, threshold, full)
                all_fresh = k is None
        else:
            j = self.first_within(steps, 0, self.budget, full)
            if j is not None and threshold is not None and self.fresh(steps[j]):
                above = self.memory(steps[j])
                k = self.first_within(steps, j + 1, threshold, above)
                all_fresh = k is None
        lad.j, lad.k = j, (None if k == j else k)
        edge = lad.edge
        floor = self._floor(threshold) if all_fresh else None
        if edge is not None and floor is not None:
            # Every block of the ladder that fits allocates afresh per call, and
            # so cannot beat a candidate already costed.
            for c in steps:
                if c.key not in self.known or self.known[c.key].fits:
                    self.notes[c.key] = (
                        "not costed: every block of its ladder that fits allocates "
                        f"afresh per call: est. at least {fmt_seconds(floor)}, "
                        "slower than a candidate costed"
                    )
            edge = None
        edges = [] if edge is None else [edge]
        if lad.k is not None and j is not None:
            if self._may_beat(steps[j], steps[lad.k], threshold):
                edges.append(j)
            elif steps[j].key in self.known:
                self.notes[steps[j].key] = (
                    "fits, not costed: allocates afresh per call, whose page "
                    "faults take longer than the estimate of the smaller "
                    f"{steps[lad.k].nest(self.sizes)}, which does not"
                )
        for e in edges:  # the boundary blocks, and their ties
            for c in steps:
                if c.block == steps[e].block:
                    self.costed(c)
        # Why the others were not compiled.
        sizes = self.sizes
        for i, c in enumerate(steps):
            if c.key in self.known:
                continue
            if j is None or i < j:
                self._note_over(steps, i)
            elif lad.k is not None and i < lad.k:
                self.note(
                    c,
                    f"not compiled: a larger block than {steps[lad.k].nest(sizes)}, "
                    "the largest that reuses its temporaries from call to call: "
                    "it would allocate them afresh per call",
                )
            else:
                edge = steps[lad.edge]
                self.note(
                    c,
                    f"not compiled: a smaller block than {edge.nest(sizes)}, "
                    "which fits: more loop trips, not needed",
                )

    def _floor(self, threshold: int | None) -> float | None:
        """For a ladder whose blocks that fit all allocate afresh per call: a
        floor on their estimated time (the compute of every candidate, and the
        page faults of `threshold` bytes) if it is above the estimate of a
        candidate costed, else `None`. Not in measured
        mode, which estimates the blocks it may time from the ladder's costed
        boundary."""
        if self.measure or threshold is None:
            return None
        costed = [c for c in self.known.values() if c.fits and c.seconds]
        if not costed:
            return None
        floor = self.model.seconds(
            min(c.flops or 0.0 for c in costed),
            min(c.transcendentals or 0.0 for c in costed),
            0.0,
            0,
            float(threshold),
        )
        best = min(c.seconds or 0.0 for c in costed)
        return floor if floor > best else None

    def _may_beat(
        self, big: PlanCandidate, small: PlanCandidate, threshold: int | None
    ) -> bool:
        """Whether `big`, a block that allocates afresh per call, may be faster by
        the time model than `small`, the ladder's largest block that does not:
        whether a floor on its estimate (its compute, page faults and loop
        trips) is below `small`'s. Costing `small` first."""
        small = self.costed(small)
        temp = self.known[big.key].temp_bytes if big.key in self.known else None
        fresh = float(temp if temp is not None else threshold or 0)
        floor = self.model.seconds(
            small.flops or 0.0,
            small.transcendentals or 0.0,
            0.0,
            big.trips if big.scan else 0,
            fresh,
        )
        return floor < (small.seconds or 0.0)

    def _note_over(self, steps: list[PlanCandidate], i: int) -> None:
        """Why `steps[i]`, a block larger than the largest that fits, was not
        compiled: a smaller block is over budget, or predicted to be."""
        c, sizes = steps[i], self.sizes
        for s in steps[i:]:
            known = self.known.get(s.key)
            if known is not None and known.fits is False:
                self.note(
                    c,
                    f"not compiled: a larger block than {s.nest(sizes)}, which is "
                    "over budget",
                )
                return
            if self.predicted.get(s.key, 0) > self.budget:
                what = "it" if s is c else f"{s.nest(sizes)}, a smaller block,"
                self.note(
                    c,
                    f"not compiled: {what} is predicted to need "
                    f"{fmt_bytes(self.predicted[s.key])} > {fmt_bytes(self.budget)} "
                    "(from the blocks of its ladder compiled: temporaries grow "
                    "about linearly with the block)",
                )
                return

    def first_within(
        self,
        steps: list[PlanCandidate],
        start: int,
        limit: int,
        above: PlanCandidate,
    ) -> int | None:
        """The first step from `start` (the largest block) whose temporaries are at
        most `limit`; `above`, a larger block, is known to exceed it.

        Temporaries shrink with the block along a ladder, close to affinely, so the
        blocks compiled predict the boundary (`predict`): the largest block
        predicted within `limit` is compiled, and the prediction refined, until a
        step is within `limit` and the next larger one is known to exceed it, or
        predicted to when it scans the same dims (only a chunk differs)."""
        lo, hi = start, len(steps)  # the answer is in steps[lo:hi], or None
        points = [(above.block, above.temp_bytes or 0)]
        points += [
            (c.block, self.known[c.key].temp_bytes or 0)
            for c in steps
            if c.key in self.known
        ]
        while lo < hi:
            within = [
                i
                for i in range(lo, hi)
                if (predict(points, steps[i].block) or 0) <= limit
            ]
            i = within[0] if within else hi - 1
            c = self.memory(steps[i])
            points.append((c.block, c.temp_bytes or 0))
            if (c.temp_bytes or 0) > limit:
                lo = i + 1
                continue
            hi = i
            if i == lo:
                break
            # The next larger block need not be compiled if it scans the same
            # dims (only a chunk differs: temporaries affine in the block) and is
            # predicted to exceed `limit`.
            prev = steps[i - 1]
            larger = predict(points, prev.block) or 0
            same = [n for n, _ in prev.scan] == [n for n, _ in c.scan]
            if same and larger > limit and prev.block > c.block:
                self.predicted[prev.key] = int(larger)
                break
        return hi if hi < len(steps) else None

    def estimate(self, c: PlanCandidate, lad: Ladder) -> float:
        """The estimated time of a candidate of a searched ladder that fits: its
        own if costed, else from the costs of its ladder's boundary (the same
        arithmetic), with its own trips and temporaries."""
        known = self.known.get(c.key, c)
        if known.seconds is not None:
            return known.seconds
        assert lad.edge is not None
        edge = self.known[lad.steps[lad.edge].key]
        if known.temp_bytes is not None:
            temp = known.temp_bytes
        else:
            temp = int((edge.temp_bytes or 0) * c.block / max(edge.block, 1))
        return self.model.seconds(
            edge.flops or 0.0,
            edge.transcendentals or 0.0,
            edge.bytes_accessed or 0.0,
            c.trips if c.scan else 0,
            float(self.model.fresh(temp)),
        )

    def time(self, cands: list[PlanCandidate]) -> dict[tuple, float]:
        """Run each candidate's compiled program on fresh inputs, side by side; the
        median seconds per call of each."""
        programs = [self.compiler.programs[c.spec] for c in cands]
        args = self.compiler.program_inputs()
        return time_candidates(cands, programs, args, self.progress.step)

    def run(self, source: str, shard: tuple[ShardDim, ...]) -> Plan:
        """Plan the call: the chosen nest, and every candidate with its reason.
        Raises `NoFit` if no candidate fits the budget."""
        start = time.perf_counter()
        full, ladders, considered, free = self._space()
        timed: dict[tuple, float] = {}
        compared: list[PlanCandidate] = []
        sizes = self.sizes
        if any(sizes[n] == 0 for n in self.call.mapped):
            chosen = full  # nothing to run; no need to compile anything
            for c in considered.values():
                self.note(c, "not compiled: a mapped dim has size 0")
            text = (
                f"Chose {full.nest(sizes)}: a mapped dim has size 0, so nothing "
                "runs and nothing was compiled."
            )
        else:
            chosen, compared, timed, text = self._choose(
                full, ladders, considered, free
            )
        candidates = tuple(
            with_reason(
                self.known.get(k, c),
                chosen,
                self.notes.get(k),
                timed,
                self.measure,
                self.budget,
                compared,
            )
            for k, c in considered.items()
        )
        chosen = next(c for c in candidates if c.key == chosen.key)
        return auto_plan(
            self.call,
            sizes,
            chosen,
            candidates,
            self.budget,
            source,
            shard,
            self.compiler.backward,
            n_compiled=self.compiler.n_compiled,
            seconds=time.perf_counter() - start,
            checkpoint=self.compiler.build(chosen.spec).checkpoint,
            time_model=self.model,
            summary=text,
            measured=self.measure,
        )

    def _space(
        self,
    ) -> tuple[PlanCandidate, list[Ladder], dict[tuple, PlanCandidate], bool]:
        """Full vmap (of the planned dims), the ladders, every candidate by key,
        and whether any dim is planned."""
        call, sizes = self.call, self.sizes
        fixed = call.options.scan  # the given scans, outermost, as given
        frozen = frozenset(given_dims(call)) | frozenset(collective_dims(call))
        free = tuple(n for n in call.mapped if n not in frozen)
        # Unscanned dims are vmapped: those of `vmap=` in the order given, then the
        # others in the order of the output's dims (no transpose).
        scanned = set(call.options.scan_names)
        layout = call.options.vmap + tuple(
            n
            for n in dim_orders(call, sizes)[0]
            if n not in call.options.vmap and n not in scanned
        )
        source = "full vmap" if not fixed else "given scans"
        full = candidate(fixed, layout, sizes, source)
        orders = dim_orders(call, sizes, free) if free else []
        ladders = [
            Ladder(ladder(order, layout, sizes, fixed, frozen)) for order in orders
        ]
        considered = {full.key: full}
        steps = (c for lad in ladders for c in lad.steps)
        for c in sorted(steps, key=lambda c: -c.block):
            considered.setdefault(c.key, c)
        return full, ladders, considered, bool(free)

    def _choose(
        self,
        full: PlanCandidate,
        ladders: list[Ladder],
        considered: dict[tuple, PlanCandidate],
        free: bool,
    ) -> tuple[PlanCandidate, list[PlanCandidate], dict[tuple, float], str]:
        """Search the ladders: the chosen candidate, those compared, their measured
        times (measured mode), and the summary."""
        f = self.costed(full)
        # Full vmap is kept if it fits, allocates nothing afresh per call, and the
        # planner does not measure.
        go = bool(ladders) and (not f.fits or bool(f.fresh_bytes) or self.measure)
        for i, lad in enumerate(ladders if go else []):
            if i > 0 and self.compiler.n_compiled >= MAX_COMPILES:
                for c in lad.steps:
                    self.note(
                        c, f"not compiled: beyond the compile cap ({MAX_COMPILES} "
                        "compiles)"
                    )
                continue  # the first ladder is always searched
            self.search(lad, f)
        if not go:
            why = (
                "full vmap fits and reuses its temporaries from call to call: "
                "nothing else needed"
            )
            for c in considered.values():
                self.note(c, f"not compiled: {why}")
        fitting = [c for c in self.known.values() if c.fits and c.seconds is not None]
        if not fitting:
            evaluated = list(self.known.values())
            smallest = min(evaluated, key=lambda c: c.temp_bytes or 0)
            message = no_fit_message(
                self.call,
                self.budget,
                smallest,
                len(evaluated),
                self.sizes,
                self.compiler.backward,
            )
            raise NoFit(message, smallest, len(evaluated))
        chosen = min(fitting, key=lambda c: c.seconds or 0.0)
        compared, timed, note = fitting, {}, ""
        if self.measure and (go or len(fitting) > 1):
            chosen, compared, timed, note = self.measured(ladders, full, chosen)
        text = summary(
            chosen,
            self.known[full.key],
            compared,
            timed,
            go,
            free,
            self.budget,
            self.model,
            self.sizes,
            note,
        )
        return chosen, compared, timed, text

    def measured(
        self,
        ladders: list[Ladder],
        full: PlanCandidate,
        model_choice: PlanCandidate,
    ) -> tuple[PlanCandidate, list[PlanCandidate], dict[tuple, float], str]:
        """Time the model's best few candidates that fit; the fastest, those timed,
        their times, and a note if timing was impossible."""
        estimates: dict[tuple, float] = {}
        for c in self.known.values():
            if c.fits and c.seconds is not None:
                estimates[c.key] = c.seconds
        for lad in ladders:
            if not lad.searched or lad.j is None or lad.edge is None:
                continue
            for c in lad.steps[lad.j :]:
                known = self.known.get(c.key)
                if known is not None and known.fits is False:
                    continue
                estimates.setdefault(c.key, self.estimate(c, lad))
        by_key = {c.key: c for lad in ladders for c in lad.steps}
        by_key[full.key] = full
        ranked = sorted(estimates, key=lambda k: estimates[k])
        pool = measured_pool(model_choice.key, ranked)
        for k in pool:
            if k not in self.known:
                self.notes.pop(k, None)
        timed_cands = [c for c in (self.memory(by_key[k]) for k in pool) if c.fits]
        for k in ranked:
            if k not in pool and k not in self.known:
                self.notes[k] = (
                    f"not compiled: est. {fmt_seconds(estimates[k])}, not among the "
                    f"{MAX_MEASURED} measured (the best estimates and a spread of "
                    f"the rest)"
                )
        try:
            timed = self.time(timed_cands)
        except Exception as e:  # e.g. inputs of a dtype we cannot make
            note = f"could not measure ({type(e).__name__}: {e}), so estimated"
            return model_choice, [c for c in timed_cands if c.seconds], {}, note
        fastest = min(timed_cands, key=lambda c: timed[c.key])
        kept = timed[model_choice.key] <= KEEP_WITHIN * timed[fastest.key]
        return (model_choice if kept else fastest), timed_cands, timed, ""


def auto_plan(
    call: Call,
    sizes: dict[str, int],
    chosen: PlanCandidate,
    candidates: tuple[PlanCandidate, ...],
    budget: int,
    source: str,
    shard: tuple[ShardDim, ...],
    backward: bool,
    **fields: Any,
) -> Plan:
    """The `Plan` of `plan="auto"`: planned now, or read from the disk cache."""
    return Plan(
        fun_name=call.fun_name,
        auto=True,
        sizes=tuple({**call.sizes, **sizes}.items()),
        dims=dims_of(chosen, sizes),
        chosen=chosen,
        candidates=candidates,
        budget_bytes=budget,
        budget_source=source,
        shard=shard,
        backward=backward,
        given=given_dims(call),
        collective=collective_dims(call),
        **fields,
    )

