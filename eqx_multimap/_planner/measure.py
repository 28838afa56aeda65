"""Measured mode (`docs/planner.md`): timed search, the one timing loop, calibration."""

import dataclasses
import datetime
import functools as ft
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._resolve import Call
from .._text import fmt_bytes, fmt_seconds, plural
from .cost import Compiler
from .model import machine, SLICE, SPILL, TimeModel
from .plan import PlanCandidate
from .search import Choice, MATERIAL, Search, Steps


SHORT_SPEND = 0.1  # the short list times a candidate for this share of its compile
TARGET = 0.02  # seconds: a run on a slice of a candidate's trips (a short list's less)
TRIPS = 8  # at least, in a slice: a call's fixed cost (its temporaries' first touch)
WHOLE = 0.5  # timed whole if a slice would keep at least this share of the trips
CACHES = 2  # a slice's inputs and outputs fill the last cache level this many times
FEW = 4  # candidates run, at least, whatever the cap
CLOSE = 1.3  # those within this factor of the fastest are timed again, side by side
SAMPLE = 2e-3  # seconds: the shortest sample (a quick program runs several times)
SPEND = 0.25  # a candidate is timed for up to this share of its compile (3 rounds)
LONG = 0.05  # seconds: a program that runs longer is timed on one call, once
WARM = 4  # untimed calls, at most, before a program's first sample
DISTURBED = 1.5  # a round whose probe took this many times its median is dropped
CLEAR = 3.0  # a long candidate whose first timed run is this much slower is timed once
LOOSE = 2.0  # a rung predicted over the budget by less is timed whole if it fits
Index = dict[str, np.ndarray]  # the elements of some dims


class Probe:
    """A threaded program (under a ms) timed before each round: over `DISTURBED` times
    its median (not best: rounds after a long program run slower), a job held a core."""

    def __init__(self, run: Callable[[], Any] | None = None):
        self.run, self.times = run or _probe_loop(), []

    @jax.ensure_compile_time_eval()  # as `rounds`
    def time(self, clock: Callable[[], float] = time.perf_counter) -> None:
        jax.block_until_ready(self.run())  # settles
        self.times.append(_clocked(self.run, clock))

    def disturbed(self, start: int = 0) -> list[bool]:
        usual = statistics.median(self.times) if self.times else 0.0
        return [t > DISTURBED * usual for t in self.times[start:]]


def _clocked(fn: Callable, clock: Callable[[], float], number: int = 1) -> float:
    t0 = clock()
    for _ in range(number):
        jax.block_until_ready(fn())
    return (clock() - t0) / number


@ft.cache
def _probe_loop() -> Callable[[], Any]:
    x = np.ones(2**17, np.float32)  # not traced: planning runs in a trace
    loop = lambda y: jax.lax.fori_loop(0, 50, lambda i, y: y * 0.999 + 1, y)
    return ft.partial(jax.jit(loop).lower(x).compile(), x)


@jax.ensure_compile_time_eval()  # run eagerly in a trace (a callback gets arrays)
def rounds(
    thunks: Sequence[Callable[[], Any]],
    at_least: int,
    at_most: int = 0,
    seconds: float = 0.0,
    probe: Probe | None = None,
    settled: bool = False,
    clock: Callable[[], float] = time.perf_counter,
) -> list[list[float]]:
    """The package's timing loop: seconds per call of each thunk, per round.

    Untimed calls of each until one is no faster than 0.9x the one before (up to `WARM`;
    one if over `LONG` or `settled`): its first calls fault in its temporaries' pages
    (a gradient's: 13, 5.0, 3.5, then 2.7 ms). Then `at_least` rounds (to `at_most`
    within about `seconds`; one if all take over `LONG`), in an order rotating each
    round. A sample lasts `SAMPLE` at least (each thunk called as often), a quick one
    called once before, untimed (a caller calling again finds the machine so); rounds
    a `probe` finds disturbed dropped, unless all were."""
    firsts, warm = [], 1 if settled else WARM
    for fn in thunks:
        t = [_clocked(fn, clock)]
        while len(t) < warm and t[-1] <= LONG and (len(t) < 2 or t[-1] < 0.9 * t[-2]):
            t.append(_clocked(fn, clock))
        firsts.append(t[-1])
    number = max(1, math.ceil(SAMPLE / max(min(firsts), 1e-9)))
    per_round = (number + (number > 1)) * sum(firsts)
    n = max(at_least, min(at_most, int(seconds / max(per_round, 1e-9))))
    n = 1 if min(firsts) > LONG else n
    times: list[list[float]] = [[] for _ in thunks]
    for r in range(n):
        if probe is not None:
            probe.time()
        for i in [(k + r) % len(thunks) for k in range(len(thunks))]:
            if number > 1:
                jax.block_until_ready(thunks[i]())
            times[i].append(_clocked(thunks[i], clock, number))
    if probe is not None and not all(bad := probe.disturbed(len(probe.times) - n)):
        times = [[t for t, b in zip(ts, bad) if not b] for ts in times]
    return times


