"""The planner's search: which candidate nests it compiles, and which it chooses.
Full vmap is compiled first and the others predicted from it; on each ladder, the
blocks at the edge of the budget and of each cache level are costed, and the
cheapest by the time model wins (in measured mode, the fastest timed). See
`docs/design.md`."""

import dataclasses
import math
import time

from .._timing import fmt_bytes, fmt_seconds
from .cost import (
    Compiler,
    corrected,
    KEEP_WITHIN,
    lockstep,
    Progress,
    Reference,
    spread,
    Timer,
    WALK_FIRST,
    WALK_SLOWER,
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


MAX_COMPILES = 12  # planning that has compiled this many searches no further ladder
# A block predicted (uncorrected and corrected) within this fraction of the budget
# is not compiled to check it: predictions are within 0.35-3x of XLA's figure on
# the benchmarks' workloads.
SAFE_FRACTION = 1 / 8
# A compile (another ladder, a larger block) is worth an estimate this much faster:
# smaller differences are within the time model's error.
MATERIAL = 1.05
SEARCH_VERSION = 9  # bumped when the search chooses otherwise: older plans unused


@dataclasses.dataclass
class Ladder:
    """One ladder, as searched: the index of its largest block that fits (`j`)."""

    steps: list[PlanCandidate]
    searched: bool = False
    j: int | None = None


class Search:
    """One planning run: compiles candidates (each at most once), remembers what it
    learnt about each, and says why each was or was not chosen."""

    def __init__(self, request: Request, progress: Progress):
        self.request, self.call = request, request.call
        self.sizes, self.budget = request.sizes, request.budget
        self.model, self.measure = request.model, request.measure
        self.compiler = Compiler(
            self.call, self.sizes, self.model, request.backward, progress.step
        )
        self.known: dict[tuple, PlanCandidate] = {}  # compiled, or taken as predicted
        self.notes: dict[tuple, str] = {}  # why one not compiled was not chosen
        self.ref: Reference | None = None  # full vmap's figures, the others' basis
        self.lockstep = False  # a vmapped block runs a while loop in lockstep
        self.slices: dict[tuple, dict[str, int]] = {}  # measured: sizes timed at

    def memory(self, c: PlanCandidate) -> PlanCandidate:
        if c.key not in self.known:
            temp = self.compiler.memory(c)
            self.known[c.key] = dataclasses.replace(
                c, temp_bytes=temp, fits=temp <= self.budget
            )
        return self.known[c.key]

    def costed(self, c: PlanCandidate) -> PlanCandidate:
        c = self.known.get(c.key) or self.memory(c)
        if c.fits and c.seconds is None:
            assert self.ref is not None
            self.known[c.key] = self.compiler.predicted_costs(c, self.ref)
        return self.known[c.key]

    def prediction(self, steps: list[PlanCandidate], c: PlanCandidate) -> float:
        """The temporaries of `c`, a step of `steps`, predicted and corrected by the
        steps compiled (`cost.corrected`)."""
        assert self.ref is not None
        known = (self.known.get(s.key) for s in steps)
        return corrected(self.ref, c, [k for k in known if k and not k.predicted])

    def cautious(self, steps: list[PlanCandidate], c: PlanCandidate) -> int | float:
        """The larger of `prediction` and the uncorrected one: a correction scales by
        a neighbour's ratio, which a fusion XLA makes at one block and not at the
        next breaks."""
        assert self.ref is not None
        return max(self.prediction(steps, c), self.ref.temp_bytes(c))

    def seconds_at(self, c: PlanCandidate) -> float:
        """The estimated time of `c`, its costs predicted from full vmap's."""
        assert self.ref is not None
        return self.compiler.predicted_costs(c, self.ref).seconds or 0.0

    def taken(self, steps: list[PlanCandidate], c: PlanCandidate, why: str) -> None:
        """Cost `c` uncompiled, its temporaries `cautious`ly predicted (`pick` checks
        them if it wins); compiled if the planner measures (it runs it)."""
        assert self.ref is not None
        if self.measure:
            self.costed(c)
        elif c.key not in self.known:
            temp = int(self.cautious(steps, c))
            guess = dataclasses.replace(c, temp_bytes=temp, fits=True, predicted=True)
            self.known[c.key] = self.compiler.predicted_costs(guess, self.ref)
            self.notes[c.key] = why

    def note(self, c: PlanCandidate, why: str) -> None:
        if c.key not in self.known:
            self.notes.setdefault(c.key, why)

    def search(self, lad: Ladder, full: PlanCandidate) -> None:
        """Cost the ladder's largest block that fits the budget (`j`), its largest
        whose predicted working set fits each level of the memory hierarchy, their
        ties (the same block) and, in lockstep, its smallest."""
        assert self.ref is not None
        steps, lad.searched = lad.steps, True
        lad.j = j = 0 if full.fits else self.first_within(steps)
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
                edges[i] = (
                    f"the largest block of its ladder whose working set "
                    f"({fmt_bytes(ws[i])}) fits {fmt_bytes(size)} of cache"
                )
        for e, why in edges.items():
            for c in steps:
                if c.block == steps[e].block and c.key in self.known:
                    self.costed(c)
                elif c.block == steps[e].block:
                    self.taken(steps, c, why)
        for i, c in enumerate(steps):
            if i < j:
                over = "over budget, or predicted to be"
                self.note(c, f"not compiled: a larger block than one {over}")
            elif c.key not in self.known:
                e = steps[max(k for k in edges if k <= i)].nest(self.sizes)
                self.note(
                    c,
                    f"not compiled: a smaller block than {e}, whose working set "
                    "fits the same level of the memory hierarchy: more loop trips",
                )

    def first_within(self, steps: list[PlanCandidate]) -> int | None:
        """The first step (the largest block) whose temporaries fit the budget.

        The largest step predicted to fit is compiled, correcting the prediction,
        until a step fits and the next larger one is known not to, or predicted not
        to when it scans the same dims (temporaries affine in the chunk); unless one
        far within the budget is taken as predicted (`take_predicted`)."""
        lo, hi = 0, len(steps)  # the answer is in steps[lo:hi], or None
        while lo < hi:
            guesses = [self.prediction(steps, steps[i]) for i in range(lo, hi)]
            within = [lo + k for k, t in enumerate(guesses) if t <= self.budget]
            taken = self.take_predicted(steps, within)
            if taken is not None:
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

    def take_predicted(
        self, steps: list[PlanCandidate], within: list[int]
    ) -> int | None:
        """The largest step of `within` (those predicted to fit, largest first)
        `cautious`ly predicted within `SAFE_FRACTION` of the budget, taken uncompiled
        if est. at most `MATERIAL` slower than every larger one; `None` if none, or
        if the planner measures (it runs what it compiles)."""
        safe = self.budget * SAFE_FRACTION
        s = next((i for i in within if self.cautious(steps, steps[i]) <= safe), None)
        if s is None or self.measure:
            return None
        c, larger = steps[s], within[: within.index(s)]
        fastest = min((self.seconds_at(steps[i]) for i in larger), default=float("inf"))
        if self.seconds_at(c) > MATERIAL * fastest:
            return None
        for i in larger:
            self.note(
                steps[i],
                f"not compiled: predicted to fit, est. at most {MATERIAL - 1:.0%} "
                f"faster than {c.nest(self.sizes)}, which needs no compile",
            )
        self.taken(steps, c, "far within the budget")
        return s

    def cannot_win(self, lad: Ladder) -> str | None:
        """Why no block of the ladder can be est. `MATERIAL`ly faster than the best
        costed; `None` if one may, or if the planner measures (it may find what the
        model does not see)."""
        costed = [c for c in self.known.values() if c.fits and c.seconds]
        if not costed or self.measure:
            return None
        best = min(costed, key=lambda c: c.seconds or 0.0)
        for c in lad.steps:
            fits = self.prediction(lad.steps, c) <= self.budget
            if fits and self.seconds_at(c) * MATERIAL < (best.seconds or 0.0):
                return None
        return (
            "not compiled: no block of its ladder predicted to fit is est. "
            f"{MATERIAL - 1:.0%} faster than {best.nest(self.sizes)} (its loop "
            "trips and working set predicted from full vmap's)"
        )

    def run(self) -> Plan:
        """Plan the call: the chosen nest, and every candidate with its reason.
        Raises `NoFit` if no candidate fits the budget."""
        start = time.perf_counter()
        call, sizes = self.call, self.sizes
        fixed = call.options.scan  # the given scans, outermost, as given
        frozen = frozenset(given_dims(call)) | frozenset(collective_dims(call))
        free = tuple(n for n in call.mapped if n not in frozen)
        # Vmapped: the dims of `vmap=` as given, then the others in the output's order.
        given = call.options.vmap + call.options.scan_names
        layout = call.options.vmap + tuple(
            n for n in dim_orders(call, sizes)[0] if n not in given
        )
        full = candidate(fixed, layout, sizes, "given scans" if fixed else "full vmap")
        orders = dim_orders(call, sizes, free, every=self.measure) if free else []
        ladders = [Ladder(ladder(o, layout, sizes, fixed, frozen)) for o in orders]
        considered = {full.key: full}
        steps = (c for lad in ladders for c in lad.steps)
        for c in sorted(steps, key=lambda c: -c.block):
            considered.setdefault(c.key, c)
        if any(sizes[n] == 0 for n in call.mapped):  # nothing runs: nothing compiled
            chosen, compared, timed = full, [], {}
            for c in considered.values():
                self.note(c, "not compiled: a mapped dim has size 0")
            text = (
                f"Chose {full.nest(sizes)}: a mapped dim has size 0, so nothing "
                "runs and nothing was compiled."
            )
        else:
            chosen, compared, timed, text = self._choose(full, ladders, bool(free))
        candidates = tuple(
            with_reason(
                self.known.get(k, c), chosen, self.notes.get(k), timed,
                self.budget, compared,
            )  # fmt: skip
            for k, c in considered.items()
        )
        chosen = next(c for c in candidates if c.key == chosen.key)
        return auto_plan(
            self.request, chosen, candidates,
            n_compiled=self.compiler.n_compiled,
            seconds=time.perf_counter() - start,
            checkpoint=self.compiler.build(chosen.spec).checkpoint,
            time_model=self.model, summary=text, measured=self.measure,
        )  # fmt: skip

    def _choose(
        self, full: PlanCandidate, ladders: list[Ladder], free: bool
    ) -> tuple[PlanCandidate, list[PlanCandidate], dict[tuple, float], str]:
        """Search the ladders: the chosen candidate, those compared, their measured
        times (measured mode), and the summary."""
        compiled = self.memory(full)
        self.lockstep = lockstep(self.compiler.jaxpr)
        self.ref = self.compiler.reference(compiled)
        f = self.costed(full)
        # Full vmap is kept if it fits, its working set is within the last level of
        # the memory hierarchy, nothing runs in lockstep, and the planner does not
        # measure.
        last = max((size for size, _ in self.model.levels), default=0)
        go = bool(ladders) and (
            not f.fits or (f.working_set or 0) > last or self.measure or self.lockstep
        )
        # A body whose while loop runs in lockstep is measured by `walk`, which
        # needs no search by the model.
        walk = go and self.measure and self.lockstep
        walked = self.measured(ladders, full, None) if walk else None
        for i, lad in enumerate(ladders if go and walked is None else []):
            why = None
            if i > 0 and self.compiler.n_compiled >= MAX_COMPILES:
                why = f"not compiled: beyond the compile cap ({MAX_COMPILES} compiles)"
            elif i > 0:  # the first ladder is always searched
                why = self.cannot_win(lad)
            if why is None:
                self.search(lad, f)
            for c in lad.steps if why else []:
                self.note(c, why)
        ws = fmt_bytes(f.working_set or 0)
        for c in (c for lad in ladders for c in lad.steps) if not go else ():
            self.note(
                c,
                f"not compiled: full vmap fits, and its working set ({ws}) is "
                f"within {fmt_bytes(last)} of cache: nothing else needed",
            )
        if walked is not None:
            chosen, compared, timed, note = walked
        else:
            fitting, chosen = self.pick()
            compared, timed, note = fitting, {}, ""
        if walked is None and self.measure and (go or len(fitting) > 1):
            measured = self.measured(ladders, full, chosen)
            assert measured is not None
            chosen, compared, timed, note = measured
        text = summary(
            chosen, self.known[full.key], compared, timed, go, free,
            self.request, note,
        )  # fmt: skip
        return chosen, compared, timed, text

    def pick(self) -> tuple[list[PlanCandidate], PlanCandidate]:
        """The candidates costed that fit, and the fastest by the estimate (in
        lockstep, a block of one element wins if est. at most `MATERIAL` slower: the
        waste of a larger block depends on the data, which the model cannot see).
        One whose temporaries were only predicted, and not within `SAFE_FRACTION` of
        the budget, is compiled first to check that it fits."""

        def rank(c: PlanCandidate) -> float:
            lockstep = self.lockstep and c.block > 1
            return (c.seconds or 0.0) * (MATERIAL if lockstep else 1.0)

        while True:
            fitting = [c for c in self.known.values() if c.fits and c.seconds]
            if not fitting:
                tried = list(self.known.values())
                smallest = min(tried, key=lambda c: c.temp_bytes or 0)
                message = no_fit_message(self.request, smallest, len(tried))
                raise NoFit(message, smallest, len(tried))
            c = min(fitting, key=rank)
            if not c.predicted or (c.temp_bytes or 0) <= self.budget * SAFE_FRACTION:
                return fitting, c
            temp = self.compiler.memory(c)
            fits = temp <= self.budget
            self.known[c.key] = dataclasses.replace(
                c, temp_bytes=temp, fits=fits, predicted=False,
                seconds=c.seconds if fits else None,
            )  # fmt: skip
            self.notes.pop(c.key, None)

    def measured(
        self,
        ladders: list[Ladder],
        full: PlanCandidate,
        model_choice: PlanCandidate | None,
    ) -> tuple[PlanCandidate, list[PlanCandidate], dict[tuple, float], str] | None:
        """Time candidates on sub-slices (`cost.Timer`), walking the ladders from
        the model's choice (`None`: a body in lockstep, from the smallest block).
        The fastest (its memory compiled; the model's choice if within
        `KEEP_WITHIN` of it), those timed, their times, and a note if timing was
        impossible; `None` if nothing timed fits, or timing failed in lockstep."""
        by_key = {c.key: c for lad in ladders for c in lad.steps}
        by_key[full.key] = full
        lockstep = model_choice is None  # the cap grows with the longest compile
        timer = Timer(self.compiler, self.call, self.request.values, lockstep)
        try:
            self.walk(ladders, timer, model_choice)
            if not timer.timed:
                return None
            timed = timer.confirm()
        except Exception as e:  # e.g. inputs of a dtype we cannot make
            if model_choice is None:
                return None
            note = f"could not measure ({type(e).__name__}: {e}), so estimated"
            return model_choice, [model_choice], {}, note
        self.slices = timer.slices
        order = sorted(timed, key=lambda k: timed[k])
        mine = timed.get(model_choice.key) if model_choice else None
        if mine is not None and mine <= KEEP_WITHIN * timed[order[0]]:
            order.remove(model_choice.key)
            order.insert(0, model_choice.key)
        # The fastest whose memory, compiled, fits.
        fitting = (c for c in (self.memory(by_key[k]) for k in order) if c.fits)
        chosen = next(fitting, None)
        if chosen is None:
            return None
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

    def walk(
        self, ladders: list[Ladder], timer: Timer, start: PlanCandidate | None
    ) -> None:
        """Time blocks from `start`, the model's choice, or for a body whose while
        loop runs in lockstep (a block loops as long as its slowest element, which
        the model cannot see), from the smallest block. Then a block of about
        `start`'s size (in lockstep, of `WALK_FIRST` elements) along each dim, on
        the ladder that scans it innermost; then from the fastest, larger blocks
        of its ladder until one is `WALK_SLOWER` than the best, then smaller ones
        alike, until `due`. In lockstep, all on the same elements (`spread`): the
        elements' costs differ."""
        ups: dict[str, list[PlanCandidate]] = {}  # by innermost dim, smallest first
        for lad in ladders:
            fit = [c for c in lad.steps if self.cautious(lad.steps, c) <= self.budget]
            ups.setdefault(lad.steps[-1].scan[-1][0], fit[::-1])
        every = [c for up in ups.values() for c in up]
        if not every and start is None:
            return
        first = start or min(every, key=lambda c: c.block)
        seeds = {}
        for d, up in ups.items():
            if start is not None and up:
                near = [abs(math.log(c.block / max(start.block, 1))) for c in up]
                seeds[d] = near.index(min(near))
            elif up and up[-1].block > first.block:
                seeds[d] = next(
                    i for i, c in enumerate(up)
                    if c.block >= WALK_FIRST and c.block > first.block or c is up[-1]
                )  # fmt: skip
        index = None
        if start is None:  # runs of each dim's seed chunk, spread over it
            chunk = {d: dict(ups[d][i].scan).get(d) for d, i in seeds.items()}
            index = {d: spread(n, chunk.get(d) or 1) for d, n in self.sizes.items()}
        seconds = lambda c: timer.time(c, index)  # noqa: E731
        best = min([first] + [ups[d][i] for d, i in seeds.items()], key=seconds)
        d = min(seeds, key=lambda d: seconds(ups[d][seeds[d]]), default=None)
        if d is not None:
            i, up = seeds[d], ups[d]
            for way in (up[i + 1 :], up[:i][::-1] if start is not None else []):
                for c in way:
                    if timer.due() or seconds(c) > WALK_SLOWER * seconds(best):
                        break
                    best = min(best, c, key=seconds)
        for c in (c for lad in ladders for c in lad.steps):
            if c.key not in timer.timed and c.key not in self.known:
                self.notes[c.key] = "not timed: beyond the walk over blocks"
