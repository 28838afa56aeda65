import inspect
import itertools as it
import re

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from eqx_multimap import filter_multi_vmap, ShapeError, SpecError
from hypothesis import given, settings
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 8, reason="needs 8 (simulated) devices; see conftest.py"
)

COLLECTIVES = (
    "all-gather",
    "all-reduce",
    "collective-permute",
    "all-to-all",
    "reduce-scatter",
)


def make_mesh(shape, names, kind="explicit"):
    types = (AxisType.Explicit if kind == "explicit" else AxisType.Auto,) * len(shape)
    return jax.make_mesh(shape, names, axis_types=types)


def loop_map(fun, args, names, sizes):
    """Independent reference: a Python loop over every index combination.

    `args` is a list of `(array, dims)` with `dims` a list of dim names (one per
    axis, `None` for an axis that is not mapped). Returns the stacked results with
    the mapped dims first, in the order of `names`, then the body's own axes.
    """
    results = []
    for idx in it.product(*(range(sizes[n]) for n in names)):
        at = dict(zip(names, idx))
        call_args = []
        for x, dims in args:
            x = np.asarray(x)
            index = tuple(at[d] if d in at else slice(None) for d in dims)
            call_args.append(x[index])
        results.append(np.asarray(fun(*call_args)))
    core_shape = results[0].shape if results else ()
    return np.stack(results).reshape(tuple(sizes[n] for n in names) + core_shape)


def body(vis, nu):
    # vis: (2,), nu: () -> (2,)
    return jnp.sin(vis) * nu + jnp.cos(nu)


def data(t, f, b, seed=0):
    rng = np.random.default_rng(seed)
    vis = jnp.asarray(rng.normal(size=(t, f, b, 2)), dtype=jnp.float32)
    nu = jnp.asarray(rng.normal(size=(f,)), dtype=jnp.float32)
    return vis, nu


def reference(vis, nu):
    t, f, b, _ = vis.shape
    ref = loop_map(
        body,
        [(vis, ["T", "F", "B", None]), (nu, ["F"])],
        ["F", "T", "B"],
        {"T": t, "F": f, "B": b},
    )
    return ref


def shard_shapes(x):
    return sorted({s.data.shape for s in x.addressable_shards})


def spec_of(x):
    """The output's `PartitionSpec`, padded with `None` to its rank."""
    assert isinstance(x.sharding, NamedSharding)
    spec = tuple(x.sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


IN_DIMS = {"vis": "T F B 2", "nu": "F"}


@pytest.mark.parametrize(
    "strategy",
    [
        dict(vmap="T B"),  # F only sharded: vmapped locally, outermost
        dict(vmap="T F B"),  # F also named in vmap
        dict(scan="F", vmap="T B"),  # each shard scans its local F block
        dict(scan={"F": 2}, vmap="T B"),  # local F=5: 2 chunks of 2 + remainder 1
        dict(scan={"T": 2}, vmap="B"),  # T=3: 1 chunk + remainder, F vmapped
        dict(),  # no strategy: out_dims names are vmapped
    ],
)
def test_one_dim_matches_unsharded_and_loop(strategy):
    mesh = make_mesh((8,), ("d",))
    vis, nu = data(3, 40, 2)
    kw = dict(in_dims=IN_DIMS, out_dims="F T B 2", **strategy)
    sharded = filter_multi_vmap(body, shard={"F": "d"}, mesh=mesh, **kw)
    # Unsharded, a dim that is only sharded must be vmapped explicitly.
    local = dict(kw)
    if "vmap" in strategy and "F" not in str(strategy):
        local["vmap"] = "F " + strategy["vmap"]
    unsharded = filter_multi_vmap(body, **local)
    out = sharded(vis, nu)
    ref = reference(vis, nu)
    expected = unsharded(vis, nu)
    assert out.shape == ref.shape == (40, 3, 2, 2)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
    assert spec_of(out) == ("d", None, None, None)
    assert shard_shapes(out) == [(5, 3, 2, 2)]
    assert len(out.sharding.device_set) == 8


@pytest.mark.parametrize("kind", ["explicit", "auto"])
@pytest.mark.parametrize("ambient", [False, True])
def test_two_dims_on_2d_mesh(kind, ambient):
    mesh = make_mesh((2, 4), ("x", "y"), kind)

    def fun(vis, nu, gain):
        return body(vis, nu) * gain

    wrapped = filter_multi_vmap(
        fun,
        in_dims={"vis": "T F B 2", "nu": "F", "gain": ""},
        out_dims="F T B 2",
        scan={"T": 2},
        vmap="B",
        shard={"F": "y", "B": "x"},
        mesh=None if ambient else mesh,
    )
    vis, nu = data(5, 8, 6)
    gain = jnp.asarray(1.5, dtype=jnp.float32)
    if ambient:
        with jax.set_mesh(mesh):
            out = wrapped(vis, nu, gain)
    else:
        out = wrapped(vis, nu, gain)
    ref = reference(vis, nu) * 1.5
    assert out.shape == (8, 5, 6, 2)
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)
    assert spec_of(out) == ("y", None, "x", None)
    assert shard_shapes(out) == [(2, 5, 3, 2)]