def trip_slice(c: PlanCandidate, sizes: dict[str, int], keep: float) -> Index:
    """The elements of the dims `c` scans that it is timed on: about `keep` of its
    trips, its block whole; outer loops cut first, to whole chunks spread, ends kept."""
    out = {}
    for name, chunk in c.scan:
        k, n = chunk or 1, sizes[name] // (chunk or 1)
        m = min(n, max(1, math.ceil(n * keep)))  # of its `n` chunks
        starts = np.unique(np.round(np.linspace(0, n - 1, m)).astype(int)) * k
        out[name] = (starts[:, None] + np.arange(k)).ravel()
        keep *= n / m
        if keep >= 1:
            break
    return out


def _sliced(call: Call, index: Index, sub: dict[str, int]) -> list:
    """The call's values at the elements `index` gives (by NumPy on CPU: no gather
    compiled per slice); of others, the first `sub` (a device's block with `shard=`)."""
    out, cpu = [], jax.default_backend() == "cpu"
    with jax.ensure_compile_time_eval():
        for v, axes in zip(call.values, call.leaf_axes):
            for name, ax in axes.items():
                if name not in index:
                    if np.shape(v)[ax] != sub[name]:
                        v = jax.lax.slice_in_dim(v, 0, sub[name], axis=ax)
                elif cpu and not jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key):
                    v = jax.device_put(np.take(np.asarray(v), index[name], axis=ax))
                else:
                    v = jnp.take(v, index[name], axis=ax)
            out.append(v)
    return out


@dataclasses.dataclass
class Timed:
    """A candidate as timed: a thunk running it, the dims it cut (`slice`: their
    elements, by name), the factor from a run to the whole call, compile, rounds."""

    run: Callable[[], Any]
    slice: dict[str, int]
    scale: float
    compile: float
    rounds: list[float]
    probe: int = 0  # the probe's time before it (`Probe.times`)


