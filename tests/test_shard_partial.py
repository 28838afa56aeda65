"""`shard=` on a mesh with other axes: only the axes it names are manual, so an
argument split over the others (model weights over "m") stays split (issue 42)."""

import re

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
)
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 8, reason="needs 8 (simulated) devices; see conftest.py"
)

M, K, F = 2048, 512, 8  # W: 4 MiB, 1 MiB per device over "m"
MiB = 2**20


def make_mesh(kind):
    types = (AxisType.Auto if kind == "auto" else AxisType.Explicit,) * 2
    return jax.make_mesh((2, 4), ("f", "m"), axis_types=types)


def data(mesh, f=F):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(M, K)).astype(np.float32) / np.sqrt(K)
    x = rng.normal(size=(f, K)).astype(np.float32)
    w = jax.device_put(jnp.asarray(w), NamedSharding(mesh, P("m", None)))
    split = "f" if f % 2 == 0 else None
    x = jax.device_put(jnp.asarray(x), NamedSharding(mesh, P(split, None)))
    return w, x


def body(w, x):
    return jnp.tanh(w @ x)


def ours(mesh=None, **kw):
    kw = {"out_dims": "F M", "core": "M"} | kw
    return filter_multi_vmap(
        body, in_dims={"w": "M K", "x": "F K"}, shard={"F": "f"}, mesh=mesh, **kw
    )


def hand(w, x):
    """The hand-written partial-manual `shard_map`."""
    inner = lambda w, x: jnp.tanh(x @ w.T)  # noqa: E731
    return jax.shard_map(
        inner, in_specs=(P(), P("f")), out_specs=P("f"), axis_names={"f"}
    )(w, x)


def reference(w, x):
    return np.tanh(np.asarray(x) @ np.asarray(w).T)


def _compiled(fun, *args):
    return jax.jit(fun).lower(*args).compile()


def _gathers_of(text, shape):
    """The all-gathers in the HLO `text` whose result has the shape `shape`."""
    dims = ",".join(map(str, shape))
    return re.findall(rf"= f32\[{dims}\][^ ]* all-gather\(", text)


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_weights_split_over_other_axis_stay_split(kind):
    mesh = make_mesh(kind)
    w, x = data(mesh)
    with jax.set_mesh(mesh):
        ours_c = _compiled(ours(mesh), w, x)
        hand_c = _compiled(hand, w, x)
        out = jax.jit(ours(mesh))(w, x)
    text = ours_c.as_text()
    assert "tanh" in text
    assert not _gathers_of(text, (M, K))  # W is never gathered over "m"
    if kind == "auto":  # the hand-written shard_map has none either
        assert "all-gather" not in text
    ours_temp = ours_c.memory_analysis().temp_size_in_bytes
    hand_temp = hand_c.memory_analysis().temp_size_in_bytes
    assert ours_temp <= hand_temp + MiB, (ours_temp, hand_temp)
    assert ours_temp < MiB  # not all of W (4 MiB), nor its 1 MiB block twice
    np.testing.assert_allclose(out, reference(w, x), rtol=1e-5, atol=1e-5)
    # The output stays split over "m" as `w`'s dim 'M' is, on both axis types.
    assert (tuple(out.sharding.spec) + (None,) * 2)[:2] == ("f", "m")


@pytest.mark.parametrize("kind", ["auto", "explicit"])
@pytest.mark.parametrize("ambient", [False, True])
def test_values_and_grads_against_full_vmap_and_hand(kind, ambient):
    mesh = make_mesh(kind)
    w, x = data(mesh)
    sharded = ours(None if ambient else mesh)
    full = filter_multi_vmap(
        body, in_dims={"w": "M K", "x": "F K"}, out_dims="F M", core="M", vmap="F"
    )

    def loss(f):
        return lambda w, x: jnp.sum(f(w, x) ** 2)

    with jax.set_mesh(mesh):
        got = jax.jit(sharded)(w, x)
        want, want_hand = jax.jit(full)(w, x), jax.jit(hand)(w, x)
        grads = [
            jax.jit(jax.grad(loss(f), argnums=(0, 1)))(w, x)
            for f in (sharded, full, hand)
        ]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, want_hand, rtol=1e-5, atol=1e-5)
    assert (tuple(got.sharding.spec) + (None,) * 2)[:2] == ("f", "m")
    for got_g, want_g, hand_g in zip(*grads):
        np.testing.assert_allclose(got_g, want_g, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got_g, hand_g, rtol=1e-4, atol=1e-4)
    assert tuple(grads[0][0].sharding.spec)[:1] == ("m",)  # W's cotangent too


