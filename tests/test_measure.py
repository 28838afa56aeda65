"""Measured mode on real data: `eqx_multimap.tune`, un-jitted calls of a measuring
planner, sub-slices, the cap, and bodies whose cost depends on their data."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from eqx_multimap import explain, filter_multi_vmap, Planner, SpecError, tune
from eqx_multimap._body import data_dependent
from eqx_multimap._planner import cost
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

        def call(args):
            seen.append(summarise(np.asarray(args[0])))
            return compiled(args)

        return call

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


def test_sub_slice_spreads_whole_chunks():
    sizes = {"T": 32, "F": 16}
    c = PlanCandidate((("T", None), ("F", 4)), (), 4, 128, "ladder")
    index = cost.sub_slice(c, sizes)
    # Whole chunks of 4, spread over F; the loop trips shared out between T and F.
    assert list(index["F"]) == list(range(16))  # 4 chunks of 4
    assert len(index["T"]) * len(index["F"]) >= cost.MIN_SLICE * 512
    assert list(index["T"]) == [0, 10, 21, 31]  # spread to the last
    one = PlanCandidate((("T", None), ("F", None)), (), 1, 512, "ladder")
    assert [len(x) for x in cost.sub_slice(one, sizes).values()] == [8, 8]
    full = PlanCandidate((), ("T", "F"), 512, 1, "full vmap")
    assert cost.sub_slice(full, sizes) == {}


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
        cost, "concrete_inputs", lambda specs: made.append(specs) or 1 / 0
    )
    rate, y = _args()
    planner = Planner(measure=True, cache_dir=False)
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


def test_the_cap_times_fewer_candidates(monkeypatch):
    rate, y = _args()
    counts = {}
    for cap in (1e-6, 1e6):
        monkeypatch.setattr(cost, "CAP", cap)
        plan = tune(_wrapper(Planner(cache_dir=False)), rate, y)
        counts[cap] = sum(c.measured is not None for c in plan.candidates)
    # A tiny cap still times the walk's first steps: the smallest block, and a
    # block along each of the two dims.
    assert counts[1e-6] == 3 < counts[1e6]


def test_a_candidate_timed_while_a_core_was_taken_is_timed_again(monkeypatch):
    # Another job held a core while every candidate but the first ran: each is
    # timed again, side by side, however slow it seemed. (Marking one only, the
    # test would depend on its time: alone the fastest, it has no one to race.)
    class Disturbed(cost.Probe):
        def __init__(self):
            super().__init__(run=lambda: None)

        def time(self, clock=None):
            self.times.append(3.0 if self.times else 1.0)

    confirmed, timers = [], []
    interleaved, confirm = cost.time_interleaved, cost.Timer.confirm

    def spy(fns, *args, **kwargs):
        confirmed.append((list(fns), kwargs["probe"]))
        return interleaved(fns, *args, **kwargs)

    def keep(self):
        timers.append(self)
        return confirm(self)

    monkeypatch.setattr(cost, "Probe", Disturbed)
    monkeypatch.setattr(cost, "KEEP_WITHIN", 1.0)  # none re-timed for being close
    monkeypatch.setattr(cost, "time_interleaved", spy)
    monkeypatch.setattr(cost.Timer, "confirm", keep)
    tune(_wrapper(Planner(cache_dir=False)), *_args())
    (timer,) = timers
    ((fns, probe),) = confirmed
    late = [k for k, i in timer.probed.items() if i >= 1]
    assert probe is timer.probe and probe.disturbed()[:3] == [False, True, True]
    assert len(timer.timed) >= 3 and len(late) == len(timer.timed) - 1
    assert all(timer.runs[k][0] in fns for k in late)


def _outer_tanh(x):
    """No while loop: its cost does not depend on its data."""
    return jnp.sum(jnp.tanh(jnp.outer(x, x)) @ x)


def test_a_quick_call_is_timed_whole(monkeypatch):
    # No while loop: the blocks are timed on the whole call when it is est. quick,
    # else each on a slice of a few of its blocks.
    from eqx_multimap._planner import search

    x = jax.random.normal(jax.random.key(0), (256, 8, 16))
    seen = _first_arguments_run(monkeypatch, lambda a: a.shape[:2])
    for below, what in ((1e9, "each on the whole call"), (0.0, "each on a slice")):
        monkeypatch.setattr(search, "WHOLE_BELOW", below)
        seen.clear()
        f = filter_multi_vmap(
            _outer_tanh, in_dims="T B K", out_dims="T B", plan=Planner(cache_dir=False)
        )
        plan = tune(f, x)
        assert what in plan.summary and plan.chosen.measured is not None
        assert seen and (below == 0 or all(s == (256, 8) for s in seen))
        # Each element sums 256 float32 products of size ~1 in an order the nest
        # picks (XLA fuses the block's matmul differently), so the absolute
        # error is a few 1e-5 where the sum nearly cancels.
        np.testing.assert_allclose(
            f(x), jax.vmap(jax.vmap(_outer_tanh))(x), rtol=1e-5, atol=1e-4
        )


def test_measured_mode_compiles_the_memory_of_its_choice_only():
    # Candidates are costed as `plan="auto"` costs them, their temporaries
    # predicted; only the one chosen is compiled to check that it fits (unless
    # predicted far within the budget). It fits, compiled as a fixed nest too.
    from eqx_multimap._planner.search import SAFE_FRACTION

    x = jax.random.normal(jax.random.key(0), (64, 16, 32))
    kw = dict(in_dims="T B K", out_dims="T B")
    wide = filter_multi_vmap(_outer_tanh, **kw, plan=Planner(cache_dir=False))
    budget = explain(wide, x).chosen.temp_bytes // 4  # full vmap's does not fit
    f = filter_multi_vmap(
        _outer_tanh, **kw, plan=Planner(cache_dir=False), memory_budget=budget
    )
    plan = tune(f, x)
    assert sum(c.measured is not None for c in plan.candidates) >= 2
    assert any(c.predicted for c in plan.candidates)
    chosen = plan.chosen
    assert not chosen.predicted or chosen.temp_bytes <= SAFE_FRACTION * budget
    fixed = filter_multi_vmap(_outer_tanh, **kw, scan=plan.scan, vmap=plan.vmap)
    assert explain(fixed, x).chosen.temp_bytes <= budget
    np.testing.assert_allclose(
        f(x), jax.vmap(jax.vmap(_outer_tanh))(x), rtol=1e-5, atol=1e-4
    )


def test_the_walk_times_every_block_on_the_same_elements(monkeypatch):
    # The elements' loop counts differ along F, so a block is only comparable with
    # another on the same elements: every program the walk runs sees the same
    # rates, spread over F (its first and last included), whatever its block.
    seen = _first_arguments_run(monkeypatch, lambda x: sorted(x.ravel().tolist()))
    rate = jnp.broadcast_to(jnp.linspace(2.0, 40.0, 64), (16, 64))
    f = filter_multi_vmap(
        _loop, in_dims=("T F", "T F"), out_dims="T F", plan=Planner(cache_dir=False)
    )
    plan = tune(f, rate, jnp.ones_like(rate))
    timed = [c for c in plan.candidates if c.measured is not None]
    assert len(timed) >= 3 and {c.block for c in timed} >= {1, 8}
    assert len(seen) >= len(timed) and all(s == seen[0] for s in seen)
    assert seen[0][0] == 2.0 and seen[0][-1] == 40.0
    assert len(seen[0]) < rate.size  # a slice: runs of 8 along each dim


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
