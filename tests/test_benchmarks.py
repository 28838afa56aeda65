"""`benchmarks/run.py`: the programs it compares compute the same thing, and its
sections, report, figures, progress and summary have the structure they promise (on
tiny sizes; the timings themselves are never tested)."""

import csv
import itertools as it
import os
import re
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from .helpers import load_benchmark


run = load_benchmark("run")
report = run.report
timing = load_benchmark("_timing")


def _tiny_config(**changes):
    cfg = run.Config(
        b_sizes=(4, 9),
        l_sizes=(1, 2),
        max_elements=9 * 9 * 1,
        repeats=3,
        cell_budget_s=0.0,
        mem_n=6,
        mem_m=8,
        chunk=4,
        budget=2**20,
        bw_shape=(4, 3, 2),
    )
    for k, v in changes.items():
        setattr(cfg, k, v)
    return cfg


@pytest.mark.parametrize("b1", [1, 4, 9])
def test_grid_methods_match_a_loop(b1):
    b2, L = 3, 2
    xs = jax.random.normal(jax.random.key(0), (b1, b2, L), jnp.float32)
    x = np.asarray(xs)
    ref = np.stack(
        [np.stack([np.sin(x[i, j] ** 2 + 1) for j in range(b2)]) for i in range(b1)]
    )
    methods = run.grid_methods(b1, run.auto_plan_kwargs())
    assert list(methods)[0] == "vmap"  # the baseline of every ratio
    assert {"scan(vmap)", "vmap(scan)", "ours vmap", "ours scan(vmap)"} <= set(methods)
    for name, fn in methods.items():
        out = jax.jit(fn)(xs)
        assert out.shape == (b1, b2, L) and out.dtype == jnp.float32, name
        np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6, err_msg=name)


def _memory_reference(workload, inputs):
    arrays = [np.asarray(a, np.float64) for a in inputs]
    outs = []
    for i in range(arrays[0].shape[0]):
        x, y = arrays[0][i], arrays[1][i]
        w = np.exp(np.outer(x, y))
        if workload == "sumexp":
            outs.append(np.sum(w))
        else:
            outs.append((w @ arrays[2][i]) / np.sum(w, axis=1))
    return np.stack(outs)


@pytest.mark.parametrize(
    "workload, strategy",
    list(it.product(run.MEMORY_WORKLOADS, ["vmap", "scan", "chunk"])),
)
def test_memory_programs_match_a_loop(workload, strategy):
    inputs = run.memory_inputs(workload, 6, 8)
    out = jax.jit(run.memory_program(workload, strategy, 4, 2**20))(*inputs)
    ref = _memory_reference(workload, inputs)
    assert out.shape == ref.shape and out.dtype == jnp.float32
    np.testing.assert_allclose(out, ref, rtol=1e-5)


def test_memory_child_sees_the_vmapped_intermediate():
    spec = dict(workload="softmax_matvec", n=32, m=64, chunk=4, budget=2**20)
    vmapped = run.memory_child(dict(spec, strategy="vmap"))
    scanned = run.memory_child(dict(spec, strategy="scan"))
    intermediate = 32 * 64 * 64 * 4  # all n intermediates at once
    assert vmapped["temp_bytes"] >= intermediate
    assert scanned["temp_bytes"] < intermediate // 8
    for r in (vmapped, scanned):
        assert 0 < r["rss_before_run"] <= r["peak_rss"]


def test_memory_program_rejects_an_unknown_strategy():
    with pytest.raises(ValueError, match="Unrecognised memory strategy 'bogus'"):
        run.memory_program("sumexp", "bogus", 4, 2**20)


def test_timing_helpers():
    assert timing.paired_ratios([2.0, 6.0], [1.0, 2.0]) == [2.0, 3.0]
    assert timing.quartiles([5.0]) == (5.0, 5.0, 5.0)
    assert timing.quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 3.0, 4.0)


def test_fresh_compiles_a_separate_executable_of_the_same_program():
    xs = jnp.ones((3, 4, 2), jnp.float32)
    a = timing.compiled(run.hand_vmap, xs)
    again = timing.compiled(run.hand_vmap, xs)
    twin = timing.compiled(timing.fresh(run.hand_vmap), xs)
    # `jax.jit` hands back its cached executable for the same function ...
    assert again.runtime_executable() is a.runtime_executable()
    # ... but not for a fresh one, whose optimised HLO is the same.
    assert twin.runtime_executable() is not a.runtime_executable()
    assert timing.normalised_hlo(twin) == timing.normalised_hlo(a)


@pytest.fixture(scope="module")
def grid():
    """Three measured cells and one skipped: 81 elements, over `max_elements`."""
    return run.run_grid(_tiny_config(l_sizes=(1,), max_elements=9 * 4))


