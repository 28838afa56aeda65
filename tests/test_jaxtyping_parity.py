"""Annotations mean what jaxtyping says they mean.

Each test compares our verdict (a result, or an error) with jaxtyping's own
(`beartype.door.is_bearable` under one `jaxtyped` memo, and, for the fields of a
Module or typed container, under a memo of their own, as jaxtyping's dataclass check
does), and our values with a plain loop reference.
"""

# Single-name dims such as `Float[Array, "F"]` read to ruff as forward references.
# ruff: noqa: F821

import contextlib
import dataclasses
import re
import types
import typing
from typing import Any, NamedTuple, TypedDict

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from beartype import beartype
from beartype.door import is_bearable
from eqx_multimap import filter_multi_vmap, ShapeError, SpecError
from hypothesis import given, settings, strategies as st
from jaxtyping import Array, Float, jaxtyped, PRNGKeyArray, PyTree, TypeCheckError


def jaxtyping_accepts(*pairs: tuple[Any, Any]) -> bool:
    """jaxtyping's verdict on `(value, annotation)` pairs, checked in one memo (as
    the parameters and return value of one `@jaxtyped` function are)."""
    with jaxtyped("context"):
        return all(is_bearable(value, ann) for value, ann in pairs)


def fields_accepted(obj: Any) -> bool:
    """jaxtyping's dataclass check: the fields of `obj` against their annotations,
    in a memo of their own."""
    hints = typing.get_type_hints(type(obj))
    if isinstance(obj, dict):
        return jaxtyping_accepts(*((obj[k], hints[k]) for k in hints))
    return jaxtyping_accepts(*((getattr(obj, k), hints[k]) for k in hints))


def rand(seed: int, *shape: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def loop(body, *xs: jax.Array) -> np.ndarray:
    """`body` on every row of the leading axis of `xs`, stacked."""
    return np.stack([np.asarray(body(*(x[i] for x in xs))) for i in range(len(xs[0]))])


def assert_close(actual: Any, expected: Any) -> None:
    assert isinstance(actual, jax.Array)
    expected = np.asarray(expected)
    assert actual.shape == expected.shape
    assert actual.dtype == expected.dtype
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=1e-5, atol=1e-5)


#
# Typed containers as parameters: their field annotations give the dims.
#


class PairNT(NamedTuple):
    a: Float[Array, "T F"]
    b: Float[Array, "F"]


