"""A sum over a mapped dim: `reduce={"T": "sum"}` against materialise-then-sum and
against a hand-written `lax.scan` with a carry.

The body, for one element `t`, is `softmax(outer(x_t, y_t), axis=1) @ v`: a `(K, M)`
intermediate that XLA materialises (`K = M = 64`: 16 KiB per element), summed over
`T`. Per `T`, five programs are compiled, then timed side by side, interleaved round
by round, with `jax.block_until_ready`:

- `reduced scan`: `filter_multi_vmap(..., reduce={"T": "sum"}, scan="T")`;
- `reduced chunk`: the same with `scan={"T": k}` (a vmap over `k` times inside);
- `materialise`: `filter_multi_vmap(..., out_dims="T K")` (vmap over `T`), then
    `.sum(0)`: what summing over a mapped dim took before `reduce=`;
- `hand scan`: `lax.scan(lambda c, e: (c + body(*e), None), zeros, (x, y))`;
- `hand twin`: a second, separately compiled copy of `hand scan` (the same
    optimised HLO): its ratio to `hand scan` is the noise floor.

Reported per `T`: the compiled temporaries (`memory_analysis().temp_size_in_bytes`),
the median times, and paired ratios (the median of the per-round time ratios of two
programs timed in the same rounds, with their interquartile range); and whether the
optimised HLO of `reduced scan` is identical to `hand scan`'s.

    python benchmarks/reduce.py --quick     # T in {256, 1024, 4096}: under a minute
    python benchmarks/reduce.py             # T up to 16384
    python benchmarks/reduce.py --full      # T up to 32768 (512 MiB materialised)
"""

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable


sys.path.insert(0, os.path.dirname(__file__))

import jax
import jax.lax as lax
import jax.numpy as jnp
from _timing import (
    compiled,
    distinct,
    fmt_bytes,
    fresh,
    median,
    normalised_hlo,
    paired_ratios,
    quartiles,
    ratio_spread,
    time_calibrated,
)
from eqx_multimap import filter_multi_vmap


def body(x, y, v):
    """One element: `x: (K,)`, `y: (M,)`, `v: (M,)` -> `(K,)`."""
    return jax.nn.softmax(jnp.outer(x, y), axis=1) @ v


DIMS = dict(in_dims=("T K", "T M", "M"), core="K")
PROGRAMS = ("reduced scan", "reduced chunk", "materialise", "hand scan", "hand twin")


def make_programs(k: int) -> dict[str, Callable]:
    """Every program, built afresh (new function objects, compiled on their own)."""
    fun = fresh(body)

    def hand_scan(x, y, v):
        def step(c, e):
            return c + body(e[0], e[1], v), None

        return lax.scan(step, jnp.zeros(x.shape[1:], x.dtype), (x, y))[0]

    stacked = filter_multi_vmap(fun, out_dims="T K", **DIMS)
    return {
        "reduced scan": filter_multi_vmap(
            fun, out_dims="K", reduce={"T": "sum"}, scan="T", **DIMS
        ),
        "reduced chunk": filter_multi_vmap(
            fun, out_dims="K", reduce={"T": "sum"}, scan={"T": k}, **DIMS
        ),
        "materialise": lambda x, y, v: stacked(x, y, v).sum(0),
        "hand scan": hand_scan,
        "hand twin": fresh(hand_scan),
    }


def inputs(t: int, k: int, m: int) -> tuple:
    keys = jax.random.split(jax.random.key(0), 3)
    x = 0.3 * jax.random.normal(keys[0], (t, k), jnp.float32)
    y = 0.3 * jax.random.normal(keys[1], (t, m), jnp.float32)
    v = jax.random.normal(keys[2], (m,), jnp.float32)
    return x, y, v


@dataclasses.dataclass
class Config:
    ts: tuple[int, ...]
    k: int = 64  # K = M
    chunk: int = 16
    max_rounds: int = 15
    min_rounds: int = 5
    cell_budget_s: float = 2.0


def make_config(args) -> Config:
    if args.quick:
        cfg = Config(ts=(256, 1024, 4096), max_rounds=15, cell_budget_s=2.0)
    elif args.full:
        ts = (256, 1024, 4096, 16384, 32768)
        cfg = Config(ts=ts, max_rounds=31, cell_budget_s=8.0)
    else:
        cfg = Config(ts=(256, 1024, 4096, 16384), max_rounds=21, cell_budget_s=4.0)
    if args.repeats:
        cfg.max_rounds = args.repeats
    return cfg