def test_grid_section_rows_pairs_and_skipped_cells(grid, tmp_path):
    result = grid
    assert result["cells"] == list(it.product((4, 9), (4, 9), (1,)))
    assert result["skipped"] == [(9, 9, 1)]
    assert result["twin_identical"]
    skip = "skipped: 81 elements > max 36"
    for r in result["rows"]:
        if (r["b1"], r["b2"], r["L"]) == (9, 9, 1):
            assert r["status"] == skip and r["median_ms"] is None
            continue
        assert r["status"] == "ok"
        if r["method"] == "vmap":
            assert r["ratio_vs_vmap"] == 1.0
        assert r["rounds"] >= 3 and r["median_ms"] > 0 and r["compile_s"] > 0
        assert r["q25_ms"] <= r["median_ms"] <= r["q75_ms"]
    questions = {(p["question"], p["a"], p["b"]) for p in result["pairs"]}
    assert set(run.GRID_PAIRS) <= questions
    for p in result["pairs"]:
        if p["status"] != "ok":
            assert p["status"] == skip and p["paired"] is None
            continue
        rounds = [float(r) for r in p["round_ratios"].split()]
        assert len(rounds) == p["rounds"] >= 3
        assert p["q25"] <= p["paired"] <= p["q75"]
        assert p["paired"] == pytest.approx(statistics.median(rounds), rel=1e-3)
    path = tmp_path / "grid.csv"
    run.write_csv(str(path), result["rows"])
    with open(path) as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(result["rows"])
    marked = [r for r in rows if (r["b1"], r["b2"], r["L"]) == ("9", "9", "1")]
    assert len(marked) == len(run.grid_methods(9, run.auto_plan_kwargs()))
    assert all(r["status"] == skip and r["median_ms"] == "" for r in marked)


def test_grid_report_has_each_table_and_a_computed_takeaway(grid):
    result = grid
    text = report.grid_markdown(result)
    headings = [
        "### Ours against hand-written",
        "### Map order: `scan(vmap)` against `vmap(scan)`",
        "### Every program against full `vmap`",
        "### Median time (ms)",
        "### Compile time (s), lower + compile, timed apart",
    ]
    if result["auto"]:
        headings.append('### `plan="auto"` against the fastest fixed program')
    sections = re.split(r"\n(?=### )", text)
    for heading in headings:
        (section,) = [s for s in sections if s.startswith(heading + "\n")]
        assert "| b1 | b2 | L |" in section, heading
        assert "\n**Takeaway:** " in section, heading
    assert report.PAIRED in text
    assert "ratio, paired" in text and "ratio, of medians" in text
    assert "Skipped: 9x9x1" in text and "| 9 | 9 | 1 | skipped |" in text
    # The takeaways are computed from the data.
    ours = [
        p["paired"]
        for p in result["pairs"]
        if p["question"] == "ours_vs_hand" and p["status"] == "ok"
    ]
    lo, hi = report.noise_floor(result)
    assert (
        f"ours / hand-written: median {statistics.median(ours):.2f} over "
        f"{len(ours)} cell-strategies ({min(ours):.2f} to {max(ours):.2f})"
    ) in text
    assert f"noise floor ({lo:.2f} to {hi:.2f})" in text


def test_bandwidth_section_and_report():
    result = run.run_bandwidth(_tiny_config())
    by = {(r["function"], r["method"]): r for r in result["rows"]}
    assert by[("(copy)", "numpy copyto")]["frac_memcpy"] == 1.0
    assert by[("(copy)", "XLA copy")]["frac_xla_copy"] == 1.0
    assert ("sin(x**2+1)", "ours scan(vmap)") in by
    assert result["nbytes"] == 4 * 3 * 2 * 4
    text = report.bandwidth_markdown(result)
    assert "of memcpy, paired" in text and "of XLA copy, paired" in text
    assert "\n**Takeaway:** the maps run at " in text


class _Bar:
    """Stands in for `tqdm`: records the total and the steps counted."""

    def __init__(self, desc, total):
        self.desc, self.total, self.n, self.closed = desc, total, 0, False

    def set_postfix_str(self, what):
        self.what = what

    def update(self):
        self.n += 1

    def close(self):
        self.closed = True


