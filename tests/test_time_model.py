"""The planner's time model: the machine's cache levels, a bandwidth per level, its
calibration (best of repeated runs), and the search that uses it."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from eqx_multimap import explain, filter_multi_vmap, Planner, TimeModel
from eqx_multimap._planner import measure, model as _model
from eqx_multimap._resolve import resolve


KiB = 1024


def _sysfs(root, caches):
    for i, (level, kind, size) in enumerate(caches):
        d = root / f"index{i}"
        d.mkdir(parents=True)
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    return str(root)


def test_cache_levels_read_from_sysfs(tmp_path):
    caches = [
        (1, "Data", "32K"),
        (1, "Instruction", "64K"),
        (2, "Unified", "512K"),
        (3, "Unified", "16M"),
    ]
    root = _sysfs(tmp_path / "cache", caches)
    assert _model.cache_levels(root) == (32 * KiB, 512 * KiB, 16 * 2**20)
    # Each holds half its size at its bandwidth; a core's own, once per core.
    assert _model.held((32 * KiB, 512 * KiB, 16 * 2**20), 4) == (
        64 * KiB, KiB**2, 8 * 2**20
    )  # fmt: skip
    # The default model on this machine has the OS's levels.
    model = TimeModel.for_backend("cpu")
    want = _model.held(_model.cache_levels(), model.cores)
    assert tuple(s for s, _ in model.levels) == want


def test_cache_levels_fallback(tmp_path):
    assert _model.cache_levels(str(tmp_path / "missing")) == _model.FALLBACK_CACHES
    bad = _sysfs(tmp_path / "bad", [(1, "Data", "lots")])
    assert _model.cache_levels(bad) == _model.FALLBACK_CACHES
    only_code = _sysfs(tmp_path / "code", [(1, "Instruction", "32K")])
    assert _model.cache_levels(only_code) == _model.FALLBACK_CACHES


def test_seconds_is_monotone_in_the_working_set():
    model = TimeModel()
    sizes = [s for s, _ in model.levels]
    # Memory-bound: 1e9 bytes, negligible compute.
    sets = [1, *sizes, *(s + 1 for s in sizes), 10 * sizes[-1]]
    times = [model.seconds(1.0, 0.0, 1e9, 0, ws) for ws in sorted(sets)]
    assert times == sorted(times)
    # Each boundary crossed costs more: the bandwidths fall level by level.
    for size, rate in model.levels:
        assert model.seconds(0.0, 0.0, 1e9, 0, size) == pytest.approx(1e9 / rate)
        assert model.seconds(1.0, 0.0, 1e9, 0, size + 1) > 1e9 / rate
    assert model.seconds(0.0, 0.0, 1e9, 0, 2**40) == pytest.approx(1e9 / 1e10)
    # Compute and traffic are added (not overlapped), plus the loop trips.
    compute = 1e12 / model.flops + 1e9 / model.transcendentals
    memory = 1e9 / model.levels[0][1]
    assert model.seconds(1e12, 1e9, 1e9, 10, 1) == pytest.approx(
        compute + memory + 10 * model.loop_overhead
    )


def test_past_the_last_level_the_bandwidth_falls_to_memorys():
    # Log-linearly, from the last level's at what it holds to main memory's at
    # `SPILL` times that, where the calibration measures it.
    model = TimeModel(levels=((2**20, 1e11),), bandwidth=1e9)
    assert model.rate(2**20) == 1e11 and model.rate(2**20 + 1) < 1e11
    assert model.rate(2 * 2**20) == pytest.approx(1e10)  # halfway, for a `SPILL` of 4
    assert model.rate(_model.SPILL * 2**20) == pytest.approx(1e9) == model.rate(2**40)


def test_small_ops_run_on_one_core_and_inputs_stream_from_their_level():
    model = TimeModel(cores=4)
    work = model.seconds(1e9, 0.0, 1e9, 0, 1)
    # The share of work in ops too small to split runs on one of the four cores.
    assert model.seconds(1e9, 0.0, 1e9, 0, 1, serial=1.0) == pytest.approx(4 * work)
    assert model.seconds(1e9, 0.0, 1e9, 0, 1, serial=0.5) == pytest.approx(2.5 * work)
    assert TimeModel().seconds(1e9, 0.0, 1e9, 0, 1, serial=1.0) == work  # one core
    # Inputs and outputs move at the bandwidth of the level that holds them all,
    # the rest at that of the level holding the working set.
    (l1, r1), (_, r2) = model.levels[:2]
    io = l1 + 1  # past the first level
    got = model.seconds(0.0, 0.0, 3.0 * io, 0, 1, io=io)
    assert got == pytest.approx(io / r2 + 2 * io / r1)
    assert model.seconds(0.0, 0.0, 1.0 * io, 0, 1, io=10 * io) == pytest.approx(io / r2)


def test_time_model_json_round_trip():
    model = TimeModel.for_backend("cpu")
    stored = json.loads(json.dumps(model.to_json()))
    assert TimeModel.from_json(stored) == model
    for bad in ([[1024]], [[-1, 1e9]], [[1.5, 1e9]], "L2"):
        with pytest.raises(ValueError):
            TimeModel.from_json({**stored, "levels": bad})
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="cores"):
            TimeModel.from_json({**stored, "cores": bad})


def test_the_timing_loop_interleaves_and_drops_disturbed_rounds():
    # Two thunks under a fake clock: untimed calls each (the second no faster than
    # the first), then rounds in an order that rotates; a round the probe finds
    # disturbed is dropped.
    clock, calls = [0.0], []

    def thunk(name, seconds):
        def run():
            calls.append(name)
            clock[0] += seconds

        return run

    class Probe(measure.Probe):
        def __init__(self):
            super().__init__(run=lambda: None)

        def time(self):
            self.times.append([1.0, 9.0, 1.0][len(self.times)])

    a, b = thunk("a", 0.01), thunk("b", 0.02)
    times = measure.rounds([a, b], 3, probe=Probe(), clock=lambda: clock[0])
    assert calls == ["a", "a", "b", "b", "a", "b", "b", "a", "a", "b"]
    np.testing.assert_allclose(times, [[0.01, 0.01], [0.02, 0.02]])  # round 2 dropped


def test_a_long_program_is_timed_on_its_second_call():
    # The first call of a program (its temporaries fresh) is no sample of the calls
    # that follow it: long ones are timed once each, after their untimed first call.
    clock, calls = [0.0], []

    def thunk(name, first, then):
        def run():
            calls.append(name)
            clock[0] += then if name in calls[:-1] else first

        return run

    a, b = thunk("a", 0.08, 0.11), thunk("b", 0.09, 0.08)
    times = measure.rounds([a, b], 3, 15, 10.0, clock=lambda: clock[0])
    assert calls == ["a", "b", "a", "b"]
    np.testing.assert_allclose(times, [[0.11], [0.08]])


def test_a_program_is_timed_once_its_first_calls_stop_getting_faster():
    # Its first calls fault in its temporaries' pages: untimed calls until one is no
    # faster than 0.9x the one before (at most `WARM`), and a sample of each after.
    clock, calls = [0.0], []

    def thunk(name, *seconds):
        def run():
            calls.append(name)
            clock[0] += seconds[min(calls.count(name), len(seconds)) - 1]

        return run

    a, b = thunk("a", 0.013, 0.005, 0.0046, 0.002), thunk("b", 0.02, 0.01, 0.005, 0.003)
    times = measure.rounds([a, b], 1, clock=lambda: clock[0])
    assert calls == ["a"] * 3 + ["b"] * measure.WARM + ["a", "b"]
    np.testing.assert_allclose(times, [[0.002], [0.003]])
    # Timed again once settled (as when a candidate is timed beside the fastest so
    # far): one untimed call of each, for the length of a sample.
    calls.clear()
    times = measure.rounds([a, b], 1, settled=True, clock=lambda: clock[0])
    assert calls == ["a", "b", "a", "b"]


def test_a_probe_slow_only_while_it_warms_up_drops_only_those_rounds():
    # After a long program the probe runs slower for a few rounds (its threads and
    # caches cold): judged against its median, not its best, only the outlier goes.
    probe = measure.Probe(run=lambda: None)
    probe.times = [2.0, 1.6, 1.2, 1.0, 0.7]
    assert probe.disturbed() == [True, False, False, False, False]
    assert probe.disturbed(3) == [False, False]


def test_calibrated_levels_are_the_machines(monkeypatch):
    # The calibration measures one bandwidth per level, each on what it holds, and
    # one past the last; a core's own levels (all but the last) on one core (its
    # share), times the cores; each is the best of the repeats.
    calls = []

    def stream(nbytes, repeats, one_core=False):
        calls.append((nbytes, repeats, one_core))
        return 1e11 / len(calls)

    monkeypatch.setattr(measure, "stream_bandwidth", stream)
    model = measure.calibrate(repeats=2)
    default = TimeModel.for_backend("cpu")
    levels = [s for s, _ in default.levels]
    assert [s for s, _ in model.levels] == levels
    shares = [s // default.cores for s in levels[:-1]] + levels[-1:]
    assert [n for n, _, _ in calls[:-1]] == shares
    assert [one for _, _, one in calls] == [True] * (len(levels) - 1) + [False] * 2
    assert calls[-1][0] > levels[-1] and all(r == 2 for _, r, _ in calls)
    assert model.levels[0][1] == 1e11 * default.cores
    rates = [r for _, r in model.levels] + [model.bandwidth]
    assert rates == sorted(rates, reverse=True)
    assert model.calibrated and "caches" in (model.calibration or "")


def test_one_core_bandwidth_streams_slices_in_place():
    # On one core: slices of `SLICE` bytes, each read and written once per pass.
    whole = measure.stream_bandwidth(2**20, 2)
    one = measure.stream_bandwidth(2**20, 2, one_core=True)
    assert whole and one and 1e8 < one < 1e13 and 1e8 < whole < 1e13


def test_fastest_levels():
    flat = TimeModel(levels=((2**10, 5.0), (2**20, 5.0)), bandwidth=1.0)
    steep = TimeModel(levels=((2**10, 5.0), (2**20, 4.0)), bandwidth=1.0)
    assert (flat.fastest, steep.fastest, TimeModel(levels=()).fastest) == (
        2**20, 2**10, 0,
    )  # fmt: skip


def test_accelerator_profile():
    # No accelerator here: the structure of the default device profile.
    model = TimeModel.for_backend("gpu")
    assert model.levels == _model.DEVICE_LEVELS
    assert model.bandwidth == _model.DEVICE_MEMORY
    assert model.loop_overhead > TimeModel().loop_overhead


#
# The search with a memory hierarchy.
#


def _outer(x, w):
    # One element: a (K, K) intermediate that feeds a matmul (not fused away).
    return jnp.sum(jnp.tanh(jnp.outer(x, x) * w) @ x)


def _args(getkey, t=16, b=12, k=32):
    x = jax.random.normal(getkey(), (t, b, k)) * 0.1
    w = jax.random.normal(getkey(), (k, k)) * 0.1
    return x, w


def _map(plan, budget):
    return filter_multi_vmap(
        _outer, in_dims=("T B K", None), out_dims="T B", plan=plan,
        memory_budget=budget,
    )  # fmt: skip


def _reference(x, w):
    return np.stack([np.stack([_outer(xb, w) for xb in xt]) for xt in x])


def _plan(model, getkey, budget=2**30):
    x, w = _args(getkey)
    f = _map(Planner(cache_dir=False, time_model=model, measure=False), budget)
    plan = explain(f, x, w)
    np.testing.assert_allclose(f(x, w), _reference(x, w), rtol=1e-4, atol=1e-5)
    return plan


def _ws(plan, c):
    return c.working_set


# A machine whose last level is 64 KiB: full vmap (16 * 12 elements of 4 KiB
# intermediates) is past it.
SMALL = 64 * KiB


def test_full_vmap_within_the_fastest_levels_is_kept(getkey):
    plan = _plan(TimeModel(levels=((2**30, 1e11),)), getkey)
    assert plan.scan == {} and plan.n_compiled == 1
    table = " ".join(plan.table(all=True).split())
    assert "within the fastest 1.0 GiB of memory" in table


def test_full_vmap_is_kept_if_no_block_is_est_materially_faster(getkey):
    # Full vmap is past the fastest level, but the next is only 1% slower: no block
    # inside the fastest is est. 5% faster, so nothing else is compiled.
    model = TimeModel(levels=((SMALL, 1e11), (2**30, 0.99e11)))
    plan = _plan(model, getkey)
    assert plan.scan == {} and plan.n_compiled == 1
    assert "est. 5% faster" in " ".join(plan.table(all=True).split())


def test_a_block_inside_a_level_is_compiled_and_chosen(getkey):
    # Full vmap is over this budget; the largest block that fits is past the 64 KiB
    # level, and the largest inside it (predicted) is compiled to check the budget
    # (its prediction is not far within it), then chosen: the model says the level
    # is 100x faster.
    model = TimeModel(levels=((SMALL, 1e11),), bandwidth=1e9)
    budget = 128 * KiB
    plan = _plan(model, getkey, budget)
    chosen = plan.chosen
    assert chosen.scan and chosen.working_set <= SMALL and not chosen.predicted
    assert chosen.temp_bytes <= budget and chosen.fits
    costed = [c for c in plan.candidates if c.seconds is not None]
    assert any(c.working_set > SMALL for c in costed)  # the budget's boundary
    assert chosen == min(costed, key=lambda c: c.seconds)
    # The same machine with one bandwidth: the larger block wins (fewer trips).
    flat = _plan(dataclasses.replace(model, bandwidth=1e11), getkey, budget)
    assert flat.chosen.block > chosen.block
    assert flat.chosen.working_set > SMALL


def test_full_vmap_past_the_last_level_is_compared_with_blocks(getkey):
    # Full vmap fits, but its working set is past the level: the largest block
    # inside it is costed too, its temporaries predicted (far within the budget, not
    # compiled), and wins.
    model = TimeModel(levels=((SMALL, 1e11),), bandwidth=1e9)
    plan = _plan(model, getkey)
    full = plan.candidates[0]
    assert full.source == "full vmap" and full.fits and full.working_set > SMALL
    chosen = plan.chosen
    assert chosen.scan and chosen.working_set <= SMALL and chosen.predicted
    assert plan.n_compiled == 1
    assert "fits 64.0 KiB of cache" in chosen.reason


def test_simulated_accelerator_prefers_the_block_on_chip(getkey):
    # A device profile: 96 KiB of on-chip memory at 1e12 B/s, HBM at 1e10, and a
    # kernel launch per loop trip. The planner picks a block on chip or just past
    # it (the est. bandwidth falls past it, to HBM's at `SPILL` times it): none
    # larger, and not one on chip smaller than the largest there.
    device = TimeModel(
        flops=1e13,
        transcendentals=1e12,
        levels=((96 * KiB, 1e12),),
        bandwidth=1e10,
        loop_overhead=1e-6,
    )
    plan = _plan(device, getkey)
    chosen = plan.chosen
    assert chosen.scan and chosen.working_set < 2 * 96 * KiB
    on_chip = [
        c for c in plan.candidates
        if c.working_set is not None and c.working_set <= 96 * KiB
    ]  # fmt: skip
    assert chosen.block >= max(c.block for c in on_chip)
    costed = [c for c in plan.candidates if c.seconds is not None and c.fits]
    assert chosen.seconds == min(c.seconds for c in costed)
    # With a kernel launch 100x dearer, fewer trips win: full vmap.
    dear = _plan(dataclasses.replace(device, loop_overhead=1e-4), getkey)
    assert dear.scan == {}


#
# A while loop in lockstep.
#


def _halve_until_small(x):
    # Each element loops until its own norm is small: a data-dependent trip count.
    def cond(y):
        return jnp.sum(y * y) > 1e-6

    return jax.lax.while_loop(cond, lambda y: y * 0.5, x)


def _halve_ten_times(x):
    return jax.lax.fori_loop(0, 10, lambda i, y: y * 0.5, x)


def test_lockstep_is_found_in_the_vmapped_program():
    import equinox.internal as eqxi
    from eqx_multimap._jaxpr import lockstep

    x = jnp.ones((4, 8))
    vmapped = lambda f: jax.make_jaxpr(jax.vmap(f))(x).jaxpr  # noqa: E731
    assert lockstep(vmapped(_halve_until_small))
    assert not lockstep(jax.make_jaxpr(_halve_until_small)(x[0]).jaxpr)
    assert not lockstep(vmapped(_halve_ten_times))

    def unvmapped(x):  # as equinox's loops reduce a batched predicate
        cond = lambda y: eqxi.unvmap_any(jnp.sum(y * y) > 1e-6)  # noqa: E731
        return jax.lax.while_loop(cond, lambda y: y * 0.5, x)

    assert lockstep(vmapped(unvmapped))
    assert not lockstep(jax.make_jaxpr(unvmapped)(x[0]).jaxpr)


def _mlp(w, h):
    for layer in w:  # w: (4, K, K) per element
        h = jnp.tanh(layer @ h)
    return h


def test_op_bytes_are_the_bytes_each_op_reads():
    from eqx_multimap._jaxpr import op_bytes
    from eqx_multimap._planner.cost import serial

    w, h = jnp.ones((8, 4, 64, 64)), jnp.ones((8, 64))
    ops = op_bytes(jax.make_jaxpr(jax.vmap(_mlp))(w, h).jaxpr)
    # A dot per layer reads its weights and `h`; `tanh` reads the product. The
    # slices of `w` move data, fused into the dots: not ops of their own.
    dot, tanh = 8 * (64 * 64 + 64) * 4, 8 * 64 * 4
    assert sorted(ops) == sorted([dot, tanh] * 4)
    share = 4 * tanh / (4 * dot + 4 * tanh)
    assert serial(ops, 1.0) == pytest.approx(share)  # 131 KiB dots: split
    assert serial(ops, 0.5) == 1.0  # at 4 elements every op is under 96 KiB
    x = jnp.ones((4, 8))
    assert op_bytes(jax.make_jaxpr(jax.vmap(_halve_until_small))(x).jaxpr) == []
    assert op_bytes(None) == []  # a jaxpr it cannot read: none taken to be small


@pytest.mark.parametrize("cores", [1, 2])
def test_a_block_whose_ops_split_over_cores_wins(getkey, cores):
    # Each element has its own 64x64 weights: a block of 4 fits L2, but its dots
    # (66 KiB) are too small to split over threads; from 8 elements (132 KiB) they
    # split. On one core the block inside L2 wins; on two, a block of 8 or more.
    w = jax.random.normal(getkey(), (256, 4, 64, 64)) / 8
    h = jax.random.normal(getkey(), (256, 64))
    levels = ((2**20, 2.1e11), (8 * 2**20, 8e10))  # full vmap (32 MiB) past both
    model = TimeModel(levels=levels, bandwidth=1.3e10, cores=cores)
    kw = dict(in_dims=("B L K J", "B J"), out_dims="B K", core="K")
    planner = Planner(cache_dir=False, time_model=model, measure=False)
    f = filter_multi_vmap(_mlp, plan=planner, memory_budget=2**30, **kw)
    plan = explain(f, w, h)
    assert set(plan.scan) == {"B"}
    assert plan.chosen.block == 4 if cores == 1 else plan.chosen.block >= 8
    np.testing.assert_allclose(f(w, h), jax.vmap(_mlp)(w, h), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("body", [_halve_until_small, _halve_ten_times])
def test_a_while_loop_in_lockstep_plans_one_element_per_trip(getkey, body):
    # Full vmap fits and is within the cache: kept, unless the body's while loop
    # runs in lockstep when vmapped; then the smallest block is costed, and wins
    # when its estimate is within 5% (here loop trips are nearly free).
    scale = 10.0 ** jnp.arange(6, dtype=jnp.float32)[None, :, None]
    x = jax.random.normal(getkey(), (8, 6, 16)) * scale
    model = TimeModel(loop_overhead=1e-12)
    planner = Planner(cache_dir=False, time_model=model, measure=False)
    kw = dict(in_dims="T B K", out_dims="T B K", core="K")
    f = filter_multi_vmap(body, plan=planner, **kw)
    plan = planner.plan(resolve(f._fun, f._options, (x,), {}))  # forward only
    if body is _halve_until_small:
        assert plan.chosen.block == 1 and set(plan.scan) == {"T", "B"}
        assert "lockstep" in plan.chosen.reason
    else:
        assert plan.scan == {} and plan.n_compiled == 1
    want = np.stack([np.stack([body(xb) for xb in xt]) for xt in x])
    np.testing.assert_allclose(f(x), want, rtol=1e-6)
