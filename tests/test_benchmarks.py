"""`benchmarks/run.py`: the programs it compares compute the same thing, and its
sections, report, figures, progress and summary have the structure they promise (on
tiny sizes; the timings themselves are never tested)."""

import contextlib
import csv
import io
import itertools as it
import os
import re
import statistics
import time

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


@pytest.mark.slow
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


# `benchmarks/overhead.py` and `benchmarks/grad.py`, on tiny sizes: the structure of
# what they print, never the timings.
#

overhead = load_benchmark("overhead")
grad = load_benchmark("grad")


def _run_main(module, cfg, argv) -> str:
    """`module.main(argv)` with `make_config` returning `cfg`; what it printed."""
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.setattr(module, "make_config", lambda args: cfg)
        assert module.main(argv) == 0
    return out.getvalue()


def _table_rows(text: str, heading: str) -> list[list[str]]:
    """The body rows of the first Markdown table after `heading`, as cells."""
    section = text[text.index(heading) :]
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


@pytest.fixture(scope="module")
def overhead_out():
    # One cell per body; the heavy body's full vmap materialises 4 * 3 * 4 * 4 = 192
    # elements, over `max_elements`: skipped.
    cfg = overhead.Config(
        cells={"cheap": [(4, 3, 2)], "heavy": [(4, 3, 4)]},
        compile_cells={"cheap": (4, 3, 2), "heavy": (4, 3, 4)},
        max_elements=100,
        max_rounds=3,
        cell_budget_s=0.0,
        compile_repeats=1,
        min_rounds=3,
        compile_nests=("scan(vmap)",),
    )
    return _run_main(overhead, cfg, [])


def test_overhead_main_prints_every_table_and_the_summary(overhead_out):
    text = overhead_out
    for heading in (
        "## cheap body: `sin(x**2 + 1)`",
        "## heavy body: `tanh(outer(x, x)) @ x`",
        "## Compile time (lower + compile of fresh programs, seconds)",
    ):
        assert heading in text
    assert text.index("## cheap body") < text.index("## heavy body")
    assert text.index("## heavy body") < text.index("\nSummary (Total: ")
    cheap = _table_rows(text, "## cheap body")
    assert [r[3] for r in cheap] == ["vmap", "scan(vmap)", "chunk 1"]
    for r in cheap:
        assert r[:3] == ["4", "3", "2"]
        assert float(r[4]) > 0 and float(r[5]) > 0
        for spread in (r[6], r[7]):  # ours / hand and twin / hand, with their IQR
            assert re.fullmatch(r"\d+\.\d\d \(\d+\.\d\d to \d+\.\d\d\)", spread)
        assert int(r[8].rstrip("*")) >= 3
    heavy = _table_rows(text, "## heavy body")
    assert heavy[0][3] == "vmap" and heavy[0][4] == "skipped: 192 elements > max 100"
    compile_rows = _table_rows(text, "## Compile time")
    assert [(r[0], r[4]) for r in compile_rows] == [
        ("cheap", "scan(vmap)"),
        ("heavy", "scan(vmap)"),
    ]
    summary = text[text.index("\nSummary (Total: ") :]
    for pattern in (
        r"grid: cheap scan\(vmap\): ours / hand median \d+\.\d\d, worst \d+\.\d\d "
        r"over 1 cells \(target median <= 1\.05, worst <= 1\.10\)",
        r"grid: cheap chunk: ours / hand median \d+\.\d\d, worst \d+\.\d\d over 1",
        r"grid: heavy scan\(vmap\): ours / hand median \d+\.\d\d, worst \d+\.\d\d "
        r"over 1 cells \(target <= 0\.25; by L: L=4: \d+\.\d\d\)",
        r"grid: heavy vmap: ours / hand no cells over 0 cells",
        r"grid: noise floor \(twin / hand\): median \d+\.\d\d, cells \d+\.\d\d to "
        r"\d+\.\d\d \(IQR \d+\.\d\d to \d+\.\d\d\) over 5 cells; twins' HLO "
        r"identical in 5 of 5",
        r"compile: ours / hand \(lower \+ compile, median of paired repetitions\): "
        r"cheap scan\(vmap\) \d+\.\d\d, heavy scan\(vmap\) \d+\.\d\d \(target <= 1\.3",
    ):
        assert re.search(pattern, summary), pattern


