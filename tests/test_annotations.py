"""Dims from jaxtyping annotations: parameters, returns, `eqx.Module` fields.

Every mapped result is compared against `loop_reference`: a plain Python loop over
every index combination of the mapped dims, calling numpy on the slices, then
`np.stack`.
"""

# Single-name dims such as `Float[Array, "F"]` read to ruff as forward references.
# ruff: noqa: F821

import itertools as it
import re
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from beartype import beartype
from eqx_multimap import filter_multi_vmap, ShapeError, SpecError
from hypothesis import given, settings, strategies as st
from jaxtyping import (
    Array,
    Float,
    Int,
    jaxtyped,
    Key,
    PyTree,
    Shaped,
    TypeCheckError,
)

from . import _future_annotated as fut


def loop_reference(body, sizes: dict[str, int], out: str) -> np.ndarray:
    """Stack `body(idx)` over every combination of indices, in the order of `out`.

    `body` gets `{dim: index}` and returns the per-element result (a numpy array).
    `out` is a dims string without `...`: the names in `sizes` go where they appear,
    every other token is the next axis of the per-element result.
    """
    names = list(sizes)
    results = [
        np.asarray(body(dict(zip(names, idx))))
        for idx in it.product(*(range(sizes[n]) for n in names))
    ]
    core = results[0].shape
    stacked = np.stack(results).reshape(tuple(sizes[n] for n in names) + core)
    perm, k = [], len(names)
    for tok in out.split():
        if tok in sizes:
            perm.append(names.index(tok))
        else:
            perm.append(k)
            k += 1
    assert k == stacked.ndim, (out, stacked.shape)
    return np.transpose(stacked, perm)


def assert_same(actual: Any, expected: np.ndarray) -> None:
    assert isinstance(actual, jax.Array)
    assert actual.shape == expected.shape
    assert actual.dtype == expected.dtype
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=1e-5, atol=1e-5)


def rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def raises_all(error: type[Exception], fragments: list[str], call) -> None:
    """`call()` raises `error`, with every regex fragment in its message."""
    for fragment in fragments:
        with pytest.raises(error, match=fragment):
            call()


#
# The example of the issue: Module argument, array arguments, array return.
#


class SkyModel(eqx.Module):
    flux: Float[Array, "S F"]
    lmn: Float[Array, "S 3"]


def _predict_math(flux, lmn, vis, nu, xp):
    # vis: (F, 2, 2), nu: (F,), flux: (S, F), lmn: (S, 3)
    model = xp.sum(flux, axis=0) * nu
    return vis * model[:, None, None] + xp.sum(lmn)


STRATEGIES = [
    dict(scan="T", vmap="B"),
    dict(vmap="T B"),
    dict(vmap="B T"),
    dict(scan="T B"),
    dict(scan={"T": 2}, vmap="B"),
]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_module_and_array_params_array_return(strategy):
    @filter_multi_vmap(**strategy, core="F")
    def predict(
        sky: SkyModel, vis: Float[Array, "T F B 2 2"], nu: Float[Array, "F"]
    ) -> Float[Array, "F T B 2 2"]:
        assert sky.flux.shape == (3, 4) and sky.lmn.shape == (3, 3)
        assert vis.shape == (4, 2, 2) and nu.shape == (4,)
        return _predict_math(sky.flux, sky.lmn, vis, nu, jnp)

    rng = np.random.default_rng(0)
    S, F, T, B = 3, 4, 5, 2
    flux, lmn = rand(rng, S, F), rand(rng, S, 3)
    vis, nu = rand(rng, T, F, B, 2, 2), rand(rng, F)
    sky = SkyModel(jnp.asarray(flux), jnp.asarray(lmn))
    out = predict(sky, jnp.asarray(vis), jnp.asarray(nu))
    expected = loop_reference(
        lambda i: _predict_math(flux, lmn, vis[i["T"], :, i["B"]], nu, np),
        {"T": T, "B": B},
        "F T B 2 2",
    )
    assert_same(out, expected)


def test_no_strategy_vmaps_every_dim_of_the_return_annotation():
    @filter_multi_vmap
    def f(x: Float[Array, "T F B"], w: Float[Array, "F"]) -> Float[Array, "B T"]:
        assert x.shape == w.shape == (3,)
        return jnp.dot(w, x)

    rng = np.random.default_rng(1)
    x, w = rand(rng, 4, 3, 2), rand(rng, 3)
    expected = loop_reference(
        lambda i: np.dot(w, x[i["T"], :, i["B"]]), {"T": 4, "B": 2}, "B T"
    )
    assert_same(f(jnp.asarray(x), jnp.asarray(w)), expected)


