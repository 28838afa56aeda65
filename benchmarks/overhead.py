"""Overhead of `filter_multi_vmap` against the hand-written nest it replaces.

Two bodies over `xs` of shape `(b1, b2, L)`, mapped over `b1` and `b2` (`core="L"`):

- cheap: `f(x) = sin(x**2 + 1)`, elementwise (the seed grid of the origin benchmark);
- heavy: `g(x) = tanh(outer(x, x)) @ x` on rows of length `L`: transcendentals and a
  materialised `(L, L)` intermediate per element.

Three nests each, ours against the hand-written program:

- full vmap: `vmap="b1 b2"` against `jax.vmap(jax.vmap(body))`;
- scan(vmap): `scan="b1", vmap="b2"` against
  `lax.scan(lambda c, x: (c, jax.vmap(body)(x)), None, xs)`;
- chunked scan: `scan={"b1": k}, vmap="b2"` against
  `lax.map(jax.vmap(body), xs, batch_size=k)`, `k = b1 // 8` (a remainder of 4
  at `b1` = 100 and 300).

The grid (cells whose biggest array has more than `max_elements` elements are
skipped, and listed as such):

- default: cheap `b1, b2` in {100, 300}, `L` in {1, 10, 100}; heavy `b1` in
  {100, 300}, `b2 = 100`, `L` in {8, 32, 64} (full vmap of `g` materialises
  `(b1, b2, L, L)`);
- `--quick`: cheap `b1 = b2` in {100, 300}, `L` in {1, 10}; heavy `(100, 100, L)`,
  `L` in {8, 32}; compile times of the scans only;
- `--full`: cheap `b1, b2` in {100, 1000, 3000}, `L` in {1, 10, 100}; heavy `b1` in
  {100, 300, 1000}, `b2` in {100, 300}, `L` in {8, 32, 64}.

Every program is built afresh (a new function object) and compiled on its own, so
that the HLO check compares the programs it names: `jax.jit` hands back its cached
executable for an equal function. Per cell, three programs are timed side by side,
interleaved, with `jax.block_until_ready`: ours, the hand-written nest, and a second,
separately compiled copy of the hand-written nest (its *twin*: the same optimised
HLO), whose ratio to the hand-written nest is the noise floor. Reported per cell:
the median of the per-round time ratios ours / hand-written with their interquartile
range, the twin's, and whether the optimised HLO of ours is identical to the
hand-written nest's.

What to expect: on CPU, `eqx_multimap` slices a scanned input apart from the body's
kernels (inside a `conditional`) only when the body reads it through two index maps
in one fusion (`outer(x, x)`), where XLA:CPU's fused slice stops LLVM from
vectorising; the cheap body is sliced as `lax.scan` slices it, so its programs
should be identical, and the heavy body's scans should differ (a `conditional`) and
be faster.

The compile section times lower + compile of fresh programs, ours and hand-written
taking turns, several repetitions, for one cell per body.

    python benchmarks/overhead.py --quick    # about a minute
    python benchmarks/overhead.py            # about 3 minutes
    python benchmarks/overhead.py --full     # long
    python benchmarks/overhead.py --sections compile
"""

import argparse
import dataclasses
import itertools as it
import os
import sys
import time
from collections.abc import Callable


sys.path.insert(0, os.path.dirname(__file__))

import jax
import jax.lax as lax
import jax.numpy as jnp
from _timing import (
    add_sections,
    chosen_sections,
    compile_seconds,
    compiled,
    fresh,
    hlo_note,
    median,
    paired_ratios,
    quartiles,
    ratio_spread,
    settle_for,
    SETTLED_NOTE,
    time_calibrated,
)
from eqx_multimap import filter_multi_vmap


def cheap(x):
    return jnp.sin(x**2 + 1)


def heavy(x):
    return jnp.tanh(jnp.outer(x, x)) @ x


BODIES: dict[str, tuple[str, Callable]] = {
    "cheap": ("sin(x**2 + 1)", cheap),
    "heavy": ("tanh(outer(x, x)) @ x", heavy),
}
NESTS = ("vmap", "scan(vmap)", "chunk")
SECTIONS = ("grid", "compile")
DIMS = dict(in_dims="b1 b2 L", out_dims="b1 b2 L", core="L")


