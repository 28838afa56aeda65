"""The origin benchmark, reproduced properly: map orders, memory and bandwidth.

Three sections, each written to `benchmarks/results/` as CSV, with one Markdown
report (`results.md`, headline summary first) and one figure per question:

- `grid`: `f(x) = sin(x**2 + 1)` over `xs` of shape `(b1, b2, L)`, mapped over `b1`
    and `b2`, for `b1, b2` in {100, 1000, 3000} and `L` in {1, 10, 100}. Compared:
    hand-written `vmap(vmap)`, `scan(vmap)`, `vmap(scan)`, `lax.map(batch_size=k)`,
    and `filter_multi_vmap` with the same strategies (plus `plan="auto"` when the
    installed `eqx_multimap` has a planner), and a second, separately compiled copy
    of the hand-written `vmap`: the noise floor. Every program is compiled first
    (compile time reported apart), run once as warm-up, then all are timed side by
    side, interleaved, with `jax.block_until_ready`. Figures: `ours_vs_hand.png`
    and `order.png`.
- `memory`: per-element workloads with a big intermediate (`exp(outer(x, y))`, 1 GiB
    when fully vmapped): the compiled temp bytes
    (`compiled.memory_analysis().temp_size_in_bytes`), the peak RSS of a fresh
    subprocess per strategy, and the time. Figure: `memory.png`.
- `bandwidth`: elementwise maps as a fraction of a measured memcpy bandwidth (bytes
    moved = bytes read + bytes written).

Ratios are paired: the median of the per-round time ratios of two programs timed in
the same rounds, which can differ from the ratio of their median times. Only ratios
measured side by side in one run are compared; absolute times depend on the machine
and its load, and nothing here passes or fails on them.

    python benchmarks/run.py --quick     # reduced sizes, about a minute
    python benchmarks/run.py             # the full grid (10-15 minutes on 2 cores)
    python benchmarks/run.py --sections grid --max-elements 1e9
"""

import argparse
import concurrent.futures as cf
import contextlib
import csv
import dataclasses
import itertools as it
import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Iterator


sys.path.insert(0, os.path.dirname(__file__))

import _report as report
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from _timing import (
    add_sections,
    chosen_sections,
    compiled,
    fresh,
    median,
    normalised_hlo,
    paired_ratio,
    paired_ratios,
    quartiles,
    time_side_by_side,
)
from eqx_multimap import filter_multi_vmap


try:
    from eqx_multimap import explain
except ImportError:  # an `eqx_multimap` without the planner
    explain = None

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "results")
SECTIONS = ("grid", "memory", "bandwidth")
MiB = 2**20


# ----------------------------------------------------------------------------------
# Progress: one bar per section, one step per compile, timing or subprocess.


class Steps:
    """The progress of one section: a `tqdm` bar, or nothing when `bar` is `None`."""

    def __init__(self, bar=None):
        self.bar = bar

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        """Show `what` while it runs; count it as one step when it is done."""
        if self.bar is not None:
            self.bar.set_postfix_str(what)
        yield
        if self.bar is not None:
            self.bar.update()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str("done")
            self.bar.close()


def no_progress(desc: str, total: int) -> Steps:
    del desc, total
    return Steps()


def tqdm_progress(desc: str, total: int) -> Steps:
    from tqdm import tqdm

    return Steps(tqdm(total=total, desc=f"{desc:9s}", unit="step", leave=True))


Progress = Callable[[str, int], Steps]


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


_GRID_DIMS = dict(in_dims="b1 b2 L", out_dims="b1 b2 L", core="L")