def run_cell(t: int, cfg: Config) -> dict:
    """Compile every program for `T = t`, read their temporaries, time them."""
    args = inputs(t, cfg.k, cfg.k)
    programs = make_programs(cfg.chunk)
    comp = {name: compiled(fn, *args) for name, fn in programs.items()}
    temps = {
        name: int(c.memory_analysis().temp_size_in_bytes) for name, c in comp.items()
    }
    if not distinct(comp["reduced scan"], comp["hand scan"]):
        raise AssertionError("the HLO check must compare two compiled programs")
    same_hlo = normalised_hlo(comp["reduced scan"]) == normalised_hlo(comp["hand scan"])
    names = list(PROGRAMS)
    times = time_calibrated(
        [lambda c=comp[n]: c(*args) for n in names],
        budget_s=cfg.cell_budget_s,
        max_rounds=cfg.max_rounds,
        min_rounds=cfg.min_rounds,
    )
    t_of = dict(zip(names, times))
    return dict(
        T=t,
        temps=temps,
        ms={n: 1e3 * median(ts) for n, ts in t_of.items()},
        ratios={
            "reduced scan / hand scan": paired_ratios(
                t_of["reduced scan"], t_of["hand scan"]
            ),
            "reduced chunk / hand scan": paired_ratios(
                t_of["reduced chunk"], t_of["hand scan"]
            ),
            "reduced scan / materialise": paired_ratios(
                t_of["reduced scan"], t_of["materialise"]
            ),
            "hand twin / hand scan": paired_ratios(
                t_of["hand twin"], t_of["hand scan"]
            ),
        },
        same_hlo=same_hlo,
        rounds=len(times[0]),
    )


def run(cfg: Config, log: Callable[[str], None]) -> list[dict]:
    rows = []
    log("\n## Compiled temporaries and median times\n")
    header = " | ".join(f"{n} temp | {n} (ms)" for n in PROGRAMS)
    log(f"| T | {header} | rounds |")
    log("|---:|" + "---:|---:|" * len(PROGRAMS) + "---:|")
    for t in cfg.ts:
        r = run_cell(t, cfg)
        rows.append(r)
        cells = " | ".join(
            f"{fmt_bytes(r['temps'][n])} | {r['ms'][n]:.3f}" for n in PROGRAMS
        )
        log(f"| {t} | {cells} | {r['rounds']} |")
    log("\n## Paired ratios, median (IQR)\n")
    pairs = list(rows[0]["ratios"]) if rows else []
    log("| T | " + " | ".join(pairs) + " | same HLO (reduced scan, hand scan) |")
    log("|---:|" + "---|" * len(pairs) + "---|")
    for r in rows:
        cells = " | ".join(ratio_spread(r["ratios"][p]) for p in pairs)
        log(f"| {r['T']} | {cells} | {'yes' if r['same_hlo'] else 'no'} |")
    return rows


def summary_lines(rows: list[dict], cfg: Config) -> list[str]:
    """The answers, computed from the rows."""
    if not rows:
        return ["no cells"]
    lo, hi = rows[0], rows[-1]
    lines = []
    for name in ("reduced scan", "reduced chunk", "materialise", "hand scan"):
        growth = hi["temps"][name] / max(lo["temps"][name], 1)
        lines.append(
            f"temp bytes, {name}: {fmt_bytes(lo['temps'][name])} at T={lo['T']}, "
            f"{fmt_bytes(hi['temps'][name])} at T={hi['T']} (x{growth:.1f})"
        )
    for pair in rows[0]["ratios"]:
        per_t = ", ".join(
            f"T={r['T']}: {quartiles(r['ratios'][pair])[1]:.2f}" for r in rows
        )
        lines.append(f"time, {pair} (paired median): {per_t}")
    same = sum(r["same_hlo"] for r in rows)
    lines.append(
        f"optimised HLO of reduced scan identical to hand scan's: {same} of "
        f"{len(rows)} T (K = M = {cfg.k}, chunk {cfg.chunk})"
    )
    return lines


def main(argv=None, cfg: Config | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="T in {256, 1024, 4096}")
    size.add_argument("--full", action="store_true", help="T up to 32768")
    parser.add_argument("--repeats", type=int, default=None, help="max timed rounds")
    args = parser.parse_args(argv)
    cfg = cfg or make_config(args)

    def log(line: str) -> None:
        print(line, flush=True)

    log(
        f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} "
        f"cores); T in {list(cfg.ts)}, K = M = {cfg.k}, up to {cfg.max_rounds} "
        "rounds per T"
    )
    start = time.perf_counter()
    rows = run(cfg, log)
    log(f"\nSummary (Total: {time.perf_counter() - start:.0f} s)\n")
    for line in summary_lines(rows, cfg):
        log(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