def test_overhead_hlo_check_tells_the_programs_apart(overhead_out):
    # The cheap body is sliced as `lax.scan` slices it: the same optimised HLO. The
    # heavy body's scanned input is sliced inside a conditional: not the same.
    cheap = _table_rows(overhead_out, "## cheap body")
    heavy = _table_rows(overhead_out, "## heavy body")
    assert [r[-1] for r in cheap] == ["yes", "yes", "yes"]
    assert [r[-1] for r in heavy[1:]] == ["no (conditional)", "no (conditional)"]
    assert (
        "grid: HLO identical to hand-written: cheap vmap 1 of 1; cheap scan(vmap) "
        "1 of 1; cheap chunk 1 of 1; heavy vmap 0 of 0; heavy scan(vmap) 0 of 1, "
        "1 with a conditional; heavy chunk 0 of 1, 1 with a conditional"
    ) in overhead_out


def test_overhead_hlo_check_compiles_the_programs_it_names():
    xs = jnp.ones((4, 3, 2), jnp.float32)
    hand = overhead.hand(overhead.cheap, "scan(vmap)", 1)
    # `jax.jit` hands back its cached executable for the same function: refused.
    with pytest.raises(AssertionError, match="must compare two compiled programs"):
        overhead.hlo_note(timing.compiled(hand, xs), timing.compiled(hand, xs))
    # Every wrapper built is new (not equal to the last), so compiled afresh.
    a = overhead.ours(overhead.cheap, "scan(vmap)", 1)
    b = overhead.ours(overhead.cheap, "scan(vmap)", 1)
    assert a != b
    assert timing.distinct(timing.compiled(a, xs), timing.compiled(b, xs))


@pytest.mark.parametrize("nest", ["vmap", "scan(vmap)", "chunk"])
@pytest.mark.parametrize("body", ["cheap", "heavy"])
def test_overhead_programs_compute_the_same(body, nest):
    fn = overhead.BODIES[body][1]
    xs = jax.random.normal(jax.random.key(0), (5, 3, 4), jnp.float32)
    ref = np.stack([np.stack([fn(xs[i, j]) for j in range(3)]) for i in range(5)])
    for make in (overhead.ours, overhead.hand):
        out = jax.jit(make(fn, nest, 2))(xs)
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_overhead_rejects_unknown_nests_and_sections(capsys):
    for make in (overhead.ours, overhead.hand):
        with pytest.raises(
            ValueError,
            match=re.escape(
                "Unrecognised nest 'bogus'; choose from vmap, scan(vmap), chunk."
            ),
        ):
            make(overhead.cheap, "bogus", 2)
    with pytest.raises(SystemExit):
        overhead.main(["--sections", "grid,bogus"])
    assert "unknown sections ['bogus']; choose from grid, compile" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        overhead.main(["--quick", "--full"])
    assert "argument --full: not allowed with argument --quick" in (
        capsys.readouterr().err
    )


def _tiny_grad_config():
    return grad.Config(
        t_sizes=(8, 32),
        t_one=8,
        chunk=3,  # a remainder at both sizes
        transform_nests=("scan",),
        compile_nests=("scan",),
        max_rounds=3,
        budget_s=0.0,
        compile_repeats=1,
        eager_calls=3,
        budget_n=8,
        budget_m=16,
        budget_k=16,
        budget_bytes=4 * 1024,
        min_rounds=3,
        nests=("scan",),  # every compile costs: the chunked nests are tested apart
    )


@pytest.fixture(scope="module")
def grad_main():
    """`grad.main` on one section at a time (a few seconds each), run once each."""
    outs: dict[str, str] = {}

    def run(section: str) -> str:
        if section not in outs:
            argv = ["--sections", section]
            outs[section] = _run_main(grad, _tiny_grad_config(), argv)
        return outs[section]

    return run


GRAD_HEADINGS = [
    "## `jit(grad(lambda x: f(x).sum()))`, ours against hand-written",
    "### Growth of the gradient's time with T (time at the larger T / at the smaller, "
    "paired",
    "## Other transforms at T = 8, ours against hand-written",
    "## Compile time of `jit(grad(...))` at T = 8",
    "## Un-jitted calls: ours (one wrapper, called again and again)",
    "## Memory of the derivative under a budget",
]
SUMMARY = "\nSummary (Total: "


def _in_order(text: str, headings: list[str]) -> bool:
    positions = [text.index(h) for h in headings]
    return positions == sorted(positions)