def normal_input(seed: int, shape: tuple[int, ...]) -> jax.Array:
    """Standard normal float32 inputs, drawn by numpy: `jax.random` would compile a
    generator for every new shape, which costs more than a small grid cell's run."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32))


TWIN = "vmap (twin)"


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
    """The programs compared on one grid cell, by column name (baseline first).

    `vmap (twin)` is the hand-written `vmap` again, compiled separately: the pair
    measures the noise floor. It sits between the hand-written programs and ours, so
    that it and `vmap` follow different programs in every round, as the programs of
    the other pairs do.
    """
    k = max(1, b1 // 8)
    methods = {
        "vmap": hand_vmap,
        "scan(vmap)": hand_scan_vmap,
        "vmap(scan)": hand_vmap_scan,
        f"lax.map(bs={k})": hand_lax_map(k),
        TWIN: fresh(hand_vmap),
        "ours vmap": filter_multi_vmap(f, **_GRID_DIMS, vmap="b1 b2"),
        "ours scan(vmap)": filter_multi_vmap(f, **_GRID_DIMS, scan="b1", vmap="b2"),
        f"ours chunk {k}": filter_multi_vmap(
            f, **_GRID_DIMS, scan={"b1": k}, vmap="b2"
        ),
    }
    if auto is not None:
        # No strategy given: the planner chooses how to map the dims.
        methods["ours auto"] = filter_multi_vmap(f, **_GRID_DIMS, **auto)
    return methods


def method_family(name: str) -> str:
    """Column name without its chunk size, so cells with different `k` line up."""
    if name.startswith("lax.map"):
        return "lax.map(bs=k)"
    if name.startswith("ours chunk"):
        return "ours chunk k"
    return name


# The comparisons that answer the grid's questions: (question, a, b), ratios a / b.
GRID_PAIRS = (
    ("noise", TWIN, "vmap"),
    ("ours_vs_hand", "ours vmap", "vmap"),
    ("ours_vs_hand", "ours scan(vmap)", "scan(vmap)"),
    ("ours_vs_hand", "ours chunk k", "lax.map(bs=k)"),
    ("order", "scan(vmap)", "vmap(scan)"),
)


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


def compile_programs(
    programs: dict[str, Callable], args: tuple, steps: Steps, where: str = ""
) -> tuple[dict, dict[str, float]]:
    """Compile each program, one progress step each; also the seconds each took."""
    comp, compile_s = {}, {}
    for name, fn in programs.items():
        with steps.step(f"compile {name}{where}"):
            t0 = time.perf_counter()
            comp[name] = compiled(fn, *args)
            compile_s[name] = time.perf_counter() - t0
    return comp, compile_s


def time_compiled(
    comp: dict,
    compile_s: dict[str, float],
    args: tuple,
    repeats: int,
    budget_s: float,
    steps: Steps,
    where: str = "",
) -> dict[str, Timed]:
    """Time compiled programs side by side, as one progress step."""
    thunks = [lambda c=c: c(*args) for c in comp.values()]
    with steps.step(f"time {len(thunks)} programs{where}"):
        times = time_thunks(thunks, repeats, budget_s)
    return {
        name: Timed(compile_s[name], t, paired_ratio(t, times[0]))
        for name, t in zip(comp, times)
    }


def time_programs(
    programs: dict[str, Callable],
    args: tuple,
    repeats: int,
    budget_s: float,
    steps: Steps | None = None,
    where: str = "",
) -> dict[str, Timed]:
    """Compile each program (timed apart), then time them all side by side."""
    steps = steps or Steps()
    comp, compile_s = compile_programs(programs, args, steps, where)
    return time_compiled(comp, compile_s, args, repeats, budget_s, steps, where)


def _skip_reason(elements: int, max_elements: int) -> str:
    return f"skipped: {elements:,} elements > max {max_elements:,}"


def pair_row(cell, question: str, a: str, b: str, ta=None, tb=None, status="ok"):
    """One paired comparison `a / b` on one cell; `ta`, `tb` their per-round times.

    `paired` is the median of the per-round ratios, `q25`/`q75` their quartiles, and
    `ratio_of_medians` is `median(ta) / median(tb)`, which can differ from it.
    """
    b1, b2, L = cell
    row = dict(b1=b1, b2=b2, L=L, question=question, a=a, b=b, status=status)
    row.update(
        paired=None,
        q25=None,
        q75=None,
        ratio_of_medians=None,
        rounds=None,
        round_ratios=None,
        note="",
    )
    if ta is not None and tb is not None:
        ratios = paired_ratios(ta, tb)
        q25, q50, q75 = quartiles(ratios)
        row.update(
            paired=q50,
            q25=q25,
            q75=q75,
            ratio_of_medians=median(ta) / median(tb),
            rounds=len(ratios),
            round_ratios=" ".join(f"{r:.4g}" for r in ratios),
        )
    return row


def grid_pairs(cell, timed: dict[str, Timed], auto_nest: str = "") -> list[dict]:
    """The comparisons that answer the benchmark's questions, as paired ratios."""
    family = {method_family(name): t.times for name, t in timed.items()}
    out = [pair_row(cell, q, a, b, family[a], family[b]) for q, a, b in GRID_PAIRS]
    if "ours auto" in family:
        fixed = {k: v for k, v in family.items() if k not in ("ours auto", TWIN)}
        best = min(fixed, key=lambda k: median(fixed[k]))
        row = pair_row(
            cell, "auto", "ours auto", best, family["ours auto"], fixed[best]
        )
        row["note"] = auto_nest
        out.append(row)
    return out


