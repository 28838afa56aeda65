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
    """A new function: the forward pass of `f`, or the gradient of its sum."""
    if transform == "forward":
        return lambda x: f(x)
    if transform == "grad":
        return jax.grad(lambda x: f(x).sum())
    raise ValueError(f"Unrecognised transform '{transform}'; choose forward or grad.")


def makers(body: str, nest: str, transform: str, k: int) -> list[Callable]:
    """Ours, hand-written and its twin, each a maker of new functions."""
    fn = BODIES[body]
    return [
        lambda: program(transform, ours(fn, nest, k)),
        lambda: program(transform, hand(fn, nest, k)),
        lambda: program(transform, hand(fn, nest, k)),
    ]


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
    """`run`: the three programs compiled afresh, checked, then timed."""
    xs = inputs(cell)
    made = makers(body, nest, transform, cell[0])
    progs = [harness.compiled(make(), xs) for make in made]
    if not harness.agree(*[progs[i](xs) for i in (1, 0, 2)]):  # hand first
        raise AssertionError(f"ours and hand-written differ: {body} {nest} {cell}")
    times = harness.time_interleaved(
        [lambda p=p: p(xs) for p in progs], cfg.seconds, 5, cfg.max_rounds
    )
    hlo = harness.same_hlo(progs[0], progs[1])
    # No larger: temporaries within those of the hand-written program (10%, 2 KiB).
    temps = [harness.temp_bytes(p) for p in progs]
    return times, dict(same_hlo=hlo, no_larger=hlo or temps[0] <= 1.1 * temps[1] + 2048)


def compile_cell(body, nest, transform, cell, cfg: Config) -> tuple[list, dict]:
    """`compile`: lower + compile of fresh programs, taking turns."""
    xs = jax.ShapeDtypeStruct(cell, jnp.float32)
    made = makers(body, nest, transform, cell[0])
    return harness.compile_seconds(made, (xs,), cfg.compile_repeats), {}


def eager_cell(body, nest, transform, cell, cfg: Config) -> tuple[list, dict]:
    """`eager`: un-jitted calls of one wrapper each (ours, hand, twin), timed."""
    xs = inputs(cell)
    fns = [make() for make in makers(body, nest, transform, cell[0])]
    fns[0](xs)  # the first call of a signature traces and compiles
    with harness.count_compiles() as counts:
        for _ in range(cfg.eager_calls):
            jax.block_until_ready(fns[0](xs))
    times = harness.time_interleaved(
        [lambda f=f: f(xs) for f in fns], cfg.seconds, 5, cfg.max_rounds
    )
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


#
# The report: a summary table, every row, a figure.
#


med = statistics.median


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


EAGER_COUNTS = ("traces", "compiles", "calls")


def eager_note(rows: list[dict]) -> str:
    counted = [r for r in rows if r["kind"] == "eager"]
    if not counted:
        return ""
    traces, compiles, calls = (sum(r[k] for r in counted) for k in EAGER_COUNTS)
    return (
        f"Un-jitted forward calls of ours, one wrapper called again: {traces} traces "
        f"and {compiles} compiles in {calls} calls."
    )


def detail_table(rows: list[dict]) -> str:
    head = ["kind", "transform", "body", "nest", "cell", "ours (ms)", "hand (ms)"]
    head += ["ours / hand", "twin / hand", "rounds", "same HLO", "no larger"]
    lines, fmt = [head], harness.fmt_ratios
    yes = {None: "", True: "yes", False: "no"}
    for r in rows:
        lines.append(
            [r["kind"], r["transform"], r["body"], r["nest"], r["cell"]]
            + [f"{r['ours_ms']:.3f}", f"{r['hand_ms']:.3f}"]
            + [fmt(r["ratios"]), fmt(r["twin"]), str(len(r["ratios"]))]
            + [yes[r.get("same_hlo")], yes[r.get("no_larger")]]
        )
    return md_table(lines)


def write_csv(path: str, rows: list[dict]) -> None:
    fields = list(dict.fromkeys(k for r in rows for k in r))
    joined = lambda xs: " ".join(f"{x:.4g}" for x in xs)  # every round's ratio
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(
            r | {k: joined(r[k]) for k in ("ratios", "twin")} for r in rows
        )


PANELS = (
    ("run", "forward", "forward, jit"),
    ("run", "grad", "jax.grad, jit"),
    ("compile", None, "compile (lower + compile)"),
    ("eager", None, "un-jitted call"),
)


