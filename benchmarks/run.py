"""The origin benchmark, reproduced properly: map orders, memory and bandwidth.

Three sections, each written to `benchmarks/results/` as a CSV, one Markdown report
(`results.md`) and a PNG plot:

- `grid`: `f(x) = sin(x**2 + 1)` over `xs` of shape `(b1, b2, L)`, mapped over `b1`
    and `b2`, for `b1, b2` in {100, 1000, 3000} and `L` in {1, 10, 100}. Compared:
    hand-written `vmap(vmap)`, `scan(vmap)`, `vmap(scan)`, `lax.map(batch_size=k)`,
    and `filter_multi_vmap` with the same strategies (plus `plan="auto"` when the
    installed `eqx_multimap` has a planner). Every program is compiled first (compile
    time reported apart), run once as warm-up, then all are timed side by side,
    interleaved, with `jax.block_until_ready`; reported are medians and the median
    of per-round ratios against the full vmap measured in the same rounds.
- `memory`: per-element workloads with a big intermediate (`exp(outer(x, y))`, 1 GiB
    when fully vmapped): the compiled temp bytes
    (`compiled.memory_analysis().temp_size_in_bytes`) and the peak RSS of a fresh
    subprocess per strategy (`resource.getrusage(RUSAGE_SELF).ru_maxrss`).
- `bandwidth`: elementwise maps as a fraction of a measured memcpy bandwidth (bytes
    moved = bytes read + bytes written).

Only ratios measured side by side in one run are compared; absolute times depend on
the machine and its load, and nothing here passes or fails on them.

    python benchmarks/run.py --quick     # reduced sizes, well under 2 minutes
    python benchmarks/run.py             # the full grid (10-15 minutes on 2 cores)
    python benchmarks/run.py --sections grid --max-elements 1e9
"""

import argparse
import csv
import dataclasses
import itertools as it
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable


sys.path.insert(0, os.path.dirname(__file__))

import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from _timing import compiled, median, paired_ratio, time_side_by_side
from eqx_multimap import filter_multi_vmap


HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "results")
SECTIONS = ("grid", "memory", "bandwidth")
MiB = 2**20


# ----------------------------------------------------------------------------------
# Grid: the origin benchmark.


def f(x):
    return jnp.sin(x**2 + 1)


def hand_vmap(xs):
    return jax.vmap(jax.vmap(f))(xs)


def hand_scan_vmap(xs):
    return lax.scan(lambda c, x: (c, jax.vmap(f)(x)), None, xs)[1]


def hand_vmap_scan(xs):
    return jax.vmap(lambda row: lax.scan(lambda c, x: (c, f(x)), None, row)[1])(xs)


def hand_lax_map(k: int):
    return lambda xs: lax.map(jax.vmap(f), xs, batch_size=k)


_GRID_DIMS = dict(in_dims="b1 b2 L", out_dims="b1 b2 L")


def auto_plan_kwargs() -> dict | None:
    """`{"plan": "auto"}` if this `eqx_multimap` has the planner, else `None`.

    Detected by trying: the runner works both before and after the planner lands.
    """
    try:
        filter_multi_vmap(f, **_GRID_DIMS, vmap="b1 b2", plan="auto")  # pyright: ignore
    except TypeError:
        return None
    return {"plan": "auto"}


