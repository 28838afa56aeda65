"""Where features meet: annotations, sharding, the planner, the shim, chunked scans,
methods, keyword arguments, pytree outputs and outer transforms, in combination.

Every result is compared with an independent reference (`loop_reference`: a Python
loop over index combinations and `np.stack`, or plain numpy), for shapes, dtypes and
values; every error is matched on its argument path, dim and sizes.
"""

import re

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from eqx_multimap import explain, filter_multi_vmap, multi_vmap, ShapeError, SpecError
from hypothesis import given, settings
from jax.sharding import AxisType, NamedSharding
from jaxtyping import Array, Float, Int, PyTree

from .helpers import loop_reference


pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 8, reason="needs 8 (simulated) devices; see conftest.py"
)

INTERNAL_NAMES = ("/k", "_Frozen", "LeafSpec", "InLeaf", "BoundCall", "tree_map tree")


def _mesh(kind="explicit"):
    types = (AxisType.Explicit if kind == "explicit" else AxisType.Auto,) * 2
    return jax.make_mesh((4, 2), ("x", "y"), axis_types=types)


def _rand(shape, seed=0, dtype=np.float32):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape).astype(dtype))


def _check(out, ref, dtype=jnp.float32, atol=1e-5):
    assert out.shape == ref.shape
    assert out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=atol)