def chunk_of(b1: int) -> int:
    return max(1, b1 // 8)


def nest_label(nest: str, b1: int) -> str:
    return f"chunk {chunk_of(b1)}" if nest == "chunk" else nest


def hand(body: Callable, nest: str, k: int) -> Callable:
    """The hand-written nest: a new function object on every call."""
    if nest == "vmap":
        return lambda xs: jax.vmap(jax.vmap(body))(xs)
    if nest == "scan(vmap)":
        return lambda xs: lax.scan(lambda c, x: (c, jax.vmap(body)(x)), None, xs)[1]
    if nest == "chunk":
        return lambda xs: lax.map(jax.vmap(body), xs, batch_size=k)
    raise ValueError(f"Unrecognised nest '{nest}'; choose from {', '.join(NESTS)}.")


def ours(body: Callable, nest: str, k: int) -> Callable:
    """`filter_multi_vmap` with the same nest: a new wrapper (of a new function
    object, so not equal to an earlier one) on every call."""
    fun = fresh(body)
    if nest == "vmap":
        return filter_multi_vmap(fun, **DIMS, vmap="b1 b2")
    if nest == "scan(vmap)":
        return filter_multi_vmap(fun, **DIMS, scan="b1", vmap="b2")
    if nest == "chunk":
        return filter_multi_vmap(fun, **DIMS, scan={"b1": k}, vmap="b2")
    raise ValueError(f"Unrecognised nest '{nest}'; choose from {', '.join(NESTS)}.")


def largest_array(body: str, nest: str, b1: int, b2: int, L: int) -> int:
    """Elements of the biggest array the nest materialises at once."""
    if body == "heavy":
        per_step = {"vmap": b1, "scan(vmap)": 1, "chunk": chunk_of(b1)}[nest]
        return max(b1 * b2 * L, per_step * b2 * L * L)
    return b1 * b2 * L


@dataclasses.dataclass
class Config:
    cells: dict[str, list[tuple[int, int, int]]]  # per body: (b1, b2, L)
    compile_cells: dict[str, tuple[int, int, int]]  # per body: one cell
    max_elements: int
    max_rounds: int
    cell_budget_s: float
    compile_repeats: int
    min_rounds: int = 5
    compile_nests: tuple[str, ...] = NESTS


def make_config(args) -> Config:
    if args.quick:
        cheap_cells = [(b, b, L) for b in (100, 300) for L in (1, 10)]
        heavy_cells = [(100, 100, L) for L in (8, 32)]
        return Config(
            cells={"cheap": cheap_cells, "heavy": heavy_cells},
            compile_cells={"cheap": (100, 100, 10), "heavy": (100, 100, 32)},
            max_elements=3 * 10**7,
            max_rounds=args.repeats or 15,
            cell_budget_s=0.4,
            compile_repeats=3,
            compile_nests=("scan(vmap)", "chunk"),
        )
    if args.full:
        cheap_cells = list(
            it.product((100, 1000, 3000), (100, 1000, 3000), (1, 10, 100))
        )
        heavy_cells = list(it.product((100, 300, 1000), (100, 300), (8, 32, 64)))
        max_elements, budget, rounds = 3 * 10**8, 6.0, 21
    else:
        cheap_cells = list(it.product((100, 300), (100, 300), (1, 10, 100)))
        heavy_cells = list(it.product((100, 300), (100,), (8, 32, 64)))
        max_elements, budget, rounds = 15 * 10**7, 2.0, 21
    return Config(
        cells={"cheap": cheap_cells, "heavy": heavy_cells},
        compile_cells={"cheap": (100, 100, 10), "heavy": (100, 100, 32)},
        max_elements=max_elements,
        max_rounds=args.repeats or rounds,
        cell_budget_s=budget,
        compile_repeats=5,
    )


def run_cell(body: str, nest: str, cell: tuple[int, int, int], cfg: Config) -> dict:
    """Ours, the hand-written nest and its twin compiled afresh, then timed."""
    b1, b2, L = cell
    fn = BODIES[body][1]
    k = chunk_of(b1)
    xs = jax.random.normal(jax.random.key(0), (b1, b2, L), jnp.float32)
    ours_c = compiled(ours(fn, nest, k), xs)
    hand_fn = hand(fn, nest, k)
    hand_c = compiled(hand_fn, xs)
    twin_c = compiled(fresh(hand_fn), xs)
    same = hlo_note(ours_c, hand_c)
    twin_same = hlo_note(twin_c, hand_c) == "yes"
    settle = settle_for(ours_c, hand_c, twin_c)
    t_ours, t_hand, t_twin = time_calibrated(
        [lambda: ours_c(xs), lambda: hand_c(xs), lambda: twin_c(xs)],
        budget_s=cfg.cell_budget_s,
        max_rounds=cfg.max_rounds,
        min_rounds=cfg.min_rounds,
        settle=settle,
    )
    return dict(
        body=body,
        nest=nest,
        cell=cell,
        ours_ms=1e3 * median(t_ours),
        hand_ms=1e3 * median(t_hand),
        ratios=paired_ratios(t_ours, t_hand),
        twin=paired_ratios(t_twin, t_hand),
        same_hlo=same,
        twin_same_hlo=twin_same,
        rounds=f"{len(t_ours)}{'*' if settle else ''}",
    )


def run_grid(cfg: Config, log: Callable[[str], None]) -> list[dict]:
    rows = []
    for body, (name, _) in BODIES.items():
        log(f"\n## {body} body: `{name}`\n")
        log(
            "| b1 | b2 | L | nest | ours (ms) | hand (ms) | ours / hand, paired (IQR) "
            "| twin / hand (noise) | rounds | same HLO |"
        )
        log("|---:|---:|---:|---|---:|---:|---|---|---:|---|")
        for cell in cfg.cells[body]:
            b1, b2, L = cell
            for nest in NESTS:
                label = nest_label(nest, b1)
                size = largest_array(body, nest, b1, b2, L)
                if size > cfg.max_elements:
                    rows.append(dict(body=body, nest=nest, cell=cell, skipped=size))
                    log(
                        f"| {b1} | {b2} | {L} | {label} | skipped: {size:,} elements "
                        f"> max {cfg.max_elements:,} | | | | | |"
                    )
                    continue
                r = run_cell(body, nest, cell, cfg)
                rows.append(r)
                log(
                    f"| {b1} | {b2} | {L} | {label} | {r['ours_ms']:.3f} | "
                    f"{r['hand_ms']:.3f} | {ratio_spread(r['ratios'])} | "
                    f"{ratio_spread(r['twin'])} | {r['rounds']} | {r['same_hlo']} |"
                )
        log(f"\n{SETTLED_NOTE}")
    return rows


def run_compile(cfg: Config, log: Callable[[str], None]) -> list[dict]:
    log("\n## Compile time (lower + compile of fresh programs, seconds)\n")
    log(
        "| body | b1 | b2 | L | nest | ours (s) | hand (s) | ours / hand, paired "
        "(IQR) | repetitions |"
    )
    log("|---|---:|---:|---:|---|---:|---:|---|---:|")
    rows = []
    for body, cell in cfg.compile_cells.items():
        b1, b2, L = cell
        fn = BODIES[body][1]
        k = chunk_of(b1)
        xs = jax.ShapeDtypeStruct((b1, b2, L), jnp.float32)
        for nest in cfg.compile_nests:
            s_ours, s_hand = compile_seconds(
                [lambda: ours(fn, nest, k), lambda: hand(fn, nest, k)],
                (xs,),
                cfg.compile_repeats,
            )
            ratios = paired_ratios(s_ours, s_hand)
            rows.append(dict(body=body, nest=nest, cell=cell, ratios=ratios))
            log(
                f"| {body} | {b1} | {b2} | {L} | {nest_label(nest, b1)} | "
                f"{median(s_ours):.3f} | {median(s_hand):.3f} | "
                f"{ratio_spread(ratios)} | {len(ratios)} |"
            )
    return rows


def _median_worst(values: list[float]) -> str:
    if not values:
        return "no cells"
    return f"median {median(values):.2f}, worst {max(values):.2f}"


def noise_line(section: str, rows: list[dict]) -> str:
    """The noise floor: each cell's paired ratio of two separately compiled copies
    of the same hand-written program."""
    twins = [median(r["twin"]) for r in rows]
    if not twins:
        return f"{section}: noise floor: no cells"
    lo, _, hi = quartiles(twins)
    same = sum(r["twin_same_hlo"] for r in rows)
    return (
        f"{section}: noise floor (twin / hand): median {median(twins):.2f}, cells "
        f"{min(twins):.2f} to {max(twins):.2f} (IQR {lo:.2f} to {hi:.2f}) over "
        f"{len(twins)} cells; twins' HLO identical in {same} of {len(rows)}"
    )


def summary_lines(grid: list[dict] | None, comp: list[dict] | None) -> list[str]:
    """One line per question, computed from the rows."""
    lines = []
    if grid:
        done = [r for r in grid if "skipped" not in r]

        def ratios(body: str, nest: str) -> list[float]:
            return [
                median(r["ratios"])
                for r in done
                if r["body"] == body and r["nest"] == nest
            ]

        for nest, target in (
            ("scan(vmap)", "median <= 1.05, worst <= 1.10"),
            ("chunk", "median <= 1.05, worst <= 1.10"),
            ("vmap", "~1"),
        ):
            vals = ratios("cheap", nest)
            lines.append(
                f"grid: cheap {nest}: ours / hand {_median_worst(vals)} over "
                f"{len(vals)} cells (target {target})"
            )
        for nest, target in (
            ("scan(vmap)", "<= 0.25"),
            ("chunk", "<= 0.25"),
            ("vmap", "~1"),
        ):
            vals = ratios("heavy", nest)
            by_l = {}
            for r in done:
                if r["body"] == "heavy" and r["nest"] == nest:
                    by_l.setdefault(r["cell"][2], []).append(median(r["ratios"]))
            per_l = ", ".join(
                f"L={L}: {median(v):.2f}" for L, v in sorted(by_l.items())
            )
            lines.append(
                f"grid: heavy {nest}: ours / hand {_median_worst(vals)} over "
                f"{len(vals)} cells (target {target}; by L: {per_l or '-'})"
            )
        lines.append(noise_line("grid", done))
        parts = []
        for body in BODIES:
            for nest in NESTS:
                rs = [r for r in done if r["body"] == body and r["nest"] == nest]
                same = sum(r["same_hlo"] == "yes" for r in rs)
                cond = sum(r["same_hlo"] == "no (conditional)" for r in rs)
                note = f", {cond} with a conditional" if cond else ""
                parts.append(f"{body} {nest} {same} of {len(rs)}{note}")
        lines.append("grid: HLO identical to hand-written: " + "; ".join(parts))
    if comp:
        parts = []
        for r in comp:
            parts.append(f"{r['body']} {r['nest']} {median(r['ratios']):.2f}")
        lines.append(
            "compile: ours / hand (lower + compile, median of paired repetitions): "
            + ", ".join(parts)
            + " (target <= 1.3 for scan(vmap) and chunk)"
        )
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a smaller grid")
    size.add_argument("--full", action="store_true", help="b1, b2 up to 3000")
    parser.add_argument("--repeats", type=int, default=None, help="max timed rounds")
    add_sections(parser, SECTIONS)
    args = parser.parse_args(argv)
    sections = chosen_sections(parser, args.sections, SECTIONS)
    cfg = make_config(args)

    def log(line: str) -> None:
        print(line, flush=True)

    mode = "quick" if args.quick else "full" if args.full else "default"
    log(
        f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} "
        f"cores), {mode} mode, up to {cfg.max_rounds} rounds per cell"
    )
    start = time.perf_counter()
    grid = run_grid(cfg, log) if "grid" in sections else None
    comp = run_compile(cfg, log) if "compile" in sections else None
    log(f"\nSummary (Total: {time.perf_counter() - start:.0f} s)\n")
    for line in summary_lines(grid, comp):
        log(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