class Tuner:
    """One measured search: times candidates (`time`), chooses which (`run`)."""

    def __init__(self, search: Search):
        self.search, self.sizes = search, search.sizes
        self.values, self.short = search.request.values, search.request.short
        self.cap, self.spend = search.request.cap, SHORT_SPEND if self.short else SPEND
        self.alone = 1 if self.short else 3  # rounds alone (a short list: then paired)
        self.made = ft.partial(concrete_inputs, pools={})  # views of buffers made once
        self.began = time.perf_counter()
        self.timed: dict[tuple, Timed] = {}
        self.once = 0.0  # seconds: a call that does nothing (if a slice is timed)
        self.capped = False  # the cap stopped the search
        self.probe: Probe | None = None  # compiled only if there is a choice to make
        self.why: dict[tuple, str] = {}  # why one was not timed
        self.unsure: set[tuple] = set()  # predicted over the budget (`run`)
        self.costly: dict[tuple, str] = {}  # `affordable` not: their nests

    def seconds(self, key: tuple) -> float:
        """The time of a whole call of a timed candidate: its median round, scaled."""
        if not (t := self.timed[key]).rounds:
            return math.inf  # over the budget
        return max(statistics.median(t.rounds) - self.once, 0.0) * t.scale + self.once

    def best(self) -> float:
        return min((self.seconds(k) for k in self.timed), default=math.inf)

    def fastest(self) -> Timed | None:
        """The fastest timed that ran (one compiled over the budget did not)."""
        ran = [k for k, t in self.timed.items() if t.rounds]
        return self.timed[min(ran, key=self.seconds)] if ran else None

    def compiled(self) -> float:
        """The cap's unit: the fastest's compile (the first's if none ran), s."""
        return (self.fastest() or next(iter(self.timed.values()))).compile

    def due(self) -> bool:
        """Whether, once `FEW` have run, the next candidate would take planning past
        `cap` times the fastest's compile (one kept to time it again): then `capped`."""
        if sum(bool(t.rounds) for t in self.timed.values()) < FEW:
            return False
        now = time.perf_counter()
        per = (now - self.began) / len(self.timed)  # a candidate, on average
        self.capped |= now - self.search.start + per > (self.cap - 1) * self.compiled()
        return self.capped

    def keep(self, c: PlanCandidate) -> float:
        """The share of `c`'s loop trips it is timed on (`TARGET`, `TRIPS`, `WHOLE`); if
        the call's inputs and outputs pass the last cache, `CACHES` times its worth."""
        best = self.best() if self.timed else self.search.seconds_at(c)
        levels, io = self.search.model.levels, self.search.ref.io()
        last = levels[-1][0] if levels else math.inf
        floor = CACHES * last / io if io > last else 0.0
        trips = math.prod(self.sizes[n] // (k or 1) for n, k in c.scan)  # none: whole
        keep = max(TARGET * self.spend / SPEND / max(best, 1e-9), floor, TRIPS / trips)
        return 1.0 if keep >= WHOLE else keep

    def time(self, c: PlanCandidate) -> float:
        """Compile `c` (on `keep` of its trips; `unsure`: whole) and time it beside the
        fastest: its whole call's time; `inf` if, compiled whole, it is over budget."""
        if c.key in self.timed:
            return self.seconds(c.key)
        search, keep = self.search, 1.0 if c.key in self.unsure else self.keep(c)
        index = trip_slice(c, self.sizes, keep) if keep < 1 else {}
        sub = {**self.sizes, **{n: len(x) for n, x in index.items()}}
        compiler = Compiler(search.call, sub, search.model, search.compiler.backward)
        compiler.report = search.compiler.report  # planning's progress
        fn, specs = compiler._program(c.spec)
        t0, what = time.perf_counter(), f"compiling {c.nest(sub)} to time it"
        program = compiler.compile(fn, specs, what, runs=True)
        compiling = time.perf_counter() - t0
        search.compiler.n_compiled += 1
        scale = math.prod(self.sizes.values()) / max(math.prod(sub.values()), 1)
        self.timed[c.key] = Timed(lambda: None, {}, scale, compiling, [])
        if not index:  # compiled whole: its memory is known, and not run if over
            temp = int(program.memory_analysis().temp_size_in_bytes)
            fits = temp <= search.budget
            exact = dataclasses.replace(c, temp_bytes=temp, fits=fits, predicted=False)
            costed = search.compiler.predicted_costs(exact, search.ref)
            search.known[c.key] = costed if fits else exact
            if not fits:
                return math.inf
        args = _sliced(search.call, index, sub) if self.values else self.made(specs)
        if self.values and compiler.backward:  # the call's own, cotangents made up
            args = [args, self.made(specs[1])]
        args = jax.block_until_ready(args)
        if index and not self.once:  # the part of a call that no slice scales
            noop = jax.jit(lambda a: jax.tree.leaves(a)[0].ravel()[:1]).lower(args)
            self.once = min(rounds([ft.partial(noop.compile(), args)], 3)[0])
        run = lambda: program(args)  # noqa: E731
        if (probe := self.probe) is not None:
            probe.time()
        i, lead = len(probe.times) - 1 if probe else 0, self.fastest()
        base = statistics.median(lead.rounds) if lead else math.inf
        times = self.clearly_slower(run, scale) if lead else []  # settles `run`
        spend = self.spend * compiling  # twice side by side: disturbed rounds dropped
        if not times and base > TARGET:  # alone: none timed yet, or the fastest long
            (times,) = rounds([run], self.alone, 15, spend, probe, bool(lead))
        elif not times and lead:  # beside the fastest so far, whose runs join its own
            times, again = rounds([run, lead.run], 3, 15, 2 * spend, probe, True)
            lead.rounds += again
        cut = {n: sub[n] for n in index}
        self.timed[c.key] = Timed(run, cut, scale, compiling, times, i)
        return self.seconds(c.key)

    def clearly_slower(self, run: Callable[[], Any], scale: float) -> list[float]:
        """One sample (`rounds`), the only one of a candidate whose whole call takes
        over `CLEAR` times the fastest's, or that runs over `LONG`; else (or if under
        `SAMPLE`) `[]`."""
        (times,) = rounds([run], 1)
        whole = max(times[0] - self.once, 0.0) * scale + self.once
        done = whole > CLEAR * self.best() or times[0] > LONG
        return times if times[0] >= SAMPLE and done else []

    def confirm(self) -> None:
        """Time again side by side (3+ rounds, up to `SPEND` of a compile each, within
        the cap) those within `CLOSE` of the fastest, or whose probe was disturbed."""
        best, late = self.best(), self.probe.disturbed() if self.probe else []
        close = [
            k for k, t in self.timed.items()
            if t.rounds and (self.seconds(k) <= CLOSE * best or late and late[t.probe])
            and statistics.median(t.rounds) <= LONG
        ]  # fmt: skip
        if len(close) < 2:
            return
        compiles = self.compiled()
        left = self.cap * compiles - (time.perf_counter() - self.search.start)
        spend = min(left, SPEND * compiles * len(close))
        runs = [self.timed[k].run for k in close]
        for k, ts in zip(close, rounds(runs, 3, 15, spend, self.probe, True)):
            self.timed[k].rounds = ts

    def run(self, full: PlanCandidate, ladders: list[Steps], model: PlanCandidate):
        """The fastest timed that fits (`None`: no choice). Times full vmap (if it fits)
        and the model's choice; a first step `along` each ladder (an order of the dims)
        of rungs predicted within `LOOSE` of the budget (over it: `unsure`, run whole);
        in lockstep, a block of one; then along each ladder within `CLOSE` of the
        fastest, until the cap. A short list: the model's choice, then the first
        `affordable` of a `runner_up` est. within `MATERIAL`, full vmap, a runner-up."""
        search, loose = self.search, 1.0 if self.short else LOOSE
        above = lambda s, c: search.cautious(s, c) / search.budget  # noqa: E731
        self.unsure = {c.key for s in ladders for c in s if above(s, c) > 1}
        head = [full] * bool(search.known[full.key].fits)  # full vmap, if it fits
        # In lockstep a block of one runs unbatched, unlike any larger: timed alone.
        alone = lambda c: search.lockstep and c.block == 1 and not c.vmap  # noqa: E731
        near = lambda s, c: above(s, c) <= loose  # noqa: E731
        one = [c for s in ladders for c in s if alone(c) and near(s, c)][:1]
        rungs = [[c for c in s if near(s, c) and not alone(c)] for s in ladders]
        lines = [head + r for r in rungs if r]  # each with a rung of its own
        many = len({c.key for c in head + [model] + one + sum(lines, [])}) > 1
        if self.short and not many:
            return None
        self.probe = Probe() if many and not self.short else None
        for c in [model] if self.short else head + [model]:
            self.time(c)
        mine = lambda ln: ln[len(head) :]  # noqa: E731  # a line's own rungs
        first = next((ln for ln in lines if model in mine(ln)), (lines or [head])[0])
        lone = {c.key for c in one}
        if self.short:  # the pick, then one of: a near tie, full vmap, the next
            nxt, pick = self.runner_up(), model.seconds or 0.0
            tie = [nxt] if nxt and (nxt.seconds or 0.0) <= MATERIAL * pick else []
            for c in tie + head + [nxt]:
                if sum(bool(t.rounds) for t in self.timed.values()) >= 2:
                    break
                elif c is None:  # nothing else costed: a step along the pick's ladder
                    self.along(first, 1)
                elif self.affordable(c, model):
                    self.time(c)
            over = {k: "two runs est. longer than a compile" for k in self.costly}
            return self.choose(lambda k: over.get(k, "not on the short list"))

        def lead() -> float:  # the fastest time, of full vmap and the ladders
            ran = [k for k in self.timed if k not in lone] or list(self.timed)
            return min(map(self.seconds, ran))

        def fastest(line: list[PlanCandidate]) -> float:  # of its own rungs timed
            ran = [self.seconds(c.key) for c in mine(line) if c.key in self.timed]
            return min(ran, default=math.inf)

        # Ladders scanning the model's first dim first (each rung scans a prefix).
        for line in sorted(lines, key=lambda ln: ln[-1].scan[:1] != first[-1].scan[:1]):
            if not self.due():
                self.along(line, 1)  # the middle of its largest untimed gap
        for c in one if not self.due() else []:
            self.time(c)
        for i, line in enumerate(sorted(lines, key=fastest)):  # the fastest's first
            if self.capped or i and fastest(line) > CLOSE * lead():
                break
            self.along(line)
        self.confirm()
        pruned = "a block between it and its ladder's fastest measured slower, or "
        pruned += f"its ladder's first step over {CLOSE:g}x the fastest, or over budget"
        pruned = "the cap stopped the search first" if self.capped else pruned
        over = f"its temporaries predicted over {LOOSE:g}x the budget"
        in_lines = {c.key for line in lines for c in line}
        return self.choose(lambda k: pruned if k in in_lines else over)

    def affordable(self, c: PlanCandidate, pick: PlanCandidate) -> bool:
        """Whether two runs of `c` (est. from `pick`'s) fit a compile; else `costly`."""
        est = lambda k: self.search.known[k].seconds or 1e-12  # noqa: E731
        two = 2 * self.seconds(pick.key) * est(c.key) / est(pick.key) * self.keep(c)
        if math.inf > two > self.compiled():
            self.costly[c.key] = c.nest(self.sizes)
        return c.key not in self.costly

    def runner_up(self) -> PlanCandidate | None:
        """Of the untimed costed that fit, est. within `MATERIAL` of the fastest, the
        smallest working set: the model's doubt is which cache level holds it."""
        known = self.search.known.values()
        left = [c for c in known if c.fits and c.seconds and c.key not in self.timed]
        best = min((c.seconds or 0.0 for c in left), default=0.0)
        near = [c for c in left if (c.seconds or 0.0) <= MATERIAL * best]
        return min(near, key=lambda c: c.working_set or 0, default=None)

    def along(self, line: list[PlanCandidate], steps: int | None = None) -> None:
        """Search `line` (largest block first): time the middle of the larger untimed
        gap beside its fastest until both its neighbours are timed (or `steps` are)."""
        for _ in range(len(line) if steps is None else steps):
            ran = [i for i, c in enumerate(line) if c.key in self.timed]
            t = {i: self.seconds(line[i].key) for i in ran}
            if not t:  # none timed yet: start in its middle
                self.time(line[len(line) // 2])
                continue
            b = min(t, key=t.get)
            lo = max((i for i in t if i < b), default=-1)
            hi = min((i for i in t if i > b), default=len(line))
            left, right = b - lo - 1, hi - b - 1
            if not (left or right) or self.due():
                return
            lower_left = t.get(lo, math.inf) < t.get(hi, math.inf)
            go_left = left > right or left == right and lower_left
            self.time(line[(lo + b) // 2 if go_left else (b + hi) // 2])

    def choose(self, why: Callable[[tuple], str]) -> Choice:
        """The fastest timed that fits (compiled if predicted); `why`: untimed ones."""
        search = self.search
        for k in search.considered.keys() - self.timed.keys():
            self.why[k] = f"not timed: {why(k)}"
        known = lambda k: search.known.get(k, search.considered[k])  # noqa: E731
        timed = {k: self.seconds(k) for k in self.timed if self.timed[k].rounds}
        checked = (search.checked(known(k)) for k in sorted(timed, key=self.seconds))
        chosen = next((c for c in checked if c.fits), None)  # fastest first, lazily
        compared = [known(k) for k in timed]
        return Choice(chosen or search.pick().chosen, compared, timed)

    def describe(self) -> str:
        """What was timed, on what, and whether the cap stopped the search."""
        ran = [t for t in self.timed.values() if t.rounds]
        cut = sum(bool(t.slice) for t in ran)
        part = "each" if cut == len(ran) else f"{cut} of them"
        sliced = f"{part} on a slice of its loop trips (its block kept), scaled"
        how = sliced if cut else "each on the whole call"
        what = "the call's arguments" if self.values else "made-up inputs of its shapes"
        n, checked = plural(len(ran), "candidate"), " The time model's choice checked:"
        costly = ", ".join(self.costly.values())
        costly = costly and f" Not timed (two runs est. over a compile): {costly}."
        if self.short:
            return f"{checked} a short list of {n} timed on {what}, {how}.{costly}"
        stop = "stopped the search: one more candidate would have passed it"
        stop = stop if self.capped else "was not reached"
        again = f"; those within {CLOSE:g}x of the fastest again side by side"
        return (
            f" Timed on {what}: {n}, {how}{again * (len(ran) > 1)}. The cap "
            f"({self.cap:g}x the fastest's compile, "
            f"{fmt_seconds(self.cap * self.compiled())}) {stop}."
        )


def measured(
    search: Search, full: PlanCandidate, ladders: list[Steps], model: PlanCandidate
) -> tuple[Choice, str]:
    """`Tuner.run`'s choice, and what it timed; the model's (with what timing found
    over the budget) if there was no choice to make, or timing failed."""
    tuner = Tuner(search)
    try:
        choice = tuner.run(full, ladders, model)
    except Exception as e:  # e.g. inputs of a dtype that cannot be made up
        first = (str(e).splitlines() or [""])[0]
        note = f"could not measure ({type(e).__name__}: {first}), so estimated"
        return search.pick()._replace(note=note), ""
    if choice is None:
        return search.pick(), ""
    search.notes.update(tuner.why)
    return choice, tuner.describe()


def concrete_inputs(specs: Any, pools: dict) -> Any:
    """Arrays of a pytree of `ShapeDtypeStruct`s, made eagerly even in a trace: floats
    uniform in [-1, 1) (no denormals or overflow), 4,093 repeated, others zero; views of
    a buffer per leaf (`pools`, by place and dtype: made once for calls no larger; by
    XLA if large: 0.4 s a GiB), that `jax.device_put` on CPU takes uncopied."""
    draws = np.random.default_rng(0).random(2 * 4093, dtype=np.float32) * 2 - 1  # prime

    def make(i: int, s: jax.ShapeDtypeStruct) -> Any:
        if jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key):
            impl = s.dtype._impl  # pyright: ignore[reportAttributeAccessIssue]
            data = np.zeros(tuple(s.shape) + tuple(impl.key_shape), np.uint32)
            return jax.random.wrap_key_data(data, impl=impl.name)
        n, dtype = math.prod(s.shape), np.dtype(s.dtype)
        if (x := pools.get((i, dtype))) is None or x.size < n:
            period = draws[:4093] * jnp.issubdtype(dtype, jnp.inexact)
            if jnp.issubdtype(dtype, jnp.complexfloating):
                period = period + 1j * draws[4093:]
            big = n * dtype.itemsize > 2**22  # NumPy's first touch: up to 3 s a GiB
            tile = lambda p: (jnp if big else np).tile(p, -(-n // 4093))[:n]
            fill = jax.jit(tile) if big else tile  # XLA's compile: 30 ms
            x = pools[i, dtype] = np.asarray(fill(period.astype(dtype)))
        return jax.device_put(x[:n].reshape(s.shape))

    leaves, tree = jax.tree.flatten(specs)
    with jax.ensure_compile_time_eval():
        return jax.tree.unflatten(tree, [make(i, s) for i, s in enumerate(leaves)])


def _timed(fn: Callable, specs: list, repeats: int, key: str = "") -> float | None:
    """Runs of `fn`'s compiled program per second (the best of `repeats`), or with
    `key`, XLA's `cost_analysis()[key]` per second."""
    compiled = jax.jit(fn).lower(*specs).compile()
    args = concrete_inputs(specs, {})
    seconds = min(rounds([lambda: compiled(*args)], 2, repeats, 1.0)[0])
    amount = float((compiled.cost_analysis() or {}).get(key, 1.0)) if key else 1.0
    return amount / seconds if amount > 0 and seconds > 0 else None


def stream_bandwidth(nbytes: int, repeats: int, one_core: bool = False) -> float | None:
    """Bytes per second read and written by `y = a * y + b` looped over `nbytes`, kept
    in the level they fit; with `one_core`, `SLICE` bytes per op: too few to split."""
    n = max(nbytes // 4, 256)
    k = min(n, SLICE // 4) if one_core else n  # elements per op
    n, reps = n // k * k, max(2, 2**28 // (4 * k))

    def step(i: Any, y: Any) -> Any:  # k == n: XLA drops the whole-array slices
        at = (i % (n // k)) * k
        part = jax.lax.dynamic_slice(y, (at,), (k,))
        return jax.lax.dynamic_update_slice(y, part * 0.999 + 1.0, (at,))

    loop = lambda x: jax.lax.fori_loop(0, reps, step, x)
    rate = _timed(loop, [jax.ShapeDtypeStruct((n,), jnp.float32)], repeats)
    return 8 * k * reps * rate if rate else None


def _loop_overhead(repeats: int, trips: int = 2048) -> float | None:
    """Seconds per trip of a scan of small kernels (a sort, two 16x16 matmuls, an `exp`,
    a max), their arithmetic included (`docs/design.md`): a loop body's fixed cost."""

    def step(carry: Any, x: Any) -> tuple[Any, Any]:
        w = jnp.eye(16, dtype=x.dtype) * 0.5
        y = jnp.sort(x) @ w
        return carry + jnp.max(y), jnp.exp(y) @ w

    steps = lambda xs: jax.lax.scan(step, jnp.zeros((), xs.dtype), xs)[1]
    rate = _timed(steps, [jax.ShapeDtypeStruct((trips, 16), jnp.float32)], repeats)
    return 1 / (rate * trips) if rate else None


def calibrate(repeats: int = 7) -> TimeModel:
    """Measure the time model's constants on the default backend's first device: a
    matmul, an `exp`, a streaming kernel inside each memory level (a core's own on one
    core) and past the last, and a scan of small steps; any not measurable: default."""
    start = time.perf_counter()
    default = TimeModel.for_backend(jax.default_backend())
    f32 = ft.partial(jax.ShapeDtypeStruct, dtype=jnp.float32)
    exp = lambda x: jnp.sum(jnp.exp(x))
    sizes = [size for size, _ in default.levels]  # what each holds (`model.held`)
    # A core's own caches (all but the last): one core on its share, times the cores
    # (waking threads hides their speed); the last level and memory: ops split over all.
    one_core = [stream_bandwidth(s // default.cores, repeats, True) for s in sizes[:-1]]
    rates = [r and r * default.cores for r in one_core]
    rates += [stream_bandwidth(s, repeats) for s in sizes[-1:]]
    # Past the last: `SPILL` times what it holds, at most 2 GiB (an L3 may be 480 MiB).
    memory = stream_bandwidth(min(SPILL * max(sizes, default=2**23), 2**31), repeats)
    # A smaller level is never slower than a larger one: noise is.
    floor, levels = memory or default.bandwidth, []
    for (size, old), rate in reversed(list(zip(default.levels, rates))):
        floor = max(rate or old, floor)
        levels.insert(0, (size, floor))
    measured = {
        "flops": _timed(lambda a, b: a @ b, [f32((256, 256))] * 2, repeats, "flops"),
        "transcendentals": _timed(exp, [f32((2**20,))], repeats, "transcendentals"),
        "bandwidth": memory,
        "loop_overhead": _loop_overhead(repeats),
    }
    kept = {k: v for k, v in measured.items() if v}  # each `None` or positive
    missing = sorted(set(measured) - set(kept)) + ["levels"] * (None in rates)
    m = machine()
    where = f"{m['platform']}: {m['device_kind']}"
    if m["platform"] == "cpu":
        caches = "/".join(fmt_bytes(s) for s in m["caches"])
        where = f"cpu: {m['cpu']}, {m['cores']} cores, caches {caches}"
    when = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M")
    note = f"{where}, in {time.perf_counter() - start:.2f} s on {when}"
    note += f" ({', '.join(missing)}: default, not measurable here)" * bool(missing)
    return dataclasses.replace(default, levels=tuple(levels), calibration=note, **kept)
