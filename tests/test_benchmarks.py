"""Smoke tests of the benchmark scripts' quick paths: the programs each compares
compute the same thing as an independent loop, and each script runs end to end (at
tiny sizes here; the real `--quick` under `slow`) and prints its tables and summary.
Timings are never tested."""

import csv
import io
import math
import os
import pathlib
import re
import subprocess
import sys
from contextlib import redirect_stdout

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from .helpers import load_benchmark


run = load_benchmark("run")
reduce = load_benchmark("reduce")
planner = load_benchmark("planner")


def _loop(body, xs):
    b1, b2, _ = xs.shape
    rows = [jnp.stack([body(xs[i, j]) for j in range(b2)]) for i in range(b1)]
    return jnp.stack(rows)


@pytest.mark.parametrize("body", ["cheap", "heavy"])
@pytest.mark.parametrize("nest", run.NESTS)
@pytest.mark.parametrize("transform", run.TRANSFORMS)
def test_run_programs_match_a_loop(body, nest, transform):
    xs = run.inputs((9, 2, 3))  # b1 = 9: chunks of 1 (k = b1 // 8)
    fn = run.BODIES[body]
    if transform == "forward":
        ref = _loop(fn, xs)
    else:
        ref = jax.grad(lambda x: _loop(fn, x).sum())(xs)
    programs = [make() for make in run.makers(body, nest, transform, 9)]
    assert len({id(p) for p in programs}) == 3  # ours, hand, twin: three functions
    for p in programs:
        out = jax.jit(p)(xs)
        assert out.shape == xs.shape and out.dtype == jnp.float32
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_run_rejects_unknown_nests_transforms_and_sections(capsys):
    with pytest.raises(ValueError, match="Unrecognised nest 'bogus'"):
        run.hand(run.cheap, "bogus", 2)
    with pytest.raises(ValueError, match="Unrecognised nest 'bogus'"):
        run.ours(run.cheap, "bogus", 2)
    with pytest.raises(ValueError, match="Unrecognised transform 'hessian'"):
        run.program("hessian", run.cheap)
    with pytest.raises(SystemExit):
        run.main(["--sections", "grid"])
    assert "--sections: choose from run, compile, eager" in capsys.readouterr().err