def _tiny_main(monkeypatch, tmp_path, *extra):
    """`run.main` on one measured grid cell and one skipped, tiny memory and
    bandwidth sizes, memory children run in this process; returns the bars."""
    cfg = _tiny_config(b_sizes=(4,), max_elements=4 * 4 * 1, mem_m=8, workers=1)
    bars = []

    def progress(desc, total):
        bars.append(_Bar(desc, total))
        return run.Steps(bars[-1])

    monkeypatch.setattr(run, "make_config", lambda args: cfg)
    monkeypatch.setattr(run, "tqdm_progress", progress)
    monkeypatch.setattr(run, "_run_memory_child", run.memory_child)
    assert run.main(["--out", str(tmp_path), *extra]) == 0
    return bars


def test_main_writes_the_report_figures_and_summary(monkeypatch, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    bars = _tiny_main(monkeypatch, tmp_path)
    out = capsys.readouterr().out
    # Progress: one bar per section, every step counted, then closed.
    assert [b.desc for b in bars] == list(run.SECTIONS)
    for b in bars:
        assert b.n == b.total and b.closed, b.desc
    for name in ("ours_vs_hand.png", "order.png", "memory.png"):
        assert os.path.getsize(tmp_path / name) > 0, name
    for name in ("grid.png", "bandwidth.png"):
        assert not (tmp_path / name).exists()
    for name in ("grid.csv", "grid_pairs.csv", "memory.csv", "bandwidth.csv"):
        assert (tmp_path / name).exists(), name
    text = (tmp_path / "results.md").read_text()
    assert text.index("## Summary") < text.index("## Grid") < text.index("## Memory")
    for image in ("ours_vs_hand.png", "order.png", "memory.png"):
        assert f"]({image})" in text
    assert "| `sumexp` | vmap | 0 B |" in text  # XLA fuses it: no temp memory
    assert "time / vmap, paired" in text and "time / vmap, of medians" in text
    assert text.count("\n**Takeaway:** ") >= 7
    # The terminal summary: the headline rows, then where the report is.
    for row in (
        "ours / hand-written, vmap",
        "noise floor: identical programs",
        "scan(vmap) / vmap(scan)",
        "memory softmax_matvec: scan / vmap time",
    ):
        assert re.search(rf"^{re.escape(row)} +\d+\.\d\d  ", out, re.M), row
    assert f"Report: {tmp_path}/results.md" in out


def test_main_no_plots_writes_no_figures(monkeypatch, tmp_path):
    _tiny_main(monkeypatch, tmp_path, "--no-plots", "--sections", "bandwidth")
    assert not list(tmp_path.glob("*.png"))
    assert "## Bandwidth" in (tmp_path / "results.md").read_text()


def test_main_rejects_an_unknown_section(capsys):
    with pytest.raises(SystemExit):
        run.main(["--sections", "grid,bogus"])
    assert "unknown sections ['bogus']; choose from" in capsys.readouterr().err


#
# `benchmarks/reduce.py`
#

reduce_bench = load_benchmark("reduce")


def test_reduce_programs_compute_the_same_sum():
    args = reduce_bench.inputs(5, 4, 4)
    x, y, v = (np.asarray(a, np.float64) for a in args)
    ref = sum(
        (np.exp(np.outer(x[t], y[t])) / np.exp(np.outer(x[t], y[t])).sum(1)[:, None])
        @ v
        for t in range(5)
    )
    for name, fn in reduce_bench.make_programs(2).items():
        out = jax.jit(fn)(*args)
        assert out.shape == (4,) and out.dtype == jnp.float32, name
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6, err_msg=name)


def test_reduce_benchmark_structure(capsys):
    cfg = reduce_bench.Config(
        ts=(8, 16), k=4, chunk=4, max_rounds=3, min_rounds=3, cell_budget_s=0.0
    )
    assert reduce_bench.main([], cfg=cfg) == 0
    out = capsys.readouterr().out
    assert "## Compiled temporaries and median times" in out
    assert "## Paired ratios, median (IQR)" in out
    summary = out.split("Summary (Total: ")[1].splitlines()[2:]
    names = ("reduced scan", "reduced chunk", "materialise", "hand scan")
    for name in names:
        assert any(line.startswith(f"temp bytes, {name}: ") for line in summary), name
    for pair in (
        "reduced scan / hand scan",
        "reduced chunk / hand scan",
        "reduced scan / materialise",
        "hand twin / hand scan",
    ):
        line = next(s for s in summary if s.startswith(f"time, {pair} "))
        assert re.search(r"T=8: \d+\.\d\d, T=16: \d+\.\d\d$", line), line
    assert re.search(r"identical to hand scan's: \d of 2 T", summary[-1])
    # One row per T in each table: five programs' temporaries and times, then the
    # four ratios and the HLO check.
    rows = [line for line in out.splitlines() if re.match(r"\| (8|16) \|", line)]
    assert len(rows) == 4
    assert [len(r.split("|")) - 2 for r in rows] == [12, 12, 6, 6]