def test_tuple_return():
    @filter_multi_vmap(core="F")
    def f(
        x: Float[Array, "T F"], k: Int[Array, "T"]
    ) -> tuple[Float[Array, "F T"], Int[Array, "T"]]:
        return x * 2.0, k + jnp.sum(x > 0).astype(jnp.int32)

    rng = np.random.default_rng(2)
    x = rand(rng, 5, 3)
    k = np.arange(5, dtype=np.int32)
    a, b = f(jnp.asarray(x), jnp.asarray(k))
    sizes = {"T": 5}
    assert_same(a, loop_reference(lambda i: x[i["T"]] * 2.0, sizes, "F T"))
    assert_same(
        b,
        loop_reference(
            lambda i: k[i["T"]] + np.sum(x[i["T"]] > 0).astype(np.int32), sizes, "T"
        ),
    )


#
# eqx.Module arguments: nested modules, tuples/lists of them, static fields.
#


class Component(eqx.Module):
    spectrum: Float[Array, "F"]
    gain: Float[Array, "T"]


class Sky(eqx.Module):
    flux: Float[Array, "S F"]
    components: tuple[Component, ...]
    weights: list[Float[Array, "T S"]]
    offset: Array  # an array with no dims: not mapped
    label: str = eqx.field(static=True)
    power: float = 1.0  # a non-array field: passes through


def _sky_math(flux, spectra, gains, weight, offset, power, xp):
    # flux (S, F); spectra [(F,)]; gains [()]; weight (S,); offset (F,)
    total = sum(g * s for g, s in zip(gains, spectra))
    return total * power + xp.dot(weight, flux) + offset


def _make_sky(rng, S=2, F=3, T=4, n=2, label="sky"):
    return dict(
        flux=rand(rng, S, F),
        spectra=[rand(rng, F) for _ in range(n)],
        gains=[rand(rng, T) for _ in range(n)],
        weight=rand(rng, T, S),
        offset=rand(rng, F),
    )


def _to_sky(d, label="sky", power=2.0):
    return Sky(
        flux=jnp.asarray(d["flux"]),
        components=tuple(
            Component(jnp.asarray(s), jnp.asarray(g))
            for s, g in zip(d["spectra"], d["gains"])
        ),
        weights=[jnp.asarray(d["weight"])],
        offset=jnp.asarray(d["offset"]),
        label=label,
        power=power,
    )


@pytest.mark.parametrize("strategy", [dict(vmap="T"), dict(scan="T")])
def test_nested_module_argument(strategy):
    @filter_multi_vmap(**strategy, core="F")
    def f(sky: Sky, x: Float[Array, "T F"]) -> Float[Array, "T F"]:
        assert sky.label == "sky" and sky.power == 2.0
        assert sky.components[0].gain.shape == ()
        assert sky.weights[0].shape == (2,) and sky.offset.shape == (3,)
        spectra = [c.spectrum for c in sky.components]
        gains = [c.gain for c in sky.components]
        return x * _sky_math(
            sky.flux, spectra, gains, sky.weights[0], sky.offset, sky.power, jnp
        )

    rng = np.random.default_rng(3)
    d = _make_sky(rng)
    x = rand(rng, 4, 3)
    out = f(_to_sky(d), jnp.asarray(x))

    def body(i):
        t = i["T"]
        gains = [g[t] for g in d["gains"]]
        sky = _sky_math(
            d["flux"], d["spectra"], gains, d["weight"][t], d["offset"], 2.0, np
        )
        return x[t] * sky

    assert_same(out, loop_reference(body, {"T": 4}, "T F"))


def test_module_value_without_annotation_uses_its_fields():
    @filter_multi_vmap(vmap="T")
    def f(comp, x: Float[Array, "T F"]) -> Float[Array, "T F"]:
        assert comp.gain.shape == ()
        return x * comp.spectrum * comp.gain

    rng = np.random.default_rng(4)
    s, g, x = rand(rng, 3), rand(rng, 4), rand(rng, 4, 3)
    out = f(Component(jnp.asarray(s), jnp.asarray(g)), jnp.asarray(x))
    assert_same(
        out, loop_reference(lambda i: x[i["T"]] * s * g[i["T"]], {"T": 4}, "T F")
    )