def test_run_quick_path_prints_the_summary_and_writes_the_report(
    monkeypatch, tmp_path, capsys
):
    pytest.importorskip("matplotlib")

    def tiny(args):
        one = {"cheap": (9, 3, 2), "heavy": (8, 2, 4)}
        cells = {body: [cell] for body, cell in one.items()}
        return run.Config(cells, one, 10**6, 3, 0.0, 1, 3, ("scan(vmap)",))

    monkeypatch.setattr(run, "make_config", tiny)
    assert run.main(["--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    summary = out.split("Summary (Total: ")[1]
    head = ["ours / hand-written", *run.NESTS, "twins (noise)", "same HLO (no larger)"]
    assert re.split(r"  +", summary.splitlines()[2].strip()) == head
    for kind, transforms in (("run", "forward grad"), ("compile", "forward grad")):
        for transform in transforms.split():
            for body in run.BODIES:
                assert f"\n{kind} {transform} {body} " in summary
    assert "\neager forward cheap " in summary and "\neager forward heavy " in summary
    # Ours' un-jitted wrapper neither re-traces nor recompiles when called again.
    assert "0 traces and 0 compiles in 12 calls" in out
    assert (tmp_path / "ours_vs_hand.png").stat().st_size > 10_000
    report = (tmp_path / "results.md").read_text()
    assert "| ours / hand-written | vmap | scan(vmap) | chunk | chunk2 |" in report
    assert "![ours against hand-written](ours_vs_hand.png)" in report
    with open(tmp_path / "results.csv") as fh:
        rows = list(csv.DictReader(fh))
    # run: 2 cells x 2 transforms x 4 nests; compile: 2 x 2 x 1; eager: 2 x 2.
    assert [r["kind"] for r in rows] == ["run"] * 16 + ["compile"] * 4 + ["eager"] * 4
    # The same HLO as hand-written: every cheap program of one chunked level (sliced
    # as lax.scan does); and every program's HLO is no larger than hand-written.
    run_rows = [r for r in rows if r["kind"] == "run"]
    one_level = [r for r in run_rows if r["nest"] != "chunk2"]
    assert [r["same_hlo"] for r in one_level if r["body"] == "cheap"] == ["True"] * 6
    assert [r["no_larger"] for r in run_rows] == ["True"] * 16


def test_run_plot_clips_an_outlier_and_writes_a_png(monkeypatch, tmp_path):
    Figure = pytest.importorskip("matplotlib.figure").Figure
    saved, savefig = [], Figure.savefig  # the figure `plot` saves, kept to look at
    monkeypatch.setattr(
        Figure,
        "savefig",
        lambda fig, *a, **k: (saved.append(fig), savefig(fig, *a, **k)),
    )
    rows = [
        dict(kind="run", body="cheap", nest=nest, transform="forward", cell=f"{n}x1x1")
        | dict(ratios=[1.0, 1.1, 0.9], twin=[1.0, 1.02])
        for n in range(5)
        for nest in run.NESTS
    ]
    rows[0]["ratios"] = [40.0, 41.0, 39.0]  # an outlier
    one = dict(kind="compile", body="heavy", nest="scan(vmap)", transform="grad")
    rows.append(one | dict(cell="8x2x4", ratios=[1.4], twin=[0.98]))  # one round
    run.plot(rows, str(tmp_path / "ours_vs_hand.png"))
    assert (tmp_path / "ours_vs_hand.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = saved
    (lo, hi), compile_ylim = fig.axes[0].get_ylim(), fig.axes[1].get_ylim()
    assert lo < 0.9 and 1.1 < hi < 10, (lo, hi)  # not stretched to 40
    assert fig.axes[0].get_title().endswith("; 1 beyond the axis")
    assert compile_ylim[0] < 0.98 and 1.4 < compile_ylim[1]
    assert not fig.axes[1].get_title().endswith("beyond the axis")


def test_reduce_programs_compute_the_same_sum():
    args = reduce.inputs(37, 8)
    x, y, v = (np.asarray(a, np.float64) for a in args)

    def softmax(a):
        e = np.exp(a - a.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)

    ref = sum(softmax(np.outer(x[t], y[t])) @ v for t in range(37))
    for name, fn in reduce.make_programs(16).items():
        out = jax.jit(fn)(*args)
        assert out.shape == (8,) and out.dtype == jnp.float32, name
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5, err_msg=name)


def test_reduce_quick_path_prints_every_section(monkeypatch, capsys):
    tiny = dict(ts=(32, 64), seconds=0.0, eager=(1, 2), gains=(8, 5))
    monkeypatch.setitem(reduce.SIZES, True, tiny)
    assert reduce.main(["--quick", "--repeats", "3"]) == 0
    out = capsys.readouterr().out
    summary = out.split("Summary (Total: ")[1]
    for name in ("reduced scan", "reduced chunk", "materialise", "hand scan"):
        assert f"temp bytes, {name}: " in summary
    assert "time, hand twin / hand scan (paired median): T=32: " in summary
    assert "identical to hand scan's: 2 of 2 T" in summary
    # One compile per fresh function, un-jitted or jitted, ours or hand-written.
    eager = summary.split("eager: RSS growth per 100 fresh functions")[1]
    for name in reduce.EAGER:
        assert re.search(rf"{re.escape(name)} -?[\d.]+ (B|KiB|MiB|GiB) \(1\)", eager)
    assert re.search(r"gains, grad: ours temp .*, peak RSS .*; ours has the hand", out)


def test_sharding_quick_path():
    sharding = load_benchmark("sharding")
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert sharding.main(["--quick", "--repeats", "3"]) == 0
    rows = [r for r in buf.getvalue().splitlines() if re.match(r"\| \d \|", r)]
    assert len(rows) == 8  # 2 nests x 1, 2, 4, 8 devices
    assert all(r.endswith("| 0 |") for r in rows)  # no collectives


def test_planner_quick_path_prints_its_summary_lines(monkeypatch, capsys):
    argv = ["planner.py", "--quick", "--only", "elementwise", "--repeats", "3"]
    monkeypatch.setattr(sys, "argv", argv + ["--confirm", "3"])
    planner.main()
    out = capsys.readouterr().out
    # A row forward and one under `grad`. jaxlib 0.10.0's memory analysis puts every
    # nest of the gradient over the 1 KiB budget: its row says so and is not counted.
    rows = 2 if jax.__version_info__ >= (0, 10, 2) else 1
    if rows == 1:
        assert "elementwise, grad: no nest fits" in out
    assert re.search(
        r"auto / best: geometric mean \d\.\d+, max \d\.\d+; "
        rf"[0-{rows}] of {rows} within 1\.10x",
        out,
    )
    assert f"Over budget: 0 of {rows}." in out


def test_planner_summary_counts_each_row_against_its_own_goal():
    # Cold planning: 2x the pick's compile, 4x where a short list was timed.
    line = planner._summary("cold", [1.5, 3.0, 5.0, math.nan], [2.0, 4.0, 4.0, 2.0])
    assert line == (
        "cold: geometric mean 2.823, max 5.000; 1 of 1 within 2.00x, "
        "1 of 2 within 4.00x"
    )
    assert planner._summary("auto", [1.0, 1.2]).endswith("; 1 of 2 within 1.10x")
    assert planner._summary("auto", [math.nan]) == ""


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, extra",
    [("run", ["--no-plots"]), ("reduce", []), ("sharding", []), ("planner", [])],
)
def test_the_real_quick_path(script, extra, tmp_path):
    args = [sys.executable, f"benchmarks/{script}.py", "--quick", *extra]
    if script == "run":
        args += ["--out", str(tmp_path)]
    root = str(pathlib.Path(__file__).parent.parent)
    env = dict(os.environ, PYTHONPATH=root)  # this checkout's `eqx_multimap`
    proc = subprocess.run(args, capture_output=True, text=True, cwd=root, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # Every script but sharding.py (one table, no summary) ends with its total time.
    assert ("| devices | nest |" if script == "sharding" else "Total: ") in proc.stdout