def _sharded_over(x, mesh, axis, mesh_axis):
    """`x` is really split (not replicated) along `axis` over `mesh_axis`."""
    assert isinstance(x.sharding, NamedSharding)
    assert x.sharding.spec[axis] == mesh_axis
    n = mesh.shape[mesh_axis]
    assert {s.data.shape[axis] for s in x.addressable_shards} == {x.shape[axis] // n}


def _no_internal_names(text):
    for name in INTERNAL_NAMES:
        assert name not in text, (name, text)


#
# Annotations + shard (+ a chunked scan inside each shard), jit, filter_jit, grad.
#


def _annotated_sharded(mesh):
    @filter_multi_vmap(scan={"T": 3}, vmap="B", shard={"F": "x"}, mesh=mesh)
    def predict(
        vis: Float[Array, "T F B 2"], nu: Float[Array, " F"]
    ) -> Float[Array, "F T B 2"]:
        return vis * nu

    return predict


def _predict_ref(vis, nu):
    return loop_reference(
        lambda v, n: v * n, [vis, nu], ["T F B 2", "F"], ("T", "F", "B"), "F T B 2"
    )


@pytest.mark.parametrize("jit", [None, jax.jit, eqx.filter_jit])
def test_annotations_with_shard_and_chunked_scan(jit):
    mesh = _mesh()
    predict = _annotated_sharded(mesh)
    vis, nu = _rand((7, 8, 3, 2)), _rand((8,), 1)
    fn = predict if jit is None else jit(predict)
    out = fn(vis, nu)
    _check(out, _predict_ref(vis, nu))
    _sharded_over(out, mesh, 0, "x")


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_grad_through_annotated_sharded_chunked_map(kind):
    mesh = _mesh(kind)
    predict = _annotated_sharded(mesh)
    vis, nu = _rand((7, 8, 3, 2)), _rand((8,), 1)

    def loss(v, n):
        return jnp.sum(predict(v, n) ** 2)

    with jax.set_mesh(mesh):
        g_vis, g_nu = jax.jit(jax.grad(loss, argnums=(0, 1)))(vis, nu)
    v, n = np.asarray(vis), np.asarray(nu)[None, :, None, None]
    _check(g_vis, 2 * v * n * n)
    _check(g_nu, (2 * v * v * n).sum((0, 2, 3)), atol=1e-4)


class _Sky(eqx.Module):
    flux: Float[Array, "S F"]
    name: str = eqx.field(static=True, default="sky")


class _Scaled(eqx.Module):
    flux: Float[Array, "S F T"]
    name: str = eqx.field(static=True, default="scaled")


def test_module_argument_and_module_return_with_shard():
    mesh = _mesh()

    @filter_multi_vmap(vmap="T", shard={"F": "x"}, mesh=mesh, scan={"S": 2})
    def scale(sky: _Sky, gain: Float[Array, "T F"]) -> _Scaled:
        return _Scaled(sky.flux * gain, sky.name + "!")

    sky, gain = _Sky(_rand((3, 8))), _rand((5, 8), 1)
    with jax.set_mesh(mesh):
        out = eqx.filter_jit(scale)(sky, gain)
    assert isinstance(out, _Scaled) and out.name == "sky!"
    ref = np.asarray(sky.flux)[:, :, None] * np.asarray(gain).T[None]  # S F T
    _check(out.flux, ref)
    _sharded_over(out.flux, mesh, 1, "x")


#
# Annotations + plan="auto" and explain.
#


def test_annotations_with_plan_auto_and_explain():
    @filter_multi_vmap(vmap="T F B", plan="auto", memory_budget=2**12)
    def predict(
        vis: Float[Array, "T F B 2"], nu: Float[Array, " F"]
    ) -> Float[Array, "F T B 2"]:
        return vis * nu

    vis, nu = _rand((7, 8, 3, 2)), _rand((8,), 1)
    _check(predict(vis, nu), _predict_ref(vis, nu))
    _check(jax.jit(predict)(vis, nu), _predict_ref(vis, nu))
    plan = explain(
        predict,
        jax.ShapeDtypeStruct(vis.shape, vis.dtype),
        jax.ShapeDtypeStruct(nu.shape, nu.dtype),
    )
    assert dict(plan.sizes) == {"T": 7, "F": 8, "B": 3}
    text = str(plan)
    assert ".predict): plan='auto'" in text
    _no_internal_names(text)
    # The annotation's dtype is checked by `explain` too.
    with pytest.raises(ShapeError, match=r"argument `nu` has dtype int32.*Float"):
        explain(predict, vis, jnp.zeros(8, jnp.int32))


#
# The `multi_vmap` shim, chunked scans and grads.
#


def test_shim_inside_chunked_scan_with_grads():
    inner = multi_vmap(lambda a, b: jnp.sin(a) * b, "[B],[B]", "[B]", scan_dims=["B"])

    @filter_multi_vmap(
        in_dims=("T F B", "B"), out_dims="F T B", core="B", scan={"T": 2}
    )
    def outer(a, b):
        return inner(a, b)

    x, y = _rand((5, 4, 3)), _rand((3,), 1)
    ref = loop_reference(
        lambda a, b: np.sin(a) * b, [x, y], ["T F B", "B"], ("T", "F", "B"), "F T B"
    )
    _check(outer(x, y), ref)
    g_x, g_y = jax.jit(jax.grad(lambda a, b: outer(a, b).sum(), argnums=(0, 1)))(x, y)
    xn, yn = np.asarray(x), np.asarray(y)
    _check(g_x, np.cos(xn) * yn)
    _check(g_y, np.sin(xn).sum((0, 1)))


#
# Methods, with annotations, shard and plan.
#


class _Model(eqx.Module):
    w: Float[Array, " F"]

    @filter_multi_vmap(vmap="T", shard={"F": "x"}, scan={"B": 2})
    def sharded(self, a: Float[Array, "T F B"]) -> Float[Array, "B F T"]:
        return self.w * a

    @filter_multi_vmap(vmap="T F", plan="auto", memory_budget=2**12)
    def planned(self, a: Float[Array, "T F B"]) -> Float[Array, "B F T"]:
        return self.w * a


def _model_ref(w, a):
    return loop_reference(
        lambda w_, a_: w_ * a_, [w, a], ["F", "T F B"], ("B", "F", "T"), "B F T"
    )


@pytest.mark.slow
def test_methods_with_annotations_shard_and_plan():
    mesh = _mesh()
    model, a = _Model(_rand((8,))), _rand((5, 8, 3), 1)
    ref = _model_ref(model.w, a)
    with jax.set_mesh(mesh):
        _check(model.sharded(a), ref)
        _check(eqx.filter_jit(model.sharded)(a), ref)
        _check(jax.vmap(model.sharded)(jnp.stack([a, 2 * a])), np.stack([ref, 2 * ref]))
        g = jax.jit(jax.grad(lambda m: m.sharded(a).sum()))(model)
    _check(g.w, np.asarray(a).sum((0, 2)))
    _check(model.planned(a), ref)
    assert dict(explain(model.planned, a).sizes) == {"T": 5, "F": 8, "B": 3}


#
# Keyword arguments, keyword-only arguments and **kwargs.
#


def test_keyword_only_and_var_keyword_annotations_with_shard():
    mesh = _mesh()

    @filter_multi_vmap(vmap="T", shard={"F": "x"}, mesh=mesh)
    def f(
        x: Float[Array, "T F"], *, scale: Float[Array, " F"], **kw: Float[Array, " F"]
    ) -> Float[Array, "F T"]:
        return x * scale + kw["off"]

    x, s, o = _rand((5, 8)), _rand((8,), 1), _rand((8,), 2)
    ref = loop_reference(
        lambda x_, s_, o_: x_ * s_ + o_, [x, s, o], ["T F", "F", "F"], ("T", "F"), "F T"
    )
    _check(f(x, scale=s, off=o), ref)
    _check(jax.jit(f)(x, scale=s, off=o), ref)
    # `**kw`'s annotation gives the dims of each of its entries, named as called.
    with pytest.raises(
        ShapeError,
        match=r"(?s)inconsistent sizes for dim 'F'.*size 8: `x` axis 1.*"
        r"size 3: `kw\['off'\]` axis 0",
    ):
        f(x, scale=s, off=o[:3])
    with pytest.raises(ShapeError, match=r"argument `kw\['off'\]` has dtype int32"):
        f(x, scale=s, off=jnp.zeros(8, jnp.int32))


def test_var_positional_annotation_and_module_in_var_keyword():
    class Gain(eqx.Module):
        g: Float[Array, " F"]

    def body(*xs: Float[Array, "T F"], **kw: Gain) -> Float[Array, "T F"]:
        return (xs[0] + xs[1]) * kw["gain"].g

    f = filter_multi_vmap(body, vmap="T", scan={"F": 3})
    a, b, g = _rand((5, 7)), _rand((5, 7), 1), _rand((7,), 2)
    ref = loop_reference(
        lambda a_, b_, g_: (a_ + b_) * g_,
        [a, b, g],
        ["T F", "T F", "F"],
        ("T", "F"),
        "T F",
    )
    _check(f(a, b, gain=Gain(g)), ref)
    with pytest.raises(
        ShapeError, match=r"(?s)dim 'T'.*size 5: `xs\[0\]` axis 0.*size 2: `xs\[1\]`"
    ):
        f(a, b[:2], gain=Gain(g))
    with pytest.raises(ShapeError, match=r"(?s)dim 'F'.*size 3: `kw\['gain'\]\.g`"):
        f(a, b, gain=Gain(g[:3]))


def test_explicit_in_dims_for_var_keyword_with_shard():
    mesh = _mesh()
    f = filter_multi_vmap(
        lambda x, **kw: x * kw["y"],
        in_dims={"x": "T F", "kw": {"y": "F T"}},
        out_dims="T F",
        scan={"T": 2},
        shard={"F": ("x", "y")},
        mesh=mesh,
    )
    x, y = _rand((5, 8)), _rand((8, 5), 1)
    ref = loop_reference(
        lambda x_, y_: x_ * y_, [x, y], ["T F", "F T"], ("T", "F"), "T F"
    )
    _check(f(x, y=y), ref)
    with pytest.raises(ShapeError, match=r"(?s)dim 'T'.*`kw\['y'\]` axis 1"):
        f(x, y=y[:, :3])


#
# Pytree outputs (tuple, dict, Module, static leaves) with shard and chunked scans
# with remainders, including sizes 0 and 1.
#


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(
    t=st.sampled_from([0, 1, 2, 5]),
    f_local=st.sampled_from([0, 1, 3]),
    chunk=st.sampled_from([1, 2, 3]),
    scan_f=st.booleans(),
    pad=st.booleans(),
)
def test_pytree_outputs_with_shard_and_chunked_scans(t, f_local, chunk, scan_f, pad):
    mesh = _mesh()
    f_size = 4 * f_local - (1 if pad and f_local else 0)
    scan = {"T": chunk, "F": chunk} if scan_f else {"T": chunk}

    @filter_multi_vmap(
        in_dims=("T F", "F"),
        out_dims=("F T", {"k": "T F 2", "tag": None}),
        scan=scan,
        shard={"F": "x"},
        mesh=mesh,
        pad=pad,
    )
    def body(x, y):
        return x * y, {"k": jnp.stack([x, -x]), "tag": "hi"}

    x, y = _rand((t, f_size)), _rand((f_size,), 1)
    a, b = eqx.filter_jit(body)(x, y)
    xn, yn = np.asarray(x), np.asarray(y)
    _check(a, (xn * yn).T)
    _check(b["k"], np.stack([xn, -xn], -1))
    assert b["tag"] == "hi"
    if not pad and t and f_size:
        _sharded_over(a, mesh, 0, "x")
        _sharded_over(b["k"], mesh, 1, "x")


@pytest.mark.parametrize("kind", ["explicit", "auto"])
@pytest.mark.parametrize("scan", [{"T": 2}, "T", None])
def test_sharded_output_of_size_zero_is_readable(kind, scan):
    # A computed, empty, sharded JAX array cannot be read back (`np.asarray`
    # raises); a sharded map over an empty dim returns plain empty arrays.
    mesh = _mesh(kind)
    f = filter_multi_vmap(
        lambda x: (x + 1, x.astype(jnp.int32)),
        in_dims="T F",
        out_dims=("F T", "T F"),
        scan=scan,
        vmap=None if scan else "T",
        shard={"F": "x"},
        mesh=mesh,
    )
    x = jnp.zeros((0, 8), jnp.float32)
    for fn in (f, jax.jit(f)):
        with jax.set_mesh(mesh):
            a, b = fn(x)
        assert np.asarray(a).shape == (8, 0) and a.dtype == jnp.float32
        assert np.asarray(b).shape == (0, 8) and b.dtype == jnp.int32
    with jax.set_mesh(mesh):
        g = jax.grad(lambda x: f(x)[0].sum())(x)
    assert np.asarray(g).shape == (0, 8)


#
# Outer transforms and nesting.
#


@pytest.mark.slow
def test_outer_vmap_around_sharded_and_planned_wrappers():
    mesh = _mesh()
    sharded = filter_multi_vmap(
        jnp.sin,
        in_dims="T F",
        out_dims="F T",
        scan={"T": 3},
        shard={"F": "x"},
        mesh=mesh,
    )
    planned = filter_multi_vmap(
        jnp.sin,
        in_dims="T F",
        out_dims="F T",
        vmap="T F",
        plan="auto",
        memory_budget=256,
    )
    x = _rand((3, 7, 8))
    ref = np.stack([np.sin(np.asarray(xi)).T for xi in x])
    _check(jax.vmap(sharded)(x), ref)
    _check(jax.vmap(planned)(x), ref)
    with jax.set_mesh(mesh):
        _check(jax.jit(jax.vmap(sharded))(x), ref)
    _check(jax.jit(jax.vmap(planned))(x), ref)


@pytest.mark.slow
def test_nested_filter_multi_vmap():
    inner = filter_multi_vmap(
        lambda u, v: u * v, in_dims=("F", "F"), out_dims="F", scan={"F": 3}
    )

    @filter_multi_vmap(
        in_dims={"a": "T F", "b": "F"}, out_dims="F T", core="F", scan={"T": 2}
    )
    def outer(a, b):
        return inner(a, b)

    a, b = _rand((5, 7)), _rand((7,), 1)
    _check(outer(a, b), (np.asarray(a) * np.asarray(b)).T)
    g = jax.grad(lambda b_: outer(a, b_).sum())(b)
    _check(g, np.asarray(a).sum(0))


def test_jit_of_wrappers_with_every_option():
    mesh = _mesh()
    kwargs = dict(in_dims={"a": "T F"}, out_dims="F T", checkpoint=True)
    sharded = filter_multi_vmap(
        lambda a: 2 * a,
        scan={"T": 2},
        shard={"F": ("x", "y")},
        mesh=mesh,
        pad=True,
        **kwargs,
    )
    planned = filter_multi_vmap(
        lambda a: 2 * a, vmap="T F", plan="auto", memory_budget=0.25, **kwargs
    )
    x = _rand((5, 6))
    for w in (sharded, planned):
        hash(w)
        assert w == w
        jitted = jax.jit(w)
        _check(jitted(x), 2 * np.asarray(x).T)
        _check(jitted(x), 2 * np.asarray(x).T)
        assert jitted._cache_size() == 1


#
# verbose=True on each feature path.
#


@pytest.mark.slow
def test_verbose_on_each_feature_path(capsys):
    mesh = _mesh()
    x = _rand((7, 6))
    filter_multi_vmap(
        lambda a: a,
        in_dims="T F",
        out_dims="F T",
        scan={"T": 3},
        shard={"F": "x"},
        mesh=mesh,
        pad=True,
        verbose=True,
    )(x)
    filter_multi_vmap(
        lambda a: a,
        in_dims="T F",
        out_dims="F T",
        vmap="T F",
        plan="auto",
        memory_budget=2**20,
        verbose=True,
    )(x)
    multi_vmap(lambda a: a, "[T,F]", "[F,T]", scan_dims=["T"], verbose=True)(x)

    class M(eqx.Module):
        w: Float[Array, " F"]

        @filter_multi_vmap(scan={"T": 2}, verbose=True)
        def f(self, a: Float[Array, "T F"]) -> Float[Array, "T F"]:
            return self.w * a

    M(x[0]).f(x)
    raw = capsys.readouterr().out
    out = " ".join(raw.split())  # a nest too wide for 100 columns is broken
    assert all(len(line) <= 100 for line in raw.splitlines())
    assert (
        "<lambda>): shard_map(F=6 over 'x': 4 shards of 2, padded "
        "to 8) -> scan(T: 2 chunks of 3) + vmap(T remainder=1) -> vmap(F=2) -> body"
    ) in out
    assert "plan='auto'" in out
    # The nest the planner chose (full vmap fits), printed at each trace.
    assert re.search(r"<lambda>\): vmap\([TF]=[76]\) -> vmap\([TF]=[76]\) -> body", out)
    assert "=== multi_vmap(<lambda>) ===" in out
    assert "<lambda>): scan(T=7) -> vmap(F=6) -> body" in out
    assert (
        "<locals>.M.f): scan(T: 3 chunks of 2) + vmap(T remainder=1) -> vmap(F=6) "
        "-> body"
    ) in out
    _no_internal_names(raw)


#
# Error messages: they name the real source of the dims.
#


def _raises(error, matches, fn):
    with pytest.raises(error) as info:
        fn()
    text = str(info.value)
    for m in matches:
        assert re.search(m, text), (m, text)
    _no_internal_names(text)


def test_output_errors_name_the_return_annotation():
    x = _rand((7, 8))

    @filter_multi_vmap(core="F")
    def rank(a: Float[Array, "T F"]) -> Float[Array, "T F"]:
        return a.sum()

    _raises(
        ShapeError,
        [
            r"`output` with per-element shape \(\)",
            r"rank 0",
            r"the return annotation 'T F'",
        ],
        lambda: rank(x),
    )
    assert "`out_dims`" not in _message(lambda: rank(x))

    @filter_multi_vmap(vmap="T")
    def fixed(a: Float[Array, "T F"]) -> Float[Array, "T 3"]:
        return a

    _raises(
        ShapeError,
        [
            r"per-element shape \(8,\)",
            r"the return annotation 'T 3' fixes the axis "
            r"at 0 to 3",
        ],
        lambda: fixed(x),
    )
    assert "`out_dims`" not in _message(lambda: fixed(x))

    # The same mistakes with explicit `out_dims` name `out_dims`.
    explicit = filter_multi_vmap(lambda a: a, in_dims="T F", out_dims="T 3", vmap="T")
    _raises(
        ShapeError,
        [r"but `out_dims` 'T 3' fix the axis at 0 to 3"],
        lambda: explicit(x),
    )
    explicit_rank = filter_multi_vmap(
        lambda a: a.sum(), in_dims="T F", out_dims="T F", core="F"
    )
    _raises(
        ShapeError,
        [r"rank 0", r"`out_dims` 'T F' without the mapped dims T"],
        lambda: explicit_rank(x),
    )


def _message(fn):
    try:
        fn()
    except (ShapeError, SpecError) as e:
        return str(e)
    raise AssertionError("no error")


def test_errors_with_shard_and_annotations():
    mesh = _mesh()

    @filter_multi_vmap(vmap="T", shard={"F": "x"}, mesh=mesh)
    def f(a: Float[Array, "T F"]) -> Float[Array, " T"]:
        return a

    x = _rand((7, 8))
    _raises(
        SpecError,
        [
            r"`shard` names dim 'F', which is not mapped",
            r"the return annotation does not name it",
        ],
        lambda: f(x),
    )

    @filter_multi_vmap(vmap="T", shard={"F": "x"}, mesh=mesh)
    def g(a: Float[Array, "T F"], b: Int[Array, " F"]) -> Float[Array, "T F"]:
        return a

    _raises(
        ShapeError,
        [
            r"`shard=\{'F': 'x'\}`",
            r"dim 'F' has size 6",
            r"mesh axis 'x' \(size 4\)",
            r"`a` axis 1 \(float32\[7,6\]",
        ],
        lambda: g(x[:, :6], jnp.zeros(6, jnp.int32)),
    )
    _raises(
        ShapeError,
        [r"argument `b` has dtype float32", r"Int\[\.\.\., 'F'\]"],
        lambda: g(x, x[0]),
    )


def test_module_field_errors_with_shard_and_plan():
    mesh = _mesh()

    class Nested(eqx.Module):
        ws: list[Float[Array, " F"]]
        t: PyTree[Float[Array, " T"]]

    def body(p: Nested) -> Float[Array, "T F"]:
        return p.ws[0] * p.ws[1] * p.t["u"]

    w0, w1, u = _rand((8,)), _rand((8,), 1), _rand((7,), 2)
    p_ok = Nested([w0, w1], {"u": u})
    p_bad = Nested([w0, w1[:3]], {"u": u})
    ref = loop_reference(
        lambda a, b, c: a * b * c, [w0, w1, u], ["F", "F", "T"], ("T", "F"), "T F"
    )
    for w in (
        filter_multi_vmap(body, vmap="T", shard={"F": "x"}, mesh=mesh),
        filter_multi_vmap(body, vmap="T F", plan="auto", memory_budget=2**12),
    ):
        _check(w(p_ok), ref)
        _raises(
            ShapeError,
            [r"dim 'F'", r"size 8: `p\.ws\[0\]` axis 0", r"size 3: `p\.ws\[1\]`"],
            lambda w=w: w(p_bad),
        )


@pytest.mark.parametrize("jit", ["none", "filter_jit"])
def test_sharded_callable_module_with_explicitly_sharded_fields(jit):
    # `jax.shard_map` cannot close over arrays on an explicit mesh: the array fields
    # of a callable Module are passed into the shard_map as replicated inputs.
    class Scale(eqx.Module):
        w: jax.Array

        def __call__(self, a):
            return a * self.w + jnp.sum(self.w)

    mesh = _mesh()
    x = jnp.asarray(_rand((3, 8)))
    with jax.set_mesh(mesh):
        module = Scale(jnp.asarray([2.0, -1.0]))  # created on the explicit mesh
        f = filter_multi_vmap(
            module, in_dims="T F", out_dims="F T F2", core="F2", shard={"F": "x"}
        )
        f = eqx.filter_jit(f) if jit == "filter_jit" else f
        out = f(x)
    ref = np.stack(
        [
            np.stack(
                [np.asarray(x[t, i]) * np.asarray(module.w) + 1.0 for t in range(3)]
            )
            for i in range(8)
        ]
    )
    _check(out, ref)
    _sharded_over(out, mesh, 0, "x")


def test_explain_looks_through_outer_decorators():
    from beartype import beartype
    from jaxtyping import jaxtyped

    @jaxtyped(typechecker=beartype)
    @filter_multi_vmap(vmap="T")
    def g(x: Float[Array, "T F"]) -> Float[Array, "T F"]:
        return 2 * x

    x = _rand((3, 4))
    _check(g(x), 2 * np.asarray(x))
    for fn in (g, eqx.filter_jit(g)):
        text = str(explain(fn, x))
        assert "vmap(T=3)" in text
    with pytest.raises(SpecError, match=r"must be a function returned by"):
        explain(lambda x: x, x)
