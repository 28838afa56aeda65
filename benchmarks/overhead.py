"""Overhead of `filter_multi_vmap` against the hand-written nest it replaces.

The seed grid of the origin benchmark: `f(x) = sin(x**2 + 1)` over `xs` of shape
`(b1, b2, L)`, mapped over `b1` and `b2`. For each nest (full vmap, scan(vmap), and a
chunked scan against `lax.map(batch_size=)`), both programs are compiled, then timed
side by side, interleaved, with `jax.block_until_ready`. Reported: the median of the
per-round time ratios (ours / hand-written), and whether the optimised HLO of the two
programs is the same.

    python benchmarks/overhead.py            # the quick grid (about a minute)
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
from eqx_multimap import filter_multi_vmap


def f(x):
    return jnp.sin(x**2 + 1)


def hand_vmap(xs):
    return jax.vmap(jax.vmap(f))(xs)


def hand_scan(xs):
    return lax.scan(lambda c, x: (c, jax.vmap(f)(x)), None, xs)[1]


def hand_chunked(xs, k):
    return lax.map(jax.vmap(f), xs, batch_size=k)


def ours(strategy: str, k: int):
    if strategy == "vmap":
        return filter_multi_vmap(f, in_dims="b1 b2 L", out_dims="b1 b2 L", vmap="b1 b2")
    if strategy == "scan":
        return filter_multi_vmap(
            f, in_dims="b1 b2 L", out_dims="b1 b2 L", scan="b1", vmap="b2"
        )
    return filter_multi_vmap(
        f, in_dims="b1 b2 L", out_dims="b1 b2 L", scan={"b1": k}, vmap="b2"
    )


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
    print()
    print("| b1 | b2 | L | nest | ours (ms) | hand (ms) | ratio | same HLO |")
    print("|---:|---:|---:|---|---:|---:|---:|---|")
    ratios = []
    for b1, b2, L in it.product(b_sizes, b_sizes, l_sizes):
        if b1 * b2 * L > max_elements:
            continue
        xs = jax.random.normal(jax.random.key(0), (b1, b2, L), jnp.float32)
        k = max(1, b1 // 8)
        hand = {
            "vmap": hand_vmap,
            "scan": hand_scan,
            f"chunk {k}": lambda xs: hand_chunked(xs, k),
        }
        for strategy, hand_fn in hand.items():
            ours_c = compiled(ours(strategy.split()[0], k), xs)
            hand_c = compiled(hand_fn, xs)
            same = normalised_hlo(ours_c) == normalised_hlo(hand_c)
            t_ours, t_hand = time_side_by_side(
                [lambda: ours_c(xs), lambda: hand_c(xs)], repeats=repeats
            )
            ratio = paired_ratio(t_ours, t_hand)
            ratios.append(ratio)
            print(
                f"| {b1} | {b2} | {L} | {strategy} | {1e3 * median(t_ours):.3f} | "
                f"{1e3 * median(t_hand):.3f} | {ratio:.3f} | "
                f"{'yes' if same else 'no'} |",
                flush=True,
            )
    overall = median(ratios)
    print()
    print(
        f"Median ratio ours/hand-written over {len(ratios)} cases: {overall:.3f} "
        f"({'within' if abs(overall - 1) <= 0.02 else 'outside'} 1.02)."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