@pytest.mark.slow
def test_grad_main_prints_the_grad_tables_and_summary(grad_main):
    text = grad_main("grad")
    assert _in_order(text, [*GRAD_HEADINGS[:2], SUMMARY])
    assert "(grad: " in text and "## Other transforms" not in text
    rows = _table_rows(text, GRAD_HEADINGS[0])
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (body, T, "scan") for body in ("elementwise", "heavy") for T in ("8", "32")
    ]
    for r in rows:
        assert float(r[3]) > 0 and float(r[4]) > 0
        for spread in (r[5], r[6]):  # ours / hand and twin / hand, with their IQR
            assert re.fullmatch(r"\d+\.\d\d \(\d+\.\d\d to \d+\.\d\d\)", spread)
        assert (
            int(r[7].rstrip("*")) >= 3 and r[-1] == "yes"
        )  # ours and hand-written agree
    growth = _table_rows(text, GRAD_HEADINGS[1])
    assert [r[:2] for r in growth] == [["elementwise", "scan"], ["heavy", "scan"]]
    spread = r"\d+\.\d\d \(\d+\.\d\d to \d+\.\d\d\)"  # paired, with the IQR
    assert all(re.fullmatch(spread, c) for r in growth for c in r[2:])
    summary = text[text.index(SUMMARY) :]
    for pattern in (
        r"grad: ours / hand, median over T \(range\): elementwise scan \d+\.\d\d "
        r".*; noise floor \d+\.\d\d \(IQR .*\); same HLO: elementwise 2 of 2, heavy "
        r"0 of 2; values agree in 4 of 4",
        r"grad growth T -> 4T \(paired time ratio; linear ~4\): elementwise scan "
        r"\d+\.\d \(hand \d+\.\d\)",
    ):
        assert re.search(pattern, summary), pattern


@pytest.mark.slow
def test_grad_main_prints_the_transforms_section(grad_main):
    text = grad_main("transforms")
    assert _in_order(text, [GRAD_HEADINGS[2], SUMMARY])
    transforms = _table_rows(text, GRAD_HEADINGS[2])
    assert [(r[0], r[1], r[2]) for r in transforms] == [
        (body, "scan", t)
        for body in ("elementwise", "heavy")
        for t in ("forward", "value_and_grad", "vjp", "jvp")
    ]
    assert all(r[-1] == "yes" for r in transforms)  # ours and hand-written agree
    assert re.search(
        r"transforms at T=8: ours / hand, median over bodies and nests \(range\): "
        r"forward \d+\.\d\d \(\d+\.\d\d to \d+\.\d\d\); value_and_grad .*; vjp .*; "
        r"jvp \d+\.\d\d",
        text[text.index(SUMMARY) :],
    )


@pytest.mark.slow
def test_grad_main_prints_the_compile_section(grad_main):
    text = grad_main("compile")
    assert _in_order(text, [GRAD_HEADINGS[3], SUMMARY])
    rows = _table_rows(text, GRAD_HEADINGS[3])
    assert [(r[0], r[1], r[-1]) for r in rows] == [
        ("elementwise", "scan", "1"),
        ("heavy", "scan", "1"),
    ]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)
    assert re.search(
        r"compile grad: ours / hand \(lower \+ compile, median of paired "
        r"repetitions\): elementwise scan \d+\.\d\d, heavy scan \d+\.\d\d "
        r"\(target <= 1\.3\)",
        text[text.index(SUMMARY) :],
    )


@pytest.mark.slow
def test_grad_hlo_check_tells_the_programs_apart(grad_main):
    # The elementwise body is sliced as `lax.scan` slices it: the same optimised HLO,
    # for the gradient too. The heavy body's scans slice inside a conditional.
    rows = _table_rows(grad_main("grad"), GRAD_HEADINGS[0])
    for r in rows:
        expected = "yes" if r[0] == "elementwise" else "no (conditional)"
        assert r[-2] == expected, r
    transforms = _table_rows(grad_main("transforms"), GRAD_HEADINGS[2])
    for r in transforms:
        expected = "yes" if r[0] == "elementwise" else "no (conditional)"
        assert r[-2] == expected, r


@pytest.mark.slow
@pytest.mark.parametrize("key", ["elementwise", "heavy"])
def test_grad_chunked_nests_with_a_remainder_agree(key):
    body = grad.BODIES[key]
    x = grad.inputs(body, 8)  # chunks of 3: a remainder of 2
    for transform in ("grad", "vjp"):
        args = grad.program_args(transform, x)
        ours = jax.jit(grad.program(transform, grad.ours(body, "chunk", 3)))(*args)
        hand = jax.jit(grad.program(transform, grad.hand(body, "chunk", 3)))(*args)
        assert grad.agree(ours, hand), transform


@pytest.mark.slow
def test_grad_budget_section_keeps_the_derivative_within_the_budget(grad_main):
    text = grad_main("budget")
    assert _in_order(text, [GRAD_HEADINGS[5], SUMMARY])
    by = {r[0]: r for r in _table_rows(text, GRAD_HEADINGS[5])}
    budget = 4 * 1024
    temps = {what: int(r[2]) for what, r in by.items()}
    for what in (
        "forward, planned",
        "jit(grad(sum of f)), planned",
        "jit(value_and_grad(sum of f)), planned",
    ):
        assert 0 < temps[what] <= budget, what
    # Without planning for the backward pass, the derivative does not fit.
    assert temps["jit(grad), the forward plan's nest, no backward planning"] > budget
    assert temps["jit(grad), full vmap"] > budget
    assert by["jit(grad(sum of f)), planned"][1].endswith("scan bodies checkpointed")
    assert "The three gradients agree: yes." in text
    size = r"[\d.]+ (?:B|KiB|MiB|GiB)"
    assert re.search(
        rf"budget: B = 4\.0 KiB: planned grad {size} \(0\.\d\d B\), "
        rf"value_and_grad {size} \(0\.\d\d B\), forward {size} \(0\.\d\d B\); "
        r"grad without backward planning .*; gradients agree: yes",
        text[text.index(SUMMARY) :],
    )


