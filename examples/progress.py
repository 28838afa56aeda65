"""Time what `progress=` costs: a scan with a bar against the same map without one.

The map scans `T` (1,000 iterations by default) over a vmap of `B` elements whose
body is a few flops, so that the cost of the bar's reports is as visible as it gets.
Every program is compiled first, checked to give the values of the map without a
bar, then timed interleaved with it and with its twin (a second compile of the map
without a bar: the noise floor), forward and under `jax.grad`; reported are the
median and interquartile range of the per-round time ratios (the timing harness of
`benchmarks/harness.py`, which this imports).
The bars write to stderr: run with `2>/dev/null` to keep them off the terminal.

Run: `python examples/progress.py 2>/dev/null` (`--quick`: fewer rounds).
"""

import argparse
import pathlib
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from eqx_multimap import filter_multi_vmap


# The benchmarks' timing harness, not part of the package.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from harness import (
    compiled,
    fmt_ratios,
    fmt_seconds,
    fresh,
    paired_ratios,
    time_interleaved,
)


def body(x, y):
    return jnp.sin(x) * y + 1.0


def mapped(progress):
    return filter_multi_vmap(
        fresh(body),
        in_dims=("T B", "B"),
        out_dims="T B",
        scan="T",
        progress=progress,
    )


def program(transform, progress):
    f = mapped(progress)
    if transform == "forward":
        return lambda x, y: f(x, y)
    return jax.grad(lambda x, y: jnp.sum(f(x, y)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trips", type=int, default=1000, help="iterations: T")
    parser.add_argument("--lanes", type=int, default=16, help="vmapped elements: B")
    parser.add_argument(
        "--seconds", type=float, default=20.0, help="seconds per table (about)"
    )
    parser.add_argument("--quick", action="store_true", help="4 s per table")
    args = parser.parse_args(argv)
    seconds = 4.0 if args.quick else args.seconds
    x = jnp.linspace(0.0, 1.0, args.trips * args.lanes, dtype=jnp.float32)
    x = x.reshape(args.trips, args.lanes)
    y = jnp.linspace(1.0, 2.0, args.lanes, dtype=jnp.float32)
    print(
        f"progress= overhead: scan of T={args.trips} over vmap of B={args.lanes}, "
        f"JAX {jax.__version__}, {platform.machine()}, "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}"
    )
    print("| pass | program | time (median) | over `progress=False` |")
    print("|---|---|---|---|")
    start = time.perf_counter()
    for transform in ("forward", "grad"):
        names = ["progress=False", "twin (noise floor)", "'text'", "'tqdm'"]
        progress = [False, False, "text", "tqdm"]
        fns = [compiled(program(transform, p), x, y) for p in progress]
        expected = fns[0](x, y)
        for fn in fns[1:]:
            np.testing.assert_allclose(fn(x, y), expected, rtol=1e-6, atol=1e-6)
        times = time_interleaved([lambda fn=fn: fn(x, y) for fn in fns], seconds)
        for name, ts in zip(names, times):
            ratio = fmt_ratios(paired_ratios(ts, times[0]))
            median = fmt_seconds(float(np.median(ts)))
            print(f"| {transform} | {name} | {median} | {ratio} |")
        sys.stdout.flush()
    print(f"Total: {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