class PairTD(TypedDict):
    a: Float[Array, "T F"]
    b: Float[Array, "F"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PairDC:
    a: Float[Array, "T F"]
    b: Float[Array, "F"]


class PairM(eqx.Module):
    a: Float[Array, "T F"]
    b: Float[Array, "F"]


def _get(p: Any, k: str) -> Any:
    return p[k] if isinstance(p, dict) else getattr(p, k)


@pytest.mark.parametrize("cls", [PairNT, PairTD, PairDC, PairM])
def test_typed_container_parameter_is_mapped(cls):
    a, b, x = rand(0, 3, 4), rand(1, 4), rand(2, 3, 4)
    p = cls(a=a, b=b)

    @filter_multi_vmap
    def f(p: cls, x: Float[Array, "T F"]) -> Float[Array, "T F"]:
        # T and F are mapped: one element of each field.
        assert _get(p, "a").shape == () and _get(p, "b").shape == ()
        return x * _get(p, "a") + _get(p, "b")

    assert fields_accepted(p) and jaxtyping_accepts((p, cls), (x, Float[Array, "T F"]))
    out = f(p, x)
    assert_close(out, np.asarray(x) * np.asarray(a) + np.asarray(b))
    assert jaxtyping_accepts((x, Float[Array, "T F"]), (out, Float[Array, "T F"]))


@pytest.mark.parametrize(
    "ann", [dict[str, Float[Array, "T F"]], PyTree[Float[Array, "T F"]]]
)
def test_dict_and_pytree_parameter(ann):
    d = {"u": rand(0, 3, 4), "v": rand(1, 3, 4)}

    @filter_multi_vmap
    def f(d: ann) -> Float[Array, "T F"]:
        return d["u"] * d["v"]

    assert jaxtyping_accepts((d, ann))
    assert_close(f(d), np.asarray(d["u"]) * np.asarray(d["v"]))
    # Function-scoped: `T F` holds across the dict's values. (beartype samples one
    # item of a dict, so each value is checked in the one memo here.)
    bad = {"u": rand(0, 3, 4), "v": rand(1, 4, 3)}
    assert not jaxtyping_accepts(*((v, Float[Array, "T F"]) for v in bad.values()))
    with pytest.raises(ShapeError, match=r"inconsistent sizes for dim 'T'"):
        f(bad)


#
# Typed containers in returns, at any depth.
#


class Swapped(NamedTuple):
    a: Float[Array, "F T"]


class OutTD(TypedDict):
    s: Float[Array, "T F"]
    t: Float[Array, "F T"]


def test_namedtuple_inside_tuple_return_takes_its_field_dims():
    # Square, so a field read in the wrong order would not change the shape.
    x = rand(0, 3, 3) + jnp.arange(3.0)[None, :]

    @filter_multi_vmap
    def f(x: Float[Array, "T F"]) -> tuple[Float[Array, "T F"], Swapped]:
        return x, Swapped(2 * x)

    y, s = f(x)
    assert isinstance(s, Swapped)
    assert_close(y, x)
    assert_close(s.a, 2 * np.asarray(x).T)
    ann = tuple[Float[Array, "T F"], Swapped]
    assert jaxtyping_accepts((x, Float[Array, "T F"]), ((y, s), ann))
    assert fields_accepted(s)


@pytest.mark.parametrize(
    "ann,body,expected",
    [
        (PyTree[Float[Array, "T F"]], lambda x: {"a": x, "b": 2 * x}, None),
        (dict[str, Float[Array, "T F"]], lambda x: {"a": x, "b": 2 * x}, None),
        (Swapped, lambda x: Swapped(2 * x), lambda x: Swapped(2 * x.T)),
        (OutTD, lambda x: {"s": x, "t": 3 * x}, lambda x: {"s": x, "t": 3 * x.T}),
        (
            list[tuple[Swapped, Float[Array, "T F"]]],
            lambda x: [(Swapped(x), x + 1)],
            lambda x: [(Swapped(x.T), x + 1)],
        ),
    ],
    ids=["pytree-dict", "dict", "namedtuple", "typeddict", "nested"],
)
def test_typed_returns(ann, body, expected):
    x = rand(0, 3, 4)

    @filter_multi_vmap
    def f(x: Float[Array, "T F"]) -> ann:
        return body(x)

    out = f(x)
    want = (expected or body)(x)
    assert jax.tree.structure(out) == jax.tree.structure(want)
    for got, w in zip(jax.tree.leaves(out), jax.tree.leaves(want)):
        assert_close(got, w)
    assert jaxtyping_accepts((x, Float[Array, "T F"]), (out, ann))


#
# Per-instance scoping of a Module's core dims.
#


class Layer(eqx.Module):
    w: Float[Array, "out inp"]


def test_two_layers_of_one_class():
    w1, w2, x = rand(0, 8, 3), rand(1, 2, 8), rand(2, 5, 3)

    @filter_multi_vmap(core="k")
    def f(l1: Layer, l2: Layer, x: Float[Array, "B d"]) -> Float[Array, "B k"]:
        return l2.w @ jnp.tanh(l1.w @ x)

    l1, l2 = Layer(w1), Layer(w2)
    assert fields_accepted(l1) and fields_accepted(l2)
    assert jaxtyping_accepts((l1, Layer), (l2, Layer), (x, Float[Array, "B d"]))
    out = f(l1, l2, x)
    assert_close(out, loop(lambda r: np.asarray(w2) @ np.tanh(np.asarray(w1) @ r), x))


class Tied(eqx.Module):
    w: Float[Array, "out inp"]
    b: Float[Array, "out"]


def test_mismatch_within_one_instance_names_the_field_path():
    @filter_multi_vmap
    def f(layer: Tied, x: Float[Array, "B inp"]) -> Float[Array, "B"]:
        return jnp.sum(layer.w @ x + layer.b)

    bad = Tied(jnp.ones((2, 3)), jnp.ones(5))
    assert not fields_accepted(bad)
    with pytest.raises(ShapeError) as info:
        f(bad, jnp.ones((4, 3)))
    msg = str(info.value)
    assert "dim 'out'" in msg and "within `layer`" in msg
    assert "`layer.w` axis 0" in msg and "`layer.b` axis 0" in msg


def test_mapped_dim_of_a_field_is_global():
    @filter_multi_vmap
    def f(p: PairM, x: Float[Array, "T F"]) -> Float[Array, "T F"]:
        return x * p.a

    with pytest.raises(ShapeError, match=r"inconsistent sizes for dim 'T':"):
        f(PairM(jnp.ones((5, 4)), jnp.ones(4)), jnp.ones((3, 4)))


#
# What the library cannot read: a clear error.
#


class Opaque:
    """A pytree class whose children cannot be matched to its annotated fields."""

    a: Float[Array, "T F"]

    def __init__(self, a):
        self.a = a


jax.tree_util.register_pytree_node(
    Opaque, lambda o: ((o.a,), None), lambda _, c: Opaque(*c)
)


@dataclasses.dataclass
class NotAPytree:
    a: Float[Array, "T F"]


@pytest.mark.parametrize(
    "cls,fix", [(Opaque, "Make it an `eqx.Module`"), (NotAPytree, "register_dataclass")]
)
def test_unreadable_container_names_the_fix(cls, fix):
    @filter_multi_vmap
    def f(p: cls, x: Float[Array, "T F"]) -> Float[Array, "T F"]:
        return x * p.a

    with pytest.raises(SpecError) as info:
        f(cls(jnp.ones((3, 4))), jnp.ones((3, 4)))
    msg = str(info.value)
    assert f"parameter `p` is a `{cls.__name__}`" in msg
    assert "mapped dim 'T'" in msg and fix in msg
    assert "in_dims={'p': ...}" in msg


#
# The remaining cases.
#


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey])
def test_prng_key_array_parameter_passes_through(make_key):
    key, x = make_key(0), rand(0, 3, 4)

    @filter_multi_vmap
    def f(key: PRNGKeyArray, x: Float[Array, "T F"]) -> Float[Array, "T F"]:
        return x + jax.random.normal(key, ())

    assert jaxtyping_accepts((key, PRNGKeyArray), (x, Float[Array, "T F"]))
    assert_close(f(key, x), np.asarray(x) + np.asarray(jax.random.normal(key, ())))