class Prediction(eqx.Module):
    vis: Float[Array, "F T"]
    count: Int[Array, "T"]
    total: Array  # no dims: gets the default `out_dims` ("T ...")
    tag: str = eqx.field(static=True)


@pytest.mark.parametrize("strategy", [dict(vmap="T"), dict(scan={"T": 2})])
def test_module_return(strategy):
    @filter_multi_vmap(**strategy, core="F")
    def f(x: Float[Array, "T F"], w: Float[Array, "F"]) -> Prediction:
        return Prediction(
            vis=x * w,
            count=jnp.sum(x > 0).astype(jnp.int32),
            total=jnp.sum(x),
            tag="pred",
        )

    rng = np.random.default_rng(5)
    x, w = rand(rng, 5, 3), rand(rng, 3)
    out = f(jnp.asarray(x), jnp.asarray(w))
    assert type(out) is Prediction and out.tag == "pred"
    sizes = {"T": 5}
    assert_same(out.vis, loop_reference(lambda i: x[i["T"]] * w, sizes, "F T"))
    assert_same(
        out.count,
        loop_reference(lambda i: np.sum(x[i["T"]] > 0).astype(np.int32), sizes, "T"),
    )
    assert_same(out.total, loop_reference(lambda i: np.sum(x[i["T"]]), sizes, "T"))


#
# from __future__ import annotations (tests/_future_annotated.py).
#


def test_future_annotations_module_args_and_return():
    rng = np.random.default_rng(6)
    S, F, T, B = 2, 3, 4, 2
    flux, values, gain = rand(rng, S, F), rand(rng, F), rand(rng, T)
    vis, nu = rand(rng, T, F, B), rand(rng, F)
    sky = fut.Sky(
        jnp.asarray(flux), (fut.Spectrum(jnp.asarray(values), jnp.asarray(gain)),)
    )
    out = fut.predict(sky, jnp.asarray(vis), jnp.asarray(nu))
    assert type(out) is fut.Prediction

    def body(i):
        t, b = i["T"], i["B"]
        return vis[t, :, b] * (flux.sum(0) * values * gain[t]) * nu

    sizes = {"T": T, "B": B}
    assert_same(out.vis, loop_reference(body, sizes, "F B T"))
    count = loop_reference(
        lambda i: np.sum(vis[i["T"], :, i["B"]] > 0).astype(np.int32), sizes, "T B"
    )
    assert_same(out.count, count)


def test_future_annotations_method():
    rng = np.random.default_rng(7)
    w, x = rand(rng, 3), rand(rng, 5, 3)
    out = fut.Model(jnp.asarray(w))(jnp.asarray(x))
    assert type(out) is fut.Output
    assert_same(out.y, loop_reference(lambda i: np.dot(w, x[i["B"]]), {"B": 5}, "B"))


#
# Unannotated, Optional, PyTree and alternative jaxtyping spellings.
#


def test_unannotated_params_are_unmapped():
    @filter_multi_vmap(core="F")
    def f(x: Float[Array, "T F"], w, n: int, scale=1.0) -> Float[Array, "T F"]:
        assert w.shape == (4, 3)  # passed whole, although its axis 0 has size T
        return x * w[n] * scale

    rng = np.random.default_rng(8)
    x, w = rand(rng, 4, 3), rand(rng, 4, 3)
    out = f(jnp.asarray(x), jnp.asarray(w), 2, scale=3.0)
    assert_same(out, loop_reference(lambda i: x[i["T"]] * w[2] * 3.0, {"T": 4}, "T F"))


def test_optional_param_passes_none_through():
    @filter_multi_vmap(vmap="T")
    def f(
        x: Float[Array, "T F"], bias: Float[Array, "T"] | None = None
    ) -> Float[Array, "T F"]:
        return x if bias is None else x + bias

    rng = np.random.default_rng(9)
    x, bias = rand(rng, 4, 3), rand(rng, 4)
    assert_same(f(jnp.asarray(x)), loop_reference(lambda i: x[i["T"]], {"T": 4}, "T F"))
    assert_same(
        f(jnp.asarray(x), jnp.asarray(bias)),
        loop_reference(lambda i: x[i["T"]] + bias[i["T"]], {"T": 4}, "T F"),
    )


