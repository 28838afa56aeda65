"""A wrapper is a value: it copies, pickles, compares and ships like
`eqx.filter_vmap`'s, whatever the process planned before; the planner's state (plans,
calibration) sits beside it, safe under threads and processes; and it works under
`checkify`, under every strategy (`jax.export`: `test_export.py`).

Each test compares against an independent reference (a Python loop and `np.stack`,
or a hand-written nest); upstream failures are pinned by tests that fail once
upstream fixes them.
"""

import contextlib
import copy
import functools
import gc
import json
import os
import pathlib
import pickle
import subprocess
import sys
import threading
import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from eqx_multimap import (
    _multi_vmap,
    _planner,
    explain,
    filter_multi_vmap,
    Monoid,
    multi_vmap,
    Planner,
    TimeModel,
)
from eqx_multimap._planner import default_planner
from jax._src.core import ShardingTypeError  # not public in JAX 0.10.2
from jax.experimental import checkify
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


ROOT = pathlib.Path(__file__).resolve().parents[1]

T, B = 8, 16
# Full vmap keeps `T` blocks of `B x B` floats (8 KiB): this budget makes the
# planner search, and scan.
BUDGET = 3 * 1024

STRATEGIES = {
    "vmap": dict(),
    "scan": dict(scan="T"),
    "chunked": dict(scan={"T": 3}),  # two chunks of 3, and a remainder of 2
    "auto": dict(plan="auto", memory_budget=BUDGET),
    "shard": dict(shard={"T": "d"}),  # 4 simulated devices, the ambient mesh
    "shim": None,
}


def body(x):
    """On one row `x` of `B`: a `B x B` temporary that a matmul needs whole."""
    w = jnp.exp(jnp.outer(x, x) * 0.01)
    return (w @ x) / jnp.sum(w, axis=1)


def checked(x):
    checkify.check(jnp.min(x) > 0, "x must be positive, min {m}", m=jnp.min(x))
    return body(x)


def reference(x) -> np.ndarray:
    return np.stack([np.asarray(body(x[i])) for i in range(x.shape[0])])


def make(fn, strategy: str, **extra):
    if strategy == "shim":
        return multi_vmap(fn, "[T]", "[T,...]")
    kw = {**STRATEGIES[strategy], **extra}
    return filter_multi_vmap(fn, in_dims="T B", out_dims="T B", core="B", **kw)


def mesh(kind=AxisType.Auto):
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 (simulated) devices; see conftest.py")
    return jax.make_mesh((4,), ("d",), axis_types=(kind,), devices=jax.devices()[:4])


def where(strategy: str):
    """The context a strategy runs in: the ambient mesh for `shard`."""
    if strategy == "shard":
        return jax.set_mesh(mesh())
    return contextlib.nullcontext()


def inputs(n: int = T) -> jax.Array:
    return jnp.linspace(0.5, 2.0, n * B, dtype=jnp.float32).reshape(n, B)


#
# Copies, pickles, equality (issue 30, D and E).
#


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_copies_are_equal_and_reuse_the_compile(strategy):
    f = make(body, strategy)
    x = inputs()
    traces = []

    @eqx.filter_jit
    def jitted(fn, x):
        traces.append(fn)
        return fn(x)

    with where(strategy):
        out = f(x)
        np.testing.assert_allclose(out, reference(x), rtol=1e-5)
        jitted(f, x)
        for g in (copy.copy(f), copy.deepcopy(f), pickle.loads(pickle.dumps(f))):
            assert eqx.tree_equal(f, g) is True
            assert f == g and hash(f) == hash(g)
            assert repr(f) == repr(g)
            np.testing.assert_array_equal(g(x), out)
            np.testing.assert_array_equal(jitted(g, x), out)
    # The copies reused the first compile.
    assert len(traces) == 1
    if strategy == "auto":
        assert "plan='auto'" in repr(f)
        assert copy.deepcopy(f)._options.plan.planner is default_planner()


