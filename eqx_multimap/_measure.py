"""Measured mode (`Planner(measure=True)`): which candidates are timed, and timing
them side by side.

The time model cannot see what the chunk shape does to XLA:CPU's code, so measured
mode runs up to `MAX_MEASURED` candidates that fit on fresh inputs of the call's
shapes, interleaved round by round, and the fastest wins, unless the model's own
choice measured within `KEEP_WITHIN` of it: timings of near-equal nests shift with
the machine's load, the model's ranking does not.
"""

from collections.abc import Callable
from typing import Any

import numpy as np

from ._plan import PlanCandidate
from ._timing import time_interleaved


# How many candidates are timed, and for about how long.
MAX_MEASURED = 12
MEASURE_SECONDS = 2.0
# The time model's choice is kept unless another candidate measured faster than it
# by more than this factor.
KEEP_WITHIN = 1.10


def measured_pool(first: tuple, ranked: list[tuple]) -> list[tuple]:
    """The candidates measured mode times: `first` (the model's choice), then, of
    the rest `ranked` by estimate, all if they are few, else the best half of
    `MAX_MEASURED` and an even spread over the others. The estimates cannot see
    the chunk-shape effects that measuring is for, so a candidate far down the
    ranking (many small blocks) can be the fastest; a spread samples it."""
    rest = [k for k in ranked if k != first]
    room = MAX_MEASURED - 1
    if len(rest) > room:
        head, tail = rest[: room // 2], rest[room // 2 :]
        m = room - len(head)
        picks = [tail[round(i * (len(tail) - 1) / max(m - 1, 1))] for i in range(m)]
        rest = head + list(dict.fromkeys(picks))
    return [first, *rest]



def time_candidates(
    cands: list[PlanCandidate],
    programs: list[Any],
    args: Any,
    step: Callable[[str], None],
) -> dict[tuple, float]:
    """Run each candidate's compiled program on `args`, side by side; the median
    seconds per call of each, by candidate key."""
    fns = [lambda p=p: p(args) for p in programs]

    def on_round(r: int, rounds: int) -> None:
        step(f"timing {len(cands)} candidates, round {r + 1}")

    times = time_interleaved(fns, MEASURE_SECONDS, drop_above=1.25, on_round=on_round)
    return {c.key: float(np.median(ts)) for c, ts in zip(cands, times)}
