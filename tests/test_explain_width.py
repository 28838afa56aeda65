"""Every line that `explain`, `str(plan)` and `verbose=True` print is at most 100
columns: what a docs page's code block shows at 1,280 px, and a wide terminal."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from eqx_multimap import explain, filter_multi_vmap, Plan, Planner, SpecError, TimeModel
from eqx_multimap._text import wrap_nest

from .helpers import clean_env


ROOT = pathlib.Path(__file__).parent.parent
COLUMNS = 100


def _texts(plan: Plan) -> list[str]:
    """Every text a plan prints."""
    texts = [str(plan), plan.describe(full=True), plan.table(all=True)]
    return texts + [plan.describe(gradient=g) for g in (True, False)]


def _check(text: str) -> None:
    long = [line for line in text.splitlines() if len(line) > COLUMNS]
    assert not long, "\n".join(f"{len(line)}: {line}" for line in long)


def _planner(**kwargs) -> Planner:
    return Planner(cache_dir=False, time_model=TimeModel(), **kwargs)


def _sumexp(a, b):
    return jnp.sum(jnp.exp(a[:, None] * b[None, :]) @ b)


# Three mapped dims with long names and sizes that leave remainders: long nests.
_DIMS = dict(
    in_dims=("time frequency baseline K", "time K"),
    out_dims="time frequency baseline",
)
_ARGS = (
    jax.ShapeDtypeStruct((13, 7, 11, 32), jnp.float32),
    jax.ShapeDtypeStruct((13, 32), jnp.float32),
)
_ONE = 32 * 32 * 4  # the intermediate of one element


@pytest.mark.parametrize(
    "strategies",
    [
        {},
        {"scan": "time"},
        {"scan": {"time": 4, "frequency": 2}, "vmap": "baseline"},
        {"scan": {"baseline": 3}, "vmap": "frequency time"},
    ],
)
def test_fixed_nests(strategies):
    plan = explain(filter_multi_vmap(_sumexp, **_DIMS, **strategies), *_ARGS)
    assert not plan.auto
    for text in _texts(plan):
        _check(text)


@pytest.mark.parametrize("budget", [2**30, 40 * _ONE, 6 * _ONE])
def test_auto_with_and_without_a_search(budget):
    f = filter_multi_vmap(_sumexp, **_DIMS, plan=_planner(), memory_budget=budget)
    plan = explain(f, *_ARGS)
    assert plan.auto and isinstance(plan.gradient, (Plan, str))
    if budget < 2**30:  # the budget forces a search, forward and backward
        assert plan.n_compiled > 1 and plan.chosen.scan
    texts = _texts(plan)
    if isinstance(plan.gradient, Plan):
        assert plan.gradient.backward
        texts += _texts(plan.gradient)
    for text in texts:
        _check(text)


def test_given_strategies_and_a_fractional_budget():
    f = filter_multi_vmap(
        _sumexp, **_DIMS, scan={"time": 5}, plan=_planner(), memory_budget=0.25
    )
    plan = explain(f, *_ARGS)
    assert plan.given == ("time",) and "physical RAM" in plan.budget_source
    for text in _texts(plan):
        _check(text)


def test_no_fit():
    f = filter_multi_vmap(_sumexp, **_DIMS, plan=_planner(), memory_budget=64)
    with pytest.raises(SpecError, match="no nest fits") as info:
        explain(f, *_ARGS)
    _check(str(info.value))
    # Under differentiation only: the forward plan shows the gradient's error.
    f = filter_multi_vmap(_sumexp, **_DIMS, plan=_planner(), memory_budget=6 * _ONE)
    plan = explain(f, *_ARGS)
    assert isinstance(plan.gradient, str) and "no nest fits" in plan.gradient
    for text in _texts(plan):
        _check(text)


@pytest.mark.slow
def test_measured():
    f = filter_multi_vmap(
        _sumexp, **_DIMS, plan=_planner(measure=True), memory_budget=40 * _ONE
    )
    plan = explain(f, *_ARGS)
    assert plan.measured and any(c.measured for c in plan.candidates)
    for text in _texts(plan):
        _check(text)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")
@pytest.mark.parametrize("planned", [False, True])
def test_shard(planned, capsys):
    mesh = jax.make_mesh((4, 2), ("devices_a", "devices_b"))
    # Two sharded dims make the longest nest line; planned, one, on all 8 devices.
    shard = {"time": "devices_a", "frequency": "devices_b"}
    plan = {}
    if planned:
        shard = {"time": ("devices_a", "devices_b")}
        plan = dict(plan=_planner(), memory_budget=20 * _ONE)
    f = filter_multi_vmap(
        _sumexp,
        **_DIMS,
        shard=shard,
        mesh=mesh,
        pad=True,
        verbose=True,
        **plan,
    )
    plan = explain(f, *_ARGS)
    assert plan.shard and plan.auto == planned
    if planned:
        assert plan.n_compiled > 1
    for text in _texts(plan):
        _check(text)
    f(*[jnp.ones(a.shape, a.dtype) for a in _ARGS])
    _check(capsys.readouterr().out)  # verbose: the plan, or the nest


def test_verbose(capsys):
    f = filter_multi_vmap(
        _sumexp, **_DIMS, scan={"time": 4, "frequency": 2}, verbose=True
    )
    args = [jnp.ones(a.shape, a.dtype) for a in _ARGS]
    f(*args)
    out = capsys.readouterr().out
    assert "-> body" in out
    _check(out)


def test_wrap_nest():
    line = "f: scan(T: 2 chunks of 4) + vmap(T remainder=2) -> vmap(F=3) -> body"
    assert wrap_nest(line, 100) == line
    assert wrap_nest(line, 50) == (
        "f: scan(T: 2 chunks of 4) + vmap(T remainder=2)\n    -> vmap(F=3) -> body"
    )
    # A piece with no arrow in it (the shard_map of several dims) breaks after `;`.
    line = "f: shard_map(T=8 over 'x': 2 shards of 4; F=3 over 'y': 1 shard of 3)"
    line += " -> body"
    assert wrap_nest(line, 50) == (
        "f: shard_map(T=8 over 'x': 2 shards of 4;\n"
        "       F=3 over 'y': 1 shard of 3) -> body"
    )
    line = "f: shard_map(T=16 over ('x', 'y'): 8 shards of 2) -> body"
    assert wrap_nest(line, 40) == (
        "f:\n       shard_map(T=16 over ('x', 'y'): 8 shards of 2)\n    -> body"
    )


# A symbolic size (jax.export) is planned at a stand-in size; in a process of its
# own, as `test_wrapper_state.py`'s export tests.
_SYMBOLIC = """
import json
import jax, jax.numpy as jnp
from eqx_multimap import explain, filter_multi_vmap, Planner, TimeModel

(t,) = jax.export.symbolic_shape("t")
f = filter_multi_vmap(
    lambda x: jnp.sum(jnp.exp(jnp.outer(x, x))), in_dims="time K", out_dims="time",
    plan=Planner(cache_dir=False, time_model=TimeModel()),
)
plan = explain(f, jax.ShapeDtypeStruct((t, 64), jnp.float32))
print(json.dumps([str(plan), plan.describe(full=True), plan.summary]))
"""


def test_symbolic():
    proc = subprocess.run(
        [sys.executable, "-c", _SYMBOLIC],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env=clean_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text, full, summary = json.loads(proc.stdout.splitlines()[-1])
    assert summary.startswith("Symbolic sizes: ")
    _check(text)
    _check(full)