def _auto_nest(fn: Callable, xs) -> str:
    """The nest that `plan="auto"` chose for `xs`, as `eqx_multimap.explain` says."""
    if explain is None:
        return ""
    plan = explain(fn, xs)
    return plan.chosen.nest(dict(plan.sizes)).removesuffix(" -> body")


def _grid_row(cell, name: str, status: str, t: Timed | None = None) -> dict:
    b1, b2, L = cell
    row = dict(
        b1=b1,
        b2=b2,
        L=L,
        elements=b1 * b2 * L,
        method=name,
        family=method_family(name),
        status=status,
        compile_s=None,
        median_ms=None,
        q25_ms=None,
        q75_ms=None,
        min_ms=None,
        ratio_vs_vmap=None,
        rounds=None,
    )
    if t is not None:
        q25, q50, q75 = quartiles(t.times)
        row.update(
            compile_s=t.compile_s,
            median_ms=1e3 * q50,
            q25_ms=1e3 * q25,
            q75_ms=1e3 * q75,
            min_ms=1e3 * min(t.times),
            ratio_vs_vmap=t.ratio,
            rounds=len(t.times),
        )
    return row


def run_grid(cfg, progress: Progress = no_progress) -> dict:
    auto = auto_plan_kwargs()
    cells = list(it.product(cfg.b_sizes, cfg.b_sizes, cfg.l_sizes))
    run_cells = [c for c in cells if np.prod(c) <= cfg.max_elements]
    skipped = [c for c in cells if np.prod(c) > cfg.max_elements]
    n_programs = len(grid_methods(1, auto))
    steps = progress("grid", len(run_cells) * (n_programs + 1))
    rows, pairs, twin_identical = [], [], True
    for cell in cells:
        b1, b2, L = cell
        methods = grid_methods(b1, auto)
        if cell in skipped:
            status = _skip_reason(b1 * b2 * L, cfg.max_elements)
            rows += [_grid_row(cell, name, status) for name in methods]
            pairs += [pair_row(cell, q, a, b, status=status) for q, a, b in GRID_PAIRS]
            if auto is not None:
                pairs.append(
                    pair_row(cell, "auto", "ours auto", "fastest other", status=status)
                )
            continue
        xs = normal_input(0, cell)
        where = f" @ {b1}x{b2}x{L}"
        comp, compile_s = compile_programs(methods, (xs,), steps, where)
        twin_identical &= normalised_hlo(comp["vmap"]) == normalised_hlo(comp[TWIN])
        timed = time_compiled(
            comp, compile_s, (xs,), cfg.repeats, cfg.cell_budget_s, steps, where
        )
        rows += [_grid_row(cell, name, "ok", t) for name, t in timed.items()]
        nest = _auto_nest(methods["ours auto"], xs) if auto is not None else ""
        pairs += grid_pairs(cell, timed, nest)
        del xs, comp
    steps.close()
    return dict(
        rows=rows,
        pairs=pairs,
        cells=cells,
        skipped=skipped,
        max_elements=cfg.max_elements,
        auto=auto is not None,
        twin_identical=twin_identical,
    )


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
MEMORY_CORE = {"sumexp": None, "softmax_matvec": "M"}


def memory_inputs(workload: str, n: int, m: int):
    _, in_dims, _ = MEMORY_WORKLOADS[workload]
    rng = np.random.default_rng(1)
    return tuple(
        jnp.asarray(rng.uniform(-1.0, 1.0, (n, m)).astype(np.float32))
        for _ in in_dims  # |x * y| <= 1: exp stays finite
    )