def _doubled(x: Float[Array, "T F"]) -> Float[Array, "T F"]:
    return 2 * x


def test_no_type_check_under_and_over():
    x = rand(0, 3, 4)
    under = filter_multi_vmap(typing.no_type_check(_copy(_doubled)))
    assert_close(under(x), 2 * np.asarray(x))
    over = typing.no_type_check(filter_multi_vmap(_copy(_doubled)))
    assert_close(over(x), 2 * np.asarray(x))


def _copy(fun):
    """A fresh copy of `fun`, so that `no_type_check` marks only this one."""
    out = types.FunctionType(fun.__code__, fun.__globals__, fun.__name__)
    out.__annotations__ = dict(fun.__annotations__)
    return out


def _checked_module():
    @jaxtyped(typechecker=beartype)
    class Checked(eqx.Module):
        a: Float[Array, "T F"]

    return Checked


def _checked_dataclass():
    @jaxtyped(typechecker=beartype)
    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Checked:
        a: Float[Array, "T F"]

    return Checked


@pytest.mark.parametrize("how", ["annotated", "out_dims", "jit"])
@pytest.mark.parametrize("make", [_checked_module, _checked_dataclass])
def test_returned_class_with_its_own_check_names_the_class_and_fix(make, how):
    # jaxtyping checks a class decorated `@jaxtyped` when it is built: the body,
    # building it on one element, fails with jaxtyping's own error, which keeps its
    # message and gets a note naming the class and the fix.
    Checked = make()

    def body(x: Float[Array, "T F"]) -> Checked:
        return Checked(2 * x)

    if how == "out_dims":
        f = filter_multi_vmap(body, in_dims="T F", out_dims="T F")
    else:
        f = filter_multi_vmap(body)
    if how == "jit":
        f = jax.jit(f)
    matches = [
        "Type-check error whilst checking the parameters of",  # jaxtyping's own
        "`Checked` checks its fields when it is built (it is decorated `@jaxtyped`)",
        "the body builds `Checked` from one element",
        "Build it outside: return its fields",
        "drop `@jaxtyped` from `Checked`: with the return annotation `-> Checked`, "
        "`filter_multi_vmap` checks the dims of its fields itself",
    ]
    matches = [r"\s+".join(map(re.escape, m.split())) for m in matches]
    for match in matches:
        with pytest.raises(TypeCheckError, match=match):
            f(jnp.ones((3, 4)))