def test_auto_was_searched():
    # The `auto` strategy above plans under a budget that full vmap exceeds.
    plan = explain(make(body, "auto"), inputs())
    assert plan.scan and plan.chosen.fits
    assert any(c.fits is False for c in plan.candidates)


def test_pickle_is_small_and_independent_of_history():
    f = filter_multi_vmap(body, in_dims="T B", out_dims="T B", core="B", plan="auto")
    before = pickle.dumps(f)
    # Other wrappers plan what could not be pickled: a reduction by a function
    # that pickles by reference only, and a sharded map (its devices).
    lse = Monoid(jnp.logaddexp, -jnp.inf)
    g = filter_multi_vmap(
        body, in_dims="T B", out_dims="B", reduce={"T": lse}, core="B", plan="auto"
    )
    g(inputs())
    with jax.set_mesh(mesh()):
        make(body, "shard")(inputs())
        sharded = filter_multi_vmap(
            body,
            in_dims="T B",
            out_dims="T B",
            core="B",
            shard={"T": "d"},
            plan="auto",
        )
        sharded(inputs())
    for n in range(2, 12):
        f(inputs(n))
    after = pickle.dumps(f)
    assert after == before
    # As small as `eqx.filter_vmap`'s, give or take the options.
    assert len(after) < 4 * len(pickle.dumps(eqx.filter_vmap(body))) < 2000
    loaded = pickle.loads(after)
    assert loaded == f
    np.testing.assert_allclose(loaded(inputs(5)), reference(inputs(5)), rtol=1e-5)


def test_own_planner_copies_and_pickles(tmp_path):
    planner = Planner(cache_dir=tmp_path, time_model=TimeModel())
    f = filter_multi_vmap(body, in_dims="T B", out_dims="T B", core="B", plan=planner)
    f(inputs())
    assert copy.deepcopy(planner) is planner
    g = copy.deepcopy(f)
    assert g == f and g._options.plan.planner is planner
    # A pickle carries the planner's arguments only; the plan is read from disk.
    loaded = pickle.loads(pickle.dumps(f))
    assert loaded == f and loaded._options.plan.planner is not planner
    assert len(pickle.dumps(planner)) < 1000
    other = loaded._options.plan.planner
    # (Un-jitted, `loaded` would reuse `f`'s compile: they are equal.)
    out = jax.jit(lambda x: loaded(x))(inputs())
    np.testing.assert_allclose(out, reference(inputs()), rtol=1e-5)
    assert other.n_plans == 0 and other.n_disk_hits == 1
    assert Planner(measure=True) != Planner() == Planner()


def test_no_module_state_patched():
    # The planner of `plan="auto"` is read, never replaced.
    assert not hasattr(_planner, "DEFAULT_PLANNER")
    assert default_planner() is default_planner()
    assert not hasattr(_multi_vmap, "_eager_runners")
    assert isinstance(_multi_vmap._RUNNERS, weakref.WeakKeyDictionary)

    def make_fn():
        def fn(x):
            return jnp.sin(x) * 2

        return fn

    x = jnp.arange(3.0)
    for build in (make_fn, lambda: functools.partial(make_fn())):
        fn = build()
        f = filter_multi_vmap(fn, in_dims="T", out_dims="T")
        np.testing.assert_allclose(f(x), np.sin(np.arange(3.0)) * 2, rtol=1e-6)
        assert fn in _multi_vmap._RUNNERS
        alive = weakref.ref(fn)
        del f, fn
        gc.collect()
        # Released with the function, with what it compiled.
        assert alive() is None


#
# Calibration and plans under threads and processes (issue 30, A).
#