def memory_program(workload: str, strategy: str, chunk: int, budget: int):
    fun, in_dims, out_dims = MEMORY_WORKLOADS[workload]
    kw: dict = dict(in_dims=in_dims, out_dims=out_dims, core=MEMORY_CORE[workload])
    if strategy == "vmap":
        kw["vmap"] = "n"
    elif strategy == "scan":
        kw["scan"] = "n"
    elif strategy == "chunk":
        kw["scan"] = {"n": chunk}
    elif strategy == "auto":
        kw.update(plan="auto", memory_budget=budget)  # the planner maps `n`
    else:
        raise ValueError(
            f"Unrecognised memory strategy {strategy!r}; choose from 'vmap', "
            "'scan', 'chunk' or 'auto'."
        )
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


def _run_memory_child(spec: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--memory-child", json.dumps(spec)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"memory child {spec} failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_memory(cfg, progress: Progress = no_progress) -> dict:
    """Memory of each (workload, strategy) in a fresh subprocess, then the times.

    The subprocesses measure memory only, so up to `cfg.workers` of them run at
    once; the times are measured afterwards, side by side in this process, with
    nothing else running.
    """
    n, m = cfg.mem_n, cfg.mem_m
    strategies = memory_strategies(cfg)
    jobs = list(it.product(MEMORY_WORKLOADS, strategies))
    steps = progress(
        "memory", len(jobs) + len(MEMORY_WORKLOADS) * (len(strategies) + 1)
    )
    specs = [
        dict(workload=w, strategy=s, n=n, m=m, chunk=cfg.chunk, budget=cfg.budget)
        for w, s in jobs
    ]
    results: dict[tuple[str, str], dict] = {}
    with cf.ThreadPoolExecutor(max(1, cfg.workers)) as pool:
        futures = {
            pool.submit(_run_memory_child, spec): job for spec, job in zip(specs, jobs)
        }
        for future in cf.as_completed(futures):
            workload, strategy = futures[future]
            with steps.step(f"subprocess {workload} {strategy}"):
                results[futures[future]] = future.result()
    rows = [dict(workload=w, strategy=s, **results[(w, s)]) for w, s in jobs]
    for workload in MEMORY_WORKLOADS:
        inputs = memory_inputs(workload, n, m)
        programs = {
            s: memory_program(workload, s, cfg.chunk, cfg.budget) for s in strategies
        }
        timed = time_programs(
            programs, inputs, cfg.repeats, cfg.cell_budget_s, steps, f" @ {workload}"
        )
        for row in rows:
            if row["workload"] == workload:
                t = timed[row["strategy"]]
                q25, q50, q75 = quartiles(t.times)
                ratios = paired_ratios(t.times, timed["vmap"].times)
                r25, _, r75 = quartiles(ratios)
                row.update(
                    compile_s=t.compile_s,
                    median_ms=1e3 * q50,
                    q25_ms=1e3 * q25,
                    q75_ms=1e3 * q75,
                    ratio_vs_vmap=t.ratio,
                    ratio_q25=r25,
                    ratio_q75=r75,
                    ratio_of_medians=q50 / median(timed["vmap"].times),
                    rounds=len(t.times),
                )
        del inputs
    steps.close()
    intermediate = n * m * m * 4
    return dict(rows=rows, n=n, m=m, intermediate=intermediate, budget=cfg.budget)


# ----------------------------------------------------------------------------------
# Bandwidth: elementwise maps against a measured memcpy.


def double_plus_one(x):
    return 2 * x + 1


def run_bandwidth(cfg, progress: Progress = no_progress) -> dict:
    """Elementwise maps and two reference copies, all timed side by side.

    References: `numpy copyto` copies into a preallocated, already touched buffer,
    which is the memory bandwidth itself; `XLA copy` is a jitted `x.copy()`, which,
    like every jitted function, writes a freshly allocated output. Every row moves
    the same bytes, so its fraction of a reference is the paired time ratio.
    """
    b1, b2, L = cfg.bw_shape
    xs = normal_input(2, (b1, b2, L))
    nbytes = xs.nbytes
    src = np.asarray(xs)
    dst = np.empty_like(src)
    programs = {"XLA copy": lambda x: x.copy()}
    for fname, fn in (("sin(x**2+1)", f), ("2*x+1", double_plus_one)):
        programs[f"{fname}|jnp (no map)"] = fn
        programs[f"{fname}|ours vmap"] = filter_multi_vmap(
            fn, **_GRID_DIMS, vmap="b1 b2"
        )
        programs[f"{fname}|ours scan(vmap)"] = filter_multi_vmap(
            fn, **_GRID_DIMS, scan="b1", vmap="b2"
        )
    steps = progress("bandwidth", len(programs) + 1)
    comp, _ = compile_programs(programs, (xs,), steps)
    thunks: list[Callable[[], object]] = [lambda: np.copyto(dst, src)]
    thunks += [lambda c=c: c(xs) for c in comp.values()]
    with steps.step(f"time {len(thunks)} programs"):
        times = time_thunks(thunks, max(cfg.repeats, 7), cfg.cell_budget_s)
    steps.close()
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
# Output and the command line.


def write_csv(path: str, rows: list[dict]) -> None:
    """`rows` as CSV with a header; `None` is written as an empty field."""
    if not rows:
        return
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


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
    workers: int = 2  # memory subprocesses run at once


def make_config(args) -> Config:
    if args.quick:
        cfg = Config(
            b_sizes=(100, 1000),
            l_sizes=(1, 10),
            max_elements=2 * 10**6,
            repeats=15,
            cell_budget_s=1.0,
            mem_n=32,
            mem_m=1024,
            chunk=8,
            budget=32 * MiB,
            bw_shape=(1000, 1000, 8),
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


RUNNERS = {
    "grid": (run_grid, report.grid_markdown, report.grid_figures),
    "memory": (run_memory, report.memory_markdown, report.memory_figures),
    "bandwidth": (run_bandwidth, report.bandwidth_markdown, report.no_figures),
}


def write_section(out: str, section: str, result: dict, plots: bool) -> str:
    """Write a section's CSVs and figures into `out`; return its Markdown."""
    _, markdown, figures = RUNNERS[section]
    write_csv(os.path.join(out, f"{section}.csv"), result["rows"])
    if "pairs" in result:
        write_csv(os.path.join(out, f"{section}_pairs.csv"), result["pairs"])
    text = markdown(result)
    if plots:
        for name, title in figures(result, out):
            text += f"\n\n![{title}]({name})"
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="reduced sizes (about a minute)"
    )
    add_sections(parser, SECTIONS)
    parser.add_argument("--out", default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--repeats", type=int, default=None, help="max timed rounds")
    parser.add_argument(
        "--max-elements",
        type=float,
        default=None,
        help="skip grid cells with more elements (default 3e8; 2e6 with --quick)",
    )
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        print(json.dumps(memory_child(json.loads(args.memory_child))))
        return 0

    sections = chosen_sections(parser, args.sections, SECTIONS)
    cfg = make_config(args)
    os.makedirs(args.out, exist_ok=True)
    progress = no_progress if args.no_progress else tqdm_progress

    header = (
        f"jax {jax.__version__} on {jax.devices()[0].platform} "
        f"({os.cpu_count()} cores, {platform.machine()}), "
        f"{'quick' if args.quick else 'full'} mode, up to {cfg.repeats} rounds"
    )
    print(header, flush=True)
    t_start = time.perf_counter()
    results, texts = {}, []
    for section in sections:
        t0 = time.perf_counter()
        results[section] = RUNNERS[section][0](cfg, progress)
        text = write_section(args.out, section, results[section], not args.no_plots)
        texts.append(f"{text}\n\n({section}: {time.perf_counter() - t0:.0f} s)")
    total = f"Total: {time.perf_counter() - t_start:.0f} s."
    summary = report.summary_rows(results)
    blocks = ["# `eqx_multimap` benchmark results", header]
    blocks += [report.summary_markdown(summary), *texts, total]
    path = os.path.join(args.out, "results.md")
    with open(path, "w") as fh:
        fh.write("\n\n".join(blocks) + "\n")
    print(f"\nSummary ({total})\n", flush=True)
    print(report.summary_text(summary))
    print(f"\nReport: {path} (and the CSVs and figures beside it)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
