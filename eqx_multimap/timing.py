"""Timing compiled programs side by side, with twins as the noise floor.

The one timing implementation of the project: the planner's measured mode and the
scripts in `benchmarks/` use it. Programs are timed round by round, the order
rotating (`time_interleaved`); two of them are compared by their *paired* ratio,
the median of the per-round ratios (`paired_ratios`); and a second, separately
compiled copy of a program (`fresh`, checked with `same_hlo`) timed in the same
rounds gives the noise floor. A `Probe` timed before each round drops the rounds in
which another job held a core.
"""

from ._timing import (
    compile_seconds as compile_seconds,
    compiled as compiled,
    count_compiles as count_compiles,
    fmt_bytes as fmt_bytes,
    fmt_ratios as fmt_ratios,
    fmt_seconds as fmt_seconds,
    fresh as fresh,
    normalised_hlo as normalised_hlo,
    paired_ratios as paired_ratios,
    Probe as Probe,
    quartiles as quartiles,
    same_hlo as same_hlo,
    temp_bytes as temp_bytes,
    time_interleaved as time_interleaved,
)
