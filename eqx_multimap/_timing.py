"""Timing compiled programs side by side: one implementation, for the planner's
measured mode and for the benchmarks (public as `eqx_multimap.timing`).

Times on a shared machine drift with its load, so programs are never timed one after
the other: [`time_interleaved`][] runs them round by round, the order rotating, and
their comparison is a *paired* ratio, the median of the per-round ratios
([`paired_ratios`][]). Two separately compiled copies of one program (*twins*, see
[`fresh`][] and [`same_hlo`][]) timed in the same rounds give the noise floor: how far
apart two identical programs land. On a machine shared with other jobs, a core may
also be taken for seconds at a time, which slows the programs whose ops XLA spreads
over threads and not the others: a [`Probe`][] timed before each round finds those
rounds, and they are dropped.
"""

import contextlib
import functools as ft
import math
import re
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax._src import traceback_util

from ._text import fmt_bytes as fmt_bytes, fmt_seconds as fmt_seconds


traceback_util.register_exclusion(__file__)

Clock = Callable[[], float]


def compiled(fn: Callable, *args: Any) -> Any:
    """`jax.jit(fn)` lowered and compiled for `args` (arrays or
    `jax.ShapeDtypeStruct`s): a `jax.stages.Compiled`, so that compile time is paid
    here and not in the first timed call."""
    return jax.jit(fn).lower(*args).compile()


def fresh(fn: Callable) -> Callable:
    """A new function object that calls `fn`.

    `jax.jit` caches on the function object, so `compiled(fresh(fn), ...)` next to
    `compiled(fn, ...)` is a second, separately compiled executable of the same
    program: its *twin*. Build every program that is compared afresh, or the
    comparison may read one executable twice. It keeps `fn`'s name and signature
    (`functools.wraps`), so that dims given by parameter name still apply.
    """

    @ft.wraps(fn)
    def fresh_fn(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return fresh_fn


DISTURBED = 1.5
"""A round is disturbed if its probe took more than this many times the probe's best."""


class Probe:
    """A program whose op XLA spreads over its threads (an elementwise loop over 1 MiB,
    about a millisecond), timed before each round of [`time_interleaved`][]. A
    round in which it ran more than `DISTURBED` times its best is *disturbed*:
    another job held a core. One probe may serve several calls: its best is over all
    its `times`.

    **Arguments:**

    - `run`: the thunk to time instead (tests).
    """

    def __init__(self, run: Callable[[], Any] | None = None):
        self.run, self.times = run or _probe_loop(), []

    def time(self, clock: Clock = time.perf_counter) -> None:
        jax.block_until_ready(self.run())  # settles
        t0 = clock()
        jax.block_until_ready(self.run())
        self.times.append(clock() - t0)

    def disturbed(self, start: int = 0) -> list[bool]:
        """Whether each round from `start` on was disturbed."""
        best = min(self.times, default=0.0)
        return [t > DISTURBED * best for t in self.times[start:]]


@ft.cache
def _probe_loop() -> Callable[[], Any]:
    """`Probe`'s program, compiled once per process (a planning run makes a probe)."""
    x = np.ones(2**18, np.float32)  # not traced: planning runs in a trace
    loop = lambda y: jax.lax.fori_loop(0, 99, lambda i, y: y * 0.999 + 1, y)
    program = compiled(loop, x)
    return lambda: program(x)


def time_interleaved(
    fns: Sequence[Callable[[], Any]],
    seconds: float,
    min_rounds: int = 3,
    max_rounds: int = 15,
    min_sample: float = 2e-3,
    settle: int = 1,
    drop_above: float | None = None,
    on_round: Callable[[int, int], None] | None = None,
    clock: Clock = time.perf_counter,
    probe: Probe | None = None,
) -> list[list[float]]:
    """Time thunks side by side; the seconds per call of every round, per thunk.

    **Arguments:**

    - `fns`: thunks, each running one program (its result is waited for with
        `jax.block_until_ready`).
    - `seconds`: about how long all the rounds may take together.
    - `min_rounds`, `max_rounds`: the bounds on the number of rounds.
    - `min_sample`: the shortest timed sample; a quick program is called several
        times per sample (every thunk the same number of times).
    - `settle`: untimed calls of a thunk right before each timed sample. The first
        call after another program pays for that program's leftovers (the heap it
        trimmed, the caches it filled), which a caller calling one program again and
        again does not.
    - `drop_above`: from the third round on, a thunk whose best time is above this
        many times the best of all is no longer timed (it keeps the times it has),
        or `None` to time every thunk in every round.
    - `on_round`: called with the round and the number of rounds before each round.
    - `clock`: the clock, in seconds.
    - `probe`: a [`Probe`][] timed before each round; the rounds it finds disturbed
        are dropped from the result, unless every round was.

    **Returns:**

    Per thunk, the seconds per call of each round it ran in (and kept). One untimed
    call of each (which also warms up) sets the calls per sample and the number of
    rounds; round `r` runs the thunks starting from the `r`-th, so that machine noise
    hits them all alike.
    """
    firsts = []
    for fn in fns:
        t0 = clock()
        jax.block_until_ready(fn())
        firsts.append(clock() - t0)
    number = max(1, math.ceil(min_sample / max(min(firsts, default=1.0), 1e-9)))
    per_round = (number + settle) * sum(firsts)
    rounds = max(min_rounds, min(max_rounds, int(seconds / max(per_round, 1e-9))))
    times: list[list[float]] = [[] for _ in fns]
    active = list(range(len(fns)))
    for r in range(rounds):
        if on_round is not None:
            on_round(r, rounds)
        if probe is not None:
            probe.time(clock)
        if drop_above is not None and r >= 2:
            best = min(min(times[i]) for i in active)
            active = [i for i in active if min(times[i]) <= drop_above * best]
        n = len(active)
        for k in range(n):
            i = active[(k + r) % n]
            for _ in range(settle):
                jax.block_until_ready(fns[i]())
            t0 = clock()
            for _ in range(number):
                jax.block_until_ready(fns[i]())
            times[i].append((clock() - t0) / number)
    if probe is not None and not all(bad := probe.disturbed(len(probe.times) - rounds)):
        times = [[t for t, b in zip(ts, bad) if not b] or ts for ts in times]
    return times


def compile_seconds(
    makers: Sequence[Callable[[], Callable]],
    args: Sequence[Any],
    repeats: int,
    clock: Clock = time.perf_counter,
) -> list[list[float]]:
    """Lower + compile seconds of freshly built programs, `repeats` times each.

    Each maker must return a *new* function object on every call (compiling one
    object twice is a cache hit). The makers take turns, the order rotating, after
    one untimed compile of each (the first compile of a kind pays one-off costs).
    """
    for make in makers:
        compiled(make(), *args)
    out: list[list[float]] = [[] for _ in makers]
    n = len(makers)
    for r in range(repeats):
        for k in range(n):
            i = (k + r) % n
            fn = makers[i]()
            t0 = clock()
            compiled(fn, *args)
            out[i].append(clock() - t0)
    return out


_COMPILE_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "traces",
    "/jax/core/compile/backend_compile_duration": "compiles",
}