@pytest.mark.parametrize("explicit", [False, True])
def test_misspelled_dim_is_named(explicit):
    def body(x, noise):
        return x + noise

    if explicit:
        f = filter_multi_vmap(body, in_dims={"x": "T F", "noise": "f"}, out_dims="T F")
    else:

        def body_annotated(
            x: Float[Array, "T F"], noise: Float[Array, "f"]
        ) -> Float[Array, "T F"]:
            return x + noise

        f = filter_multi_vmap(body_annotated)
    with pytest.raises(ShapeError) as info:
        f(jnp.ones((3, 4)), jnp.ones(4))
    msg = str(info.value)
    assert "`noise` names dim 'f' (size 4), which the output does not name" in msg
    assert "so 'f' is a core dim" in msg
    assert "Did you mean 'F' for 'f'?" in msg
    assert "'f' is named only by `noise` ('f')" in " ".join(msg.split())


#
# Variadic and broadcast dims, under every strategy.
#


def _mesh():
    from jax.sharding import AxisType

    return jax.make_mesh(
        (4,), ("d",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4]
    )


def _mesh_of(options: dict) -> Any:
    if "mesh" in options:
        return jax.set_mesh(options["mesh"])
    return contextlib.nullcontext()


# `batch` has 8 elements: chunks of 3 leave a remainder; 4 devices divide it.
VARIADIC_STRATEGIES = {
    "vmap": lambda: {},
    "scan": lambda: {"scan": "batch"},
    "chunked": lambda: {"scan": {"batch": 3}},
    # Named as annotated, star included.
    "scan_star": lambda: {"scan": "*batch"},
    "chunked_star": lambda: {"scan": {"*batch": 3}},
    "vmap_star": lambda: {"vmap": "*batch"},
    "shard_star": lambda: {"shard": {"*batch": "d"}, "mesh": _mesh()},
    "auto": lambda: {"plan": "auto"},
    "shard": lambda: {"shard": {"batch": "d"}, "mesh": _mesh()},
}


def _variadic_body(x, y, w):
    return jnp.tanh(x * w) * y