def test_pytree_annotation_and_jaxtyping_spellings():
    @filter_multi_vmap(vmap="T")
    def f(
        xs: PyTree[Float[Array, "T F"]],
        y: Shaped[Array, "T *_"],  # `*_` is `...`
        z: Float[np.ndarray, "rows=2 T"],  # `rows=2` is `2`
    ) -> Float[Array, "T F"]:
        assert y.shape == (2, 2) and z.shape == (2,)
        return xs["a"] * xs["b"] + jnp.sum(y) + jnp.sum(z)

    rng = np.random.default_rng(10)
    a, b, y, z = rand(rng, 4, 3), rand(rng, 4, 3), rand(rng, 4, 2, 2), rand(rng, 2, 4)
    out = f({"a": jnp.asarray(a), "b": jnp.asarray(b)}, jnp.asarray(y), z)
    expected = loop_reference(
        lambda i: a[i["T"]] * b[i["T"]] + y[i["T"]].sum() + z[:, i["T"]].sum(),
        {"T": 4},
        "T F",
    )
    assert_same(out, expected)


def test_sequence_and_tuple_annotations():
    @filter_multi_vmap(core="F")
    def f(
        xs: Sequence[Float[Array, "T F"]],
        pair: tuple[Float[Array, "F"], Float[Array, "T"]],
    ) -> Float[Array, "T F"]:
        assert pair[0].shape == (3,) and pair[1].shape == ()
        return xs[0] * xs[1] * pair[0] + pair[1]

    rng = np.random.default_rng(20)
    a, b, c, d = rand(rng, 4, 3), rand(rng, 4, 3), rand(rng, 3), rand(rng, 4)
    out = f([jnp.asarray(a), jnp.asarray(b)], (jnp.asarray(c), jnp.asarray(d)))
    expected = loop_reference(
        lambda i: a[i["T"]] * b[i["T"]] * c + d[i["T"]], {"T": 4}, "T F"
    )
    assert_same(out, expected)


def test_key_annotation():
    @filter_multi_vmap(vmap="B")
    def f(key: Key[Array, "B"], scale: Float[Array, "B"]) -> Float[Array, "B"]:
        return jax.random.normal(key) * scale

    keys = jax.random.split(jax.random.key(0), 3)
    scale = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    expected = loop_reference(
        lambda i: np.asarray(jax.random.normal(keys[i["B"]])) * scale[i["B"]],
        {"B": 3},
        "B",
    )
    assert_same(f(keys, jnp.asarray(scale)), expected)
    raises_all(
        ShapeError,
        ["argument `key` has dtype float32", re.escape("Key[..., 'B']")],
        lambda: f(jnp.asarray(scale), jnp.asarray(scale)),
    )


#
# Explicit in_dims / out_dims override annotations.
#


def test_in_dims_dict_overrides_one_annotation():
    @filter_multi_vmap(in_dims={"x": "F T"}, vmap="T")
    def f(x: Float[Array, "T F"], w: Float[Array, "T"]) -> Float[Array, "T F"]:
        return x * w

    rng = np.random.default_rng(11)
    x, w = rand(rng, 3, 4), rand(rng, 4)  # x laid out (F, T), as in_dims says
    out = f(jnp.asarray(x), jnp.asarray(w))
    assert_same(
        out, loop_reference(lambda i: x[:, i["T"]] * w[i["T"]], {"T": 4}, "T F")
    )


def test_in_dims_tuple_none_unmaps_an_annotated_param():
    @filter_multi_vmap(in_dims=(None, "T"), core="F")
    def f(table: Float[Array, "T F"], x: Float[Array, "T"]) -> Float[Array, "T F"]:
        assert table.shape == (4, 3)
        return table[0] * x

    rng = np.random.default_rng(12)
    table, x = rand(rng, 4, 3), rand(rng, 4)
    out = f(jnp.asarray(table), jnp.asarray(x))
    assert_same(out, loop_reference(lambda i: table[0] * x[i["T"]], {"T": 4}, "T F"))


def test_out_dims_override_the_return_annotation():
    @filter_multi_vmap(out_dims="F T", vmap="T")
    def f(x: Float[Array, "T F"]) -> Float[Array, "T F"]:
        return x + 1.0

    rng = np.random.default_rng(13)
    x = rand(rng, 4, 3)
    assert_same(
        f(jnp.asarray(x)), loop_reference(lambda i: x[i["T"]] + 1.0, {"T": 4}, "F T")
    )


#
# Errors.
#


def _predict_for_errors():
    @filter_multi_vmap(scan="T", core="F")
    def predict(
        sky: SkyModel, vis: Float[Array, "T F B"], nu: Float[Array, "F"]
    ) -> Float[Array, "F T B"]:
        return vis * jnp.sum(sky.flux, axis=0) * nu

    return predict


