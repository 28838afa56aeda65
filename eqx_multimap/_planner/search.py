"""The planner's search: which candidate nests it compiles, and which it chooses.

A plan picks, for the mapped dims of one call signature that no strategy names,
which to scan, in which order and with which chunk sizes; the rest are vmapped. Dims
named by `scan=`, `vmap=` or `shard=` keep the strategy given (the given scans
outermost, in their order, with their chunks), and dims that the body uses in
collectives are never scanned. Candidates (`space`) are
compiled and costed by `cost`; their temporary memory must fit the budget.

The search is bounded:

1. Full vmap (of the planned dims) is compiled first and chosen if it fits, unless
   its temporaries are allocated afresh on every call (see 3.) or the planner
   measures. Every other candidate is predicted from it (`cost`): its costs
   (the same flops; bytes plus the inputs re-read on every loop trip), and its
   temporaries, until compiled.
2. Otherwise the candidates form ladders, one per order of the dims (the output's
   layout, the inputs' layout, by size; see `space`), sorted by the number of
   elements of one loop iteration (the block), which temporary memory grows
   with. The largest block that fits is found by prediction (`Search.first_within`):
   the largest block predicted to fit is compiled, and the prediction corrected by
   it, until a block fits and the next larger one is known, or predicted, not to.
   A compile is spent only where it may matter: a block predicted far within the
   budget (`SAFE_FRACTION`), and est. at most `MATERIAL` slower than the largest
   predicted to fit, is taken as predicted (`Search.take_predicted`); every other
   block chosen for the budget was compiled and fits. The boundary candidate
   (and those with the same block in the same ladder) is costed, and the cheapest
   by estimated time (`TimeModel.seconds`) wins. The first ladder is always
   searched; another only if one of its blocks, predicted, may be materially
   faster than the best so far (`MATERIAL`).
3. On CPU, temporaries above the fresh threshold (glibc's malloc hands blocks that
   big out as fresh `mmap`s) are page-faulted in again on *every* call. So when the
   largest fitting block of a ladder (or full vmap) is above the threshold, the
   same search finds its largest block below it, and that one is costed instead:
   by the time model, its reuse of the heap saves more than the loop trips it adds.
   The threshold is a matter of speed only (a larger block fits the budget), so
   the same rule takes a block predicted within half of it (`THRESHOLD_MARGIN`).
4. Measured mode searches a ladder for every dim order, and times candidates that
   fit (every block that fits in the ladders searched: the model's best
   estimates, taking turns with an even spread over the rest, `measured_pool`) on
   sub-slices, under a cap; the fastest wins unless the model's own choice
   measured within `KEEP_WITHIN` of it (see `cost`).

Every candidate compiled outside measured mode is compiled for its analyses only
(`cost.ANALYSIS_OPTIONS`). With `shard=`, the plan is of the local nest of one
device (`localize`): the sharded dims keep their strategy, at their local sizes,
and the budget is per device.
"""

import dataclasses
import time

from .._timing import fmt_bytes, fmt_seconds
from .cost import (
    Compiler,
    corrected,
    KEEP_WITHIN,
    measured_pool,
    Progress,
    Reference,
    time_candidates,
)
from .plan import Plan, PlanCandidate
from .space import (
    auto_plan,
    candidate,
    collective_dims,
    dim_orders,
    given_dims,
    ladder,
    no_fit_message,
    NoFit,
    Request,
    summary,
    with_reason,
)


# Once planning has compiled this many programs, it searches no further ladders.
MAX_COMPILES = 12
# A block is not compiled, only predicted (`cost`), when its prediction is at
# most this fraction of the budget (a prediction that far within the budget cannot
# break it: predictions are within 0.35-3x of XLA's figure on the benchmarks'
# workloads), or of the fresh threshold (a matter of speed only: predictions are
# within 0.5-2x for 270 of 274 candidates), and it is est. at most `MATERIAL`
# slower than the largest block predicted to fit (`Search.take_predicted`).
SAFE_FRACTION = 1 / 8
THRESHOLD_MARGIN = 1 / 2
# Another ladder is searched only if one of its blocks may be estimated this much
# faster than the best candidate costed: smaller differences are within the time
# model's error, and not worth a compile.
MATERIAL = 1.05
# Bumped whenever the search changes what it chooses: plans on disk from another
# version are not used.
SEARCH_VERSION = 7


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


