"""Ours against hand-written: does `filter_multi_vmap` cost anything over the nest it
replaces, forward and under `jax.grad`, compiled and un-jitted, and to compile?

Two bodies over `xs: (b1, b2, L)` (`cheap`, `heavy`), four nests (`vmap`,
`scan(vmap)`, `chunk`, `chunk2`: chunked scans with remainders), each against its
hand-written program and that program's *twin* (a second copy: the noise floor),
all built afresh; sections `run` (compiled; same HLO or no larger), `compile` and
`eager` (un-jitted calls, and the traces and compiles of ours). Reported: paired
ratios, a summary table, and in `--out` `results.md`, `results.csv` and
`ours_vs_hand.png`. Nothing passes or fails on a time. Details:
`benchmarks/README.md`.

    python benchmarks/run.py --quick     # 2 minutes on 2 busy cores
    python benchmarks/run.py             # 19 minutes on 2 busy cores (18 cells)
    python benchmarks/run.py --sections run --max-elements 1e8
"""

import csv
import dataclasses
import functools as ft
import itertools as it
import os
import platform
import statistics
import time
from collections.abc import Callable

import harness
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from eqx_multimap import filter_multi_vmap


HERE = os.path.dirname(os.path.abspath(__file__))
SECTIONS = ("run", "compile", "eager")
NESTS = ("vmap", "scan(vmap)", "chunk", "chunk2")
TRANSFORMS = ("forward", "grad")
DIMS = dict(in_dims="b1 b2 L", out_dims="b1 b2 L", core="L")
med = statistics.median


def cheap(x):
    return jnp.sin(x**2 + 1)


def heavy(x):
    return jnp.tanh(jnp.outer(x, x)) @ x


BODIES = {"cheap": cheap, "heavy": heavy}