def _variadic_reference(x, y, w):
    return jnp.tanh(x * w[None, None, :]) * y[..., None]


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 (simulated) devices")
@pytest.mark.parametrize("strategy", list(VARIADIC_STRATEGIES))
@pytest.mark.parametrize("explicit", [False, True], ids=["annotated", "in_dims"])
def test_variadic_dim_is_mapped(strategy, explicit):
    x, y, w = rand(0, 2, 4, 3), rand(1, 2, 4), rand(2, 3)
    kw = VARIADIC_STRATEGIES[strategy]()
    if explicit:
        f = filter_multi_vmap(
            _variadic_body,
            in_dims={"x": "*batch F", "y": "*batch", "w": "F"},
            out_dims="*batch F",
            **kw,
        )
    else:

        def annotated(
            x: Float[Array, "*batch F"], y: Float[Array, "*batch"], w: Float[Array, "F"]
        ) -> Float[Array, "*batch F"]:
            return _variadic_body(x, y, w)

        f = filter_multi_vmap(annotated, **kw)
    out = f(x, y, w)
    want = np.stack(
        [np.stack([np.tanh(x[i, j] * w) * y[i, j] for j in range(4)]) for i in range(2)]
    )
    assert_close(out, want)
    assert jaxtyping_accepts(
        (x, Float[Array, "*batch F"]),
        (y, Float[Array, "*batch"]),
        (out, Float[Array, "*batch F"]),
    )
    loss = lambda g: lambda x, w: jnp.sum(g(x, y, w) ** 2)  # noqa: E731
    with _mesh_of(kw):  # an explicitly sharded output's cotangent needs it
        got = jax.grad(loss(f), argnums=(0, 1))(x, w)
    ref = jax.grad(loss(_variadic_reference), argnums=(0, 1))(x, w)
    for a, b in zip(got, ref):
        assert_close(a, b)


@pytest.mark.parametrize("batch", [(), (5,), (2, 1, 3)])
def test_variadic_dim_of_any_rank(batch):
    x, y = rand(0, *batch, 3), rand(1, *batch)

    @filter_multi_vmap
    def f(
        x: Float[Array, "*batch F"], y: Float[Array, "*batch"]
    ) -> Float[Array, "F *batch"]:
        return x * y

    out = f(x, y)
    assert_close(out, np.moveaxis(np.asarray(x) * np.asarray(y)[..., None], -1, 0))


def test_variadic_output_dim_named_by_no_argument():
    @filter_multi_vmap
    def f(x: Float[Array, "T F"]) -> Float[Array, "T *rest"]:
        return x

    matches = [
        r"the return annotation names the variadic dim '\*rest'",
        r"A variadic dim of the output must come from an argument",
        r"name '\*rest' in an argument's dims too",
    ]
    for match in matches:
        with pytest.raises(SpecError, match=match):
            f(jnp.ones((3, 4)))


def test_variadic_shapes_must_agree():
    @filter_multi_vmap
    def f(
        x: Float[Array, "*batch F"], y: Float[Array, "*batch"]
    ) -> Float[Array, "*batch F"]:
        return x * y

    x, y = jnp.ones((2, 3, 4)), jnp.ones((3, 2))
    assert not jaxtyping_accepts(
        (x, Float[Array, "*batch F"]), (y, Float[Array, "*batch"])
    )
    with pytest.raises(ShapeError) as info:
        f(x, y)
    msg = str(info.value)
    assert "variadic dim '*batch'" in msg
    assert "shape (2, 3): `x` axes 0-1" in msg and "shape (3, 2): `y` axes 0-1" in msg


def test_variadic_dim_keeps_its_name_in_the_nest(capsys):
    @filter_multi_vmap(scan={"batch": 3}, verbose=True)
    def f(x: Float[Array, "*batch F"]) -> Float[Array, "*batch F"]:
        return 2 * x

    assert_close(f(jnp.ones((2, 4, 3))), 2 * np.ones((2, 4, 3), np.float32))
    out = capsys.readouterr().out
    assert "scan(batch: 2 chunks of 3) + vmap(batch remainder=2)" in out