TICKS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.8, 0.9, 1, 1.1, 1.25, 1.5, 2, 3)


def ticks(lo: float, hi: float) -> list[float]:
    """Of `TICKS` within the limits, 1 and those not crowding it or each other."""
    gap, out = np.log(hi / lo) / 12, []
    for t in sorted(TICKS, key=lambda t: abs(np.log(t))):
        if lo <= t <= hi and all(abs(np.log(t / u)) >= gap for u in out):
            out.append(t)
    return sorted(out)


def limits(values: list[float]) -> tuple[float, float]:
    """y limits (log scale) that every median within the 5th to 95th percentile,
    the noise band and 1 fit in, with a margin; outliers are not let stretch it."""
    lo, hi = np.percentile(values, [5, 95])
    return float(lo) / 1.25, float(hi) * 1.25


def plot(rows: list[dict], path: str) -> None:
    """One panel per kind of measurement; in each, one series per nest (median and
    interquartile range of the paired ratios per cell) and the twins' band. Medians
    beyond the axis are hollow triangles on its edge, labelled with their value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker as ticker

    panels = [p for p in PANELS if any(r["kind"] == p[0] for r in rows)]
    width = max(11, 0.5 * len({r["cell"] for r in rows}) + 4)
    size = (width, 3.6 * len(panels))
    fig, axes = plt.subplots(len(panels), 1, figsize=size, squeeze=False)
    for ax, (kind, transform, title) in zip(axes[:, 0], panels):
        sub = [r for r in rows if r["kind"] == kind]
        sub = [r for r in sub if transform in (None, r["transform"])]
        labels = list(dict.fromkeys(_x_label(r, transform) for r in sub))
        band = tuple(np.percentile([med(r["twin"]) for r in sub], [10, 90]))
        meds = [med(r["ratios"]) for r in sub]
        lo, hi = limits(meds + list(band) + [1.0])
        lo, hi = min(lo, band[0] / 1.05, 1 / 1.05), max(hi, band[1] * 1.05, 1.05)
        ax.axhspan(*band, color="grey", alpha=0.25, lw=0)
        ax.axhline(1.0, color="black", lw=0.8)
        for j, nest in enumerate(NESTS):
            xs, ys, err, color = [], [], [[], []], f"C{j}"
            for r in (r for r in sub if r["nest"] == nest):
                x = labels.index(_x_label(r, transform)) + (j - 1.5) * 0.2
                q1, q2, q3 = harness.quartiles(r["ratios"])
                if lo <= q2 <= hi:
                    xs.append(x)
                    ys.append(q2)
                    err[0].append(q2 - max(q1, lo))
                    err[1].append(min(q3, hi) - q2)
                    continue
                # Beyond the axis: a hollow triangle on its edge, with the value.
                edge, marker, dy = (hi, "^", -9) if q2 > hi else (lo, "v", 3)
                ax.plot(x, edge, marker, mfc="white", color=color, ms=9, clip_on=0)
                text = dict(textcoords="offset points", color=color, size=8)
                ax.annotate(f"{q2:.2f}", (x, edge), (7, dy), **text)
            style = dict(color=color, marker="osD^"[j], ms=6)
            ax.errorbar(xs, ys, yerr=err, ls="none", capsize=3, label=nest, **style)
        ax.set_yscale("log")
        ax.set_ylim(lo, hi)
        ax.yaxis.set_major_locator(ticker.FixedLocator(ticks(lo, hi)))
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_locator(ticker.NullLocator())
        ax.set_xticks(range(len(labels)), labels, size=8, rotation=30, ha="right")
        ax.set_xlim(-0.5, len(labels) - 0.5)
        ax.set_title(f"{title}: ours / hand-written (below 1: ours faster)", size=10)
        ax.grid(axis="y", alpha=0.3)
    handles, names = axes[0, 0].get_legend_handles_labels()
    handles.append(plt.Rectangle((0, 0), 1, 1, color="grey", alpha=0.25))
    names.append("noise: twins (identical programs), 10th-90th percentile")
    fig.legend(handles, names, loc="upper center", ncol=4, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _x_label(r: dict, transform: str | None) -> str:
    return r["body"] + " " + (r["cell"] if transform else r["transform"])


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
    blocks += [eager_note(rows), detail_table(rows)]
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
