"""Measured mode: `eqx_multimap.tune`, un-jitted calls of a measuring planner, the
slices of loop trips, the search over every ladder, the cap, and bodies whose cost
depends on their data."""

import functools as ft
import os
import subprocess
import sys
import time
import types

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from eqx_multimap import (
    explain,
    filter_multi_vmap,
    Plan,
    Planner,
    SpecError,
    TimeModel,
    tune,
)
from eqx_multimap._jaxpr import data_dependent
from eqx_multimap._planner import (
    cost,
    measure,
    planner as planner_module,
    search as search_module,
)
from eqx_multimap._planner.plan import PlanCandidate


T, F = 4, 8
SEEN: list = []


def _loop(r, y):
    """A while loop whose trip count is the element's rate (0 to 40)."""

    def step(c):
        return c[0] + 1.0, jnp.sin(c[1]) + 0.1

    return jax.lax.while_loop(lambda c: c[0] < r, step, (0.0, y))[1]


def _reference(r, y):
    return np.stack(
        [np.stack([_loop(r[i, j], y[i, j]) for j in range(F)]) for i in range(T)]
    )


def _args():
    # Rates along F: the elements of one F loop alike; made-up inputs in [-1, 1)
    # would loop at most once.
    rate = jnp.broadcast_to(jnp.linspace(2.0, 40.0, F), (T, F)).astype(jnp.float32)
    return rate, jnp.ones((T, F), jnp.float32)


def _wrapper(plan):
    return filter_multi_vmap(_loop, in_dims=("T F", "T F"), out_dims="T F", plan=plan)


def _first_arguments_run(monkeypatch, summarise) -> list:
    """A spy on the programs measured mode runs: `summarise` of the first argument
    of each run, in a list that fills as they run."""
    seen = []
    compile_ = cost.Compiler.compile

    def spy(self, fn, specs, what="", runs=False):
        compiled = compile_(self, fn, specs, what, runs)
        if not runs:
            return compiled

        class Call:  # the compiled program, its runs spied on
            def __call__(self, args):
                seen.append(summarise(np.asarray(args[0])))
                return compiled(args)

            def __getattr__(self, name):
                return getattr(compiled, name)

        return Call()

    monkeypatch.setattr(cost.Compiler, "compile", spy)
    return seen


def test_data_dependent_reads_the_jaxpr():
    jaxpr = lambda f, *a: jax.make_jaxpr(f)(*a).jaxpr  # noqa: E731
    assert data_dependent(jaxpr(_loop, 1.0, 1.0)) == "a while loop"
    inner = jax.jit(lambda x: jax.lax.cond(x > 0, jnp.sin, jnp.cos, x))
    assert data_dependent(jaxpr(inner, 1.0)) == "a `lax.cond`"  # inside a jit
    assert data_dependent(jaxpr(lambda x: jnp.sin(x) * 2, 1.0)) is None
    # Total: what it cannot read is data-dependent, never an error.
    assert data_dependent(object()) == "a body the planner cannot read"


@pytest.mark.parametrize(
    "dtype", [jnp.float32, jnp.bfloat16, jnp.complex64, jnp.int32, jnp.bool_]
)
@pytest.mark.parametrize("shape", [(), (0,), (3,), (4093, 2), (2, 5, 4099)])
def test_made_up_inputs_have_the_shapes_and_dtypes_asked_for(dtype, shape):
    spec = jax.ShapeDtypeStruct(shape, dtype)
    (x,) = measure.concrete_inputs([spec], {})
    assert (x.shape, x.dtype) == (shape, dtype)
    values = np.asarray(x).astype(np.complex64).ravel()
    if not jnp.issubdtype(dtype, jnp.inexact):
        assert not values.any()
    elif values.size > 4093:  # a period of 4,093 values, each in [-1, 1)
        np.testing.assert_array_equal(values[4093:], values[:-4093])
        assert np.all(np.abs(values.real) <= 1) and len(set(values[:4093])) > 100


