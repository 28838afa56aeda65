"""Shared timing helpers: compile first, then time candidates side by side."""

import argparse
import math
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


#
# Additions for `overhead.py` and `grad.py`: calibrated side-by-side timing, compile
# times of freshly built programs, and short summaries of paired ratios.
#


def batched(fn: Callable[[], object], number: int) -> Callable[[], object]:
    """A thunk that calls `fn` `number` times, waiting for each call; for programs
    too short to time one call at a time."""

    def thunk():
        out = None
        for _ in range(number):
            out = jax.block_until_ready(fn())
        return out

    return thunk


def time_calibrated(
    fns: Sequence[Callable[[], object]],
    budget_s: float,
    max_rounds: int,
    min_rounds: int = 5,
    min_sample_s: float = 2e-3,
    settle: int = 0,
    groups: Sequence[int] | None = None,
) -> list[list[float]]:
    """Time `fns` side by side (`time_side_by_side`); the seconds *per call* of every
    round, per thunk.

    One call of each (which also warms up) sets how many calls make one timed
    sample, so that the quickest thunk's sample takes at least `min_sample_s`, and
    how many rounds fit in about `budget_s` (at least `min_rounds`, at most
    `max_rounds`). Every thunk makes the same number of calls per sample, or with
    `groups` (a group id per thunk, for thunks of very different lengths), every
    thunk of a group. Thunks that are compared should share a number: the first
    call of a sample, after another program ran, is the slowest, and weighs more in
    a shorter sample."""
    firsts = []
    for fn in fns:
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        firsts.append(time.perf_counter() - t0)
    if groups is None:
        groups = [0] * len(fns)
    quickest: dict[int, float] = {}
    for g, t in zip(groups, firsts):
        quickest[g] = min(t, quickest.get(g, t))
    numbers = [max(1, math.ceil(min_sample_s / max(quickest[g], 1e-9))) for g in groups]
    per_round = (1 + settle) * sum(n * t for n, t in zip(numbers, firsts))
    rounds = max(min_rounds, min(max_rounds, int(budget_s / max(per_round, 1e-9))))
    thunks = [batched(fn, n) for fn, n in zip(fns, numbers)]
    times = time_side_by_side(thunks, repeats=rounds, warmup=1, settle=settle)
    return [[t / n for t in ts] for ts, n in zip(times, numbers)]


def compile_seconds(
    makers: Sequence[Callable[[], Callable]], args: Sequence, repeats: int
) -> list[list[float]]:
    """Lower + compile seconds of freshly built programs, `repeats` times each.

    Each maker returns a *new* function object every time it is called (`jax.jit`
    caches on the function: compiling the same object twice is a cache hit). The
    makers take turns, the order rotating every repetition, after one untimed
    compile of each (the first compile of a kind pays one-off costs)."""
    for make in makers:
        compiled(make(), *args)
    out: list[list[float]] = [[] for _ in makers]
    n = len(makers)
    for r in range(repeats):
        for k in range(n):
            i = (k + r) % n
            fn = makers[i]()
            t0 = time.perf_counter()
            compiled(fn, *args)
            out[i].append(time.perf_counter() - t0)
    return out


def distinct(*executables) -> bool:
    """Whether compiled programs (`jax.stages.Compiled`) are separate executables:
    their optimised HLO was produced by compiling each of them, not read back from
    `jax.jit`'s cache of an equal function."""
    ids = {id(c.runtime_executable()) for c in executables}
    return len(ids) == len(executables)


def has_conditional(c) -> bool:
    """Whether a compiled program's optimised HLO has a `conditional`."""
    return re.search(r"\bconditional\(", c.as_text()) is not None


def hlo_note(ours, hand) -> str:
    """`yes` when two compiled programs have the same optimised HLO
    (`normalised_hlo`), else `no`, or `no (conditional)` when the first has a
    conditional. Raises if they are one executable: the check must compare two
    programs, each compiled from its own function (see `distinct`)."""
    if not distinct(ours, hand):
        raise AssertionError("the HLO check must compare two compiled programs")
    if normalised_hlo(ours) == normalised_hlo(hand):
        return "yes"
    return "no (conditional)" if has_conditional(ours) else "no"


def ratio_spread(ratios: Sequence[float]) -> str:
    """`median (q25 to q75)` of per-round ratios, as printed in the tables."""
    q1, q2, q3 = quartiles(list(ratios))
    return f"{q2:.2f} ({q1:.2f} to {q3:.2f})"


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


FRESH_THRESHOLD = 32 * 2**20
"""glibc malloc's largest mmap threshold: temporaries above it are allocated (and
page-faulted in) afresh on every call, and what the previous program left behind
makes the first call after it slower (see `time_side_by_side`'s `settle`)."""


SETTLED_NOTE = (
    "Rounds marked * (temporaries above 32 MiB): each timed call follows an untimed "
    "call of the same program."
)


def settle_for(*executables, threshold: int = FRESH_THRESHOLD) -> int:
    """`settle=1` for programs whose temporaries exceed `threshold`, else 0."""
    temps = [c.memory_analysis().temp_size_in_bytes for c in executables]
    return 1 if max(temps, default=0) > threshold else 0


def add_sections(parser: argparse.ArgumentParser, sections: Sequence[str]) -> None:
    """The `--sections` option of a benchmark: a comma-separated subset."""
    parser.add_argument(
        "--sections",
        default=",".join(sections),
        help=f"comma-separated subset of {','.join(sections)}",
    )


def chosen_sections(
    parser: argparse.ArgumentParser, value: str, sections: Sequence[str]
) -> list[str]:
    """The sections named by `--sections`; an unknown one is a usage error."""
    chosen = [s.strip() for s in value.split(",") if s.strip()]
    unknown = sorted(set(chosen).difference(sections))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {', '.join(sections)}")
    return chosen