BROADCAST_STRATEGIES = {
    "vmap": lambda: {},
    "scan": lambda: {"scan": "T"},
    "chunked": lambda: {"scan": {"T": 2}},
    "auto": lambda: {"plan": "auto"},
    "shard": lambda: {"shard": {"F": "d"}, "mesh": _mesh()},
}


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 (simulated) devices")
@pytest.mark.parametrize("strategy", list(BROADCAST_STRATEGIES))
@pytest.mark.parametrize("a_rows", [1, 5])
def test_broadcast_dim(strategy, a_rows):
    a, b = rand(0, a_rows, 4), rand(1, 5, 4)
    kw = BROADCAST_STRATEGIES[strategy]()

    @filter_multi_vmap(**kw)
    def f(a: Float[Array, "#T F"], b: Float[Array, "T F"]) -> Float[Array, "T F"]:
        return a * jnp.sin(b)

    assert jaxtyping_accepts((a, Float[Array, "#T F"]), (b, Float[Array, "T F"]))
    out = f(a, b)
    assert_close(out, np.asarray(a) * np.sin(np.asarray(b)))
    loss = lambda g: lambda a, b: jnp.sum(g(a, b) ** 2)  # noqa: E731
    with _mesh_of(kw):
        got = jax.grad(loss(f), argnums=(0, 1))(a, b)
    ref = jax.grad(loss(lambda a, b: a * jnp.sin(b)), argnums=(0, 1))(a, b)
    for x, y in zip(got, ref):
        assert_close(x, y)


def test_broadcast_dim_of_another_size_is_refused():
    @filter_multi_vmap
    def f(a: Float[Array, "#T F"], b: Float[Array, "T F"]) -> Float[Array, "T F"]:
        return a * b

    a, b = jnp.ones((3, 4)), jnp.ones((5, 4))
    assert not jaxtyping_accepts((a, Float[Array, "#T F"]), (b, Float[Array, "T F"]))
    with pytest.raises(ShapeError, match=r"inconsistent sizes for dim 'T'"):
        f(a, b)


def test_core_broadcast_dim_of_size_one_binds_no_size():
    @filter_multi_vmap
    def f(a: Float[Array, "T #K"], b: Float[Array, "T K"]) -> Float[Array, "T"]:
        return jnp.sum(a * b)

    a, b = rand(0, 3, 1), rand(1, 3, 4)
    assert jaxtyping_accepts((a, Float[Array, "T #K"]), (b, Float[Array, "T K"]))
    assert_close(f(a, b), np.sum(np.asarray(a) * np.asarray(b), axis=1))


@pytest.mark.parametrize(
    "in_dims,shape",
    [("T *_", (3, 4, 2)), ("T F=4", (3, 4)), ("T #4", (3, 1)), ("_ T", (2, 3))],
)
def test_dims_strings_take_the_annotation_syntax(in_dims, shape):
    f = filter_multi_vmap(lambda x: x + 1, in_dims=in_dims, out_dims="T ...")
    x = rand(0, *shape)
    want = np.asarray(x) + 1
    if in_dims.startswith("_"):
        want = np.moveaxis(want, 1, 0)
    assert_close(f(x), want)


#
# Random signatures mixing Modules, typed containers, variadic and broadcast dims.
#


class RandM(eqx.Module):
    a: Float[Array, "*batch #T K"]
    k: Float[Array, "K"]


class RandNT(NamedTuple):
    a: Float[Array, "*batch #T K"]
    k: Float[Array, "K"]


