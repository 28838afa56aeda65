"""Overhead of `filter_multi_vmap` against the hand-written nest it replaces.

Two bodies over `xs` of shape `(b1, b2, L)`, mapped over `b1` and `b2`:

- the seed grid of the origin benchmark, `f(x) = sin(x**2 + 1)`, elementwise;
- `g(x) = tanh(outer(x, x)) @ x` on rows of length `L`: transcendentals and a
  materialised `(L, L)` intermediate per element.

For each nest (full vmap, scan(vmap), and a chunked scan against
`lax.map(batch_size=)`), both programs are compiled, then timed side by side,
interleaved, with `jax.block_until_ready`. Reported: the median of the per-round time
ratios (ours / hand-written), and whether the optimised HLO of the two programs is the
same once `eqx_multimap` slices scanned inputs as `lax.scan` does (on CPU it slices
them inside a conditional instead, so that XLA does not fuse the slice into the body's
kernels and stop LLVM from vectorising them: see `eqx_multimap._nest.take`; that is
the only difference, and what the ratios measure for scans).

    python benchmarks/overhead.py            # the quick grid (under a minute)
    python benchmarks/overhead.py --full     # b1, b2 in {100, 1000, 3000}
"""

import argparse
import itertools as it
import os
import sys


sys.path.insert(0, os.path.dirname(__file__))

import jax
import jax.lax as lax
import jax.numpy as jnp
from _timing import (
    compiled,
    median,
    normalised_hlo,
    paired_ratio,
    time_side_by_side,
)
from eqx_multimap import _nest, filter_multi_vmap


def f(x):
    return jnp.sin(x**2 + 1)


def g(x):
    return jnp.tanh(jnp.outer(x, x)) @ x


# f maps elementwise: mapped over (b1, b2) it is `vmap(vmap(f))` on (b1, b2, L) alike.
# g maps rows: `in_dims="b1 b2 L"` hands it one row of length L.
BODIES = {"sin(x**2 + 1)": f, "tanh(outer(x, x)) @ x": g}


def hand(body, strategy: str, k: int):
    if strategy == "vmap":
        return lambda xs: jax.vmap(jax.vmap(body))(xs)
    if strategy == "scan":
        return lambda xs: lax.scan(lambda c, x: (c, jax.vmap(body)(x)), None, xs)[1]
    return lambda xs: lax.map(jax.vmap(body), xs, batch_size=k)


def ours(body, strategy: str, k: int):
    dims = dict(in_dims="b1 b2 L", out_dims="b1 b2 L", core="L")
    if strategy == "vmap":
        return filter_multi_vmap(body, **dims, vmap="b1 b2")
    if strategy == "scan":
        return filter_multi_vmap(body, **dims, scan="b1", vmap="b2")
    return filter_multi_vmap(body, **dims, scan={"b1": k}, vmap="b2")


def _compiled_fused(fn, xs):
    """`fn` compiled with scanned inputs sliced as `lax.scan` does."""
    _nest.ISOLATE_SLICES_ON_CPU = False
    try:
        return compiled(fn, xs)
    finally:
        _nest.ISOLATE_SLICES_ON_CPU = True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="the full seed grid")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    if args.full:
        b_sizes, l_sizes, repeats = (100, 1000, 3000), (1, 10, 100), 11
    else:
        b_sizes, l_sizes, repeats = (100, 300), (1, 10, 100), 15
    repeats = args.repeats or repeats
    max_elements = 3 * 10**8 // 4  # keep each array under ~300 MB

    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {repeats} repeats")
    for name, body in BODIES.items():
        print()
        print(f"## {name}")
        print()
        print("| b1 | b2 | L | nest | ours (ms) | hand (ms) | ratio | same HLO |")
        print("|---:|---:|---:|---|---:|---:|---:|---|")
        ratios: dict[str, list[float]] = {"vmap": [], "scan": []}
        for b1, b2, L in it.product(b_sizes, b_sizes, l_sizes):
            # g's intermediate is (b1, b2, L, L) when fully vmapped.
            if b1 * b2 * L * (L if body is g else 1) > max_elements:
                continue
            xs = jax.random.normal(jax.random.key(0), (b1, b2, L), jnp.float32)
            k = max(1, b1 // 8)
            for strategy in ("vmap", "scan", f"chunk {k}"):
                ours_fn = ours(body, strategy.split()[0], k)
                ours_c = compiled(ours_fn, xs)
                hand_c = compiled(hand(body, strategy.split()[0], k), xs)
                same = normalised_hlo(_compiled_fused(ours_fn, xs)) == normalised_hlo(
                    hand_c
                )
                t_ours, t_hand = time_side_by_side(
                    [lambda: ours_c(xs), lambda: hand_c(xs)], repeats=repeats
                )
                ratio = paired_ratio(t_ours, t_hand)
                ratios["vmap" if strategy == "vmap" else "scan"].append(ratio)
                print(
                    f"| {b1} | {b2} | {L} | {strategy} | {1e3 * median(t_ours):.3f} | "
                    f"{1e3 * median(t_hand):.3f} | {ratio:.3f} | "
                    f"{'yes' if same else 'no'} |",
                    flush=True,
                )
        print()
        print(
            f"Median ratio ours/hand-written: full vmap {median(ratios['vmap']):.3f} "
            f"over {len(ratios['vmap'])} cases, scans {median(ratios['scan']):.3f} "
            f"(min {min(ratios['scan']):.3f}, max {max(ratios['scan']):.3f}) over "
            f"{len(ratios['scan'])} cases."
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
