"""Collectives over dims, in two directions:

- `reduce=` over a sharded dim: each device reduces its block, then one
    `psum`/`pmax`/`pmin` over the dim's mesh axes, the only collective in the
    optimised forward program; the output is replicated over those axes.
- The body's own collectives by dim name (`lax.psum(x, "F")`, `pmean`, `pmax`,
    `all_gather`, `axis_index`) for vmapped and sharded dims, against the
    hand-written `jax.vmap(..., axis_name="F")`; and over a scanned dim, a
    `SpecError` before the nest is built.
"""

import re

import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
import pytest
from eqx_multimap import filter_multi_vmap, Monoid, SpecError
from eqx_multimap._resolve import resolve
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 8, reason="needs 8 (simulated) devices; see conftest.py"
)

_COLLECTIVE = re.compile(
    r"\b(all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)"
    r"(-start)?\("
)


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape))


def _rand(shape, seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32))


def _spec(x):
    spec = tuple(x.sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


def _collectives(fn, *args) -> list[str]:
    text = jax.jit(fn).lower(*args).compile().as_text()
    return [m.group(1) for m in _COLLECTIVE.finditer(text)]


_NP = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}


def _body(x, nu):
    return jnp.sin(x) * nu + jnp.cos(x)


#
# `reduce=` over a sharded dim.
#


@pytest.mark.parametrize("strategy", [{}, {"scan": "T"}, {"scan": {"T": 1}}])
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_reduce_a_sharded_dim(op, strategy):
    mesh = _mesh((4,), ("d",))
    x, nu = _rand((8, 3, 5), seed=1), _rand((3,), seed=2)
    f = filter_multi_vmap(
        _body,
        in_dims=("T F B", "F"),
        out_dims="F B",
        reduce={"T": op},
        shard={"T": "d"},
        mesh=mesh,
        **strategy,
    )
    xs = jax.device_put(x, NamedSharding(mesh, P("d")))
    out = f(xs, nu)
    want = _NP[op](np.sin(np.asarray(x)) * np.asarray(nu)[:, None] + np.cos(x), axis=0)
    assert out.shape == (3, 5) and out.dtype == jnp.float32
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    assert _spec(out) == (None, None)  # replicated over 'd'
    # One all-reduce over 'd', and no other collective.
    assert _collectives(f, xs, nu) == ["all-reduce"]


def test_reduce_one_sharded_dim_keep_another():
    # T over 'x' is reduced; F over 'y' stays sharded; B is scanned in chunks.
    mesh = _mesh((2, 4), ("x", "y"))
    x, nu = _rand((6, 8, 5), seed=3), _rand((8,), seed=4)
    f = filter_multi_vmap(
        _body,
        in_dims=("T F B", "F"),
        out_dims="B F",
        reduce={"T": "sum"},
        shard={"T": "x", "F": "y"},
        scan={"B": 2},
        mesh=mesh,
    )
    xs = jax.device_put(x, NamedSharding(mesh, P("x", "y")))
    nus = jax.device_put(nu, NamedSharding(mesh, P("y")))
    out = f(xs, nus)
    want = np.sum(np.sin(np.asarray(x)) * np.asarray(nu)[:, None] + np.cos(x), 0).T
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    assert _spec(out) == (None, "y")
    assert _collectives(f, xs, nus) == ["all-reduce"]


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_reduce_a_padded_sharded_dim(op):
    # T = 7 over 4 devices is padded to 8 with a copy of the last element, which
    # must not take part (a sum would count it twice, a mean divide by 8).
    mesh = _mesh((4,), ("d",))
    x, nu = _rand((7, 3, 2), seed=5), _rand((3,), seed=6)
    f = filter_multi_vmap(
        _body,
        in_dims=("T F B", "F"),
        out_dims="F B",
        reduce={"T": op},
        shard={"T": "d"},
        mesh=mesh,
        pad=True,
        scan="T",
    )
    want = _NP[op](np.sin(np.asarray(x)) * np.asarray(nu)[:, None] + np.cos(x), axis=0)
    np.testing.assert_allclose(f(x, nu), want, rtol=1e-5, atol=1e-5)