def test_dtype_errors_float_vs_int():
    predict = _predict_for_errors()
    sky = SkyModel(jnp.ones((2, 3)), jnp.ones((2, 3)))
    vis = jnp.ones((4, 3, 2))
    raises_all(
        ShapeError,
        [r"predict\)`", "argument `nu` has dtype int32", re.escape("Float[..., 'F']")],
        lambda: predict(sky, vis, jnp.arange(3)),
    )
    int_sky = SkyModel(jnp.ones((2, 3), dtype=jnp.int32), jnp.ones((2, 3)))
    raises_all(
        ShapeError,
        ["argument `sky.flux` has dtype int32", re.escape("Float[..., 'S F']")],
        lambda: predict(int_sky, vis, jnp.ones(3)),
    )

    @filter_multi_vmap(vmap="T")
    def g(k: Int[Array, "T"]) -> Int[Array, "T"]:
        return k + 1

    raises_all(
        ShapeError,
        ["argument `k` has dtype float32", re.escape("Int[..., 'T']")],
        lambda: g(jnp.ones(3)),
    )

    @filter_multi_vmap(vmap="T")
    def h(k: Int[Array, "T"]) -> Float[Array, "T"]:
        return k * 2  # int32, but annotated Float

    raises_all(
        ShapeError,
        ["returned `output` with dtype int32", re.escape("Float[..., 'T']")],
        lambda: h(jnp.arange(3)),
    )


def test_mismatched_module_field_sizes_name_the_field_path():
    predict = _predict_for_errors()
    bad_sky = SkyModel(jnp.ones((3, 4)), jnp.ones((5, 3)))
    raises_all(
        ShapeError,
        [
            r"inconsistent\s+sizes for dim 'S'",  # a long name: wrapped
            r"size 3: `sky\.flux` axis 0",
            r"size 5: `sky\.lmn` axis 0",
        ],
        lambda: predict(bad_sky, jnp.ones((2, 4, 2)), jnp.ones(4)),
    )

    @filter_multi_vmap(core="F")
    def f(sky: Sky, x: Float[Array, "T F"]) -> Float[Array, "T F"]:
        return x * sky.components[1].spectrum

    rng = np.random.default_rng(14)
    d = _make_sky(rng)
    # A core dim of a Module's fields is checked within its instance, as jaxtyping
    # checks a dataclass's fields: `S` of `sky.flux` and `sky.weights[0]`.
    d["weight"] = rand(rng, 4, 5)
    raises_all(
        ShapeError,
        [
            "inconsistent sizes for dim 'S' within `sky`",
            r"size 5: `sky\.weights\[0\]` axis 1",
            r"size 2: `sky\.flux` axis 0",
        ],
        lambda: f(_to_sky(d), jnp.ones((4, 3))),
    )
    # Across instances (`sky.components[1]`, `sky`, the parameter `x`) it is not
    # checked, as jaxtyping does not: the body's own error is raised.
    d = _make_sky(rng)
    d["spectra"][1] = rand(rng, 5)
    with pytest.raises(TypeError, match="incompatible shapes"):
        f(_to_sky(d), jnp.ones((4, 3)))
    d = _make_sky(rng)
    d["gains"][0] = rand(rng, 6)
    raises_all(
        ShapeError,
        ["dim 'T'", r"size 6: `sky\.components\[0\]\.gain` axis 0", "size 4"],
        lambda: f(_to_sky(d), jnp.ones((4, 3))),
    )


UNSUPPORTED = [
    ("*#batch F", "'*#batch'", "broadcastable variadic"),
    ("F+1", "'F+1'", "symbolic expression"),
    ("?F", "'?F'", "pytree path"),
]


@pytest.mark.parametrize("dims, token, why", UNSUPPORTED)
def test_unsupported_jaxtyping_dims_name_the_parameter(dims, token, why):
    @filter_multi_vmap(out_dims="T")
    def f(t: Float[Array, "T"], x: Float[Array, dims]):
        return t

    raises_all(
        SpecError,
        [
            r"\.f\)`",
            re.escape(f"parameter `x` is annotated `Float[Array, '{dims}']`"),
            re.escape(token),
            why,
            r"in_dims=\{'x': \.\.\.\}",
        ],
        lambda: f(jnp.ones(2), jnp.ones((2, 3))),
    )

    class M(eqx.Module):
        flux: Float[Array, dims]

    @filter_multi_vmap(out_dims="T")
    def g(t: Float[Array, "T"], sky: M):
        return t

    raises_all(
        SpecError,
        [r"`sky\.flux` is annotated", re.escape(token), why],
        lambda: g(jnp.ones(2), M(jnp.ones((2, 3)))),
    )

    @filter_multi_vmap(vmap="T")
    def h(t: Float[Array, "T"]) -> Float[Array, dims]:
        return t

    raises_all(
        SpecError,
        ["the return value is annotated", re.escape(token), why, "out_dims="],
        lambda: h(jnp.ones(2)),
    )


