"""The benchmarks' timing harness, not part of `eqx_multimap` (copy it to use it
elsewhere): compiled programs timed side by side, round by round, the order rotating
(`time_interleaved`), compared by their *paired* ratio, the median of the per-round
ratios (`paired_ratios`). Two separately compiled copies of one program (*twins*:
`fresh`, `same_hlo`) timed in the same rounds give the noise floor; a `Probe` finds
the rounds in which another job held a core. `benchmarks/README.md` has the method.
"""

import argparse
import contextlib
import functools as ft
import math
import re
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from eqx_multimap._planner.measure import Probe as Probe  # the planner's own
from eqx_multimap._text import fmt_bytes as fmt_bytes, fmt_seconds as fmt_seconds


Clock = Callable[[], float]


def parser(
    doc: str, sections: Sequence[str] = (), repeats: str = "the most timed rounds"
) -> argparse.ArgumentParser:
    """`--quick`, `--repeats` and, given `sections`, `--sections`: a comma-separated
    subset of them (all by default), parsed to a list."""

    def subset(text: str) -> list[str]:
        chosen = [s for s in text.split(",") if s]
        if not chosen or set(chosen) - set(sections):
            raise argparse.ArgumentTypeError(f"choose from {', '.join(sections)}")
        return chosen

    out = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    out.add_argument("--quick", action="store_true", help="smaller sizes")
    out.add_argument("--repeats", type=int, help=repeats)
    if sections:
        out.add_argument(
            "--sections", default=",".join(sections), type=subset, help="a subset"
        )
    return out


def compiled(fn: Callable, *args: Any) -> Any:
    """`jax.jit(fn)` lowered and compiled for `args` (arrays or `ShapeDtypeStruct`s),
    so that the compile is paid here and not in the first timed call."""
    return jax.jit(fn).lower(*args).compile()


def fresh(fn: Callable) -> Callable:
    """A new function object calling `fn`, with its name and signature: `jax.jit`
    caches on the function object, so `compiled(fresh(fn), ...)` beside
    `compiled(fn, ...)` is a second executable of the same program, its *twin*."""

    @ft.wraps(fn)
    def fresh_fn(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return fresh_fn


def time_interleaved(
    fns: Sequence[Callable[[], Any]],
    seconds: float,
    min_rounds: int = 3,
    max_rounds: int = 15,
    min_sample: float = 2e-3,
    settle: int = 1,
    drop_above: float | None = None,
    clock: Clock = time.perf_counter,
    probe: Probe | None = None,
) -> list[list[float]]:
    """Time thunks side by side: per thunk, the seconds per call of each round.

    One untimed call of each (which warms up) sets the calls per sample (the quickest
    sample at least `min_sample` seconds, every thunk called as often) and the rounds
    (about `seconds` in all, within `min_rounds` and `max_rounds`). Round `r` runs the
    thunks from the `r`-th on, each timed sample after `settle` untimed calls (the
    first call after another program pays for that one's leftovers). Results are
    waited for with `jax.block_until_ready`.

    - `drop_above`: from the third round on, a thunk whose best is above this many
        times the best of all is no longer timed (it keeps its times so far).
    - `probe`: a `Probe` timed before each round; the rounds it finds disturbed are
        dropped, unless every round was.
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
        if probe is not None:
            probe.time(clock)
        if drop_above is not None and r >= 2:
            best = min(min(times[i]) for i in active)
            active = [i for i in active if min(times[i]) <= drop_above * best]
        for k in range(len(active)):
            i = active[(k + r) % len(active)]
            for _ in range(settle):
                jax.block_until_ready(fns[i]())
            t0 = clock()
            for _ in range(number):
                jax.block_until_ready(fns[i]())
            times[i].append((clock() - t0) / number)
    if probe is not None and not all(bad := probe.disturbed(len(probe.times) - rounds)):
        times = [[t for t, b in zip(ts, bad) if not b] or ts for ts in times]
    return times


_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "traces",
    "/jax/core/compile/backend_compile_duration": "compiles",
}


@contextlib.contextmanager
def count_compiles() -> Iterator[dict[str, int]]:
    """JAX's traces and backend compiles while active: `{"traces": 1, "compiles": 1}`
    after `with count_compiles() as counts: jax.jit(f)(x)`."""
    counts = {"traces": 0, "compiles": 0}

    def listen(event: str, duration: float, **kwargs: Any) -> None:
        if event in _EVENTS:
            counts[_EVENTS[event]] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def agree(ref: Any, *others: Any, rtol: float = 1e-4, atol: float = 1e-4) -> bool:
    leaves = jax.tree.leaves(ref)
    return all(
        np.allclose(u, v, rtol=rtol, atol=atol)
        for other in others
        for u, v in zip(jax.tree.leaves(other), leaves, strict=True)
    )


def paired_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """The per-round ratios `a / b` of two programs timed in the same rounds; their
    median, robust to the machine's drifts, may differ from the medians' ratio."""
    return [x / y for x, y in zip(a, b)]


def quartiles(xs: Sequence[float]) -> tuple[float, float, float]:
    """The 25th, 50th and 75th percentiles of `xs` (linear interpolation)."""
    q1, q2, q3 = np.percentile(xs, [25, 50, 75]).tolist()
    return q1, q2, q3


def fmt_ratios(ratios: Sequence[float]) -> str:
    """`1.02 (0.99 to 1.05)`: the median and the interquartile range."""
    q1, q2, q3 = quartiles(ratios)
    return f"{q2:.2f} ({q1:.2f} to {q3:.2f})"


_NOISE = re.compile(r"(metadata=\{[^}]*\}|HloModule \S+|, entry_computation_layout=.*)")
_DEBUG = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def normalised_hlo(c: Any) -> str:
    """A compiled program's optimised HLO without metadata, module, instruction or
    computation names (their counters differ between traces)."""
    blocks = c.as_text().split("\n\n")
    text = "\n\n".join(b for b in blocks if not b.lstrip().startswith(_DEBUG))
    text = re.sub(r",?\s*stack_frame_id=\d+", "", _NOISE.sub("", text))
    return re.sub(r"\b[\w\-]+(\.\d+)+\b", "n", re.sub(r"%[\w.\-]+", "%x", text))


def same_hlo(a: Any, b: Any) -> bool:
    """Whether two compiled programs have the same optimised HLO; `ValueError` if they
    are one executable (read twice from `jax.jit`'s cache: see `fresh`)."""
    if a.runtime_executable() is b.runtime_executable():
        raise ValueError(
            "`same_hlo` was given one executable twice; compile each program from a "
            "new function object (`fresh(fn)`)."
        )
    return normalised_hlo(a) == normalised_hlo(b)


def temp_bytes(c: Any) -> int:
    return int(c.memory_analysis().temp_size_in_bytes)
