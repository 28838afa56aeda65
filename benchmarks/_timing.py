"""Shared timing helpers: compile first, then time candidates side by side."""

import re
import statistics
import time
from collections.abc import Callable, Sequence

import jax


def compiled(fn: Callable, *args):
    """`jax.jit(fn)` lowered and compiled for `args` (compile time kept apart)."""
    return jax.jit(fn).lower(*args).compile()


def time_side_by_side(
    fns: Sequence[Callable[[], object]],
    repeats: int = 15,
    warmup: int = 2,
    settle: int = 0,
) -> list[list[float]]:
    """Run each thunk `repeats` times, interleaved (rotating the order every round),
    with `jax.block_until_ready`; returns the seconds of every run, per thunk.

    `settle`: untimed calls of a thunk right before each timed one. The first call
    after another program can pay for that program's leftovers (the heap that
    `malloc` trimmed, caches): with programs whose temporaries differ a lot, this
    made identical executables differ by 1.3x; a settled call is what a caller
    that calls one program repeatedly sees."""
    for fn in fns:
        for _ in range(warmup):
            jax.block_until_ready(fn())
    times: list[list[float]] = [[] for _ in fns]
    n = len(fns)
    for r in range(repeats):
        for k in range(n):
            i = (k + r) % n
            for _ in range(settle):
                jax.block_until_ready(fns[i]())
            t0 = time.perf_counter()
            jax.block_until_ready(fns[i]())
            times[i].append(time.perf_counter() - t0)
    return times


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """Median of the per-round ratios a/b (robust to drifts in machine load)."""
    return statistics.median(x / y for x, y in zip(a, b))


def paired_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """The per-round ratios a/b of two programs timed in the same rounds.

    Their median is `paired_ratio(a, b)`, which can differ from the ratio of the two
    medians `median(a) / median(b)`: the rounds' ratios are taken first.
    """
    return [x / y for x, y in zip(a, b)]


def quartiles(xs: Sequence[float]) -> tuple[float, float, float]:
    """The 25th, 50th and 75th percentiles of `xs` (all three `xs[0]` for one value).

    The interquartile range, from the first to the third, is the spread reported
    for the per-round times and ratios.
    """
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def fresh(fn: Callable) -> Callable:
    """A new function object that calls `fn`.

    `jax.jit` caches on the function object, so compiling `fresh(fn)` next to `fn`
    gives a second, separately compiled executable of the same program. Timed side
    by side, two such twins measure the noise floor of a paired ratio: what two
    programs with identical HLO differ by (check with `normalised_hlo`).
    """

    def fresh_fn(*args, **kwargs):
        return fn(*args, **kwargs)

    return fresh_fn


_NOISE = re.compile(r"(metadata=\{[^}]*\}|HloModule \S+|, entry_computation_layout=.*)")


def normalised_hlo(c) -> str:
    """Optimised HLO text without metadata or module names, for comparing programs."""
    blocks = c.as_text().split("\n\n")
    debug = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
    text = "\n\n".join(b for b in blocks if not b.lstrip().startswith(debug))
    text = _NOISE.sub("", text)
    text = re.sub(r",?\s*stack_frame_id=\d+", "", text)
    # Instruction and computation names carry counters that differ between traces.
    text = re.sub(r"%[\w.\-]+", "%x", text)
    return re.sub(r"\b[\w\-]+(\.\d+)+\b", "n", text)