@pytest.mark.parametrize("split, out_dims", [(False, "F M"), (True, "F _")])
def test_output_dim_no_input_splits_comes_back_whole_on_explicit_axes(split, out_dims):
    """The output's dim is split over "m" only where an input splits the same named
    dim: here `w` is whole, or the output's dim has no name."""
    mesh = make_mesh("explicit")
    w, x = data(mesh)
    w = w if split else jax.device_put(w, NamedSharding(mesh, P()))
    wrapped = ours(mesh, out_dims=out_dims, core=None if "_" in out_dims else "M")
    with jax.set_mesh(mesh):
        out = jax.jit(wrapped)(w, x)
    assert tuple(out.sharding.spec) in {("f",), ("f", None)}
    np.testing.assert_allclose(out, reference(w, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "strategy",
    [
        dict(scan="F"),
        dict(scan={"F": 3}, pad=True),
        dict(checkpoint=True),
        pytest.param(dict(plan="auto"), marks=pytest.mark.slow),  # it measures
    ],
)
@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_nest_inside_the_manual_axis(kind, strategy):
    mesh = make_mesh(kind)
    w, x = data(mesh, 7 if strategy.get("pad") else F)  # 7: 4 a device, padded
    wrapped = ours(mesh, **strategy)
    with jax.set_mesh(mesh):
        text = _compiled(wrapped, w, x).as_text()
        out = jax.jit(wrapped)(w, x)
        g = jax.jit(jax.grad(lambda w: jnp.sum(wrapped(w, x))))(w)
        want_g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w.T)))(w)
    assert not _gathers_of(text, (M, K))
    np.testing.assert_allclose(out, reference(w, x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(g, want_g, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_reduce_and_collectives_by_dim_name(kind):
    mesh = make_mesh(kind)
    w, x = data(mesh)

    def centred(w, x):
        y = body(w, x)
        return y - jax.lax.pmean(y, "F")

    kw = dict(in_dims={"w": "M K", "x": "F K"}, shard={"F": "f"}, mesh=mesh)
    funs = [
        filter_multi_vmap(centred, out_dims="F M", core="M", **kw),
        filter_multi_vmap(body, out_dims="M", reduce={"F": "sum"}, **kw),
    ]
    with jax.set_mesh(mesh):
        texts = [_compiled(f, w, x).as_text() for f in funs]
        got = [jax.jit(f)(w, x) for f in funs]
    ref = reference(w, x)
    np.testing.assert_allclose(got[0], ref - ref.mean(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], ref.sum(0), rtol=1e-5, atol=1e-4)
    for text in texts:
        assert not _gathers_of(text, (M, K))


# Errors ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_collective_over_a_mesh_axis_left_to_the_compiler(kind):
    mesh = make_mesh(kind)
    wrapped = filter_multi_vmap(
        lambda x: jax.lax.psum(x, "m"),
        in_dims="F",
        out_dims="F",
        shard={"F": "f"},
        mesh=mesh,
    )
    for match in [
        "collective `psum` over mesh axis 'm', which is not manual",
        re.escape("`shard={'F': 'f'}` makes manual only the mesh axes it names"),
        "Shard a dim over 'm' too",
        re.escape("`jnp.sum`"),
    ]:
        with pytest.raises(SpecError, match=match):
            wrapped(jnp.arange(8.0))


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_argument_split_over_a_shard_axis_along_another_dim(kind):
    mesh = make_mesh(kind)
    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P(None, "f")))
    wrapped = filter_multi_vmap(
        lambda x: x * 2, in_dims="F K", out_dims="F K", shard={"F": "f"}
    )
    for match in [
        re.escape("`shard={'F': 'f'}` maps dim 'F' over mesh axis 'f'"),
        re.escape("float32[8,4] is already split over 'f' along its axis 1"),
        "jax.sharding.reshard",
    ]:
        # Called eagerly, the sharding of `x` is known on `Auto` axes too.
        with jax.set_mesh(mesh), pytest.raises(SpecError, match=match):
            wrapped(x)
    if kind == "auto":  # under `jax.jit` it is not: JAX reshards `x` on the way in
        with jax.set_mesh(mesh):
            out = jax.jit(wrapped)(x)
        assert out.shape == (8, 4) and out.dtype == jnp.float32
        np.testing.assert_array_equal(out, 2 * np.ones((8, 4), np.float32))


# Without `shard=`: an input split over devices along a mapped dim -----------------


def _mapped(**kw):
    return filter_multi_vmap(
        body, in_dims={"w": "M K", "x": "F K"}, out_dims="F M", **kw
    )


def test_a_scan_over_a_dim_an_input_splits_over_devices_is_an_error():
    mesh = make_mesh("explicit")
    w, x = data(mesh)  # `w` split along M over "m"
    f = _mapped(scan={"M": 256})
    for match in [
        re.escape("`scan` names dim 'M'"),
        re.escape("`w` splits it over the mesh axis 'm' (an `Explicit` axis)"),
        re.escape("Vmap 'M' (drop it from `scan`), shard it (`shard={'M': ...}`)"),
    ]:
        for call in [f, jax.jit(f)]:
            with jax.set_mesh(mesh), pytest.raises(SpecError, match=match):
                call(w, x)
    # On `Auto` axes the compiler moves the data itself: the nest runs.
    mesh = make_mesh("auto")
    w, x = data(mesh)
    with jax.set_mesh(mesh):
        out = jax.jit(f)(w, x)
    np.testing.assert_allclose(out, reference(w, x), rtol=1e-5, atol=1e-5)


def test_the_planner_never_scans_a_dim_an_input_splits_over_devices():
    mesh = make_mesh("explicit")
    rng = np.random.default_rng(0)
    w = rng.normal(size=(16, 128)).astype(np.float32)
    x = rng.normal(size=(16, 128)).astype(np.float32)
    split = jax.device_put(x, NamedSharding(mesh, P("f", None)))  # F over "f"
    outer = lambda w, x: jnp.sum(jnp.tanh(w[:, None] * x[None, :]))  # noqa: E731
    planner = Planner(cache_dir=False, time_model=TimeModel(), measure=False)
    f = filter_multi_vmap(
        outer,
        in_dims={"w": "M K", "x": "F K"},
        out_dims="F M",
        plan=planner,
        memory_budget=4 * MiB,  # the derivative's full vmap needs 96 MiB
    )
    loss = lambda f: lambda w, x: jnp.sum(f(w, x))  # noqa: E731
    hand = jax.vmap(jax.vmap(outer, (0, None)), (None, 0))
    with jax.set_mesh(mesh):
        g = jax.jit(jax.grad(loss(f), argnums=(0, 1)))(w, split)
        plan = explain(f, w, split).gradient
    want = jax.grad(loss(hand), argnums=(0, 1))(w, x)
    assert isinstance(plan, Plan) and plan.scan and "F" not in plan.scan
    assert "split over devices by inputs, never scanned: F" in str(plan)
    for a, b in zip(g, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    # Where no nest fits, the error says why the split dim was not scanned.
    split_w = jax.device_put(w, NamedSharding(mesh, P("m", None)))
    tight = filter_multi_vmap(
        outer, in_dims={"w": "M K", "x": "F K"}, out_dims="F M", plan=planner,
        memory_budget=MiB,
    )  # fmt: skip
    for match in [
        re.escape("Dim 'F' is never scanned: `x` splits it over the mesh axis 'f'"),
        re.escape("Dim 'M' is never scanned: `w` splits it over the mesh axis 'm'"),
        re.escape("`shard={'M': ...}` would map it device by device"),
    ]:
        with jax.set_mesh(mesh), pytest.raises(SpecError, match=match):
            jax.grad(loss(tight))(split_w, split)


# The planner: one device's share of an argument split over another axis -----------


def _explained(mesh, w, x, jit=False):
    """The plan of `ours` for `w` and `x`, from `explain` (under `jax.jit` with
    `jit`), with a planner of its own (no disk cache, the default time model)."""
    f = ours(mesh, plan=Planner(cache_dir=False, time_model=TimeModel()))
    plans = []

    def g(w, x):
        plans.append(explain(f, w, x))
        return x

    with jax.set_mesh(mesh):
        (jax.jit(g) if jit else g)(w, x)
    return plans[0]


LOCAL = (
    "per device, in bytes and work set: `w` counted at 1/4, split over mesh axis 'm'"
)


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_planner_counts_an_argument_split_over_another_axis_at_its_local_size(kind):
    mesh = make_mesh(kind)
    w, x = data(mesh)  # `w` split over "m": a quarter on each device
    whole = jax.device_put(w, NamedSharding(mesh, P()))
    split, replicated = _explained(mesh, w, x), _explained(mesh, whole, x)
    assert LOCAL in str(split) and "per device:" not in str(replicated)
    a, b = split.chosen, replicated.chosen
    assert a.key == b.key and a.temp_bytes == b.temp_bytes  # temporaries: compiled
    elsewhere = w.nbytes * 3 // 4  # the pieces of `w` on the 3 other devices of "m"
    assert a.working_set is not None and b.working_set is not None
    assert b.working_set - a.working_set == elsewhere
    assert a.working_set < 0.3 * b.working_set  # `w` is most of it
    assert b.bytes_accessed - a.bytes_accessed == elsewhere
    # Under `jax.jit`, the type of `w` shows its split on `Explicit` axes only; on
    # `Auto` ones it is not known, and `w` is counted whole.
    traced = _explained(mesh, w, x, jit=True)
    assert (LOCAL in str(traced)) == (kind == "explicit")
    assert traced.chosen.working_set == (a if kind == "explicit" else b).working_set


def test_planner_sees_the_split_of_an_eager_call():
    mesh = make_mesh("auto")
    w, x = data(mesh)
    f = ours(mesh, plan=Planner(cache_dir=False, time_model=TimeModel()))
    with jax.set_mesh(mesh):
        out = f(w, x)  # planned with `w` split: the same plan as `explain`'s
        plan = explain(f, w, x)
    assert plan.cache.startswith("from this process's cache") and LOCAL in str(plan)
    assert out.shape == (F, M) and out.dtype == jnp.float32
    np.testing.assert_allclose(out, reference(w, x), rtol=1e-5, atol=1e-5)