def grid_methods(b1: int, auto: dict | None) -> dict[str, Callable]:
    """The programs compared on one grid cell, by column name (baseline first)."""
    k = max(1, b1 // 8)
    methods = {
        "vmap": hand_vmap,
        "scan(vmap)": hand_scan_vmap,
        "vmap(scan)": hand_vmap_scan,
        f"lax.map(bs={k})": hand_lax_map(k),
        "ours vmap": filter_multi_vmap(f, **_GRID_DIMS, vmap="b1 b2"),
        "ours scan(vmap)": filter_multi_vmap(f, **_GRID_DIMS, scan="b1", vmap="b2"),
        f"ours chunk {k}": filter_multi_vmap(
            f, **_GRID_DIMS, scan={"b1": k}, vmap="b2"
        ),
    }
    if auto is not None:
        # `vmap=` names the mapped dims; the planner chooses how to map them.
        methods["ours auto"] = filter_multi_vmap(f, **_GRID_DIMS, vmap="b1 b2", **auto)
    return methods


def method_family(name: str) -> str:
    """Column name without its chunk size, so cells with different `k` line up."""
    if name.startswith("lax.map"):
        return "lax.map(bs=k)"
    if name.startswith("ours chunk"):
        return "ours chunk k"
    return name


@dataclasses.dataclass
class Timed:
    compile_s: float
    times: list[float]
    ratio: float  # median of per-round ratios against the baseline (first) program


def time_thunks(
    thunks: list[Callable[[], object]], repeats: int, budget_s: float
) -> list[list[float]]:
    """Time `thunks` side by side (see `_timing.time_side_by_side`).

    The number of rounds is cut down (to no fewer than 3) so that timing them all
    takes about `budget_s`, judged from a first call of each (which also warms up).
    """
    first = 0.0
    for thunk in thunks:
        t0 = time.perf_counter()
        jax.block_until_ready(thunk())
        first += time.perf_counter() - t0
    rounds = max(3, min(repeats, int(budget_s / max(first, 1e-9))))
    return time_side_by_side(thunks, repeats=rounds, warmup=0)


def time_programs(
    programs: dict[str, Callable], args: tuple, repeats: int, budget_s: float
) -> dict[str, Timed]:
    """Compile each program (timed apart), then time them all side by side."""
    comp, compile_s = {}, {}
    for name, fn in programs.items():
        t0 = time.perf_counter()
        comp[name] = compiled(fn, *args)
        compile_s[name] = time.perf_counter() - t0
    thunks = [lambda c=c: c(*args) for c in comp.values()]
    times = time_thunks(thunks, repeats, budget_s)
    return {
        name: Timed(compile_s[name], t, paired_ratio(t, times[0]))
        for name, t in zip(comp, times)
    }


def run_grid(cfg, progress) -> dict:
    auto = auto_plan_kwargs()
    cells = list(it.product(cfg.b_sizes, cfg.b_sizes, cfg.l_sizes))
    run_cells = [c for c in cells if np.prod(c) <= cfg.max_elements]
    skipped = [c for c in cells if np.prod(c) > cfg.max_elements]
    rows, pairs = [], []
    for b1, b2, L in progress(run_cells, desc="grid"):
        xs = jax.random.normal(jax.random.key(0), (b1, b2, L), jnp.float32)
        timed = time_programs(
            grid_methods(b1, auto), (xs,), cfg.repeats, cfg.cell_budget_s
        )
        for name, t in timed.items():
            rows.append(
                dict(
                    b1=b1,
                    b2=b2,
                    L=L,
                    elements=b1 * b2 * L,
                    method=name,
                    family=method_family(name),
                    compile_s=t.compile_s,
                    median_ms=1e3 * median(t.times),
                    min_ms=1e3 * min(t.times),
                    ratio_vs_vmap=t.ratio,
                    rounds=len(t.times),
                )
            )
        pairs += [
            dict(b1=b1, b2=b2, L=L, a=a, b=b, ratio=ratio)
            for a, b, ratio in grid_pairs(timed)
        ]
        del xs
    return dict(rows=rows, pairs=pairs, skipped=skipped, auto=auto is not None)


def grid_pairs(timed: dict[str, "Timed"]) -> list[tuple[str, str, float]]:
    """The comparisons that answer the benchmark's questions, as paired ratios."""
    family = {method_family(name): t.times for name, t in timed.items()}
    out = [
        (a, b, paired_ratio(family[a], family[b]))
        for a, b in (
            ("vmap(scan)", "scan(vmap)"),
            ("ours vmap", "vmap"),
            ("ours scan(vmap)", "scan(vmap)"),
            ("ours chunk k", "lax.map(bs=k)"),
        )
    ]
    if "ours auto" in family:
        fixed = {k: v for k, v in family.items() if k != "ours auto"}
        best = min(fixed, key=lambda k: median(fixed[k]))
        out.append(
            (
                "ours auto",
                "fastest other",
                paired_ratio(family["ours auto"], fixed[best]),
            )
        )
    return out


# ----------------------------------------------------------------------------------
# Memory: a big per-element intermediate, scanned or vmapped.


def sumexp(x, y):
    """`sum(exp(outer(x, y)))`: XLA fuses the outer product into the reduction."""
    return jnp.sum(jnp.exp(jnp.outer(x, y)))


def softmax_matvec(x, y, v):
    """`softmax(outer(x, y), axis=1) @ v` (without the max shift): the `(M, K)`
    weights are used twice, so XLA must materialise them."""
    w = jnp.exp(jnp.outer(x, y))
    return (w @ v) / jnp.sum(w, axis=1)


MEMORY_WORKLOADS = {
    "sumexp": (sumexp, {"x": "n M", "y": "n K"}, "n"),
    "softmax_matvec": (softmax_matvec, {"x": "n M", "y": "n K", "v": "n K"}, "n M"),
}


def memory_inputs(workload: str, n: int, m: int):
    _, in_dims, _ = MEMORY_WORKLOADS[workload]
    keys = jax.random.split(jax.random.key(1), len(in_dims))
    return tuple(
        jax.random.uniform(key, (n, m), jnp.float32, -1.0, 1.0)
        for key in keys  # |x * y| <= 1: exp stays finite
    )


def memory_program(workload: str, strategy: str, chunk: int, budget: int):
    fun, in_dims, out_dims = MEMORY_WORKLOADS[workload]
    kw: dict = dict(in_dims=in_dims, out_dims=out_dims)
    if strategy == "vmap":
        kw["vmap"] = "n"
    elif strategy == "scan":
        kw["scan"] = "n"
    elif strategy == "chunk":
        kw["scan"] = {"n": chunk}
    elif strategy == "auto":
        kw.update(vmap="n", plan="auto", memory_budget=budget)
    else:
        raise ValueError(f"Unrecognised strategy {strategy!r}")
    return filter_multi_vmap(fun, **kw)


def memory_strategies(cfg) -> list[str]:
    out = ["vmap", "scan", "chunk"]
    if auto_plan_kwargs() is not None:
        try:
            memory_program("sumexp", "auto", cfg.chunk, cfg.budget)
            out.append("auto")
        except TypeError:
            pass  # a planner without `memory_budget=`
    return out


def _status_bytes(field: str) -> int | None:
    """A `/proc/self/status` field (`VmHWM`, `VmRSS`) in bytes; `None` off Linux."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset this process's `VmHWM` to its current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _ru_maxrss_bytes() -> int:
    scale = 1 if sys.platform == "darwin" else 1024  # Linux reports KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def memory_child(spec: dict) -> dict:
    """Run one (workload, strategy) in this fresh process; report its memory.

    Peak RSS is read from `VmHWM`, reset just before the call so the call's own
    peak is known. (`ru_maxrss` is kept in the CSV, but on Linux it survives
    `exec`: a child reports at least the size of the parent that started it.)
    """
    inputs = memory_inputs(spec["workload"], spec["n"], spec["m"])
    jax.block_until_ready(inputs)
    program = memory_program(
        spec["workload"], spec["strategy"], spec["chunk"], spec["budget"]
    )
    c = compiled(program, *inputs)
    setup_peak = _status_bytes("VmHWM")
    before = _status_bytes("VmRSS")
    reset = _reset_peak_rss()
    jax.block_until_ready(c(*inputs))
    run_peak = _status_bytes("VmHWM")
    ru_maxrss = _ru_maxrss_bytes()
    if setup_peak is None or before is None or run_peak is None or not reset:
        setup_peak = run_peak = ru_maxrss  # no /proc: the best we have
        before = 0
    return dict(
        temp_bytes=int(c.memory_analysis().temp_size_in_bytes),
        peak_rss=max(setup_peak, run_peak),
        rss_before_run=before,
        run_peak_rss=run_peak,
        ru_maxrss=ru_maxrss,
    )


def run_memory(cfg, progress) -> dict:
    n, m = cfg.mem_n, cfg.mem_m
    strategies = memory_strategies(cfg)
    jobs = list(it.product(MEMORY_WORKLOADS, strategies))
    rows = []
    for workload, strategy in progress(jobs, desc="memory"):
        spec = dict(
            workload=workload,
            strategy=strategy,
            n=n,
            m=m,
            chunk=cfg.chunk,
            budget=cfg.budget,
        )
        proc = subprocess.run(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--memory-child",
                json.dumps(spec),
            ],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"memory child {spec} failed:\n{proc.stdout}\n{proc.stderr}"
            )
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(dict(workload=workload, strategy=strategy, **result))
    # Run times, side by side in this process (each child ran in its own).
    for workload in MEMORY_WORKLOADS:
        inputs = memory_inputs(workload, n, m)
        programs = {
            s: memory_program(workload, s, cfg.chunk, cfg.budget) for s in strategies
        }
        timed = time_programs(programs, inputs, cfg.repeats, cfg.cell_budget_s)
        for row in rows:
            if row["workload"] == workload:
                t = timed[row["strategy"]]
                row.update(
                    compile_s=t.compile_s,
                    median_ms=1e3 * median(t.times),
                    ratio_vs_vmap=t.ratio,
                )
        del inputs
    intermediate = n * m * m * 4
    return dict(rows=rows, n=n, m=m, intermediate=intermediate, budget=cfg.budget)


# ----------------------------------------------------------------------------------
# Bandwidth: elementwise maps against a measured memcpy.


def double_plus_one(x):
    return 2 * x + 1


def run_bandwidth(cfg, progress) -> dict:
    """Elementwise maps and two reference copies, all timed side by side.

    References: `numpy copyto` copies into a preallocated, already touched buffer,
    which is the memory bandwidth itself; `XLA copy` is a jitted `x.copy()`, which,
    like every jitted function, writes a freshly allocated output. Every row moves
    the same bytes, so its fraction of a reference is the paired time ratio.
    """
    b1, b2, L = cfg.bw_shape
    xs = jax.random.normal(jax.random.key(2), (b1, b2, L), jnp.float32)
    nbytes = xs.nbytes
    src = np.asarray(xs)
    dst = np.empty_like(src)
    thunks: list[Callable[[], object]] = [lambda: np.copyto(dst, src)]
    programs = {"XLA copy": lambda x: x.copy()}
    for fname, fn in (("sin(x**2+1)", f), ("2*x+1", double_plus_one)):
        programs[f"{fname}|jnp (no map)"] = fn
        programs[f"{fname}|ours vmap"] = filter_multi_vmap(
            fn, **_GRID_DIMS, vmap="b1 b2"
        )
        programs[f"{fname}|ours scan(vmap)"] = filter_multi_vmap(
            fn, **_GRID_DIMS, scan="b1", vmap="b2"
        )
    for fn in progress(list(programs.values()), desc="bandwidth"):
        thunks.append(lambda c=compiled(fn, xs): c(xs))
    times = time_thunks(thunks, max(cfg.repeats, 7), cfg.cell_budget_s)
    by = dict(zip(["numpy copyto", *programs], times))
    rows = []
    for name, t in by.items():
        function, _, method = name.partition("|")
        if not method:
            function, method = "(copy)", name
        rows.append(
            dict(
                function=function,
                method=method,
                median_ms=1e3 * median(t),
                bandwidth_gbs=2 * nbytes / median(t) / 1e9,
                frac_memcpy=paired_ratio(by["numpy copyto"], t),
                frac_xla_copy=paired_ratio(by["XLA copy"], t),
            )
        )
    return dict(rows=rows, shape=(b1, b2, L), nbytes=nbytes)


# ----------------------------------------------------------------------------------
# Output: CSV, Markdown, plots.


def write_csv(path: str, rows: list[dict]) -> None:
    if not rows:
        return
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _table(header: list[str], rows: list[list], align: str | None = None) -> str:
    align = align or "l" + "r" * (len(header) - 1)
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(rule) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _group_pairs(pairs: list[dict]) -> dict[tuple[str, str], list[float]]:
    out: dict[tuple[str, str], list[float]] = {}
    for p in pairs:
        out.setdefault((p["a"], p["b"]), []).append(p["ratio"])
    return out


def grid_markdown(grid: dict) -> str:
    rows = grid["rows"]
    families = list(dict.fromkeys(r["family"] for r in rows))
    cells = list(dict.fromkeys((r["b1"], r["b2"], r["L"]) for r in rows))
    by = {(r["b1"], r["b2"], r["L"], r["family"]): r for r in rows}
    head = ["b1", "b2", "L"]
    out = ["## Grid: `sin(x**2 + 1)` over `(b1, b2, L)`, mapped over `b1, b2`", ""]
    out.append(
        "`lax.map(bs=k)` and `ours chunk k` use `k = b1 // 8` (so the remainder "
        "path runs too). Ratios are medians of per-round ratios against `vmap`, "
        "timed side by side in the same rounds; below 1 is faster than `vmap`."
    )
    out.append("")
    tables = [
        ("Time ratio against full `vmap` (paired)", "ratio_vs_vmap", ".2f"),
        ("Median time (ms)", "median_ms", ".3g"),
        ("Compile time (s), lower + compile, timed apart", "compile_s", ".3f"),
    ]
    for k, (title, key, fmt) in enumerate(tables):
        out += ([] if k == 0 else [""]) + [f"### {title}", ""]
        rows = [
            list(c) + [format(by[c + (fam,)][key], fmt) for fam in families]
            for c in cells
        ]
        out.append(_table(head + families, rows))
    out += ["", "### Summary", ""]
    for fam in families[1:]:
        ratios = [by[c + (fam,)]["ratio_vs_vmap"] for c in cells]
        out.append(
            f"- `{fam}` / `vmap`: median {statistics.median(ratios):.2f}, range "
            f"{min(ratios):.2f} to {max(ratios):.2f} over {len(cells)} cells."
        )
    out += ["", "Paired ratios, each pair timed in the same rounds:", ""]
    for (a, b), ratios in _group_pairs(grid["pairs"]).items():
        faster = sum(r < 1 for r in ratios)
        out.append(
            f"- `{a}` / `{b}`: median {statistics.median(ratios):.2f}, range "
            f"{min(ratios):.2f} to {max(ratios):.2f}; `{a}` faster in {faster} of "
            f"{len(ratios)} cells."
        )
    if not grid["auto"]:
        out.append(
            '- `ours auto`: not measured, this `eqx_multimap` has no `plan="auto"`.'
        )
    if grid["skipped"]:
        cells_s = ", ".join(f"{b1}x{b2}x{L}" for b1, b2, L in grid["skipped"])
        out.append(
            f"- Skipped (more than `--max-elements` elements; in + out + the "
            f"transposed copy of `vmap(scan)` is 12 bytes per element and a call "
            f"takes seconds on 2 cores): {cells_s}."
        )
    return "\n".join(out)


def memory_markdown(mem: dict) -> str:
    rows = mem["rows"]
    out = [
        "## Memory: a big per-element intermediate",
        "",
        f"`n = {mem['n']}` elements, `M = K = {mem['m']}`: `exp(outer(x, y))` is "
        f"`{_bytes(mem['intermediate'])}` when all `n` are vmapped at once. Temp "
        "bytes are from `compiled.memory_analysis()`; peak RSS is that of a fresh "
        "subprocess per row (`VmHWM`: JAX, the inputs and the compiled program "
        "included), and 'run adds' is how far the one call raised it above the RSS "
        "before the call. Times are side by side in one process.",
        "",
    ]
    if any(r["strategy"] == "auto" for r in rows):
        out += [
            f'`auto` is `plan="auto"` with `memory_budget` = {_bytes(mem["budget"])}.',
            "",
        ]
    out.append(
        _table(
            [
                "workload",
                "strategy",
                "temp bytes",
                "peak RSS",
                "run adds",
                "median (ms)",
                "ratio vs vmap",
            ],
            [
                [
                    f"`{r['workload']}`",
                    r["strategy"],
                    _bytes(r["temp_bytes"]),
                    _bytes(r["peak_rss"]),
                    _bytes(r["run_peak_rss"] - r["rss_before_run"]),
                    f"{r['median_ms']:.3g}",
                    f"{r['ratio_vs_vmap']:.2f}",
                ]
                for r in rows
            ],
            "llrrrrr",
        )
    )
    return "\n".join(out)


def bandwidth_markdown(bw: dict) -> str:
    b1, b2, L = bw["shape"]
    out = [
        "## Bandwidth: elementwise maps against memcpy",
        "",
        f"`xs` of shape `({b1}, {b2}, {L})` float32 ({_bytes(bw['nbytes'])}); every "
        "row reads and writes that many bytes, so GB/s counts 2 x that. The two "
        "copies are the references: `numpy copyto` into a preallocated, touched "
        "buffer (the memory bandwidth), and a jitted `x.copy()` (which, like every "
        "jitted function, writes a freshly allocated output). Fractions are paired "
        "time ratios against them, all rows timed side by side.",
        "",
    ]
    out.append(
        _table(
            ["function", "method", "median (ms)", "GB/s", "of memcpy", "of XLA copy"],
            [
                [
                    r["function"]
                    if r["function"] == "(copy)"
                    else f"`{r['function']}`",
                    r["method"],
                    f"{r['median_ms']:.3g}",
                    f"{r['bandwidth_gbs']:.2f}",
                    f"{100 * r['frac_memcpy']:.0f}%",
                    f"{100 * r['frac_xla_copy']:.0f}%",
                ]
                for r in bw["rows"]
            ],
            "llrrrr",
        )
    )
    return "\n".join(out)


def _pyplot():
    """`matplotlib.pyplot` on the Agg backend (files only, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_grid(grid: dict, path: str) -> None:
    plt = _pyplot()

    rows = grid["rows"]
    l_sizes = sorted({r["L"] for r in rows})
    families = list(dict.fromkeys(r["family"] for r in rows))
    fig, axes = plt.subplots(
        2, len(l_sizes), figsize=(5 * len(l_sizes), 8), squeeze=False
    )
    for j, L in enumerate(l_sizes):
        sub = [r for r in rows if r["L"] == L]
        cells = list(dict.fromkeys((r["b1"], r["b2"]) for r in sub))
        labels = [f"{b1}x{b2}" for b1, b2 in cells]
        for fam in families:
            by = {(r["b1"], r["b2"]): r for r in sub if r["family"] == fam}
            style = "--" if fam.startswith("ours") else "-"
            axes[0][j].plot(
                labels,
                [by[c]["median_ms"] for c in cells],
                style,
                marker="o",
                label=fam,
            )
            axes[1][j].plot(
                labels, [by[c]["ratio_vs_vmap"] for c in cells], style, marker="o"
            )
        axes[0][j].set_yscale("log")
        axes[0][j].set_title(f"L = {L}")
        axes[0][j].set_ylabel("median time (ms)")
        axes[1][j].axhline(1.0, color="grey", lw=0.8)
        axes[1][j].set_ylabel("time / full vmap (paired)")
        axes[1][j].set_xlabel("b1 x b2")
        for ax in axes[:, j]:
            ax.tick_params(axis="x", rotation=45)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("sin(x**2 + 1) over (b1, b2, L), mapped over b1 and b2")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_memory(mem: dict, path: str) -> None:
    plt = _pyplot()

    rows = mem["rows"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    by = {(r["workload"], r["strategy"]): r for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(strategies)
    for i, s in enumerate(strategies):
        xs = [
            w + (i - (len(strategies) - 1) / 2) * width for w in range(len(workloads))
        ]
        temps = [by[(w, s)]["temp_bytes"] for w in workloads]
        bars = axes[0].bar(xs, [max(t, 1) / MiB for t in temps], width, label=s)
        axes[0].bar_label(bars, [_bytes(t) for t in temps], fontsize=7)
        axes[1].bar(xs, [by[(w, s)]["peak_rss"] / MiB for w in workloads], width)
    for ax, title in zip(axes, ["compiled temp bytes (MiB)", "peak RSS (MiB)"]):
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_title(title)
    axes[0].set_yscale("log")
    axes[0].axhline(mem["intermediate"] / MiB, color="grey", ls=":", lw=1)
    axes[0].legend()
    fig.suptitle(f"big intermediate: n={mem['n']}, M=K={mem['m']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_bandwidth(bw: dict, path: str) -> None:
    plt = _pyplot()

    rows = bw["rows"]
    labels = [f"{r['function']}\n{r['method']}" for r in rows]
    colors = ["C1" if r["function"] == "(copy)" else "C0" for r in rows]
    fig, ax = plt.subplots(figsize=(11, 4))
    ax.bar(range(len(rows)), [r["bandwidth_gbs"] for r in rows], color=colors)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("GB/s (read + write)")
    b1, b2, L = bw["shape"]
    ax.set_title(f"elementwise over ({b1}, {b2}, {L}) float32; orange: copies")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Config:
    b_sizes: tuple[int, ...]
    l_sizes: tuple[int, ...]
    max_elements: int
    repeats: int
    cell_budget_s: float
    mem_n: int
    mem_m: int
    chunk: int
    budget: int
    bw_shape: tuple[int, int, int]


def make_config(args) -> Config:
    if args.quick:
        cfg = Config(
            b_sizes=(100, 1000),
            l_sizes=(1, 100),
            max_elements=10**7,
            repeats=9,
            cell_budget_s=0.5,
            mem_n=64,
            mem_m=1024,
            chunk=8,
            budget=64 * MiB,
            bw_shape=(1000, 1000, 16),
        )
    else:
        cfg = Config(
            b_sizes=(100, 1000, 3000),
            l_sizes=(1, 10, 100),
            max_elements=3 * 10**8,
            repeats=11,
            cell_budget_s=15.0,
            mem_n=256,
            mem_m=1024,
            chunk=16,
            budget=64 * MiB,
            bw_shape=(1000, 1000, 64),
        )
    if args.max_elements is not None:
        cfg.max_elements = int(args.max_elements)
    if args.repeats is not None:
        cfg.repeats = args.repeats
    return cfg


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="reduced sizes (< 2 min)")
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)}",
    )
    parser.add_argument("--out", default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--repeats", type=int, default=None, help="max timed rounds")
    parser.add_argument(
        "--max-elements",
        type=float,
        default=None,
        help="skip grid cells with more elements (default 3e8; 1e7 with --quick)",
    )
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        print(json.dumps(memory_child(json.loads(args.memory_child))))
        return 0

    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections).difference(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    cfg = make_config(args)
    os.makedirs(args.out, exist_ok=True)

    from tqdm import tqdm

    def progress(items, desc):
        return tqdm(items, desc=desc, disable=args.no_progress, leave=False)

    header = (
        f"jax {jax.__version__} on {jax.devices()[0].platform} "
        f"({os.cpu_count()} cores, {platform.machine()}), "
        f"{'quick' if args.quick else 'full'} mode, up to {cfg.repeats} rounds"
    )
    report = ["# `eqx_multimap` benchmark results", "", header, ""]
    t_start = time.perf_counter()
    runners = {
        "grid": (run_grid, grid_markdown, plot_grid),
        "memory": (run_memory, memory_markdown, plot_memory),
        "bandwidth": (run_bandwidth, bandwidth_markdown, plot_bandwidth),
    }
    print(header, flush=True)
    for section in sections:
        run, markdown, plot = runners[section]
        t0 = time.perf_counter()
        result = run(cfg, progress)
        write_csv(os.path.join(args.out, f"{section}.csv"), result["rows"])
        if "pairs" in result:
            write_csv(os.path.join(args.out, f"{section}_pairs.csv"), result["pairs"])
        text = markdown(result)
        if not args.no_plots:
            plot(result, os.path.join(args.out, f"{section}.png"))
            text += f"\n\n![{section}]({section}.png)"
        report += [text, ""]
        print()
        print(text, flush=True)
        print(f"\n({section}: {time.perf_counter() - t0:.0f} s)", flush=True)
    report.append(f"Total: {time.perf_counter() - t_start:.0f} s.")
    with open(os.path.join(args.out, "results.md"), "w") as fh:
        fh.write("\n".join(report) + "\n")
    print(
        f"\nWrote {args.out}/results.md, *.csv" + ("" if args.no_plots else ", *.png")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