class Search:
    """One planning run: compiles candidates (each at most once), remembers what it
    learnt about each, and says why each was or was not chosen."""

    def __init__(self, request: Request, progress: Progress):
        self.request = request
        self.call = request.call
        self.sizes = request.sizes
        self.budget = request.budget
        self.model = request.model
        self.measure = request.measure
        self.progress = progress
        self.compiler = Compiler(
            self.call,
            self.sizes,
            self.model,
            request.backward,
            progress.step,
        )
        # By key: the candidates compiled, or taken as predicted (`predicted`).
        self.known: dict[tuple, PlanCandidate] = {}
        self.notes: dict[tuple, str] = {}  # by key: why an uncompiled one was not
        # By key: temporaries predicted above a limit, for blocks not compiled.
        self.predicted: dict[tuple, int] = {}
        # Full vmap's figures, once compiled: what the others are predicted from.
        self.ref: Reference | None = None
        self.slices: dict[tuple, dict[str, int]] = {}  # measured: sizes timed at

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
            assert self.ref is not None
            self.known[c.key] = self.compiler.predicted_costs(c, self.ref)
        return self.known[c.key]

    def prediction(self, steps: list[PlanCandidate], c: PlanCandidate) -> float:
        """The temporaries of `c`, a step of `steps`, predicted from full vmap's and
        corrected by the steps compiled (`cost.corrected`)."""
        assert self.ref is not None
        known = (self.known.get(s.key) for s in steps)
        compiled = [k for k in known if k is not None and not k.predicted]
        return corrected(self.ref, c, compiled)

    def seconds_at(self, c: PlanCandidate, temp: int) -> float:
        """The estimated time of `c` with `temp` bytes of temporaries, its costs
        predicted from full vmap's."""
        assert self.ref is not None
        guess = dataclasses.replace(c, temp_bytes=temp)
        return self.compiler.predicted_costs(guess, self.ref).seconds or 0.0

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
                k = self.first_within(steps, 0, threshold, soft=True)
                all_fresh = k is None
        else:
            j = self.first_within(steps, 0, self.budget)
            if j is not None and threshold is not None and self.fresh(steps[j]):
                k = self.first_within(steps, j + 1, threshold, soft=True)
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
            if self._may_beat(steps, steps[j], steps[lad.k]):
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
        floor on their estimated time (full vmap's compute, which every candidate
        does, and the page faults of `threshold` bytes) if it is above the
        estimate of a candidate costed, else `None`. Not in measured mode, which
        estimates the blocks it may time."""
        costed = [c.seconds for c in self.known.values() if c.fits and c.seconds]
        if self.measure or threshold is None or not costed or self.ref is None:
            return None
        ref = self.ref
        floor = self.model.seconds(ref.flops, ref.transcendentals, 0.0, 0, threshold)
        return floor if floor > min(costed) else None

    def _may_beat(
        self, steps: list[PlanCandidate], big: PlanCandidate, small: PlanCandidate
    ) -> bool:
        """Whether `big`, a block of `steps` that allocates afresh per call (its
        temporaries compiled, or predicted, above the threshold), may be faster by
        the time model than `small`, the ladder's largest block that does not.
        Costing `small` first."""
        small = self.costed(small)
        known = self.known.get(big.key)
        if known is not None and known.temp_bytes is not None:
            temp = known.temp_bytes
        else:
            threshold = self.model.fresh_threshold or 0
            temp = max(int(self.prediction(steps, big)), threshold)
        return self.seconds_at(big, temp) < (small.seconds or 0.0)

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
                    "(from full vmap's, corrected by the blocks of its ladder "
                    "compiled)",
                )
                return

    def first_within(
        self, steps: list[PlanCandidate], start: int, limit: int, soft: bool = False
    ) -> int | None:
        """The first step from `start` (the largest block) whose temporaries are at
        most `limit`; the step before `start`, if any, exceeds it.

        The largest block predicted within `limit` (`prediction`) is compiled, and
        the prediction corrected by it, until a step is within `limit` and the next
        larger one is known to exceed it, or predicted to when it scans the same
        dims (only a chunk differs: temporaries affine in the block); unless a block
        predicted far within `limit` is taken as predicted (`take_predicted`).
        `soft`: `limit` is the fresh threshold, and every block from `start` on
        fits the budget (a larger one does)."""
        lo, hi = start, len(steps)  # the answer is in steps[lo:hi], or None
        while lo < hi:
            guesses = {i: self.prediction(steps, steps[i]) for i in range(lo, hi)}
            within = [i for i, t in guesses.items() if t <= limit]
            taken = self.take_predicted(steps, within, guesses, soft)
            if taken is not None:
                return taken
            i = within[0] if within else hi - 1
            c = self.memory(steps[i])
            if (c.temp_bytes or 0) > limit:
                lo = i + 1
                continue
            hi = i
            if i == lo:
                break
            prev = steps[i - 1]
            larger = self.prediction(steps, prev)
            same = [n for n, _ in prev.scan] == [n for n, _ in c.scan]
            if same and larger > limit and prev.block > c.block:
                self.predicted[prev.key] = int(larger)
                break
        return hi if hi < len(steps) else None

    def take_predicted(
        self,
        steps: list[PlanCandidate],
        within: list[int],
        guesses: dict[int, float],
        soft: bool,
    ) -> int | None:
        """The largest block of `within` (the steps predicted within the limit,
        largest first) predicted *far* within it (from full vmap's figures, and
        corrected by the blocks compiled), taken as predicted, uncompiled, if
        its estimate is at most `MATERIAL` slower than the largest's: a compile is
        worth a material difference only. Far within: `SAFE_FRACTION` of the budget
        (a promise, left to no guess that could break it), or with `soft`, a
        fraction of the fresh threshold (`THRESHOLD_MARGIN`: only speed is at
        stake). `None` if none, or if the planner measures (it runs what it
        compiles)."""
        assert self.ref is not None
        threshold = self.model.fresh_threshold or 0
        safe = threshold * THRESHOLD_MARGIN if soft else self.budget * SAFE_FRACTION
        # Uncorrected too: a correction scales by a neighbour's ratio, which a
        # fusion XLA makes at one block and not at the next breaks.
        cautious = {i: max(guesses[i], self.ref.temp_bytes(steps[i])) for i in within}
        s = next((i for i in within if cautious[i] <= safe), None)
        if s is None or self.measure:
            return None
        top, c = within[0], steps[s]
        est = self.seconds_at(c, int(cautious[s]))
        if est > MATERIAL * self.seconds_at(steps[top], int(guesses[top])):
            return None
        for i in within[: within.index(s)]:
            self.note(
                steps[i],
                f"not compiled: predicted to fit, est. at most {MATERIAL - 1:.0%} "
                f"faster than {c.nest(self.sizes)}, which needs no compile",
            )
        what = "the fresh threshold" if soft else "the budget"
        self.notes[c.key] = f"far within {what}"
        self.known[c.key] = dataclasses.replace(
            c, temp_bytes=int(cautious[s]), fits=True, predicted=True
        )
        return s

    def estimate(self, c: PlanCandidate, lad: Ladder) -> float:
        """The estimated time of a candidate of a searched ladder that fits: its
        own if costed, else predicted (its temporaries too, if not compiled)."""
        known = self.known.get(c.key, c)
        if known.seconds is not None:
            return known.seconds
        temp = known.temp_bytes
        if temp is None:
            temp = int(self.prediction(lad.steps, c))
        return self.seconds_at(c, temp)

    def cannot_win(self, lad: Ladder) -> str | None:
        """Why no block of the ladder can be materially faster (`MATERIAL`), by the
        time model, than the best candidate costed (its temporaries predicted);
        `None` if one may, or if the planner measures (it may find what the model
        does not see)."""
        assert self.ref is not None
        costed = [c for c in self.known.values() if c.fits and c.seconds]
        if not costed or self.measure:
            return None
        best = min(costed, key=lambda c: c.seconds or 0.0)
        for c in lad.steps:
            temp = int(self.prediction(lad.steps, c))
            if temp > self.budget:
                continue
            if self.seconds_at(c, temp) * MATERIAL < (best.seconds or 0.0):
                return None
        return (
            "not compiled: no block of its ladder predicted to fit is est. "
            f"{MATERIAL - 1:.0%} faster than {best.nest(self.sizes)} (its loop "
            "trips, and the temporaries it would allocate afresh per call, "
            "predicted from full vmap's)"
        )

    def run(self) -> Plan:
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
            self.request,
            chosen,
            candidates,
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
        orders = dim_orders(call, sizes, free, every=self.measure) if free else []
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
        self.ref = self.compiler.reference(self.memory(full))
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
            why = self.cannot_win(lad) if i > 0 else None
            if why is not None:
                for c in lad.steps:
                    self.note(c, why)
                continue
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
        """Time the model's choice and a pool of other candidates that fit
        (`measured_pool`: every block at most the largest that fits of a searched
        ladder), on sub-slices; the fastest (its memory compiled), those timed,
        their times, and a note if timing was impossible."""
        estimates = {c.key: c.seconds for c in self.known.values() if c.fits}
        for lad in ladders:
            if lad.searched and lad.j is not None and lad.edge is not None:
                for c in lad.steps[lad.j :]:
                    if self.known.get(c.key, c).fits is not False:
                        estimates.setdefault(c.key, self.estimate(c, lad))
        by_key = {c.key: c for lad in ladders for c in lad.steps}
        by_key[full.key] = full
        ranked = sorted(estimates, key=lambda k: estimates[k] or 0.0)
        pool = measured_pool(model_choice.key, ranked)
        cands = [self.known.get(k, by_key[k]) for k in pool]
        try:
            timed, slices = time_candidates(
                self.compiler, self.call, cands, self.request.values
            )
        except Exception as e:  # e.g. inputs of a dtype we cannot make
            note = f"could not measure ({type(e).__name__}: {e}), so estimated"
            return model_choice, [model_choice], {}, note
        for k in ranked:
            if k not in timed and k not in self.known:
                self.notes[k] = (
                    f"not timed: est. {fmt_seconds(estimates[k] or 0.0)}; beyond "
                    "the measuring cap"
                )
        self.slices = slices
        order = sorted(timed, key=lambda k: timed[k])
        if timed[model_choice.key] <= KEEP_WITHIN * timed[order[0]]:
            order.remove(model_choice.key)
            order.insert(0, model_choice.key)
        # The fastest whose memory, compiled, fits (the model's choice does).
        chosen = next(c for c in (self.memory(by_key[k]) for k in order) if c.fits)
        self.costed(chosen)
        vs = f"vs {fmt_seconds(timed[chosen.key])}; its memory not compiled"
        for k in timed:
            if k not in self.known:
                self.notes[k] = (
                    f"slower: measured {fmt_seconds(timed[k])} {vs}"
                    if timed[k] >= timed[chosen.key]
                    else f"faster, measured {fmt_seconds(timed[k])} {vs}, but within "
                    f"{KEEP_WITHIN}x: the time model's choice was kept"
                )
        compared = [self.known.get(k, by_key[k]) for k in timed]
        return self.known[chosen.key], compared, timed, ""