@contextlib.contextmanager
def count_compiles() -> Iterator[dict[str, int]]:
    """Counts JAX's traces and backend compiles while active.

    ```python
    with count_compiles() as counts:
        jax.jit(f)(x)
    counts  # {"traces": 1, "compiles": 1}
    ```
    """
    counts = {"traces": 0, "compiles": 0}

    def listen(event: str, duration: float, **kwargs: Any) -> None:
        del duration, kwargs
        if event in _COMPILE_EVENTS:
            counts[_COMPILE_EVENTS[event]] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def paired_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """The per-round ratios `a / b` of two programs timed in the same rounds.

    Their median is the *paired* ratio, robust to drifts of the machine's load; it
    can differ from the ratio of the two medians.
    """
    return [x / y for x, y in zip(a, b)]


def quartiles(xs: Sequence[float]) -> tuple[float, float, float]:
    """The 25th, 50th and 75th percentiles of `xs` (all three `xs[0]` for one)."""
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def fmt_ratios(ratios: Sequence[float]) -> str:
    """`1.02 (0.99 to 1.05)`: the median and the interquartile range."""
    q1, q2, q3 = quartiles(ratios)
    return f"{q2:.2f} ({q1:.2f} to {q3:.2f})"


_NOISE = re.compile(r"(metadata=\{[^}]*\}|HloModule \S+|, entry_computation_layout=.*)")


def normalised_hlo(c: Any) -> str:
    """A compiled program's optimised HLO without metadata, module, instruction or
    computation names (which carry counters that differ between traces)."""
    blocks = c.as_text().split("\n\n")
    debug = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
    text = "\n\n".join(b for b in blocks if not b.lstrip().startswith(debug))
    text = _NOISE.sub("", text)
    text = re.sub(r",?\s*stack_frame_id=\d+", "", text)
    text = re.sub(r"%[\w.\-]+", "%x", text)
    return re.sub(r"\b[\w\-]+(\.\d+)+\b", "n", text)


def same_hlo(a: Any, b: Any) -> bool:
    """Whether two compiled programs have the same optimised HLO. `ValueError` if
    they are one executable (read twice from `jax.jit`'s cache): the check must
    compare two programs, each compiled from its own function (see `fresh`)."""
    if a.runtime_executable() is b.runtime_executable():
        raise ValueError(
            "`same_hlo` was given one executable twice; compile each program from a "
            "new function object (`fresh(fn)`)."
        )
    return normalised_hlo(a) == normalised_hlo(b)


def temp_bytes(c: Any) -> int:
    """The temporary memory of a compiled program, as XLA reports it."""
    return int(c.memory_analysis().temp_size_in_bytes)
