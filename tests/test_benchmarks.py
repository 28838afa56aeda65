"""`benchmarks/run.py`: the programs it compares compute the same thing, and its
sections and reports work (on tiny sizes; the timings themselves are not tested)."""

import csv
import itertools as it

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from .helpers import load_benchmark


run = load_benchmark("run")


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


def _no_progress(items, desc):
    del desc
    return items


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


def test_grid_section_and_report(tmp_path):
    result = run.run_grid(_tiny_config(), _no_progress)
    cells = {(r["b1"], r["b2"], r["L"]) for r in result["rows"]}
    every = set(it.product((4, 9), (4, 9), (1, 2)))
    assert cells == every - {(9, 9, 2)}  # 162 elements, over `max_elements`
    assert result["skipped"] == [(9, 9, 2)]
    for r in result["rows"]:
        if r["method"] == "vmap":
            assert r["ratio_vs_vmap"] == 1.0
        assert r["rounds"] >= 3 and r["median_ms"] > 0 and r["compile_s"] > 0
    pairs = {(p["a"], p["b"]) for p in result["pairs"]}
    assert ("vmap(scan)", "scan(vmap)") in pairs
    text = run.grid_markdown(result)
    assert "`vmap(scan)` / `scan(vmap)`" in text
    assert "Skipped" in text and "9x9x2" in text
    path = tmp_path / "grid.csv"
    run.write_csv(str(path), result["rows"])
    with open(path) as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(result["rows"])


def test_bandwidth_section_and_report():
    result = run.run_bandwidth(_tiny_config(), _no_progress)
    by = {(r["function"], r["method"]): r for r in result["rows"]}
    assert by[("(copy)", "numpy copyto")]["frac_memcpy"] == 1.0
    assert by[("(copy)", "XLA copy")]["frac_xla_copy"] == 1.0
    assert ("sin(x**2+1)", "ours scan(vmap)") in by
    assert result["nbytes"] == 4 * 3 * 2 * 4
    assert "of memcpy" in run.bandwidth_markdown(result)