@pytest.mark.parametrize("n", [3 * 4093 + 5, 2**23])  # filled by NumPy; by XLA
def test_made_up_inputs_are_made_once_for_each_leaf(n):
    pools = {}
    f32 = ft.partial(jax.ShapeDtypeStruct, dtype=jnp.float32)
    x, y = measure.concrete_inputs([f32((n,)), f32((2, n // 2))], pools)
    made = dict(pools)
    assert len(made) == 2  # one buffer each: the call's leaves do not share memory
    z, _ = measure.concrete_inputs([f32((n // 4, 3)), f32((2, 2))], pools)  # a later
    assert all(pools[k] is made[k] for k in made)  # candidate's: made up once
    if n > 2**22:  # a large one is not copied, either
        assert x.unsafe_buffer_pointer() == z.unsafe_buffer_pointer()
        assert x.unsafe_buffer_pointer() != y.unsafe_buffer_pointer()
    np.testing.assert_array_equal(np.asarray(z).ravel(), np.asarray(x)[: n // 4 * 3])
    (w,) = measure.concrete_inputs([f32((2 * n,))], pools)  # larger: made anew
    assert pools[0, np.dtype(np.float32)].size == 2 * n
    np.testing.assert_array_equal(np.asarray(w)[4093:], np.asarray(w)[:-4093])
    assert np.asarray(x).min() >= -1 and np.asarray(x).max() < 1


def test_a_slice_cuts_loop_trips_and_keeps_the_block():
    sizes = {"T": 32, "F": 16}
    # Scanning T, then F in chunks of 4: an eighth of the trips cuts T alone, to
    # 4 elements spread over it (its first and last included); F is kept whole.
    c = PlanCandidate((("T", None), ("F", 4)), (), 4, 128, "ladder")
    index = measure.trip_slice(c, sizes, 1 / 8)
    assert list(index) == ["T"] and list(index["T"]) == [0, 10, 21, 31]
    # T in chunks of 8, F vmapped: whole chunks, the block (8 x 16) kept.
    c = PlanCandidate((("T", 8),), ("F",), 128, 4, "ladder")
    assert list(measure.trip_slice(c, sizes, 1 / 2)["T"]) == [*range(8), *range(24, 32)]
    # Fewer trips than the outer loop has: cut inside it too.
    c = PlanCandidate((("T", 16), ("F", None)), (), 16, 32, "ladder")
    index = measure.trip_slice(c, sizes, 1 / 32)
    assert list(index["T"]) == list(range(16)) and list(index["F"]) == [0]


def _landscape(monkeypatch, seconds):
    """Measured mode with `Tuner.time` replaced: `seconds(c)` is `c`'s time, and
    each candidate's compile is one second; the candidates timed, in order."""
    timed = []

    def time_(self, c):
        if c.key not in self.timed:
            timed.append(c)
            t = seconds(c)
            self.timed[c.key] = measure.Timed(lambda: None, {}, 1.0, 1.0, [t])
        return self.seconds(c.key)

    monkeypatch.setattr(measure.Tuner, "time", time_)
    monkeypatch.setattr(measure.Tuner, "confirm", lambda self: None)
    return timed


def _valley(best_block, at=None):
    """A time that grows with the distance (in log block) from `best_block`, on the
    candidates whose first scanned dim is `at` (any, for `None`), 5% slower on
    the others."""

    def seconds(c):
        far = abs(np.log2(c.block / best_block))
        first = c.scan[0][0] if c.scan else None
        return (1.0 + 0.1 * far) * (1.0 if at in (None, first) else 1.05)

    return seconds


@pytest.mark.parametrize("best_block", [1, 8, 64, 512, 2048])
def test_the_search_finds_the_fastest_block_of_a_valley(monkeypatch, best_block):
    timed = _landscape(monkeypatch, _valley(best_block))
    x = jnp.ones((64, 32))
    f = filter_multi_vmap(jnp.sin, in_dims="T F", out_dims="T F", plan="auto")
    plan = tune(f, x)
    assert plan.chosen.block == best_block
    # Full vmap and the model's choice first, then fewer than half the others.
    assert timed[0].block == 64 * 32
    model = explain(
        filter_multi_vmap(
            jnp.sin, in_dims="T F", out_dims="T F", plan=Planner(cache_dir=False)
        ),
        x,
    )
    assert timed[1].key == model.chosen.key or model.chosen.block == 64 * 32
    n = sum(c.measured is not None for c in plan.candidates)
    assert n < len(plan.candidates) / 2
    assert "was not reached" in plan.summary
    # Each candidate not timed says why: a slower one was timed between.
    untimed = [c for c in plan.candidates if c.measured is None]
    assert all("measured slower" in c.reason for c in untimed)


def test_the_search_finds_the_fastest_order(monkeypatch):
    # The fastest blocks scan F first: reached from the other orders' ladders.
    _landscape(monkeypatch, _valley(16, at="F"))
    x = jnp.ones((64, 32))
    f = filter_multi_vmap(jnp.sin, in_dims="T F", out_dims="T F", plan="auto")
    plan = tune(f, x)
    assert plan.chosen.block == 16 and plan.chosen.scan[0][0] == "F"


@pytest.mark.parametrize("tie", [False, True])
def test_a_short_list_times_one_more_a_near_tie_else_full_vmap(monkeypatch, tie):
    # `plan="auto"` times the model's choice, then one more: the candidate est. next
    # fastest if est. within `MATERIAL` of it (of those, the smallest working set),
    # else full vmap. Here every estimate is a tie, or none is.
    timed = _landscape(monkeypatch, lambda c: 1e-3 / c.block)  # runs within a compile
    monkeypatch.setattr(measure, "MATERIAL", np.inf if tie else 0.0)
    small = TimeModel(levels=((64 * 2**10, 2e11),), bandwidth=1e9)  # it searches
    a, b = jnp.ones((16, 12, 32)), jnp.ones((16, 32))
    body = lambda a, b: jnp.sum(jnp.exp(a[:, None] * b[None, :]) @ b)  # noqa: E731
    f = lambda p: filter_multi_vmap(  # noqa: E731
        body, in_dims=("T B K", "T K"), out_dims="T B", plan=p, memory_budget=2**30
    )
    model = explain(f(Planner(cache_dir=False, time_model=small, measure=False)), a, b)
    plan = explain(f(Planner(cache_dir=False, time_model=small)), a, b)
    forward = timed[:2]  # the forward plan's (`explain` plans the gradient too)
    assert plan.basis == "short" and forward[0].key == model.chosen.key
    assert model.chosen.scan == (("T", None),) and model.chosen.vmap == ("B",)
    # The other: T in chunks of 2 (costed, the smallest working set), or full vmap.
    assert dict(forward[1].scan) == {"T": 2} if tie else forward[1].scan == ()
    assert (forward[1].source == "full vmap") == (not tie)
    assert sum(c.measured is not None for c in plan.candidates) == 2
    assert plan.chosen.key == forward[1].key  # the larger block: the faster here


@pytest.mark.parametrize("long", [False, True])
def test_a_short_list_skips_a_candidate_whose_runs_would_outlast_a_compile(
    monkeypatch, long
):
    # Each compile takes 1 s (`_landscape`). The model's choice runs in 1 ms, or 1 s:
    # then two runs of full vmap, est. slower, would take longer than a compile.
    run = 1.0 if long else 1e-3
    timed = _landscape(
        monkeypatch, lambda c: run * (3.0 if c.vmap == ("T", "B") else 1)
    )
    small = TimeModel(levels=((64 * 2**10, 2e11),), bandwidth=1e9)  # it searches
    a, b = jnp.ones((16, 12, 32)), jnp.ones((16, 32))
    body = lambda a, b: jnp.sum(jnp.exp(a[:, None] * b[None, :]) @ b)  # noqa: E731
    f = filter_multi_vmap(
        body,
        in_dims=("T B K", "T K"),
        out_dims="T B",
        plan=Planner(cache_dir=False, time_model=small),
        memory_budget=2**30,
    )
    plan = explain(f, a, b)
    full = plan.candidates[0]
    assert (
        full.source == "full vmap" and full.fits and full.seconds > plan.chosen.seconds
    )
    assert (full.measured is None) == long
    summary = " ".join(plan.summary.split())
    skipped = (
        "Not timed (two runs est. over a compile): vmap(T=16) -> vmap(B=12) -> body"
    )
    assert (skipped in summary) == long
    assert ("two runs est. longer than a compile" in full.reason) == long
    assert [c.source == "full vmap" for c in timed[:2]] == [False, not long]


def test_the_cap_stops_the_search_and_says_so():
    rate, y = _args()
    counts = {}
    for cap in (1e-6, 1e6):
        plan = tune(_wrapper(Planner(cache_dir=False, cap=cap)), rate, y)
        counts[cap] = sum(c.measured is not None for c in plan.candidates)
        stopped = "stopped the search" in plan.summary
        assert stopped == (cap < 1)
        assert (cap < 1) == any(
            "the cap stopped the search first" in c.reason for c in plan.candidates
        )
    # A tiny cap still times `FEW`: full vmap, the model's choice, a block of one
    # element (the while loop runs in lockstep) and the search's first rungs.
    assert counts[1e-6] == measure.FEW < counts[1e6]


def test_a_quick_call_is_timed_whole_a_long_one_on_slices(monkeypatch):
    # Each timed program keeps its candidate's block: a slice cuts loop trips.
    x = jax.random.normal(jax.random.key(0), (256, 8, 16))
    # The forward programs' `x` (the derivative's first argument is a list).
    spied = _first_arguments_run(monkeypatch, lambda a: a.shape[:2] * (a.ndim == 3))
    seen = _Forward(spied)
    for target, what in ((1e9, "each on the whole call"), (1e-9, "on a slice of")):
        monkeypatch.setattr(measure, "TARGET", target)
        monkeypatch.setattr(measure, "CACHES", 0)  # this machine's caches ignored
        seen.clear()
        f = filter_multi_vmap(  # a large cap: long loops reached (`TRIPS`)
            _outer_tanh, in_dims="T B K", out_dims="T B",
            plan=Planner(cache_dir=False, cap=1e6),
        )  # fmt: skip
        plan = tune(f, x)
        assert what in plan.summary and plan.chosen.measured is not None
        assert seen[0] == (256, 8)  # full vmap: whole
        assert all(s == (256, 8) for s in seen) == (target > 1)
        cut = [c for c in plan.candidates if c.measured is not None and c.scan]
        assert cut
        np.testing.assert_allclose(
            f(x), jax.vmap(jax.vmap(_outer_tanh))(x), rtol=1e-5, atol=1e-4
        )


@pytest.mark.parametrize(
    "sleep, fastest, once",
    [
        (0.008, 0.002, True),  # long, 4x the fastest: its one sample
        (0.004, 0.002, False),  # long, 2x: timed in rounds
        (0.0, 1e-9, False),  # quick: a quick program's first runs are no sample
        (0.06, 0.05, True),  # over `LONG`, as fast: its one sample
    ],
)
def test_a_long_candidate_clearly_slower_than_the_fastest_is_run_once(
    sleep, fastest, once
):
    # A candidate clearly slower than the fastest, or that runs over `LONG`, is
    # timed on one call (after untimed ones).
    calls = []

    def run():
        calls.append(None)
        time.sleep(sleep)

    tuner = types.SimpleNamespace(once=0.0, best=lambda: fastest)
    times = measure.Tuner.clearly_slower(tuner, run, 1.0)  # pyright: ignore
    warm = 1 if sleep > measure.LONG else 2  # untimed calls, then a run
    assert len(calls) >= warm + 1 and bool(times) == once
    if once:  # (the second no faster than the first)
        assert len(calls) == warm + 1 and times[0] >= sleep


def test_tune_times_again_on_new_data_and_replaces_the_plan():
    rate, y = _args()
    planner = Planner(cache_dir=False)
    f = _wrapper(planner)
    first = tune(f, rate, y)
    n = planner.n_plans
    second = tune(f, rate * 0 + 1.0, y)  # the same signature, new data
    # Planned again, and its derivative's nest tried (a while loop: JAX's reverse
    # mode raises).
    assert planner.n_plans == n + 2 and second.basis == "arguments"
    assert "planned now" in second.cache
    assert explain(f, rate, y).chosen.key == second.chosen.key
    assert first.chosen.measured is not None


def test_tune_times_a_call_with_nothing_to_scan(monkeypatch):
    # Dims of size 1: no ladder has a rung, only full vmap is there to time.
    probes = []

    class Probe(measure.Probe):  # a compile, needed only to compare candidates
        def __init__(self, *args):
            probes.append(self)
            super().__init__(*args)

    monkeypatch.setattr(measure, "Probe", Probe)
    f = _wrapper(Planner(cache_dir=False))
    rate, y = (x[:1, :1] for x in _args())
    plan = tune(f, rate, y)
    assert plan.basis == "arguments" and plan.chosen.measured is not None
    assert "could not measure" not in plan.summary
    assert not probes
    np.testing.assert_allclose(
        f(rate, y), np.asarray(_loop(rate[0, 0], y[0, 0]))[None, None]
    )


def test_measured_mode_runs_nothing_over_the_budget(monkeypatch):
    # Full vmap does not fit: it is never run; the choice fits when compiled.
    x = jax.random.normal(jax.random.key(0), (64, 16, 32))
    kw = dict(in_dims="T B K", out_dims="T B")
    wide = filter_multi_vmap(_outer_tanh, **kw, plan=Planner(cache_dir=False))
    budget = explain(wide, x).chosen.temp_bytes // 4
    seen = _first_arguments_run(monkeypatch, lambda a: a.shape)
    f = filter_multi_vmap(
        _outer_tanh, **kw, plan=Planner(cache_dir=False), memory_budget=budget
    )
    plan = tune(f, x)
    assert sum(c.measured is not None for c in plan.candidates) >= 2
    full = next(c for c in plan.candidates if not c.scan)
    assert full.measured is None and not full.fits
    fixed = filter_multi_vmap(_outer_tanh, **kw, scan=plan.scan, vmap=plan.vmap)
    assert explain(fixed, x).chosen.temp_bytes <= budget
    assert seen
    np.testing.assert_allclose(
        f(x), jax.vmap(jax.vmap(_outer_tanh))(x), rtol=1e-5, atol=1e-4
    )


def test_a_rung_predicted_just_over_the_budget_is_timed_if_it_fits(monkeypatch):
    # Every rung not compiled predicted 1.5x over the budget: each is compiled whole
    # (its memory known, not a slice), and runs only if it fits.
    x = jax.random.normal(jax.random.key(0), (64, 16, 32))
    budget = 2**20  # full vmap's temporaries: 4.1 MiB
    time_, unsure = measure.Tuner.time, set()

    def spy(self, c):  # the forward pass's
        unsure.update(set() if self.search.compiler.backward else {c.key} & self.unsure)
        return time_(self, c)

    monkeypatch.setattr(search_module.Search, "cautious", lambda *a: 1.5 * budget)
    monkeypatch.setattr(measure.Tuner, "time", spy)
    monkeypatch.setattr(measure, "TARGET", 1e-9)  # others timed on slices
    monkeypatch.setattr(measure, "CACHES", 0)  # this machine's caches ignored
    f = filter_multi_vmap(
        _outer_tanh, in_dims="T B K", out_dims="T B",
        plan=Planner(cache_dir=False, cap=1e6), memory_budget=budget,
    )  # fmt: skip
    plan = tune(f, x)
    assert plan.measured and "could not measure" not in plan.summary
    checked = [c for c in plan.candidates if c.key in unsure]
    assert sum(c.measured is not None for c in checked) >= 2
    for c in checked:
        assert not c.predicted and (c.measured is None) == (c.temp_bytes > budget)
    np.testing.assert_allclose(
        f(x), jax.vmap(jax.vmap(_outer_tanh))(x), rtol=1e-5, atol=1e-4
    )


def test_a_candidate_timed_beside_the_fastest_is_given_its_own_runs(monkeypatch):
    # The fastest so far (full vmap, 1 ms alone) splits its ops over threads: beside
    # each candidate it runs in 1 ms or 2 ms by turns (another job takes a core, or
    # not). A candidate that runs in 2 ms every time is measured 2 ms, not scaled by
    # the other's turns (1.5 ms); the fastest keeps its runs beside them too.
    def fake_rounds(thunks, at_least, *args, **kwargs):
        for thunk in thunks:
            thunk()
        if len(thunks) == 2:  # a candidate beside the fastest, in that order
            return [[2e-3] * 6, [1e-3, 2e-3] * 3]
        return [[2e-3]] if at_least == 1 else [[1e-3] * 5]  # a first run; alone

    monkeypatch.setattr(measure, "rounds", fake_rounds)
    monkeypatch.setattr(measure.Tuner, "confirm", lambda self: None)
    f = filter_multi_vmap(
        _outer_tanh, in_dims="T B K", out_dims="T B",
        plan=Planner(cache_dir=False, time_model=TimeModel()),
    )  # fmt: skip
    plan = tune(f, jax.random.normal(jax.random.key(0), (16, 8, 4)))
    timed = [c for c in plan.candidates if c.measured is not None]
    assert len(timed) >= 3 and not plan.chosen.scan  # full vmap
    assert plan.chosen.measured == pytest.approx(1e-3)
    assert all(c.measured == pytest.approx(2e-3) for c in timed if c.scan)


class _Forward:
    """The non-empty entries of a spy's list."""

    def __init__(self, spied):
        self.spied = spied

    def clear(self):
        self.spied.clear()

    def __iter__(self):
        return iter([s for s in self.spied if s])

    def __getitem__(self, i):
        return list(self)[i]


def _outer_tanh(x):
    """No while loop: its cost does not depend on its data."""
    return jnp.sum(jnp.tanh(jnp.outer(x, x)) @ x)


def test_tune_times_the_arguments_and_is_reused():
    rate, y = _args()
    planner = Planner(measure=True, cache_dir=False)
    f = _wrapper(planner)
    plan = tune(f, rate, y)
    assert plan.basis == "arguments" and plan.measured
    assert "Timed on the call's arguments" in plan.summary
    timed = [c for c in plan.candidates if c.measured is not None]
    assert len(timed) >= 2 and plan.chosen.measured is not None
    assert plan.chosen.fits
    # Every order of the dims is a candidate: scanning F outermost too.
    firsts = {c.scan[0][0] for c in plan.candidates if c.scan}
    assert firsts == {"T", "F"}
    # Later calls use it, jitted or not, with no planning and no compile.
    n_plans, n_compiles = planner.n_plans, planner.n_compiles
    np.testing.assert_allclose(f(rate, y), _reference(rate, y), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(f)(rate, y), _reference(rate, y), rtol=1e-6)
    assert (planner.n_plans, planner.n_compiles) == (n_plans, n_compiles)
    again = explain(f, rate, y)  # (which plans the derivative's nest too)
    assert again.chosen.key == plan.chosen.key and again.basis == "arguments"


def test_an_un_jitted_call_made_before_tune_runs_the_tuned_nest(monkeypatch, capsys):
    traced = []

    def body(x):
        traced.append(x)
        return jnp.sin(x)

    x = jnp.linspace(-3.0, 3.0, 64 * 32).reshape(64, 32)
    want = jax.vmap(jax.vmap(jnp.sin))(x)
    f = filter_multi_vmap(
        body, in_dims="T F", out_dims="T F", plan="auto", verbose=True
    )
    np.testing.assert_allclose(f(x), want, rtol=1e-6)  # compiled with the model's nest
    before = explain(f, x).chosen
    _landscape(monkeypatch, _valley(1 if before.block > 1 else 64 * 32))
    tuned = tune(f, x)
    assert tuned.chosen.key != before.key
    capsys.readouterr()
    traced.clear()
    np.testing.assert_allclose(f(x), want, rtol=1e-6)
    eager = capsys.readouterr().out
    assert traced  # traced again, with the tuned plan
    np.testing.assert_allclose(jax.jit(f)(x), want, rtol=1e-6)
    assert eager and eager == capsys.readouterr().out
    assert tuned.chosen.nest({"T": 64, "F": 32}) in " ".join(eager.split())


def test_tune_returns_the_plan_with_its_gradient_as_explain_does():
    x = jax.random.normal(jax.random.key(0), (32, 16))
    y = jnp.linspace(0.0, 1.0, 16)
    f = filter_multi_vmap(
        lambda x, y: jnp.sin(x) * y,
        in_dims=("T F", "F"),
        out_dims="T F",
        plan=Planner(cache_dir=False),
    )
    tuned = tune(f, x, y)
    explained = explain(f, x, y)
    assert isinstance(tuned.gradient, Plan) and tuned.gradient.basis == "arguments"
    assert isinstance(explained.gradient, Plan)
    assert tuned.gradient.chosen.key == explained.gradient.chosen.key
    assert "under differentiation" in str(tuned)
    grad = jax.grad(lambda x: jnp.sum(f(x, y)))(x)
    want = np.cos(np.asarray(x)) * np.asarray(y)
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-6)
    # A body JAX cannot differentiate (a while loop): why, as `explain` says it.
    rate, y = _args()
    g = _wrapper(Planner(cache_dir=False))
    tuned = tune(g, rate, y)
    assert isinstance(tuned.gradient, str)
    assert tuned.gradient == explain(g, rate, y).gradient
    with pytest.raises(ValueError, match="Reverse-mode differentiation does not work"):
        jax.grad(lambda r: jnp.sum(g(r, y)))(rate)
    assert tuned.gradient.startswith("Not differentiable: ValueError: Reverse-mode")


def test_a_plan_tuned_on_numpy_float64_is_used_without_x64():
    # Without x64 JAX computes NumPy float64 in float32: one signature, one plan.
    assert not jax.config.jax_enable_x64
    x = np.random.default_rng(0).normal(size=(12, 8))
    nu = np.linspace(1.0, 2.0, 8)
    want = np.tanh(x * nu)
    kw = dict(in_dims=("T F", "F"), out_dims="T F")
    body = lambda x, nu: jnp.tanh(x * nu)  # noqa: E731
    planner = Planner(cache_dir=False)
    f = filter_multi_vmap(body, **kw, plan=planner)
    tune(f, x, nu)
    n = planner.n_plans
    for args in ((x, nu), (jnp.asarray(x), jnp.asarray(nu))):
        np.testing.assert_allclose(f(*args), want, rtol=1e-5)
        np.testing.assert_allclose(jax.jit(f)(*args), want, rtol=1e-5)
        assert explain(f, *args).basis == "arguments"
    assert planner.n_plans == n
    # A measuring planner's un-jitted call times on its arguments, and uses that plan.
    planner = Planner(measure=True, cache_dir=False)
    f = filter_multi_vmap(body, **kw, plan=planner)
    np.testing.assert_allclose(f(x, nu), want, rtol=1e-5)
    n = planner.n_plans
    assert explain(f, jnp.asarray(x), jnp.asarray(nu)).basis == "arguments"
    assert planner.n_plans == n + 1  # the derivative's nest only


def _loop_y_first(y, rate):
    """`_loop` with its parameters in another order than their names sort in."""
    return _loop(rate, y)


@pytest.mark.parametrize("tune_by_keyword", (True, False))
def test_a_tuned_plan_is_found_by_either_spelling_of_the_call(
    tune_by_keyword, tmp_path
):
    # Positional and keyword spellings of one call are one signature: the same
    # leaves in the same order, so the same body, the same plan in memory and on
    # disk, and values equal to `jax.vmap`'s either way.
    rate, y = _args()

    def call(g, by_keyword):
        return g(y=y, rate=rate) if by_keyword else g(y, rate)

    def wrapper(planner):
        in_dims = {"y": "T F", "rate": "T F"}
        return filter_multi_vmap(
            _loop_y_first, in_dims=in_dims, out_dims="T F", plan=planner
        )

    planner = Planner(cache_dir=tmp_path, time_model=TimeModel(), cap=30.0)
    f = wrapper(planner)
    plan = call(ft.partial(tune, f), tune_by_keyword)
    n_plans = planner.n_plans
    reference = jax.vmap(jax.vmap(_loop_y_first))(y, rate)
    for by_keyword in (True, False):
        out = call(jax.jit(f), by_keyword)
        np.testing.assert_allclose(out, reference, rtol=1e-6)
    assert planner.n_plans == n_plans
    again = call(ft.partial(explain, f), not tune_by_keyword)
    assert again.basis == "arguments" and again.chosen.key == plan.chosen.key
    # A new planner (as in a new process, with the default cap) reads the tuned plan
    # from disk (one: a while loop has no derivative to plan).
    fresh = Planner(cache_dir=tmp_path, time_model=TimeModel())
    from_disk = call(ft.partial(explain, wrapper(fresh)), not tune_by_keyword)
    assert from_disk.basis == "arguments" and from_disk.chosen.key == plan.chosen.key
    assert fresh.n_disk_hits == 1 and fresh.n_compiles == 0


def test_a_tuned_method_is_found_by_either_spelling_of_the_call():
    planner = Planner(cache_dir=False, time_model=TimeModel())

    class Model(eqx.Module):
        offset: jax.Array

        @filter_multi_vmap(
            in_dims={"y": "T F", "rate": "T F"}, out_dims="T F", plan=planner
        )
        def __call__(self, y, rate):
            return _loop(rate, y) + self.offset

    model = Model(jnp.asarray(0.5))
    rate, y = _args()
    reference = jax.vmap(jax.vmap(_loop))(rate, y) + 0.5
    plan = tune(model.__call__, y, rate=rate)
    n_plans = planner.n_plans
    jitted = eqx.filter_jit(model)
    for out in (jitted(y, rate), jitted(y=y, rate=rate)):
        np.testing.assert_allclose(out, reference, rtol=1e-6)
    assert planner.n_plans == n_plans
    again = explain(model.__call__, y=y, rate=rate)
    assert again.basis == "arguments" and again.chosen.key == plan.chosen.key


def test_measured_values_reach_the_body(monkeypatch):
    # A spy on the programs measured mode runs: the arguments' rates reach them
    # (made-up floats are in [-1, 1)).
    seen = _first_arguments_run(monkeypatch, lambda x: float(np.max(x)))
    rate, y = _args()
    tune(_wrapper(Planner(cache_dir=False)), rate, y)
    assert seen and max(seen) == 40.0
    # Under jit with a body whose cost is not data-dependent, made-up inputs.
    seen.clear()
    f = filter_multi_vmap(
        lambda x: jnp.sin(x) * 2,
        in_dims="T F",
        out_dims="T F",
        plan=Planner(measure=True, cache_dir=False),
    )
    plan = explain(f, rate * 0 + 5.0)
    assert plan.basis == "inputs" and "Timed on made-up inputs" in plan.summary
    assert seen and max(seen) < 1.0


def test_under_jit_a_data_dependent_body_is_planned_by_the_model(monkeypatch):
    made = []
    monkeypatch.setattr(
        measure, "concrete_inputs", lambda specs: made.append(specs) or 1 / 0
    )
    rate, y = _args()
    planner = Planner(measure=True, cache_dir=False, time_model=TimeModel())
    f = _wrapper(planner)
    plan = explain(f, rate, y)
    assert not made  # nothing fabricated
    assert plan.basis == "model" and not plan.measured
    assert "depends on its data (a while loop): planned by the model" in plan.summary
    assert "`eqx_multimap.tune(f, *args)`" in plan.summary
    np.testing.assert_allclose(jax.jit(f)(rate, y), _reference(rate, y), rtol=1e-6)
    # An un-jitted call measures on its arguments (once per signature).
    monkeypatch.undo()
    n = planner.n_plans
    np.testing.assert_allclose(f(rate, y), _reference(rate, y), rtol=1e-6)
    assert planner.n_plans == n + 1
    f(rate, y)
    assert planner.n_plans == n + 1
    assert explain(f, rate, y).basis == "arguments"


def test_tune_needs_a_planned_function_and_arrays():
    rate, y = _args()
    fixed = filter_multi_vmap(_loop, in_dims=("T F", "T F"), out_dims="T F")
    fixed_nest = r"`filter_multi_vmap\(_loop\)` has a fixed nest;\s+pass `plan='auto'`"
    with pytest.raises(SpecError, match=fixed_nest):
        tune(fixed, rate, y)
    spec = jax.ShapeDtypeStruct(rate.shape, rate.dtype)
    with pytest.raises(SpecError, match=r"must be arrays,\s+not tracers"):
        tune(_wrapper("auto"), spec, spec)


_SCRIPT = """
import jax.numpy as jnp, sys
sys.path.insert(0, {tests!r})
from test_measure import _args, _wrapper
from eqx_multimap import Planner, explain, tune
planner = Planner(cache_dir={cache!r})
f = _wrapper(planner)
if sys.argv[1] == "tune":
    tune(f, *_args())
else:
    f(*_args())  # planned as usual: the tuned plan, from disk
counts = planner.n_compiles, planner.n_disk_hits
plan = explain(f, *_args())
print(plan.basis, plan.chosen.scan, plan.chosen.vmap, *counts)
"""


def test_a_tuned_plan_is_reused_by_a_new_process(tmp_path):
    script = tmp_path / "run.py"
    tests = os.path.dirname(os.path.abspath(__file__))
    script.write_text(_SCRIPT.format(tests=tests, cache=str(tmp_path / "cache")))
    env = {**os.environ, "PYTHONPATH": os.path.dirname(tests)}

    def run(how):
        out = subprocess.run(
            [sys.executable, str(script), how],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.split("\n")[-2]

    first = run("tune")
    assert first.startswith("arguments") and not first.endswith(" 0 0")
    # A new process, with a planner that does not measure, reads it from disk.
    second = run("explain")
    basis, rest = second.split(" ", 1)
    assert basis == "arguments" and rest.endswith(" 0 1")  # no compile, a disk hit
    assert rest.rsplit(" ", 2)[0] == first.split(" ", 1)[1].rsplit(" ", 2)[0]


def test_tune_searches_when_full_vmap_and_all_but_one_rung_are_over_budget():
    # Full vmap over the budget, and no ladder with two rungs that fit besides the
    # block of one element (in lockstep, timed on its own): each ladder is a line
    # of one rung (they were dropped, and the search raised).
    def body(x):
        def step(s):
            return s[0] + 1, jnp.tanh(jnp.outer(s[1], s[1])) @ s[1] + 1.0

        more = lambda s: (s[0] < 20) & (jnp.sum(s[1]) < 1e6)  # noqa: E731
        return jax.lax.while_loop(more, step, (0, x))[1]

    f = filter_multi_vmap(
        body, in_dims="A B K", out_dims="A B K", core="K",
        plan=Planner(time_model=TimeModel(), cache_dir=False),
        memory_budget=64 * 2**10,
    )  # fmt: skip
    x = jnp.full((32, 8, 64), 0.01)
    plan = tune(f, x)
    assert "could not measure" not in plan.summary
    timed = [c for c in plan.candidates if c.measured is not None]
    assert len(timed) >= 2 and all(c.fits for c in timed)
    np.testing.assert_allclose(f(x), jax.vmap(jax.vmap(body))(x), rtol=1e-5)


def test_a_measured_plan_says_what_was_timed_when_full_vmap_sufficed():
    # Full vmap's working set is small, so the model compiles nothing else; measured
    # mode still times the ladders, and the summary says so.
    f = filter_multi_vmap(
        lambda x, y: jnp.sin(x) * y, in_dims=("T F", "F"), out_dims="T F", plan="auto"
    )
    x, y = jnp.ones((8, 4)), jnp.linspace(0.0, 1.0, 4)
    plan = tune(f, x, y)
    n = sum(c.measured is not None for c in plan.candidates)
    assert n > 1 and plan.measured and plan.basis == "arguments"
    assert "nothing else was compiled" not in plan.summary
    assert f"the fastest of the {n} timed" in plan.summary
    np.testing.assert_allclose(f(x, y), np.sin(np.asarray(x)) * np.asarray(y))


def test_a_measured_plan_with_one_candidate_timed_does_not_call_it_the_fastest(
    monkeypatch,
):
    # Every candidate but the first timed (full vmap) is compiled whole and found over
    # the budget, as under a budget only full vmap fits: one ran, none beside it.
    def fake_time(self, c):
        if c.key not in self.timed:
            ran = [] if self.timed else [1e-3]  # no rounds: over the budget
            self.timed[c.key] = measure.Timed(lambda: None, {}, 1.0, 1e-3, ran)
        return self.seconds(c.key)

    monkeypatch.setattr(measure.Tuner, "time", fake_time)
    monkeypatch.setattr(measure.Tuner, "confirm", lambda self: None)
    f = filter_multi_vmap(
        _outer_tanh, in_dims="T B K", out_dims="T B",
        plan=Planner(cache_dir=False, time_model=TimeModel()),
    )  # fmt: skip
    x = jax.random.normal(jax.random.key(0), (16, 8, 4))
    plan = tune(f, x)
    assert [c for c in plan.candidates if c.measured is not None] == [plan.chosen]
    assert not plan.chosen.scan and "the only one timed (measured 1 ms)" in plan.summary
    assert plan.chosen.reason == "chosen: the only one timed (measured 1 ms)"
    assert "the fastest of" not in str(plan)
    # The rungs left on ladders whose steps were over the budget say so.
    left = [c.reason for c in plan.candidates if "its ladder's first step" in c.reason]
    assert left and all(r.endswith("the fastest, or over budget") for r in left)
    np.testing.assert_allclose(
        f(x), jax.vmap(jax.vmap(_outer_tanh))(x), rtol=1e-5, atol=1e-4
    )


def test_a_plan_whose_timing_failed_says_so_and_rests_on_the_model(monkeypatch):
    def fail(self, *args):
        raise RuntimeError("no timer here\nand a second line")

    monkeypatch.setattr(measure.Tuner, "run", fail)
    f = filter_multi_vmap(
        lambda x: jnp.sin(x), in_dims="T F", out_dims="T F", plan="auto"
    )
    plan = tune(f, jnp.ones((8, 4)))
    assert plan.basis == "model" and not plan.measured
    assert "(could not measure (RuntimeError: no timer here), so estimated)" in (
        plan.summary
    )
    assert "second line" not in plan.summary


def test_measuring_compiles_its_candidates_and_nothing_else():
    # The candidates are traced as the call traces them: the body's constant
    # expressions are not run eagerly on the way (each would be a compile of its own).
    def body(x):
        c = jnp.cos(jnp.arange(13.0)).sum() * jnp.exp(jnp.float32(0.37))
        return jnp.sin(x) * c

    model = TimeModel.for_backend(jax.default_backend())  # nothing to calibrate
    planner = Planner(cache_dir=False, time_model=model)
    f = filter_multi_vmap(body, in_dims="T F", out_dims="T F", plan=planner)
    x = jnp.linspace(0.0, 1.0, 24).reshape(6, 4)
    from .helpers import load_benchmark  # here: `_SCRIPT` imports this module bare

    with load_benchmark("harness").count_compiles() as counts:
        plan = tune(f, x)
    n = counts["compiles"]
    assert isinstance(plan.gradient, Plan) and plan.measured
    # At most one more: the probe that finds rounds another job disturbed.
    assert n <= plan.n_compiled + plan.gradient.n_compiled + 1, n
    np.testing.assert_allclose(
        f(x), np.sin(x) * (np.cos(np.arange(13.0)).sum() * np.exp(0.37)), rtol=1e-5
    )


def test_under_jit_measuring_runs_a_callback_on_arrays():
    # Candidates timed while the outer function is traced: the body's callbacks
    # get arrays, not the outer trace's tracers.
    seen = []

    def body(v):
        jax.debug.callback(lambda a: seen.append(isinstance(a, jax.core.Tracer)), v)
        return v * 2

    f = filter_multi_vmap(
        body, in_dims="T F", out_dims="T F", plan=Planner(measure=True, cache_dir=False)
    )
    x = jnp.arange(8.0).reshape(4, 2)
    out = jax.jit(f)(x)
    jax.effects_barrier()
    assert seen and not any(seen) and explain(f, x).basis == "inputs"
    np.testing.assert_array_equal(out, 2 * np.arange(8.0).reshape(4, 2))


def test_a_function_jitted_before_tune_runs_the_tuned_nest(monkeypatch):
    # JAX keeps a trace by function: `jax.jit(f)` after `tune` would reuse the one
    # made with the model's plan, unless replacing the plan drops it.
    traced = []

    def body(x):
        traced.append(x)
        return jnp.sin(x)

    x = jnp.linspace(-3.0, 3.0, 64 * 32).reshape(64, 32)
    f = filter_multi_vmap(body, in_dims="T F", out_dims="T F", plan="auto")
    want = np.sin(np.asarray(x))
    np.testing.assert_allclose(jax.jit(f)(x), want, rtol=1e-6)
    before = explain(f, x).chosen
    _landscape(monkeypatch, _valley(1 if before.block > 1 else 64 * 32))
    tuned = tune(f, x)
    assert tuned.chosen.key != before.key
    traced.clear()
    np.testing.assert_allclose(jax.jit(f)(x), want, rtol=1e-6)
    assert traced  # traced again, with the tuned plan
    loops = str(jax.jit(f).lower(x).as_text()).count("while")
    assert loops == len(tuned.chosen.scan) > 0 or loops == 0 == len(tuned.chosen.scan)


def test_calibration_runs_on_one_device_under_a_mesh(monkeypatch):
    seen = []

    def calibrate():
        seen.append(jax.sharding.get_abstract_mesh())
        return TimeModel.for_backend("cpu")

    monkeypatch.setattr(planner_module, "calibrate", calibrate)
    mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    f = filter_multi_vmap(
        jnp.sin, in_dims="T F", out_dims="T F", plan=Planner(cache_dir=False)
    )  # no time model given: it is calibrated at the first plan
    with jax.set_mesh(mesh):
        plan = explain(f, jnp.ones((8, 4)))
    assert seen and seen[0].empty and plan.chosen is not None


_MODEL = TimeModel.for_backend("cpu")  # no calibration


def predict_visibilities_per_baseline_and_channel(x):
    return jnp.tanh(x)


def test_a_plan_header_fits_the_page():
    f = filter_multi_vmap(
        predict_visibilities_per_baseline_and_channel,
        in_dims="T F",
        out_dims="T F",
        plan=Planner(measure=True, cache_dir=False, time_model=_MODEL),
    )
    text = explain(f, jnp.ones((8, 4))).describe(full=True)
    assert "predict_visibilities_per_baseline_and_channel): plan=" in " ".join(
        text.split()
    )
    assert max(map(len, text.splitlines())) <= 100


def test_no_fit_names_the_planner_given():
    # Each element's K x K intermediate (4 KiB) is over the budget.
    f = filter_multi_vmap(
        lambda a, b: jnp.sum(jnp.exp(a[:, None] * b[None, :]) @ b),
        in_dims=("T K", "K"),
        out_dims="T",
        plan=Planner(measure=True, cache_dir=False, time_model=_MODEL),
        memory_budget=64,
    )
    with pytest.raises(
        SpecError, match=r"with `plan=Planner\(measure=True\)`: no nest fits"
    ):
        f(jnp.ones((8, 32)), jnp.ones(32))