def test_one_dim_over_two_mesh_axes():
    mesh = make_mesh((2, 4), ("x", "y"))
    wrapped = filter_multi_vmap(
        body, in_dims=IN_DIMS, out_dims="F T B 2", shard={"F": ("x", "y")}, mesh=mesh
    )
    vis, nu = data(2, 16, 3)
    out = wrapped(vis, nu)
    np.testing.assert_allclose(out, reference(vis, nu), rtol=1e-6, atol=1e-6)
    assert spec_of(out) == (("x", "y"), None, None, None)
    assert shard_shapes(out) == [(2, 2, 3, 2)]
    # Contiguous blocks, `x` major: device (x=i, y=j) holds F[(4 i + j) * 2 : ...].
    for shard in out.addressable_shards:
        start = shard.index[0].start
        np.testing.assert_allclose(
            shard.data, reference(vis, nu)[start : start + 2], rtol=1e-6, atol=1e-6
        )
    assert sorted(s.index[0].start for s in out.addressable_shards) == list(
        range(0, 16, 2)
    )


def test_output_pytree_with_different_dim_orders():
    mesh = make_mesh((2, 4), ("x", "y"))

    def fun(vis, nu):
        return {"a": jnp.sum(vis) * nu, "b": body(vis, nu), "tag": "static"}

    wrapped = filter_multi_vmap(
        fun,
        in_dims=IN_DIMS,
        out_dims={"a": "B F T", "b": "T 2 F B", "tag": None},
        vmap="T",
        shard={"F": "y", "B": "x"},
        mesh=mesh,
    )
    vis, nu = data(3, 4, 2)
    out = wrapped(vis, nu)
    sizes = {"T": 3, "F": 4, "B": 2}
    args = [(vis, ["T", "F", "B", None]), (nu, ["F"])]
    ref_a = loop_map(lambda v, n: np.sum(v) * n, args, ["B", "F", "T"], sizes)
    ref_b = loop_map(body, args, ["T", "F", "B"], sizes).transpose(0, 3, 1, 2)
    assert out["tag"] == "static"
    assert out["a"].shape == (2, 4, 3) and out["b"].shape == (3, 2, 4, 2)
    np.testing.assert_allclose(out["a"], ref_a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["b"], ref_b, rtol=1e-6, atol=1e-6)
    assert spec_of(out["a"]) == ("x", "y", None)
    assert spec_of(out["b"]) == (None, None, "y", "x")


def _compiled_text(fun, *args):
    return jax.jit(fun).lower(*args).compile().as_text()


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_pure_map_has_no_collectives(kind):
    mesh = make_mesh((2, 4), ("x", "y"), kind)
    wrapped = filter_multi_vmap(
        body,
        in_dims=IN_DIMS,
        out_dims="F T B 2",
        scan={"T": 2},
        vmap="B",
        shard={"F": "y", "B": "x"},
        mesh=mesh,
    )
    vis, nu = data(5, 8, 4)
    vis = jax.device_put(vis, NamedSharding(mesh, P(None, "y", "x")))
    nu = jax.device_put(nu, NamedSharding(mesh, P("y")))
    text = _compiled_text(wrapped, vis, nu)
    assert "sine" in text  # the body really is in the compiled module
    for op in COLLECTIVES:
        assert op not in text, op
    out = jax.jit(wrapped)(vis, nu)
    np.testing.assert_allclose(out, reference(vis, nu), rtol=1e-6, atol=1e-6)
    assert spec_of(out) == ("y", None, "x", None)

    # The check can fail: trimming a padded dim gathers it, which is a collective.
    padded = filter_multi_vmap(
        body, in_dims=IN_DIMS, out_dims="F T B 2", shard={"F": "y"}, pad=True, mesh=mesh
    )
    text = _compiled_text(padded, *data(5, 7, 4))
    assert any(op in text for op in COLLECTIVES)