def test_monoid_over_a_sharded_dim_keeps_the_order():
    # The devices' partial products are gathered and multiplied in mesh order.
    mesh = _mesh((2, 4), ("x", "y"))
    xs = _rand((16, 3, 2, 2), seed=7) * 0.5 + jnp.broadcast_to(
        jnp.eye(2), (16, 3, 2, 2)
    )
    f = filter_multi_vmap(
        lambda a: a,
        in_dims="T B 2 2",
        out_dims="B 2 2",
        reduce={"T": Monoid(jnp.matmul, jnp.eye(2))},
        shard={"T": ("x", "y")},
        mesh=mesh,
        scan={"T": 1},
    )
    x = np.asarray(xs, np.float64)
    want = np.stack([np.linalg.multi_dot(list(x[:, b])) for b in range(3)])
    np.testing.assert_allclose(f(xs), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_gradient_through_a_sharded_reduction(op):
    mesh = _mesh((4,), ("d",))
    x = _rand((8, 3), seed=8)
    f = filter_multi_vmap(
        lambda a: jnp.tanh(a) * a,
        in_dims="T B",
        out_dims="B",
        reduce={"T": op},
        shard={"T": "d"},
        mesh=mesh,
        scan="T",
    )
    reduce = {"sum": jnp.sum, "mean": jnp.mean, "max": jnp.max, "min": jnp.min}[op]
    want = jax.grad(lambda x: jnp.sum(jnp.sin(reduce(jnp.tanh(x) * x, axis=0))))(x)
    with jax.set_mesh(mesh):
        got = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(f(x)))))(x)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


#
# The body's collectives, by dim name.
#


def _uses_collectives(x):
    # x: () -- one (T, F) element.
    return {
        "psum": lax.psum(x, "F"),
        "pmean": lax.pmean(x, "F"),
        "pmax": lax.pmax(x, "F"),
        "gather": lax.all_gather(x, "F"),
        "index": lax.axis_index("F"),
        "centred": x - lax.pmean(x, "F"),
    }


_OUT = {
    "psum": "T F",
    "pmean": "T F",
    "pmax": "T F",
    "gather": "T F G",
    "index": "T F",
    "centred": "T F",
}


def _hand_collectives(x):
    """The hand-written nest: vmap over T of vmap over F, bound as axis 'F'."""
    return jax.vmap(jax.vmap(_uses_collectives, axis_name="F"))(x)


def _check(out, x):
    want = _hand_collectives(x)
    for key in _OUT:
        assert out[key].shape == want[key].shape, key
        assert out[key].dtype == want[key].dtype, key
        np.testing.assert_allclose(
            out[key], want[key], rtol=1e-6, atol=1e-6, err_msg=key
        )
    # The hand-written nest against numpy, once.
    xn = np.asarray(x)
    np.testing.assert_allclose(want["psum"][:, 0], xn.sum(1), rtol=1e-5)
    np.testing.assert_array_equal(want["gather"][:, 3], xn)
    np.testing.assert_array_equal(want["index"][0], np.arange(x.shape[1]))


@pytest.mark.parametrize(
    "strategy", [{}, {"vmap": "F T"}, {"scan": "T"}, {"scan": {"T": 2}}]
)
def test_collectives_over_a_vmapped_dim(strategy):
    x = _rand((3, 8), seed=9)
    f = filter_multi_vmap(
        _uses_collectives, in_dims="T F", out_dims=_OUT, core="G", **strategy
    )
    _check(f(x), x)


@pytest.mark.parametrize(
    "mesh_shape, names, axes",
    [((4,), ("d",), "d"), ((2, 4), ("x", "y"), ("x", "y")), ((2, 4), ("x", "y"), "y")],
)
@pytest.mark.parametrize("strategy", [{}, {"scan": "T"}])
def test_collectives_over_a_sharded_dim(mesh_shape, names, axes, strategy):
    # Inside `shard_map` F is vmapped over each device's block: psum spans the
    # local axis and the mesh axes, all_gather is in global order, axis_index is
    # the global index.
    mesh = _mesh(mesh_shape, names)
    x = _rand((3, 8), seed=10)
    f = filter_multi_vmap(
        _uses_collectives,
        in_dims="T F",
        out_dims=_OUT,
        core="G",
        shard={"F": axes},
        mesh=mesh,
        **strategy,
    )
    _check(f(x), x)


def test_collectives_inside_a_jitted_helper():
    @jax.jit
    def helper(x):
        return lax.psum(x, "F") + lax.axis_index("F").astype(x.dtype)

    mesh = _mesh((4,), ("d",))
    x = _rand((2, 8), seed=11)
    f = filter_multi_vmap(
        helper, in_dims="T F", out_dims="T F", shard={"F": "d"}, mesh=mesh
    )
    want = jax.vmap(jax.vmap(helper, axis_name="F"))(x)
    np.testing.assert_allclose(f(x), want, rtol=1e-6)