def test_return_annotation_without_a_mapped_dim():
    @filter_multi_vmap(vmap="T B")
    def f(x: Float[Array, "T B"]) -> tuple[Float[Array, "T B"], Float[Array, "T"]]:
        return x, x

    raises_all(
        SpecError,
        [
            r"the return annotation 'T' for `output\[1\]` does not name the mapped "
            r"dim 'B'",
            "Fix the return annotation, or override it with `out_dims=...`",
        ],
        lambda: f(jnp.ones((2, 3))),
    )


def f_unresolved(x: "Float[Array, 'T F']", y: "NotDefinedAnywhere"):  # noqa: F821
    return x * y


def test_unresolvable_string_annotation():
    f = filter_multi_vmap(f_unresolved, out_dims="T F", core="F")
    raises_all(
        SpecError,
        ["cannot resolve the annotation 'NotDefinedAnywhere'", "parameter `y`"],
        lambda: f(jnp.ones((2, 3)), jnp.ones(3)),
    )
    g = filter_multi_vmap(f_unresolved, out_dims="T F", core="F", in_dims={"y": "F"})
    rng = np.random.default_rng(15)
    x, y = rand(rng, 2, 3), rand(rng, 3)
    assert_same(
        g(jnp.asarray(x), jnp.asarray(y)),
        loop_reference(lambda i: x[i["T"]] * y, {"T": 2}, "T F"),
    )


#
# Runtime type checkers: outside is right, inside is an error.
#


def test_jaxtyped_outside_checks_the_batched_shapes():
    @jaxtyped(typechecker=beartype)
    @filter_multi_vmap(scan="T", core="F")
    def predict(
        sky: SkyModel, vis: Float[Array, "T F B 2 2"], nu: Float[Array, "F"]
    ) -> Float[Array, "F T B 2 2"]:
        return _predict_math(sky.flux, sky.lmn, vis, nu, jnp)

    rng = np.random.default_rng(16)
    flux, lmn = rand(rng, 3, 4), rand(rng, 3, 3)
    vis, nu = rand(rng, 2, 4, 3, 2, 2), rand(rng, 4)
    sky = SkyModel(jnp.asarray(flux), jnp.asarray(lmn))
    expected = loop_reference(
        lambda i: _predict_math(flux, lmn, vis[i["T"], :, i["B"]], nu, np),
        {"T": 2, "B": 3},
        "F T B 2 2",
    )
    assert_same(predict(sky, jnp.asarray(vis), jnp.asarray(nu)), expected)
    assert_same(jax.jit(predict)(sky, jnp.asarray(vis), jnp.asarray(nu)), expected)
    # The checker sees the batched shapes, so a bad `F` is its error, first.
    raises_all(
        TypeCheckError,
        ["parameter 'nu'", r"Float\[\S*Array, 'F'\]", "F=4"],
        lambda: predict(sky, jnp.asarray(vis), jnp.ones(5)),
    )


@pytest.mark.parametrize(
    "checker, name",
    [(jaxtyped(typechecker=beartype), "jaxtyped"), (beartype, "beartype")],
)
def test_type_checker_inside_is_a_clear_error(checker, name):
    @filter_multi_vmap(core="F")
    @checker
    def f(x: Float[Array, "T F"], w: Float[Array, "F"]) -> Float[Array, "F T"]:
        return x * w

    raises_all(
        SpecError,
        [
            f"wrapped in `@{name}` inside `@filter_multi_vmap`",
            "the annotation of the return value",  # checked first: it gives the dims
            "mapped dim 'T'",
            re.escape("@jaxtyped(typechecker=beartype)\n    @filter_multi_vmap(...)"),
        ],
        lambda: f(jnp.ones((2, 3)), jnp.ones(3)),
    )

    # Only the return annotation is used for dims: the same error, for it.
    g = filter_multi_vmap(f, in_dims={"x": "T F", "w": "F"}, core="F")
    raises_all(
        SpecError,
        [f"`@{name}` inside", "the return value", "mapped dim 'T'"],
        lambda: g(jnp.ones((2, 3)), jnp.ones(3)),
    )