@pytest.mark.parametrize("shard", [{"F": "d"}, {"F": "d", "T": "e"}])
def test_not_divisible_raises(shard):
    mesh = make_mesh((4, 2), ("d", "e"))
    wrapped = filter_multi_vmap(
        body, in_dims=IN_DIMS, out_dims="F T B 2", shard=shard, mesh=mesh
    )
    vis, nu = data(4, 10, 2)
    matches = [
        r"filter_multi_vmap\(body\)",
        "dim 'F' has size 10",
        r"mesh axis 'd' \(size 4\)",
        re.escape("`vis` axis 1 (float32[4,10,2,2]"),
        re.escape("`nu` axis 0"),
        "pad=True",
        "to 12",
    ]
    for match in matches:
        with pytest.raises(ShapeError, match=match):
            wrapped(vis, nu)


def test_not_divisible_over_two_axes_raises():
    mesh = make_mesh((2, 4), ("x", "y"))
    wrapped = filter_multi_vmap(
        body,
        in_dims=IN_DIMS,
        out_dims="F T B 2",
        shard={"F": ("x", "y")},
        mesh=mesh,
    )
    for match in [
        "dim 'F' has size 12",
        re.escape("mesh axes ('x', 'y') (sizes 2 x 4 = 8)"),
        "multiple of 8",
    ]:
        with pytest.raises(ShapeError, match=match):
            wrapped(*data(2, 12, 2))


def nan_on_zero(vis, nu):
    # Zeros as padding would give inf/NaN (and NaN gradients); real slices do not.
    return jnp.log(vis**2) / nu