def chunk_of(b1: int) -> int:
    return max(1, b1 // 8)


def hand(body: Callable, nest: str, k: int) -> Callable:
    """The hand-written nest: new function objects on every call, each step built
    once (so that an un-jitted `lax.scan` finds its traced step in its cache)."""
    row = jax.vmap(body)
    if nest == "vmap":
        both = jax.vmap(row)
        return lambda xs: both(xs)
    if nest == "scan(vmap)":
        step = lambda c, x: (c, row(x))  # noqa: E731
        return lambda xs: lax.scan(step, None, xs)[1]
    if nest == "chunk":
        return lambda xs: lax.map(row, xs, batch_size=k)
    if nest == "chunk2":
        inner = lambda x: lax.map(body, x, batch_size=chunk_of(x.shape[0]))  # noqa
        return lambda xs: lax.map(inner, xs, batch_size=k)
    raise ValueError(f"Unrecognised nest '{nest}'; choose from {', '.join(NESTS)}.")


def ours(body: Callable, nest: str, k: int) -> Callable:
    """`filter_multi_vmap` with the same nest, wrapping a new function object (so
    that it is not equal to an earlier wrapper)."""
    fun = harness.fresh(body)
    if nest == "vmap":
        return filter_multi_vmap(fun, **DIMS, vmap="b1 b2")
    if nest == "scan(vmap)":
        return filter_multi_vmap(fun, **DIMS, scan="b1", vmap="b2")
    if nest == "chunk":
        return filter_multi_vmap(fun, **DIMS, scan={"b1": k}, vmap="b2")
    if nest == "chunk2":
        ours = ft.partial(filter_multi_vmap, fun, **DIMS)  # b2's chunk at the call
        return lambda xs: ours(scan={"b1": k, "b2": chunk_of(xs.shape[1])})(xs)
    raise ValueError(f"Unrecognised nest '{nest}'; choose from {', '.join(NESTS)}.")


def program(transform: str, f: Callable) -> Callable:
    if transform == "forward":
        return lambda x: f(x)
    if transform == "grad":
        return jax.grad(lambda x: f(x).sum())
    raise ValueError(f"Unrecognised transform '{transform}'; choose forward or grad.")


def makers(body: str, nest: str, transform: str, k: int) -> list[Callable]:
    """Ours, hand-written and its twin, each a maker of new functions."""
    fn, makes = BODIES[body], (ours, hand, hand)
    return [lambda m=m: program(transform, m(fn, nest, k)) for m in makes]


def largest_array(body: str, nest: str, transform: str, cell: tuple) -> int:
    """Elements of the biggest array a program materialises at once."""
    b1, b2, L = cell
    if body == "cheap":
        return b1 * b2 * L
    k1, k2 = chunk_of(b1), chunk_of(b2)
    per_step = {"vmap": b1 * b2, "scan(vmap)": b2, "chunk": k1 * b2, "chunk2": k1 * k2}
    return max(b1 * b2 * L, per_step[nest] * L * L * (3 if transform == "grad" else 1))


def inputs(cell: tuple) -> jax.Array:
    rng = np.random.default_rng(0)
    return jnp.asarray(0.5 * rng.standard_normal(cell, dtype=np.float32))


@dataclasses.dataclass
class Config:
    cells: dict[str, list[tuple[int, int, int]]]  # per body: (b1, b2, L)
    one_cell: dict[str, tuple[int, int, int]]  # per body: compile and eager
    max_elements: int
    max_rounds: int
    seconds: float  # timing budget per cell
    compile_repeats: int
    eager_calls: int
    compile_nests: tuple[str, ...] = NESTS


def make_config(args) -> Config:
    one = {"cheap": (100, 100, 10), "heavy": (100, 100, 32)}
    if args.quick:
        cells = {
            "cheap": [(100, 100, 1), (300, 300, 10)],
            "heavy": [(100, 100, 8), (100, 100, 32)],
        }
        cfg = Config(cells, one, 3 * 10**7, 11, 0.3, 3, 20, ("scan(vmap)",))
    else:
        cells = {
            "cheap": list(it.product((100, 300), (100, 300), (1, 10, 100))),
            "heavy": list(it.product((100, 300), (100,), (8, 32, 64))),
        }
        cfg = Config(cells, one, 15 * 10**7, 21, 1.5, 5, 50)
    if args.max_elements is not None:
        cfg.max_elements = int(args.max_elements)
    cfg.max_rounds = args.repeats or cfg.max_rounds
    return cfg


def run_cell(body, nest, transform, cell, cfg: Config) -> tuple[list, dict]:
    xs = inputs(cell)
    made = makers(body, nest, transform, cell[0])
    progs = [harness.compiled(make(), xs) for make in made]
    if not harness.agree(*[progs[i](xs) for i in (1, 0, 2)]):  # hand first
        raise AssertionError(f"ours and hand-written differ: {body} {nest} {cell}")
    thunks = [lambda p=p: p(xs) for p in progs]
    times = harness.time_interleaved(thunks, cfg.seconds, 5, cfg.max_rounds)
    hlo = harness.same_hlo(progs[0], progs[1])
    # No larger: temporaries within those of the hand-written program (10%, 2 KiB).
    temps = [harness.temp_bytes(p) for p in progs]
    return times, dict(same_hlo=hlo, no_larger=hlo or temps[0] <= 1.1 * temps[1] + 2048)


def compile_cell(body, nest, transform, cell, cfg: Config) -> tuple[list, dict]:
    # Lower + compile seconds of new functions, all made beforehand (untimed), after
    # one untimed compile of each: a kind's first pays one-off costs.
    xs, r = jax.ShapeDtypeStruct(cell, jnp.float32), cfg.compile_repeats
    makes = makers(body, nest, transform, cell[0])
    made = [iter([make() for _ in range(r + 1)]) for make in makes]
    thunks = [lambda fns=fns: harness.compiled(next(fns), xs) for fns in made]
    return harness.time_interleaved(thunks, 0.0, r, r, 0.0, 0), {}


def eager_cell(body, nest, transform, cell, cfg: Config) -> tuple[list, dict]:
    xs = inputs(cell)
    fns = [make() for make in makers(body, nest, transform, cell[0])]
    fns[0](xs)  # the first call of a signature traces and compiles
    with harness.count_compiles() as counts:
        for _ in range(cfg.eager_calls):
            jax.block_until_ready(fns[0](xs))
    thunks = [lambda f=f: f(xs) for f in fns]
    times = harness.time_interleaved(thunks, cfg.seconds, 5, cfg.max_rounds)
    return times, dict(counts, calls=cfg.eager_calls)


MEASURE = {"run": run_cell, "compile": compile_cell, "eager": eager_cell}


def measure(sections: list[str], cfg: Config, log: Callable[[str], None]) -> list:
    """Every row: what was measured, ours' and hand's median milliseconds, the paired
    ratios ours / hand and twin / hand per round, and what the section adds."""
    rows = []
    for kind, body in it.product(sections, BODIES):
        cells = cfg.cells[body] if kind == "run" else [cfg.one_cell[body]]
        transforms = ("forward",) if kind == "eager" else TRANSFORMS
        nests = {"compile": cfg.compile_nests, "eager": NESTS[:2]}.get(kind, NESTS)
        for cell, transform, nest in it.product(cells, transforms, nests):
            size = "x".join(map(str, cell))
            what = f"{kind} {body} {nest} {transform} {size}"
            if largest_array(body, nest, transform, cell) > cfg.max_elements:
                log(f"{what}: skipped, more than {cfg.max_elements:,} elements")
                continue
            times, extra = MEASURE[kind](body, nest, transform, cell, cfg)
            t_ours, t_hand, t_twin = times
            ratios = harness.paired_ratios(t_ours, t_hand)
            twin = harness.paired_ratios(t_twin, t_hand)
            ms = dict(ours_ms=1e3 * med(t_ours), hand_ms=1e3 * med(t_hand))
            rows.append(
                dict(kind=kind, body=body, nest=nest, transform=transform, cell=size)
                | dict(**ms, ratios=ratios, twin=twin, **extra)
            )
            log(
                f"{what}: ours / hand {harness.fmt_ratios(ratios)}, twin / hand "
                f"{harness.fmt_ratios(twin)}"
            )
    return rows


def summary_table(rows: list[dict]) -> list[list[str]]:
    """Per kind, transform and body: ours / hand per nest, the median over cells of
    the paired ratios (their range), the twins' (the noise floor), same HLO (or no
    larger: in temporaries)."""
    out = [["ours / hand-written", *NESTS, "twins (noise)", "same HLO (no larger)"]]
    for key in dict.fromkeys((r["kind"], r["transform"], r["body"]) for r in rows):
        group = [r for r in rows if (r["kind"], r["transform"], r["body"]) == key]
        cols = [[med(r["ratios"]) for r in group if r["nest"] == n] for n in NESTS]
        cols = [_spread(ratios) for ratios in cols]
        twins = _spread([med(r["twin"]) for r in group])
        hlo = [(r["same_hlo"], r["no_larger"]) for r in group if "same_hlo" in r]
        same = f"{sum(h for h, _ in hlo)} ({sum(n for _, n in hlo)}) of {len(hlo)}"
        same = same if hlo else ""
        out.append([" ".join(key), *cols, twins, same])
    return out


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{med(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def text_table(lines: list[list[str]]) -> str:
    widths = [max(len(r[k]) for r in lines) for k in range(len(lines[0]))]
    lines = [lines[0], ["-" * w for w in widths], *lines[1:]]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in lines)


def md_table(lines: list[list[str]]) -> str:
    rule = ["---"] * len(lines[0])
    return "\n".join("| " + " | ".join(r) + " |" for r in [lines[0], rule, *lines[1:]])


def eager_note(rows: list[dict]) -> str:
    counted = [r for r in rows if r["kind"] == "eager"]
    if not counted:
        return ""
    traces, compiles, calls = (
        sum(r[k] for r in counted) for k in ("traces", "compiles", "calls")
    )
    return (
        f"Un-jitted forward calls of ours, one wrapper called again: {traces} traces "
        f"and {compiles} compiles in {calls} calls."
    )


def write_csv(path: str, rows: list[dict]) -> None:
    fields = list(dict.fromkeys(k for r in rows for k in r))
    joined = lambda xs: " ".join(f"{x:.4g}" for x in xs)  # every round's ratio
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(
            r | {k: joined(r[k]) for k in ("ratios", "twin")} for r in rows
        )


def plot(rows: list[dict], path: str) -> None:
    """One panel per kind of measurement: per nest and cell, the median and
    interquartile range of the paired ratios ours / hand-written; the twins' band
    (10th to 90th percentile of their medians); a log axis clipped to the 5th to 95th
    percentile of the medians, with a margin (the title counts those beyond it)."""
    from matplotlib import ticker
    from matplotlib.figure import Figure

    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    label = lambda r: f"{r['body']} {r['transform']} {r['cell']}"
    width = max(11, 0.3 * len(set(map(label, rows))) + 4)
    fig = Figure(figsize=(width, 3.6 * len(kinds)))
    for ax, kind in zip(fig.subplots(len(kinds), 1, squeeze=False)[:, 0], kinds):
        sub = [r for r in rows if r["kind"] == kind]
        labels = list(dict.fromkeys(map(label, sub)))
        for j, nest in enumerate(NESTS):
            mine = [r for r in sub if r["nest"] == nest]
            xs = [labels.index(label(r)) + (j - 1.5) * 0.2 for r in mine]
            # A nest not measured here: an empty series, in the legend all the same.
            q = np.array([harness.quartiles(r["ratios"]) for r in mine]).reshape(-1, 3)
            err = (q[:, 1] - q[:, 0], q[:, 2] - q[:, 1])
            style = dict(fmt="osD^"[j], color=f"C{j}", capsize=3, label=nest)
            ax.errorbar(xs, q[:, 1], err, **style)
        band = np.percentile([med(r["twin"]) for r in sub], [10, 90])
        noise = "twins (identical programs), 10th-90th percentile"
        ax.axhspan(*band, color="grey", alpha=0.25, lw=0, label=noise)
        ax.axhline(1.0, color="black", lw=0.8)
        meds = [med(r["ratios"]) for r in sub]
        lo, hi = np.percentile(meds, [5, 95])
        lo, hi = min(lo, band[0], 1.0) / 1.25, max(hi, band[1], 1.0) * 1.25
        beyond = sum(not lo <= m <= hi for m in meds)
        ax.set(yscale="log", ylim=(lo, hi), xlim=(-0.5, len(labels) - 0.5))
        ax.yaxis.set_major_locator(ticker.AutoLocator())  # even steps, not 10x apart
        ax.yaxis.set_minor_locator(ticker.NullLocator())
        ax.yaxis.set_major_formatter("{x:g}")
        ax.set_xticks(range(len(labels)), labels, size=8, rotation=30, ha="right")
        title = f"{kind}: ours / hand-written (below 1: ours faster)"
        ax.set_title(title + f"; {beyond} beyond the axis" * bool(beyond), size=10)
    fig.legend(*ax.get_legend_handles_labels(), loc="upper center", ncol=5)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    parser = harness.parser(__doc__, SECTIONS)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--max-elements", type=float, help="skip bigger programs")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    cfg = make_config(args)
    header = (
        f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} "
        f"cores, {platform.machine()}), {'quick' if args.quick else 'default'} mode, "
        f"up to {cfg.max_rounds} rounds"
    )
    print(header, flush=True)
    start = time.perf_counter()
    rows = measure(args.sections, cfg, lambda line: print(line, flush=True))
    total = f"Total: {time.perf_counter() - start:.0f} s."
    summary = summary_table(rows)
    os.makedirs(args.out, exist_ok=True)
    write_csv(os.path.join(args.out, "results.csv"), rows)
    blocks = ["# Ours against hand-written", header, total, md_table(summary)]
    blocks.append(eager_note(rows))
    if not args.no_plots:
        plot(rows, os.path.join(args.out, "ours_vs_hand.png"))
        blocks.append("![ours against hand-written](ours_vs_hand.png)")
    path = os.path.join(args.out, "results.md")
    with open(path, "w") as fh:
        fh.write("\n\n".join(blocks) + "\n")
    print(f"\nSummary ({total} Paired ratios: median over cells (range).)\n")
    print(text_table(summary))
    print(f"\n{eager_note(rows)}\nReport: {path} (and results.csv, the figure)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