class RandTD(TypedDict):
    a: Float[Array, "*batch #T K"]
    k: Float[Array, "K"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RandDC:
    a: Float[Array, "*batch #T K"]
    k: Float[Array, "K"]


CONTAINERS = [RandM, RandNT, RandTD, RandDC]
LAYOUTS = ["*batch T", "T *batch"]
RANDOM_STRATEGIES = [
    {},
    {"scan": "T"},
    {"scan": {"T": 2}},
    {"scan": {"batch": 2}},
    {"scan": "batch", "vmap": "T"},
]


def _canonical(x: np.ndarray, layout: str, n_batch: int) -> np.ndarray:
    """`x` in the layout `*batch T`."""
    return x if layout == "*batch T" else np.moveaxis(x, 0, n_batch)


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(
    batch=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    T=st.integers(1, 4),
    K=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    x_layout=st.sampled_from(LAYOUTS),
    out_layout=st.sampled_from(LAYOUTS),
    kinds=st.tuples(*(st.sampled_from(CONTAINERS) for _ in range(2))),
    broadcast=st.tuples(st.booleans(), st.booleans()),
    strategy=st.sampled_from(range(len(RANDOM_STRATEGIES))),
)
def test_random_signatures(
    batch, T, K, x_layout, out_layout, kinds, broadcast, strategy
):
    batch = tuple(batch)
    rng = np.random.default_rng(0)
    x_shape = batch + (T,) if x_layout == "*batch T" else (T,) + batch
    x = rng.standard_normal(x_shape).astype(np.float32)
    containers = []
    for kind, k, b in zip(kinds, K, broadcast):
        a = rng.standard_normal(batch + (1 if b else T, k)).astype(np.float32)
        kk = rng.standard_normal(k).astype(np.float32)
        containers.append(kind(a=jnp.asarray(a), k=jnp.asarray(kk)))
    p, q = containers
    P_, Q_ = kinds

    def body(x, p, q):
        return x * jnp.sum(_get(p, "a") * _get(p, "k")) + jnp.sum(
            _get(q, "a") * _get(q, "k")
        )

    body.__annotations__ = {
        "x": Float[Array, x_layout],
        "p": P_,
        "q": Q_,
        "return": Float[Array, out_layout],
    }
    f = filter_multi_vmap(body, **RANDOM_STRATEGIES[strategy])
    out = f(jnp.asarray(x), p, q)

    n = len(batch)
    pa = np.sum(np.asarray(_get(p, "a")) * np.asarray(_get(p, "k")), axis=-1)
    qa = np.sum(np.asarray(_get(q, "a")) * np.asarray(_get(q, "k")), axis=-1)
    want = _canonical(x, x_layout, n) * pa + qa
    if out_layout == "T *batch":
        want = np.moveaxis(want, n, 0)
    assert_close(out, want)
    # jaxtyping's verdict: the arguments and the output in one memo, each
    # container's fields in their own.
    assert all(fields_accepted(c) for c in containers)
    assert jaxtyping_accepts(
        (jnp.asarray(x), Float[Array, x_layout]),
        (p, P_),
        (q, Q_),
        (out, Float[Array, out_layout]),
    )


def test_errors_show_the_arguments_as_given():
    @filter_multi_vmap
    def f(x: Float[Array, "*batch K"], y: Float[Array, "K"]) -> Float[Array, "*batch"]:
        return jnp.sum(x * y)

    with pytest.raises(ShapeError) as info:
        f(jnp.ones((2, 4, 3)), jnp.ones(5))
    msg = str(info.value)
    assert "`x` axis 2 (float32[2,4,3], dims '*batch K')" in msg
    assert "*batch=(2, 4)" in msg
    with pytest.raises(ShapeError, match=r"float32\[2,4,5\] has size 5 at axis 2"):
        _fixed(jnp.ones((2, 4, 5)))


@filter_multi_vmap
def _fixed(x: Float[Array, "*batch 3"]) -> Float[Array, "*batch"]:
    return jnp.sum(x)


def test_body_note_shows_the_variadic_shape():
    @filter_multi_vmap
    def f(x: Float[Array, "*batch 3"]) -> Float[Array, "*batch"]:
        return jnp.sum(x) + jnp.ones(2) @ jnp.ones(3)

    with pytest.raises(TypeError) as info:
        f(jnp.ones((2, 4, 3)))
    note = "\n".join(info.value.__notes__)
    assert "x: float32[3] per element (given float32[2,4,3], dims '*batch 3')" in note
    assert "Mapped dims (named by the return annotation): *batch=(2, 4)." in note


class Keyless:
    """A dataclass-like pytree flattened without field names."""

    a: Float[Array, "T F"]

    def __init__(self, a):
        self.a = a


jax.tree_util.register_pytree_node(
    dataclasses.dataclass(Keyless), lambda o: ((o.a,), None), lambda _, c: Keyless(*c)
)


def test_dataclass_flattened_without_keys_is_refused():
    @filter_multi_vmap
    def f(p: Keyless, x: Float[Array, "T F"]) -> Float[Array, "T F"]:
        return x * p.a

    with pytest.raises(SpecError, match=r"parameter `p` is a `Keyless`"):
        f(Keyless(jnp.ones((3, 4))), jnp.ones((3, 4)))