@pytest.mark.parametrize(
    "strategy", [dict(vmap="T B"), dict(scan={"F": 2}, vmap="B"), dict(scan="T F")]
)
def test_pad_is_exact(strategy):
    mesh = make_mesh((2, 4), ("x", "y"))
    wrapped = filter_multi_vmap(
        nan_on_zero,
        in_dims=IN_DIMS,
        out_dims="F T B 2",
        shard={"F": "y", "T": "x"},
        pad=True,
        mesh=mesh,
        **strategy,
    )
    vis, nu = data(3, 7, 2, seed=1)
    nu = nu + jnp.sign(nu)  # keep away from zero
    sizes = {"T": 3, "F": 7, "B": 2}
    args = [(vis, ["T", "F", "B", None]), (nu, ["F"])]
    ref = loop_map(nan_on_zero, args, ["F", "T", "B"], sizes)
    with jax.set_mesh(mesh):
        out = jax.jit(wrapped)(vis, nu)
        grad = jax.jit(jax.grad(lambda v, n: wrapped(v, n).sum(), argnums=(0, 1)))
        g_vis, g_nu = grad(vis, nu)
    assert out.shape == (7, 3, 2, 2) and out.dtype == jnp.float32
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    ref_g_vis, ref_g_nu = jax.grad(
        lambda v, n: jnp.sum(jnp.log(v**2) / n[None, :, None, None]), argnums=(0, 1)
    )(vis, nu)
    np.testing.assert_allclose(g_vis, ref_g_vis, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(g_nu, ref_g_nu, rtol=1e-5, atol=1e-5)
    assert g_vis.shape == vis.shape and g_nu.shape == nu.shape


def test_pad_with_prng_keys():
    mesh = make_mesh((8,), ("d",), "auto")

    def draw(key, scale):
        return jax.random.normal(key, (2,)) * scale

    wrapped = filter_multi_vmap(
        draw,
        in_dims={"key": "N", "scale": "N"},
        out_dims="N 2",
        shard={"N": "d"},
        pad=True,
        mesh=mesh,
    )
    keys = jax.random.split(jax.random.key(0), 5)
    scale = jnp.arange(1.0, 6.0)
    out = wrapped(keys, scale)
    ref = np.stack([draw(keys[i], scale[i]) for i in range(5)])
    assert out.shape == (5, 2)
    np.testing.assert_allclose(out, ref, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("jit", ["jax.jit", "eqx.filter_jit"])
def test_grad_through_sharded_map(jit):
    mesh = make_mesh((2, 4), ("x", "y"), "auto")

    class Model(eqx.Module):
        weight: jax.Array

        def __call__(self, vis, nu):
            return body(vis, nu) * self.weight

    model = Model(jnp.asarray([0.5, -2.0], dtype=jnp.float32))
    wrapped = filter_multi_vmap(
        model,
        in_dims=IN_DIMS,
        out_dims="F T B 2",
        scan={"T": 2},
        shard={"F": "y", "B": "x"},
        mesh=mesh,
    )
    unsharded = filter_multi_vmap(
        model, in_dims=IN_DIMS, out_dims="F T B 2", vmap="T F B"
    )

    def loss(w, vis, nu):
        return jnp.sum(w(vis, nu) ** 2)

    vis, nu = data(3, 8, 2)
    if jit == "jax.jit":
        grad = jax.jit(jax.grad(loss, argnums=(1, 2)))
        g_vis, g_nu = grad(wrapped, vis, nu)
    else:
        grad = eqx.filter_jit(eqx.filter_grad(loss))
        g_model = grad(wrapped, vis, nu)
        ref_model = eqx.filter_grad(loss)(unsharded, vis, nu)
        np.testing.assert_allclose(
            g_model._fun.weight, ref_model._fun.weight, rtol=1e-5
        )
        g_vis, g_nu = jax.grad(loss, argnums=(1, 2))(wrapped, vis, nu)
    r_vis, r_nu = jax.grad(loss, argnums=(1, 2))(unsharded, vis, nu)

    def direct(vis, nu):
        y = jnp.sin(vis) * nu[None, :, None, None] + jnp.cos(nu)[None, :, None, None]
        return jnp.sum((y * model.weight[None, None, None, :]) ** 2)

    d_vis, d_nu = jax.grad(direct, argnums=(0, 1))(vis, nu)
    for got, ref, direct_ref in [(g_vis, r_vis, d_vis), (g_nu, r_nu, d_nu)]:
        assert got.shape == ref.shape and got.dtype == ref.dtype
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got, direct_ref, rtol=1e-5, atol=1e-5)
    assert spec_of(g_vis)[1:3] == ("y", "x")


def test_ambient_mesh_under_jit():
    mesh = make_mesh((8,), ("d",))
    wrapped = jax.jit(
        filter_multi_vmap(body, in_dims=IN_DIMS, out_dims="F T B 2", shard={"F": "d"})
    )
    vis, nu = data(2, 8, 3)
    with jax.set_mesh(mesh):
        out = wrapped(vis, nu)
    np.testing.assert_allclose(out, reference(vis, nu), rtol=1e-6, atol=1e-6)
    assert spec_of(out) == ("d", None, None, None)
    assert shard_shapes(out) == [(1, 2, 3, 2)]


def test_inputs_from_process_local_data():
    # The multi-host recipe of the README, in one process: local data == global.
    mesh = make_mesh((2, 4), ("x", "y"))
    vis_np, nu_np = (np.asarray(a) for a in data(2, 8, 4))
    vis_sharding = NamedSharding(mesh, P(None, "y", "x"))
    blocks = vis_sharding.addressable_devices_indices_map(vis_np.shape)
    assert len(blocks) == 8
    vis = jax.make_array_from_process_local_data(vis_sharding, vis_np, vis_np.shape)
    nu = jax.make_array_from_process_local_data(NamedSharding(mesh, P()), nu_np)
    wrapped = filter_multi_vmap(
        body, in_dims=IN_DIMS, out_dims="F T B 2", shard={"F": "y", "B": "x"}
    )
    with jax.set_mesh(mesh):
        out = jax.jit(wrapped)(vis, nu)
    np.testing.assert_allclose(out, reference(vis_np, nu_np), rtol=1e-6, atol=1e-6)
    assert spec_of(out) == ("y", None, "x", None)
    assert shard_shapes(out) == [(2, 2, 2, 2)]


def test_verbose_prints_shard_map_outermost(capsys):
    mesh = make_mesh((2, 4), ("x", "y"))
    wrapped = filter_multi_vmap(
        body,
        in_dims=IN_DIMS,
        out_dims="F T B 2",
        scan={"F": 2},
        vmap="B",
        shard={"F": "y", "T": "x"},
        pad=True,
        mesh=mesh,
        verbose=True,
    )
    wrapped(*data(3, 12, 2))
    printed = capsys.readouterr().out.strip()
    assert printed == (  # broken after a `;` and before an arrow: 100 columns
        "filter_multi_vmap(body): shard_map(F=12 over 'y': 4 shards of 3;\n"
        "       T=3 over 'x': 2 shards of 2, padded to 4) -> scan(F: 1 chunk of 2) + "
        "vmap(F remainder=1)\n    -> vmap(T=2) -> vmap(B=2) -> body"
    )


MESHES = [
    ((8,), ("a",)),
    ((2, 4), ("a", "b")),
    ((4, 2), ("a", "b")),
    ((2, 2, 2), "abc"),
]


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(
    mesh_index=st.integers(0, len(MESHES) - 1),
    t=st.integers(1, 5),
    f=st.integers(1, 9),
    b=st.integers(1, 4),
    pick=st.permutations(["T", "F", "B"]),
    n_sharded=st.integers(1, 3),
    scan_f=st.sampled_from([None, "scan", 2]),
)
def test_random_sizes_and_meshes(mesh_index, t, f, b, pick, n_sharded, scan_f):
    shape, names = MESHES[mesh_index]
    mesh = make_mesh(shape, tuple(names))
    n_sharded = min(n_sharded, len(shape))
    shard = {dim: axis for dim, axis in zip(pick[:n_sharded], names)}
    scan = None if scan_f is None else ("F" if scan_f == "scan" else {"F": scan_f})
    vmap = "T B" if scan else "T F B"
    wrapped = filter_multi_vmap(
        body,
        in_dims=IN_DIMS,
        out_dims="F T B 2",
        scan=scan,
        vmap=vmap,
        shard=shard,
        pad=True,
        mesh=mesh,
    )
    vis, nu = data(t, f, b, seed=t * 100 + f * 10 + b)
    out = wrapped(vis, nu)
    assert out.shape == (f, t, b, 2) and out.dtype == jnp.float32
    np.testing.assert_allclose(out, reference(vis, nu), rtol=1e-5, atol=1e-5)
    sizes = {"F": f, "T": t, "B": b}
    axis_of = {"F": 0, "T": 1, "B": 2}
    spec = spec_of(out)
    for dim, axis in shard.items():
        # Divisible dims stay sharded; padded ones come back gathered.
        divisible = sizes[dim] % mesh.shape[axis] == 0
        assert spec[axis_of[dim]] == (axis if divisible else None)


# Errors ----------------------------------------------------------------------------


def test_unknown_mesh_axis_at_decoration():
    mesh = make_mesh((2, 4), ("x", "y"))
    for match in [
        re.escape("`filter_multi_vmap(..., shard={'F': 'freq'})`"),
        "dim 'F' is sharded over mesh axis 'freq'",
        re.escape("'x' (size 2), 'y' (size 4)"),
    ]:
        with pytest.raises(SpecError, match=match):
            filter_multi_vmap(body, in_dims=IN_DIMS, shard={"F": "freq"}, mesh=mesh)


def test_unknown_mesh_axis_in_ambient_mesh():
    wrapped = filter_multi_vmap(
        body, in_dims=IN_DIMS, out_dims="F T B 2", shard={"F": "freq"}
    )
    with jax.set_mesh(make_mesh((8,), ("d",))):
        for match in [
            r"filter_multi_vmap\(body\)",
            "ambient mesh",
            "mesh axis 'freq'",
            re.escape("'d' (size 8)"),
        ]:
            with pytest.raises(SpecError, match=match):
                wrapped(*data(2, 8, 2))


def test_no_mesh():
    wrapped = filter_multi_vmap(
        body, in_dims=IN_DIMS, out_dims="F T B 2", shard={"F": "d"}
    )
    for match in [
        re.escape("`filter_multi_vmap(body)`: `shard={'F': 'd'}`"),
        "no ambient mesh",
        re.escape("mesh=mesh"),
        re.escape("jax.set_mesh(mesh)"),
    ]:
        with pytest.raises(SpecError, match=match):
            wrapped(*data(2, 8, 2))


def test_given_mesh_differs_from_ambient_mesh():
    mesh = make_mesh((2, 4), ("x", "y"), "auto")
    wrapped = filter_multi_vmap(
        body, in_dims=IN_DIMS, out_dims="F T B 2", shard={"F": "y"}, mesh=mesh
    )
    with jax.set_mesh(make_mesh((8,), ("d",))):
        for match in [
            re.escape("`filter_multi_vmap(body)`: `shard={'F': 'y'}`"),
            re.escape("(axes 'x' (size 2), 'y' (size 4)) differs from the ambient"),
            re.escape("(axes 'd' (size 8))"),
            "Drop `mesh=`",
        ]:
            with pytest.raises(SpecError, match=match):
                wrapped(*data(2, 8, 2))
    # The same mesh as the ambient one is fine.
    with jax.set_mesh(mesh):
        out = wrapped(*data(2, 8, 2))
    np.testing.assert_allclose(out, reference(*data(2, 8, 2)), rtol=1e-6, atol=1e-6)


def test_same_mesh_axis_for_two_dims():
    for shard, match in [
        ({"F": "x", "B": "x"}, r"mesh axis 'x' for both dims 'F' and\s+'B'"),
        ({"F": ("x", "y"), "T": ("y",)}, r"mesh axis 'y' for both dims 'F' and\s+'T'"),
        ({"F": ("x", "x")}, "mesh axis 'x' twice for dim 'F'"),
    ]:
        with pytest.raises(SpecError, match=match):
            filter_multi_vmap(body, in_dims=IN_DIMS, shard=shard)


def test_sharded_dim_not_mapped():
    # Raised at decoration: `out_dims` fix the mapped dims.
    mesh = make_mesh((8,), ("d",))
    for match in [
        "`shard` names dim 'Q', which is not mapped",
        "`out_dims` does not name it",
        "here 'F', 'T', 'B'",
    ]:
        with pytest.raises(SpecError, match=match):
            filter_multi_vmap(
                body, in_dims=IN_DIMS, out_dims="F T B 2", shard={"Q": "d"}, mesh=mesh
            )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(shard="F"), r"shard=\.\.\.\)` must be a dict from dim name"),
        (dict(shard={"F": 3}), r"shard=\{'F': 3\}\)`:\s+the value must be a mesh axis"),
        (dict(shard={"F": ()}), r"non-empty tuple of mesh axis names"),
        (dict(shard={"_F": "d"}), r"has key '_F', which is not a dim name"),
        (dict(shard={"F": "d"}, pad=1), r"pad=\.\.\.\)` must be `True` or `False`"),
        (dict(shard={"F": "d"}, mesh="d"), r"mesh=\.\.\.\)` must be a `jax\.sharding"),
        (
            dict(mesh=jax.make_mesh((8,), ("d",))),
            r"\(\.\.\., mesh=\.\.\.\)` is only used with `shard=`",
        ),
        (dict(pad=True), r"\(\.\.\., pad=\.\.\.\)` is only used with `shard=`"),
    ],
)
def test_bad_options(kwargs, match):
    # Under the test suite's jaxtyping/beartype hook, values of the wrong *type* are
    # caught by the annotations first; call the function itself, as users without
    # the hook do, to check our own messages.
    unchecked = inspect.unwrap(filter_multi_vmap)
    with pytest.raises(SpecError, match=match):
        unchecked(body, in_dims=IN_DIMS, **kwargs)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_closures_over_mesh_placed_and_traced_arrays(kind):
    # `jax.shard_map` cannot close over arrays on an explicit mesh; the body's
    # closed-over arrays (here one placed on the mesh, and under `jax.grad` a
    # tracer) are passed into the shard_map as replicated inputs.
    mesh = make_mesh((4, 2), ("x", "y"), kind)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 8)).astype(np.float32))

    def loss(w):
        f = filter_multi_vmap(
            lambda a: jnp.tanh(a * jnp.sum(w)),
            in_dims="T F",
            out_dims="F T",
            shard={"F": "x"},
        )
        return jnp.sum(f(x))

    def ref(w):
        return jnp.sum(jnp.tanh(x * jnp.sum(w)))

    with jax.set_mesh(mesh):
        w = jnp.linspace(0.0, 0.1, 8)
        for got, want in [
            (loss(w), ref(w)),
            (jax.grad(loss)(w), jax.grad(ref)(w)),
            (jax.jit(jax.grad(loss))(w), jax.grad(ref)(w)),
        ]:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