_PROCESS = """
import sys, time
import jax.numpy as jnp
from eqx_multimap import filter_multi_vmap, Planner

planner = Planner(cache_dir=sys.argv[1])
f = filter_multi_vmap(jnp.sin, in_dims="T", out_dims="T", plan=planner)
if len(sys.argv) > 2:  # wait for the others
    print("ready", flush=True)
    while not __import__("os").path.exists(sys.argv[2]):
        time.sleep(0.01)
for n in range(8):
    f(jnp.ones(n + 2))
print(planner.n_calibrations, planner.n_plans, planner.n_disk_hits, flush=True)
"""


def _process(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _PROCESS, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def _counts(proc: subprocess.Popen) -> list[int]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return [int(n) for n in out.split()[-3:]]


@pytest.mark.slow
def test_one_calibration_for_threads_and_processes(tmp_path):
    cache, go = tmp_path / "cache", tmp_path / "go"
    procs = [_process(str(cache), str(go)) for _ in range(2)]
    for proc in procs:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
    planner = Planner(cache_dir=cache)
    f = filter_multi_vmap(jnp.sin, in_dims="T", out_dims="T", plan=planner)
    outs: dict[int, jax.Array] = {}
    threads = [
        threading.Thread(target=lambda n=n: outs.update({n: f(jnp.ones(n + 2))}))
        for n in range(8)
    ]
    go.touch()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    counts = [_counts(p) for p in procs]
    for n in range(8):
        np.testing.assert_allclose(outs[n], np.sin(np.ones(n + 2)), rtol=1e-6)
    # One calibration in all, and one stored.
    assert planner.n_calibrations + sum(c[0] for c in counts) == 1
    assert len(list(cache.glob("v*/calibration/*.json"))) == 1
    # A later process plans nothing again, and does not calibrate.
    assert _counts(_process(str(cache))) == [0, 0, 8]


def test_threads_share_one_calibration(tmp_path):
    planner = Planner(cache_dir=tmp_path)
    models = []
    threads = [
        threading.Thread(target=lambda: models.append(planner.time_model))
        for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert planner.n_calibrations == 1
    assert len(models) == 8 and all(m is models[0] for m in models)


def test_calibrating_again_keeps_the_plans(tmp_path):
    x = inputs()

    def wrap(planner):
        return filter_multi_vmap(
            body, in_dims="T B", out_dims="T B", core="B", plan=planner
        )

    first = Planner(cache_dir=tmp_path)
    wrap(first)(x)
    assert first.n_calibrations == 1 and first.n_plans == 1
    # Calibrate again, with other (noisy) constants.
    (stored,) = tmp_path.glob("v*/calibration/*.json")
    record = json.loads(stored.read_text())
    record["value"]["flops"] *= 3
    record["value"]["bandwidth"] /= 6
    stored.write_text(json.dumps(record))
    second = Planner(cache_dir=tmp_path)
    # (Un-jitted, it would reuse the first wrapper's compile: they are equal.)
    out = jax.jit(lambda x: wrap(second)(x))(x)
    np.testing.assert_allclose(out, reference(x), rtol=1e-5)
    assert second.time_model.flops == 3 * first.time_model.flops
    assert second.n_plans == 0 and second.n_disk_hits == 1
    # A time model given by hand is part of the key.
    third = Planner(cache_dir=tmp_path, time_model=TimeModel())
    jax.jit(lambda x: wrap(third)(x))(x)
    assert third.n_plans == 1


#
# checkify (issue 30, B).
#


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_checkify_through_every_strategy(strategy, jit):
    # `shard` on a mesh given (`checkify` fails under an ambient mesh: upstream,
    # see `test_plain_shard_map_checkify_fails_too`).
    extra = dict(mesh=mesh()) if strategy == "shard" else {}
    f = checkify.checkify(make(checked, strategy, **extra))
    if jit:
        f = jax.jit(f)
    good = inputs()
    bad = good.at[5, 3].set(-1.0)
    err, out = f(good)
    assert err.get() is None
    np.testing.assert_allclose(out, reference(good), rtol=1e-5)
    err, _ = f(bad)
    message = err.get()
    assert message is not None and "x must be positive, min -1.0" in message


@pytest.mark.parametrize("strategy", ["vmap", "auto"])
def test_checkify_under_grad(strategy):
    f = make(checked, strategy)

    def loss(x):
        return jnp.sum(f(x))

    x = inputs()
    err, grad = checkify.checkify(jax.grad(loss))(x)
    assert err.get() is None
    expected = jax.grad(lambda x: jnp.sum(jax.vmap(body)(x)))(x)
    np.testing.assert_allclose(grad, expected, rtol=1e-5)
    if strategy == "vmap":  # a scanned nest loses it: upstream, as below
        err, _ = checkify.checkify(jax.grad(loss))(x.at[0, 0].set(-1.0))
        assert "x must be positive" in str(err.get())


def test_plain_scan_loses_checks_under_grad_too():
    """`checkify` of the gradient of a hand-written `lax.map` drops the body's
    check, as our scanned nests do (JAX 0.10.2). When this test fails, upstream has
    fixed it: check the message under grad for every strategy above."""
    x = inputs().at[0, 0].set(-1.0)
    err, _ = checkify.checkify(jax.grad(lambda x: jnp.sum(jax.lax.map(checked, x))))(x)
    assert err.get() is None


_EXPLICIT_CHECKIFY = (
    "upstream (JAX 0.10.2): `checkify` gathers its error from an array sharded "
    "over an explicit mesh axis, and JAX cannot infer that gather's sharding"
)


@pytest.mark.xfail(raises=ShardingTypeError, reason=_EXPLICIT_CHECKIFY)
def test_checkify_shard_on_explicit_mesh():
    m = mesh(AxisType.Explicit)
    f = filter_multi_vmap(
        checked, in_dims="T B", out_dims="T B", core="B", shard={"T": "d"}, mesh=m
    )
    x = jax.device_put(inputs(), NamedSharding(m, P("d")))
    err, out = checkify.checkify(f)(x)
    assert err.get() is None
    np.testing.assert_allclose(out, reference(inputs()), rtol=1e-5)


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto])
def test_plain_shard_map_checkify_fails_too(kind):
    """`checkify` of a hand-written `jax.shard_map` under an ambient mesh fails
    (JAX 0.10.2), as ours does on an explicit mesh. When this test fails, upstream
    has fixed it: drop the `xfail` above, and run `shard` under the ambient mesh in
    `test_checkify_through_every_strategy`."""
    m = mesh(kind)
    plain = jax.shard_map(jax.vmap(checked), mesh=m, in_specs=P("d"), out_specs=P("d"))
    x = jax.device_put(inputs(), NamedSharding(m, P("d")))
    with jax.set_mesh(m), pytest.raises(ValueError, match="mesh"):
        checkify.checkify(plain)(x)


#
# Where a plan came from (issue 31, item 6).
#


def test_explain_says_where_the_plan_came_from(tmp_path):
    def wrap(planner):
        return filter_multi_vmap(
            body,
            in_dims="T B",
            out_dims="T B",
            core="B",
            plan=planner,
            memory_budget=BUDGET,
        )

    x = inputs()
    planner = Planner(cache_dir=tmp_path, time_model=TimeModel())
    now = explain(wrap(planner), x)
    assert now.cache.startswith("planned now (") and now.cache_path is not None
    assert os.path.exists(now.cache_path)
    assert "this plan: planned now (" in str(now)
    again = explain(wrap(planner), x)
    assert again.cache.startswith("from this process's cache: planned by an earlier")
    assert now.cache_path in again.cache and again == now
    disk = explain(wrap(Planner(cache_dir=tmp_path, time_model=TimeModel())), x)
    assert disk.cache.startswith(f"from the disk cache, {now.cache_path}")
    assert disk.cache_path == now.cache_path
    off = explain(wrap(Planner(cache_dir=False, time_model=TimeModel())), x)
    assert off.cache.startswith("planned now (") and "no disk cache" in off.cache
    assert off.cache_path is None