def test_type_checker_inside_with_explicit_dims_checks_elements():
    @filter_multi_vmap(in_dims={"x": "T F", "w": "F"}, out_dims="F T", core="F")
    @jaxtyped(typechecker=beartype)
    def f(x: Float[Array, "F"], w: Float[Array, "F"]) -> Float[Array, "F"]:
        return x * w

    rng = np.random.default_rng(17)
    x, w = rand(rng, 4, 3), rand(rng, 3)
    assert_same(
        f(jnp.asarray(x), jnp.asarray(w)),
        loop_reference(lambda i: x[i["T"]] * w, {"T": 4}, "F T"),
    )

    # The inner checker really sees one element: a batched annotation fails it.
    @filter_multi_vmap(in_dims={"x": "T F"}, out_dims="T F", core="F")
    @jaxtyped(typechecker=beartype)
    def g(x: Float[Array, "T F"]) -> Float[Array, "F"]:
        return x

    raises_all(
        TypeCheckError,
        ["parameter 'x'", r"f32\[3\]"],
        lambda: g(jnp.asarray(x)),
    )


#
# Methods on Modules.
#


class Model(eqx.Module):
    w: Float[Array, "F"]
    gains: Float[Array, "B"]  # a field of `self` with a mapped dim: mapped too

    @filter_multi_vmap(vmap="B")
    def __call__(self, x: Float[Array, "B F"]) -> Float[Array, "B"]:
        assert self.gains.shape == () and self.w.shape == (3,)
        return jnp.dot(self.w, x) * self.gains


def test_method_on_module():
    rng = np.random.default_rng(18)
    w, gains, x = rand(rng, 3), rand(rng, 5), rand(rng, 5, 3)
    model = Model(jnp.asarray(w), jnp.asarray(gains))
    expected = loop_reference(
        lambda i: np.dot(w, x[i["B"]]) * gains[i["B"]], {"B": 5}, "B"
    )
    assert_same(model(jnp.asarray(x)), expected)
    assert_same(eqx.filter_jit(lambda m, x: m(x))(model, jnp.asarray(x)), expected)
    raises_all(
        ShapeError,
        ["inconsistent sizes for dim 'B'", r"`self\.gains` axis 0", r"`x` axis 0"],
        lambda: model(jnp.ones((4, 3))),
    )


#
# Random dims orders.
#


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(
    sizes=st.tuples(*(st.integers(1, 3) for _ in range(3))),
    in_order=st.permutations(["T", "B", "F"]),
    out_order=st.permutations(["T", "B", "F"]),
    strategy=st.sampled_from(STRATEGIES[:4] + [dict(scan={"T": 2, "B": 2})]),
)
def test_random_annotated_orders(sizes, in_order, out_order, strategy):
    T, B, F = sizes
    in_dims, out_dims = " ".join(in_order), " ".join(out_order)

    def body(x, w):
        return x * w

    body.__annotations__ = {
        "x": Float[Array, in_dims],
        "w": Float[Array, "F"],
        "return": Float[Array, out_dims],
    }
    f = filter_multi_vmap(body, **strategy, core="F")
    rng = np.random.default_rng(sum(sizes))
    shape = {"T": T, "B": B, "F": F}
    x, w = rand(rng, *(shape[n] for n in in_order)), rand(rng, F)

    def ref(i):
        index = tuple(i.get(n, slice(None)) for n in in_order)
        return x[index] * w

    expected = loop_reference(ref, {"T": T, "B": B}, out_dims)
    assert_same(f(jnp.asarray(x), jnp.asarray(w)), expected)


class Linear(eqx.Module):
    w: Float[Array, "F"]

    def __call__(self, x: Float[Array, "B F"]) -> Float[Array, "B"]:
        return jnp.dot(self.w, x)


def test_callable_module_as_the_mapped_function():
    rng = np.random.default_rng(19)
    w, x = rand(rng, 3), rand(rng, 4, 3)
    f = filter_multi_vmap(Linear(jnp.asarray(w)), vmap="B")
    expected = loop_reference(lambda i: np.dot(w, x[i["B"]]), {"B": 4}, "B")
    assert_same(f(jnp.asarray(x)), expected)