def test_gradient_through_a_body_collective():
    def centred(x):
        return jnp.tanh(x - lax.pmean(x, "F"))

    x = _rand((3, 8), seed=12)
    want = jax.grad(
        lambda x: jnp.sum(jax.vmap(jax.vmap(centred, axis_name="F"))(x) ** 2)
    )(x)
    mesh = _mesh((4,), ("d",))
    for kw in ({}, {"shard": {"F": "d"}, "mesh": mesh}):
        f = filter_multi_vmap(centred, in_dims="T F", out_dims="T F", scan="T", **kw)
        with jax.set_mesh(mesh):
            got = jax.grad(lambda x: jnp.sum(f(x) ** 2))(x)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_collective_dims():
    x = _rand((3, 8), seed=13)
    f = filter_multi_vmap(_uses_collectives, in_dims="T F", out_dims=_OUT, core="G")
    call = resolve(f._fun, f._options, (x,), {})
    assert call.collective_dims == frozenset({"F"})

    def nested(x):  # inside a `cond` and a `jit`
        y = jax.jit(lambda v: lax.pmax(v, "T"))(x)
        return lax.cond(x > 0, lambda: lax.psum(y, "F"), lambda: y)

    g = filter_multi_vmap(nested, in_dims="T F", out_dims="T F")
    call = resolve(g._fun, g._options, (x,), {})
    assert call.collective_dims == frozenset({"T", "F"})
    h = filter_multi_vmap(jnp.sin, in_dims="T F", out_dims="T F")
    assert resolve(h._fun, h._options, (x,), {}).collective_dims == frozenset()


#
# Errors: before the nest is built.
#


def _raises_each(error, matches, thunk):
    for match in matches:
        with pytest.raises(error, match=match):
            thunk()


@pytest.mark.parametrize(
    "kw, how",
    [
        ({"scan": "F"}, "a scanned dim is a loop"),
        ({"scan": {"F": 2}}, "a scanned in chunks dim is a loop"),
        (
            {"scan": "F", "shard": {"F": "d"}, "mesh": _mesh((4,), ("d",))},
            "a scanned dim is a loop",
        ),
    ],
)
def test_collective_over_a_scanned_dim(kw, how):
    def psum_body(x):
        return lax.psum(x, "F")

    f = filter_multi_vmap(psum_body, in_dims="T F", out_dims="T F", **kw)
    _raises_each(
        SpecError,
        [
            r"filter_multi_vmap\(.*psum_body\)",
            "the body uses the collective `psum` over dim 'F', which `scan` names",
            how,
            "Vmap it",
            "shard it",
            re.escape("`reduce={'F': 'sum'}`"),
        ],
        lambda: f(_rand((2, 8))),
    )


def test_unsupported_collectives_over_a_sharded_dim():
    mesh = _mesh((4,), ("d",))
    x = _rand((2, 7))
    padded = filter_multi_vmap(
        lambda x: lax.psum(x, "F"),
        in_dims="T F",
        out_dims="T F",
        shard={"F": "d"},
        mesh=mesh,
        pad=True,
    )
    _raises_each(
        SpecError,
        [
            "the collective `psum` over dim 'F', which `shard` splits over mesh axes",
            r"with `pad=True` it is padded \(to 8\)",
        ],
        lambda: padded(x),
    )
    permuted = filter_multi_vmap(
        lambda x: lax.ppermute(x, "F", [(0, 1), (1, 0)]),
        in_dims="T F",
        out_dims="T F",
        shard={"F": "d"},
        mesh=mesh,
    )
    _raises_each(
        SpecError,
        ["`ppermute` over dim 'F'", "cannot be rewritten to span the mesh"],
        lambda: permuted(_rand((2, 8))),
    )
    in_cond = filter_multi_vmap(
        lambda x: lax.cond(x > 0, lambda: lax.psum(x, "F"), lambda: x),
        in_dims="T F",
        out_dims="T F",
        shard={"F": "d"},
        mesh=mesh,
    )
    _raises_each(
        SpecError,
        ["`psum` over dim 'F'", "inside `cond`"],
        lambda: in_cond(_rand((2, 8))),
    )