def test_grad_eager_section_neither_retraces_nor_recompiles(grad_main):
    text = grad_main("eager")
    rows = _table_rows(text, GRAD_HEADINGS[4])
    assert [(r[0], r[1]) for r in rows] == [
        ("elementwise", "8"),
        ("elementwise", "32"),
        ("heavy", "8"),
        ("heavy", "32"),
    ]
    assert all(r[-1] == "0, 0 in 3 calls" for r in rows)
    assert re.search(
        r"eager: un-jitted ours / un-jitted lax\.scan: elementwise T=8 \d+\.\d\d, "
        r".*heavy T=32 \d+\.\d\d \(target <= 2\); ours re-traced 0 and recompiled 0 "
        r"times in 12 repeated calls",
        text[text.index(SUMMARY) :],
    )


def test_grad_rejects_unknown_nests_transforms_and_sections(capsys):
    body = grad.BODIES["elementwise"]
    for make in (grad.ours, grad.hand):
        with pytest.raises(
            ValueError,
            match=re.escape(
                "Unrecognised nest 'bogus'; choose from scan, chunk, vmap."
            ),
        ):
            make(body, "bogus", 3)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Unrecognised transform 'bogus'; choose from grad, forward, "
            "value_and_grad, vjp, jvp."
        ),
    ):
        grad.program("bogus", grad.hand(body, "scan", 3))
    with pytest.raises(SystemExit):
        grad.main(["--sections", "bogus,grad"])
    assert (
        "unknown sections ['bogus']; choose from grad, transforms, compile, eager, "
        "budget"
    ) in capsys.readouterr().err


def test_timing_additions():
    calls = []
    thunk = timing.batched(lambda: calls.append(1) or jnp.zeros(()), 4)
    thunk()
    assert len(calls) == 4
    times = timing.time_calibrated(
        [lambda: jnp.zeros(()), lambda: jnp.ones(())], budget_s=0.0, max_rounds=9
    )
    assert [len(t) for t in times] == [5, 5]  # `min_rounds` when over budget
    assert all(t > 0 for ts in times for t in ts)
    calls = [0, 0]

    def counted(i):
        calls[i] += 1
        if i:  # the second thunk is much longer than the first
            time.sleep(0.002)
        return jnp.zeros(())

    times = timing.time_calibrated(
        [lambda: counted(0), lambda: counted(1)],
        budget_s=0.0,
        max_rounds=9,
        min_rounds=3,
        min_sample_s=2e-3,
        groups=[0, 1],
    )
    assert [len(t) for t in times] == [3, 3]
    assert calls[0] > calls[1] == 1 + 1 + 3  # the first call, the warmup, 3 rounds
    makers = [lambda: timing.fresh(run.hand_vmap), lambda: timing.fresh(run.hand_vmap)]
    seconds = timing.compile_seconds(makers, (jnp.ones((3, 4, 2)),), repeats=2)
    assert [len(s) for s in seconds] == [2, 2] and min(map(min, seconds)) > 0
    assert timing.ratio_spread([1.0, 2.0, 3.0, 4.0, 5.0]) == "3.00 (2.00 to 4.00)"
    assert timing.fmt_bytes(3 * 2**20) == "3.0 MiB" and timing.fmt_bytes(12) == "12 B"


@pytest.mark.slow
def test_contention_prints_every_nest_in_every_phase(capsys):
    contention = load_benchmark("contention")
    contention.main(["--seconds", "0.05"])
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("nest "))
    assert header.split()[1:] == "idle one core busy one core busy idle".split()
    for nest in contention.NESTS:
        row = next(line for line in out.splitlines() if line.startswith(nest))
        ratios = re.findall(r"\((\d+\.\d\d)x\)", row)
        assert len(ratios) == 4 and all(float(r) >= 1.0 for r in ratios), row
    # In every phase, one nest is the fastest.
    rows = [
        line for line in out.splitlines() if line.startswith(tuple(contention.NESTS))
    ]
    for phase in range(4):
        assert any(re.findall(r"\((\d+\.\d\d)x\)", r)[phase] == "1.00" for r in rows)