def test_return_annotation_errors_before_the_body_is_traced():
    def f(x: Float[Array, "T F"]) -> tuple[Float[Array, "T F"], Float[Array, " T"]]:
        raise AssertionError("the body was traced")

    raises_all(
        SpecError,
        [r"the return annotation 'T' for `output\[1\]`", "mapped dim 'F'"],
        lambda: filter_multi_vmap(f)(jnp.ones((2, 3))),
    )


def test_return_annotation_without_dims():
    # `jnp.sin` is annotated `-> Array`: no dims, so which are mapped is unknown.
    raises_all(
        SpecError,
        [r"has no `out_dims`,\s+and its return annotation names no dims", "out_dims="],
        lambda: filter_multi_vmap(jnp.sin, in_dims="T F", scan="T")(jnp.ones((2, 3))),
    )


#
# Every dtype annotation of jaxtyping: the dims are read and the dtype checked.
# (docs/annotations.md lists these; keep the two in step.)
#

# Annotation -> a dtype it accepts (64-bit ones under `jax.enable_x64`).
DTYPE_ANNOTATIONS = {
    "Shaped": "float32",
    "Float": "float32",
    "Complex": "complex64",
    "Inexact": "float16",
    "Real": "uint8",
    "Num": "int8",
    "Int": "int32",
    "UInt": "uint32",
    "Integer": "int16",
    "Bool": "bool",
    "Key": "key",
    "BFloat16": "bfloat16",
    "Float16": "float16",
    "Float32": "float32",
    "Float64": "float64",
    "Float8e4m3b11fnuz": "float8_e4m3b11fnuz",
    "Float8e4m3fn": "float8_e4m3fn",
    "Float8e4m3fnuz": "float8_e4m3fnuz",
    "Float8e5m2": "float8_e5m2",
    "Float8e5m2fnuz": "float8_e5m2fnuz",
    "Complex64": "complex64",
    "Complex128": "complex128",
    "Int2": "int2",
    "Int4": "int4",
    "Int8": "int8",
    "Int16": "int16",
    "Int32": "int32",
    "Int64": "int64",
    "UInt2": "uint2",
    "UInt4": "uint4",
    "UInt8": "uint8",
    "UInt16": "uint16",
    "UInt32": "uint32",
    "UInt64": "uint64",
}


def test_every_dtype_annotation_is_listed():
    every = {
        name
        for name in dir(jaxtyping)
        if isinstance(getattr(jaxtyping, name), type)
        and issubclass(getattr(jaxtyping, name), jaxtyping.AbstractDtype)
        and name != "AbstractDtype"
    }
    # Int2 and UInt2 are newer than jaxtyping 0.2.38, the oldest version we support.
    newer = {"Int2", "UInt2"} if not hasattr(jaxtyping, "Int2") else set()
    assert every == set(DTYPE_ANNOTATIONS) - newer


@pytest.mark.parametrize("name", sorted(DTYPE_ANNOTATIONS))
def test_dtype_annotation(name):
    if not hasattr(jaxtyping, name):
        pytest.skip(f"this jaxtyping has no `{name}`")
    ann = getattr(jaxtyping, name)
    dtype = DTYPE_ANNOTATIONS[name]
    with jax.enable_x64(dtype.endswith(("64", "128")) and dtype != "complex64"):

        def f(x: ann[Array, "T F"]) -> Shaped[Array, "F T"]:
            return x

        w = filter_multi_vmap(f, scan="T")
        if dtype == "key":
            x = jax.random.split(jax.random.key(0), 12).reshape(3, 4)
        else:
            x = (jnp.arange(12) % 2).reshape(3, 4).astype(dtype)
        out = w(x)
        assert out.shape == (4, 3) and out.dtype == x.dtype
        if dtype == "key":
            out, x = jax.random.key_data(out), jax.random.key_data(x)
            np.testing.assert_array_equal(out, np.swapaxes(np.asarray(x), 0, 1))
        else:
            assert np.array_equal(np.asarray(out), np.asarray(x).T)
        # A dtype outside the annotation's is a `ShapeError` naming both.
        if name == "Shaped":
            return
        accepted = () if dtype == "key" else ann.dtypes
        wrong = next(d for d in ("float32", "int32", "bool") if d not in accepted)
        raises_all(
            ShapeError,
            [
                f"argument `x` has dtype {wrong}",
                re.escape(f"{ann.__name__}[..., 'T F']"),
            ],
            lambda: w(jnp.zeros((3, 4), wrong)),
        )
