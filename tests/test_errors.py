"""Error messages, in the style of jaxtyping's `test_messages.py`.

Each failure has a list of regex fragments (the API, the argument path, the dim, the
sizes); each fragment is checked on its own with `pytest.raises(..., match=...)`.
"""

import functools as ft
import json
import re
import subprocess
import sys
import textwrap

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from eqx_multimap import (
    explain,
    filter_multi_vmap,
    multi_vmap,
    parse_dims,
    ShapeError,
    SpecError,
)
from hypothesis import given, settings
from jaxtyping import Array, Float, Int

from .test_core import signatures


class Model(eqx.Module):
    flux: jax.Array
    gain: jax.Array


def _never_called(*args, **kwargs):
    raise AssertionError("the body was traced although the inputs are invalid")


def _raises_each(error, matches, thunk):
    for match in matches:
        with pytest.raises(error, match=match):
            thunk()


def test_error_classes():
    assert ShapeError.__module__ == "eqx_multimap"
    assert SpecError.__module__ == "eqx_multimap"
    assert issubclass(ShapeError, TypeError)
    assert issubclass(SpecError, ValueError)
    assert not issubclass(ShapeError, SpecError)
    assert not issubclass(SpecError, ShapeError)


#
# Bad data: ShapeError, raised before the body is traced.
#


def test_inconsistent_sizes_names_every_path_and_size():
    calls = []

    def f(model, *, scale, **kwargs):
        calls.append(1)
        return model.flux * kwargs["nu"] * scale

    w = filter_multi_vmap(
        f,
        in_dims={"model": Model(flux="T F B", gain="F"), "kwargs": {"nu": "F"}},
        out_dims="T F B",
        scan="T",
        vmap="F B",
    )
    model = Model(flux=jnp.ones((3, 4, 2)), gain=jnp.ones(6))
    matches = [
        r"`filter_multi_vmap\(test_inconsistent_sizes_names_every_path_and_size"
        r"\.<locals>\.f\)`",
        r"inconsistent sizes for dim 'F'",
        r"size 4: `model\.flux` axis 1 \(float32\[3,4,2\], dims 'T F B'\)",
        r"size 6: `model\.gain` axis 0 \(float32\[6\], dims 'F'\)",
        r"size 5: `kwargs\['nu'\]` axis 0 \(float32\[5\], dims 'F'\)",
        r"T=3, B=2",
    ]
    _raises_each(ShapeError, matches, lambda: w(model, scale=2.0, nu=jnp.ones(5)))
    assert calls == []


def test_inconsistent_sizes_groups_equal_sizes():
    w = filter_multi_vmap(
        _never_called, in_dims=("T F", "F", "F"), out_dims="T F", scan="T"
    )
    matches = [
        r"dim 'F'",
        r"size 4: `args\[0\]` axis 1 \(float32\[3,4\], dims 'T F'\); `args\[1\]` "
        r"axis 0",
        r"size 2: `args\[2\]` axis 0",
    ]
    _raises_each(
        ShapeError, matches, lambda: w(jnp.ones((3, 4)), jnp.ones(4), jnp.ones(2))
    )


def test_inconsistent_core_dim():
    # `c` is not mapped, but is still checked across arguments.
    w = filter_multi_vmap(_never_called, in_dims=("T c", "c c"), out_dims="T", scan="T")
    matches = [
        r"inconsistent sizes for dim 'c'",
        r"size 2: `args\[0\]` axis 1",
        r"size 3: `args\[1\]` axis 0 \(float32\[3,3\], dims 'c c'\); `args\[1\]` "
        r"axis 1",
        r"T=5",
    ]
    _raises_each(ShapeError, matches, lambda: w(jnp.ones((5, 2)), jnp.ones((3, 3))))


@pytest.mark.parametrize(
    "dims, shape, matches",
    [
        ("T F", (3,), [r"argument `x`", r"float32\[3\]", r"has rank 1", "exactly 2"]),
        ("T", (3, 4), [r"argument `x`", r"float32\[3,4\]", r"has rank 2", "exactly 1"]),
        (
            "T ... F 2",
            (3, 4),
            [
                r"argument `x`",
                r"float32\[3,4\]",
                r"rank 2",
                r"'T \.\.\. F 2'",
                "least 3",
            ],
        ),
    ],
)
def test_rank_mismatch(dims, shape, matches):
    def g(x, y):
        raise AssertionError("traced")

    w = filter_multi_vmap(g, in_dims=(dims, "T"), out_dims="T", scan="T")
    _raises_each(ShapeError, matches, lambda: w(jnp.ones(shape), jnp.ones(3)))


def test_fixed_size_mismatch():
    w = filter_multi_vmap(_never_called, in_dims="T F 2 2", out_dims="T F", scan="T")
    matches = [
        r"argument `args\[0\]`",
        r"float32\[3,4,2,3\]",
        r"size 3 at axis 3",
        r"'T F 2 2'",
        r"fix that axis to 2",
    ]
    _raises_each(ShapeError, matches, lambda: w(jnp.ones((3, 4, 2, 3))))


@pytest.mark.parametrize("value", [2.0, 3, "hello", None, len])
def test_non_array_leaf_with_mapped_dims(value):
    def g(x, y):
        raise AssertionError("traced")

    w = filter_multi_vmap(g, in_dims=("T", "T"), out_dims="T", scan="T")
    if value is None:
        # `None` is an empty pytree: it has no leaves to give dims to.
        with pytest.raises(AssertionError, match="traced"):
            w(jnp.ones(3), value)
        return
    if isinstance(value, (int, float)):
        # A Python scalar is checked as the rank-0 array that `jax.jit` sees.
        matches = [
            r"argument `y`",
            rf"the Python `{type(value).__name__}` {value!r}",
            r"has rank 0, but dims 'T' need exactly 1",
        ]
    else:
        matches = [
            r"argument `y`",
            rf"is `{type(value).__name__}`",
            re.escape(repr(value)),
            r"not an array",
            r"mapped dim 'T'",
            r"give it `None` dims",
        ]
    _raises_each(ShapeError, matches, lambda: w(jnp.ones(3), value))
    if isinstance(value, (int, float)):
        _raises_each(ShapeError, matches[2:], lambda: jax.jit(w)(jnp.ones(3), value))


def test_errors_raised_before_body_is_traced():
    calls = []

    def body(x, y):
        calls.append(1)
        return x * y

    w = filter_multi_vmap(
        body, in_dims=("T F", "F"), out_dims="F T", scan={"T": 2}, vmap="F"
    )
    bad_calls = [
        (ShapeError, "inconsistent", (jnp.ones((3, 4)), jnp.ones(5))),
        (ShapeError, "rank", (jnp.ones(3), jnp.ones(3))),
        (ShapeError, "not an array", (jnp.ones((3, 4)), "nu")),
    ]
    for error, match, args in bad_calls:
        with pytest.raises(error, match=match):
            w(*args)
        with pytest.raises(error, match=match):
            eqx.filter_jit(w)(*args)
        with pytest.raises(error, match=match):
            eqx.filter_make_jaxpr(w)(*args)
    assert calls == []
    # A valid call traces the body.
    w(jnp.ones((3, 4)), jnp.ones(4))
    assert calls


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(sig=signatures(), data=st.data())
def test_inconsistent_sizes_random_signatures(sig, data):
    # Add one argument that disagrees with the others on one mapped dim.
    name = data.draw(st.sampled_from(sig.mapped))
    size = sig.sizes[name]
    bad = data.draw(st.sampled_from([s for s in range(5) if s != size]))
    args = list(sig.args) + [jnp.ones((2, bad))]
    in_dims = sig.in_dims + (f"_ {name}",)
    w = filter_multi_vmap(
        _never_called,
        in_dims=in_dims,
        out_dims=sig.out_dims + (" ".join(sig.mapped),),
        core=sig.core,
        scan=sig.scan,
        vmap=sig.vmap,
    )
    k = len(args) - 1
    matches = [
        rf"inconsistent sizes for dim '{name}'",
        rf"size {size}: `args\[\d\]` axis \d",
        rf"size {bad}: `args\[{k}\]` axis 1 \(float32\[2,{bad}\], dims '_ {name}'\)",
    ]
    _raises_each(ShapeError, matches, lambda: w(*args))


#
# Bad specs: SpecError.
#


@pytest.mark.parametrize(
    "dims, matches",
    [
        ("T,F", [r"'T,F'", r"spaces, not commas", r"e\.g\. 'T F'"]),
        ("[T,F,B]", [r"not commas", r"e\.g\. 'T F B'", r"multi_vmap"]),
        ("[T F]", [r"'\[T F\]'", r"no brackets"]),
        ("T ... F ...", [r"'T \.\.\. F \.\.\.'", r"`\.\.\.` may appear at most once"]),
        ("*batch T ...", [r"`\*batch` and `\.\.\.` cannot both appear"]),
        ("*#T F", [r"dim '\*#T'", r"broadcastable variadic"]),
        ("?T F", [r"dim '\?T'", r"pytree path"]),
        ("~T F", [r"dim '~T'", r"`~`", r"DSA2000-Cal"]),
        ("T+1", [r"dim 'T\+1'", r"symbolic"]),
        ("n=T+1 T", [r"dim 'n=T\+1'", r"symbolic"]),
        ("T 2*F", [r"dim '2\*F'", r"symbolic"]),
        ("T$", [r"dim 'T\$'", r"not a name, an integer, `_` or `\.\.\.`"]),
        ("1x", [r"dim '1x'", r"not a name"]),
        ("T 2.5", [r"dim '2\.5'", r"not a name"]),
    ],
)
def test_invalid_dims_strings(dims, matches):
    matches = [r"Invalid dims string"] + matches
    _raises_each(SpecError, matches, lambda: parse_dims(dims))
    # At decoration time, in `in_dims` and in `out_dims`.
    _raises_each(
        SpecError,
        matches,
        lambda: filter_multi_vmap(_never_called, in_dims=(dims,), out_dims="T"),
    )
    _raises_each(
        SpecError,
        matches,
        lambda: filter_multi_vmap(_never_called, in_dims="T", out_dims={"a": dims}),
    )
    _raises_each(
        SpecError,
        matches,
        lambda: filter_multi_vmap(_never_called, in_dims={"x": {"y": dims}}),
    )


def _f(x):
    return x


def test_not_callable():
    matches = [r"must wrap a callable", r"3 of type `int`", r"keyword-only"]
    _raises_each(SpecError, matches, lambda: filter_multi_vmap(3, in_dims="T"))


@pytest.mark.parametrize(
    "strategy, matches",
    [
        ({"scan": "X", "vmap": "T"}, [r"`scan` names dim 'X'"]),
        ({"vmap": "T F"}, [r"`vmap` names dim 'F'", r"A dim named only by the inputs"]),
        ({"scan": {"T": 2, "Y": None}}, [r"`scan` names dim 'Y'"]),
        ({"shard": {"F": "x"}}, [r"`shard` names dim 'F'"]),
        ({"scan": "c", "core": "c"}, [r"`scan` names dim 'c'", r"declared `core`"]),
    ],
)
def test_strategy_names_unmapped_dim(strategy, matches):
    # With explicit `out_dims` the mapped dims are known at decoration, so is this.
    matches = matches + [
        r"which is not mapped",
        r"the named dims of the output \(here 'T'",
        r"only chooses how a mapped dim is mapped",
    ]
    out_dims = "T c" if "core" in strategy else "T"
    _raises_each(
        SpecError,
        matches,
        lambda: filter_multi_vmap(
            _never_called, in_dims=("T F c", "F"), out_dims=out_dims, **strategy
        ),
    )


def test_strategy_names_unmapped_dim_of_the_return_annotation():
    # From a return annotation, the same error is raised at the call, before the
    # body is traced.
    def g(x: Float[Array, "T F"]) -> Float[Array, " T"]:
        raise AssertionError("traced")

    w = filter_multi_vmap(g, vmap="F")
    matches = [r"`vmap` names dim 'F'", r"the return annotation does not name it"]
    _raises_each(SpecError, matches, lambda: w(jnp.ones((3, 4))))


def test_mapped_dim_named_by_no_argument():
    # `F` appears only in the dims of a non-array: its size is unknown, and the
    # error blames `out_dims`, which made it mapped.
    w = filter_multi_vmap(_never_called, in_dims=("T", None), out_dims="T F")
    matches = [
        r"`out_dims` names dim 'F',\s+so it is mapped",
        r"no array argument's dims name it",
        r"size is unknown",
        r"declare it `core='F'`",
    ]
    _raises_each(SpecError, matches, lambda: w(jnp.ones(3), 1.0))


def test_core_names_a_dim_the_output_does_not():
    matches = [r"`core` names dim 'c'", r"`out_dims` does not name", r"core already"]
    _raises_each(
        SpecError,
        matches,
        lambda: filter_multi_vmap(_f, in_dims="T c", out_dims="T", core="c"),
    )


@pytest.mark.parametrize(
    "scan, vmap", [("T", "T F"), ({"T": 2}, ("F", "T")), (("F", "T"), "F")]
)
def test_dim_in_both_vmap_and_scan(scan, vmap):
    matches = [r"`filter_multi_vmap`", r"dim '[TF]'", r"both `vmap` and `scan`"]
    _raises_each(
        SpecError,
        matches,
        lambda: filter_multi_vmap(_f, in_dims="T F", scan=scan, vmap=vmap),
    )


@pytest.mark.parametrize("chunk", [0, -1, True, False])
def test_bad_chunk_sizes(chunk):
    matches = [
        re.escape(f"scan={{'T': {chunk!r}}}"),
        r"chunk size must be a positive integer",
        r"or `None`",
    ]
    _raises_each(
        SpecError,
        matches,
        lambda: filter_multi_vmap(_f, in_dims="T", scan={"T": chunk}),
    )


@pytest.mark.parametrize(
    "argname, value, matches",
    [
        ("scan", "T,F", [r"scan=\.\.\.", r"'T,F'", r"not commas", r"'T F'"]),
        ("vmap", "T,F", [r"vmap=\.\.\.", r"not commas"]),
        ("scan", ["_x"], [r"scan=\.\.\.", r"'_x'", r"not a dim name"]),
        ("vmap", "T F T", [r"vmap=\.\.\.", r"names dim 'T' twice"]),
        ("scan", {"T": 2, "2x": 1}, [r"scan=\.\.\.", r"'2x'", r"not a dim name"]),
    ],
)
def test_bad_strategy_names(argname, value, matches):
    _raises_each(
        SpecError,
        matches,
        lambda: filter_multi_vmap(_f, in_dims="T F", **{argname: value}),
    )


def test_out_dims_or_return_annotation_needed():
    w = filter_multi_vmap(_never_called, in_dims="T", vmap="T")
    matches = [
        r"has no `out_dims` and no\s+return\s+annotation",  # wrapped on a terminal
        r"the mapped dims are the named dims of the output",
        r"Give `out_dims`",
    ]
    _raises_each(SpecError, matches, lambda: w(jnp.ones(3)))


def test_no_mapped_dims():
    w = filter_multi_vmap(_never_called, in_dims="T", out_dims="...")
    matches = [r"maps no dims", r"output's dims name none"]
    _raises_each(SpecError, matches, lambda: w(jnp.ones(3)))


def test_numpy_integer_chunk_sizes():
    x = jnp.arange(10.0)
    w = filter_multi_vmap(
        lambda a: a * 2.0, in_dims="T", out_dims="T", scan={"T": np.int64(3)}
    )
    np.testing.assert_array_equal(w(x), np.arange(10.0, dtype=np.float32) * 2)


def test_in_dims_tuple_length_mismatch():
    w = filter_multi_vmap(_never_called, in_dims=("T F",), out_dims="T", scan="T")
    matches = [
        r"`in_dims` has 1 entries",
        r"called with 2 positional arguments",
        r"dict of `in_dims` by parameter name",
    ]
    _raises_each(SpecError, matches, lambda: w(jnp.ones((3, 4)), jnp.ones(4)))


def test_unknown_in_dims_keys():
    # The signature is known at decoration, so the keys are checked there.
    def g(x, y):
        raise AssertionError("traced")

    matches = [
        r"`filter_multi_vmap\(test_unknown_in_dims_keys\.<locals>\.g\)`",
        r"`in_dims` keys did not correspond to any parameter: \('z', 'w'\)",
        r"The parameters are \('x', 'y'\)",
    ]
    _raises_each(
        SpecError,
        matches,
        lambda: filter_multi_vmap(
            g, in_dims={"x": "T", "z": "T", "w": None}, out_dims="T", scan="T"
        ),
    )


def test_misspelled_in_dims_key_at_decoration():
    def scale(vis, nu):
        raise AssertionError("traced")

    matches = [
        r"`filter_multi_vmap\(.*scale\)`",
        r"keys did not correspond to any parameter: \('viz',\)",
        r"The parameters are \('vis', 'nu'\)",
        r"Did you mean 'vis' \(not 'viz'\)\?",
    ]
    _raises_each(
        SpecError,
        matches,
        lambda: filter_multi_vmap(
            scale, in_dims={"viz": "T F", "nu": "F"}, out_dims="T F"
        ),
    )
    # Also as a decorator with arguments, and for a key differing only in case.
    with pytest.raises(SpecError, match=r"Did you mean 'nu' \(not 'Nu'\)\?"):

        @filter_multi_vmap(in_dims={"vis": "T F", "Nu": "F"}, out_dims="T F")
        def scale2(vis, nu):
            return vis * nu


def test_in_dims_keys_of_partials_and_methods():
    def g(x, y, *, scale):
        return x * y * scale

    # A `functools.partial` has the signature of what is left to pass.
    p = ft.partial(g, jnp.float32(2.0))
    with pytest.raises(
        SpecError, match=r"(?s)\('x',\).*parameters are \('y', 'scale'\)"
    ):
        filter_multi_vmap(p, in_dims={"x": "T", "y": "T"}, out_dims="T")
    w = filter_multi_vmap(p, in_dims={"y": "T", "scale": None}, out_dims="T")
    out = w(jnp.arange(3.0), scale=3.0)
    np.testing.assert_array_equal(out, 6 * np.arange(3.0, dtype=np.float32))

    # A method: `self` is a parameter like any other.
    class Scaler(eqx.Module):
        k: float

        @filter_multi_vmap(in_dims={"self": None, "x": "T"}, out_dims="T")
        def __call__(self, x):
            return self.k * x

    np.testing.assert_array_equal(Scaler(3.0)(jnp.arange(3.0)), 3 * np.arange(3.0))
    with pytest.raises(
        SpecError, match=r"(?s)\('xs',\).*parameters are \('self', 'x'\)"
    ):

        class Bad(eqx.Module):
            @filter_multi_vmap(in_dims={"xs": "T"}, out_dims="T")
            def __call__(self, x):
                return x


def test_in_dims_keys_of_var_keyword_functions_are_not_checked():
    # A function taking `**kwargs` may be passed any keyword: no check is possible.
    def g(x, **kwargs):
        return x * kwargs["nu"]

    w = filter_multi_vmap(g, in_dims={"x": "T", "nu": "T", "other": None}, out_dims="T")
    out = w(jnp.arange(3.0), nu=jnp.arange(3.0))
    np.testing.assert_array_equal(out, np.arange(3.0) ** 2)


@pytest.mark.parametrize(
    "spec, value, matches",
    [
        (
            {"a": "T", "b": None},
            {"a": jnp.ones(3), "c": jnp.ones(3)},
            [r"argument `m`", r"\{'a': 'T', 'b': None\}", r"key path\s+m\b"],
        ),
        (
            ("T", ("T", "T")),
            (jnp.ones(3), (jnp.ones(3),)),
            [r"argument `m`", r"key path\s+m\[1\]", r"length 2", r"length 1"],
        ),
        (
            {"flux": "T"},
            Model(jnp.ones(3), jnp.ones(3)),
            [r"argument `m`", r"<class 'dict'>", r"Model", r"equinox\.Module"],
        ),
    ],
)
def test_in_dims_not_a_prefix(spec, value, matches):
    def g(m):
        raise AssertionError("traced")

    w = filter_multi_vmap(g, in_dims=(spec,), out_dims="T", scan="T")
    matches = matches + [r"pytree prefix of `m`", r"does not fit"]
    _raises_each(SpecError, matches, lambda: w(value))


def test_mapped_dim_twice_in_one_array():
    w = filter_multi_vmap(_never_called, in_dims="T T", out_dims="T", scan="T")
    matches = [r"argument `args\[0\]`", r"'T T'", r"mapped dim 'T' twice"]
    _raises_each(SpecError, matches, lambda: w(jnp.ones((3, 3))))


#
# Body outputs that do not match `out_dims`.
#


@pytest.mark.parametrize(
    "out_dims, matches",
    [
        (
            ("T F", "T"),
            [r"`out_dims` 'T' for `output\[1\]`", r"does not name the mapped dim 'F'"],
        ),
        ("T F T", [r"'T F T'", r"names more than once the mapped dim 'T'"]),
        (
            {"a": "F ... c", "b": "T F c"},
            [r"'F \.\.\. c' for `output\['a'\]`", r"does not name the mapped dim 'T'"],
        ),
    ],
)
def test_out_dims_missing_mapped_dim(out_dims, matches):
    # Raised at decoration: explicit `out_dims` fix the mapped dims.
    matches = matches + [r"Every output array is mapped over each of .* exactly once"]
    _raises_each(
        SpecError,
        matches,
        lambda: filter_multi_vmap(
            _never_called, in_dims=("T F c", "F"), out_dims=out_dims, scan="T"
        ),
    )


def test_out_dims_tuple_for_one_output():
    # The message names the output's structure, never a tracer.
    w = filter_multi_vmap(lambda x: x, in_dims="T F", out_dims=("T F",), scan="T")
    matches = [r"`out_dims`", r"pytree prefix of `output`", r"\('T F',\)"]
    for match in matches:
        with pytest.raises(SpecError, match=match) as info:
            w(jnp.ones((3, 4)))
        assert "Tracer" not in str(info.value)


@pytest.mark.parametrize(
    "body, out_dims, error, matches",
    [
        (
            lambda x: x[0],
            "T F 3",
            ShapeError,
            [r"returned `output`", r"per-element shape \(\)", r"rank 0", r"'T F 3'"],
        ),
        (
            lambda x: x[:2],
            "T F 3",
            ShapeError,
            [r"per-element shape \(2,\)", r"'T F 3'", r"fix the axis at 0 to 3"],
        ),
        (
            lambda x: x[:2],
            ("T c F", "c"),
            ShapeError,
            [
                r"inconsistent sizes for dim 'c'",
                r"size 3: `x` axis 2 \(float32\[3,4,3\], dims 'T F c'\)",
                r"size 2: `output` \(body output of shape \(2,\)\) axis 0",
                r"T=3, F=4",
            ],
        ),
        (
            lambda x: (x[0], x[1]),
            ("T F", "T F", "T F"),
            SpecError,
            [r"`out_dims`", r"pytree prefix of `output`", r"length 3", r"length 2"],
        ),
        (
            lambda x: (x[0], x[1]),
            ("T F", None),
            SpecError,
            [r"`out_dims` gives `None` for `output\[1\]`", r"which is an array"],
        ),
    ],
)
def test_body_output_does_not_match_out_dims(body, out_dims, error, matches):
    core = None
    if isinstance(out_dims, tuple) and out_dims[1] == "c":
        out_dims, core = out_dims
    w = filter_multi_vmap(
        body, in_dims="T F c", out_dims=out_dims, core=core, scan={"T": 2}
    )
    _raises_each(error, matches, lambda: w(jnp.ones((3, 4, 3))))


def test_bad_call_arguments():
    w = filter_multi_vmap(lambda x, y: x, in_dims="T", out_dims="T", scan="T")
    with pytest.raises(TypeError, match=r"(?s)called with bad\s+arguments.*'y'"):
        w(jnp.ones(3))


#
# Ill-typed specs. The test suite runs the library under jaxtyping's pytest plugin
# (beartype on every annotated function), which rejects these before the library's
# own checks run; users normally run without it, so check in a plain subprocess.
#

_ILL_TYPED = {
    "in_dims_int_leaf": (
        "filter_multi_vmap(f, in_dims=(3,))",
        [r"in_dims=\.\.\.", r"contains 3 of type `int`", r"dims strings"],
    ),
    "in_dims_int": (
        "filter_multi_vmap(f, in_dims=3)",
        [r"in_dims=\.\.\.", r"contains 3 of type `int`"],
    ),
    "out_dims_int": (
        "filter_multi_vmap(f, in_dims='T', out_dims=0)",
        [r"out_dims=\.\.\.", r"0 of type `int`"],
    ),
    "in_dims_dict_float": (
        "filter_multi_vmap(f, in_dims={'x': 1.5})",
        [r"in_dims=\{'x': \.\.\.\}", r"1\.5 of type `float`"],
    ),
    "chunk_float": (
        "filter_multi_vmap(f, in_dims='T', scan={'T': 1.5})",
        [r"scan=\{'T': 1\.5\}", r"chunk size must be a positive integer"],
    ),
    "chunk_str": (
        "filter_multi_vmap(f, in_dims='T', scan={'T': '2'})",
        [r"scan=\{'T': '2'\}", r"positive integer"],
    ),
    "vmap_int_name": (
        "filter_multi_vmap(f, in_dims='T', vmap=('T', 3))",
        [r"vmap=\.\.\.", r"got 3", r"not a dim name"],
    ),
    "scan_int": (
        "filter_multi_vmap(f, in_dims='T', scan=3)",
        [r"scan=\.\.\.", r"must be a dims string", r"got 3"],
    ),
}

_SUBPROCESS = textwrap.dedent(
    """
    import json, sys
    from eqx_multimap import filter_multi_vmap

    def f(x):
        return x

    out = {}
    for name, expr in json.loads(sys.argv[1]).items():
        try:
            eval(expr)
            out[name] = [None, None]
        except Exception as e:
            out[name] = [type(e).__name__, str(e)]
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def ill_typed_errors():
    cases = {k: expr for k, (expr, _) in _ILL_TYPED.items()}
    res = subprocess.run(
        [sys.executable, "-c", _SUBPROCESS, json.dumps(cases)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(res.stdout.splitlines()[-1])


@pytest.mark.parametrize("case", sorted(_ILL_TYPED))
def test_ill_typed_specs(ill_typed_errors, case):
    kind, message = ill_typed_errors[case]
    assert kind == "SpecError", (kind, message)
    for match in _ILL_TYPED[case][1]:
        assert re.search(match, message), (match, message)


def test_var_positional_in_dims_length_mismatch():
    def f(*xs):
        raise AssertionError("traced")

    w = filter_multi_vmap(f, in_dims={"xs": ("T", "T")}, out_dims="T", scan="T")
    matches = [r"`in_dims\['xs'\]` has 2 entries", r"`\*xs`", r"called with 3"]
    _raises_each(SpecError, matches, lambda: w(jnp.ones(3), jnp.ones(3), jnp.ones(3)))


@pytest.mark.parametrize("jit", [False, True])
def test_python_scalar_checked_as_rank_zero(jit):
    # Dims given to a Python scalar describe a rank-0 value, eagerly as under jit.
    w = filter_multi_vmap(
        lambda x, y: x * y, in_dims=("T F", "F"), out_dims="F T", scan="T"
    )
    call = jax.jit(w) if jit else w
    matches = [r"argument `y`", r"rank 0", r"dims 'F' need exactly 1"]
    for match in matches:
        with pytest.raises(ShapeError, match=match):
            call(jnp.ones((3, 4)), 1.0)
    # With dims that fit a scalar, it passes through (eagerly) unchanged.
    v = filter_multi_vmap(
        lambda x, y: x * y, in_dims=("T F", "..."), out_dims="F T", scan="T"
    )
    out = v(jnp.ones((3, 4)), 2.0)
    assert out.shape == (4, 3) and out.dtype == jnp.float32
    np.testing.assert_array_equal(out, np.full((4, 3), 2.0, np.float32))


#
# The mistakes of a first day: arguments without arrays, misspelled dims and
# keywords, and errors from inside the body.
#


def _scale(vis, nu):
    return vis * nu


def _scale_never_called(vis, nu):
    raise AssertionError("the body was traced although the inputs are invalid")


@pytest.mark.parametrize(
    "value, what",
    [
        ([0.0, 1.0, 2.0, 3.0], r"a list of 4 floats \(\[0\.0, 1\.0, 2\.0, 3\.0\]\)"),
        ((0, 1, 2, 3), r"a tuple of 4 ints \(\(0, 1, 2, 3\)\)"),
        ([1, 2.0, 3], r"a list of 2 ints and 1 float"),
        ({"a": [1.0], "b": 2.0}, r"a dict holding 2 floats"),
    ],
)
@pytest.mark.parametrize("jit", [False, True])
def test_dims_string_for_an_argument_with_no_array(value, what, jit):
    no_array = r"with no array in it"
    if jit:
        # Under `jax.jit` the numbers arrive as rank-0 arrays.
        what = rf"a {type(value).__name__} (of|holding) \d .*\[\] array"
        no_array = r"with no array of rank 1 or more in it"
    w = filter_multi_vmap(
        _scale_never_called, in_dims={"vis": "T F", "nu": "F"}, out_dims="T F"
    )
    w = jax.jit(w) if jit else w
    matches = [
        r"`filter_multi_vmap\(_scale_never_called\)`",
        r"argument `nu` is " + what,
        no_array,
        r"its dims 'F' name dim 'F'",
        r"Pass an array, `jnp\.asarray\(nu\)`"
        if isinstance(value, (list, tuple))
        else r"Pass arrays in it",
        r"give it `None` dims to pass it through unchanged",
    ]
    _raises_each(ShapeError, matches, lambda: w(jnp.ones((3, 4)), value))


def test_dims_string_for_a_subtree_with_no_array():
    # The spec names the subtree `m['b']`; its leaves are numbers.
    def g(m):
        raise AssertionError("traced")

    matches = [
        r"argument `m\['b'\]` is a list of 2 floats",
        r"its dims 'T c' name dims 'T', 'c'",
        r"`jnp\.asarray\(m\['b'\]\)`",
    ]
    w = filter_multi_vmap(g, in_dims=({"a": "T", "b": "T c"},), out_dims="T")
    _raises_each(ShapeError, matches, lambda: w({"a": jnp.ones(3), "b": [1.0, 2.0]}))


@pytest.mark.parametrize("dims", ["...", "_ _", None])
def test_no_array_with_unnamed_dims_passes_through(dims):
    # Dims that name no dim describe nothing to check: the list passes through.
    w = filter_multi_vmap(
        lambda x, ks: x * sum(ks), in_dims=("T", dims), out_dims="T", scan="T"
    )
    out = w(jnp.arange(3.0), [1.0, 2.0])
    np.testing.assert_array_equal(out, 3 * np.arange(3.0, dtype=np.float32))


def test_non_array_leaves_beside_arrays_pass_through():
    # Filter semantics: a pytree that holds an array maps it; its other leaves
    # (numbers, strings) reach the body as they are.
    seen = []

    def body(m):
        seen.append((m["x"].shape, m["k"], m["name"]))
        return m["x"] * m["k"]

    w = filter_multi_vmap(body, in_dims="T", out_dims="T", scan="T")
    out = w({"x": jnp.arange(3.0), "k": 2.0, "name": "gain"})
    np.testing.assert_array_equal(out, 2 * np.arange(3.0, dtype=np.float32))
    assert seen == [((), 2.0, "gain")]


def test_list_under_annotations_names_the_parameter():
    def gather(x: Float[Array, "T N"], ant1: Int[Array, " B"]) -> Float[Array, "T B"]:
        raise AssertionError("traced")

    w = filter_multi_vmap(gather)
    matches = [
        r"`filter_multi_vmap\(.*gather\)`",
        r"parameter `ant1` is annotated `Int\[Array, 'B'\]`",
        r"but was given a list of 3 ints \(\[0, 1, 2\]\)",
        r"the annotation is not met",
        r"`jnp\.asarray\(ant1\)`",
        r"`in_dims=\{'ant1': \.\.\.\}` \(`None` passes it through unchanged\)",
    ]
    _raises_each(ShapeError, matches, lambda: w(jnp.ones((3, 4)), [0, 1, 2]))
    with pytest.raises(ShapeError) as info:
        w(jnp.ones((3, 4)), [0, 1, 2])
    # Not the output dim left unbound.
    assert "so it is mapped" not in str(info.value)


def test_misspelled_dim_in_in_dims_gets_a_note():
    # `f` for `F`: `f` is named by no output, so it is a core dim, and the body
    # fails on a (4,) `nu`. The user's own error is kept, with a note.
    w = filter_multi_vmap(
        _scale, in_dims={"vis": "T F B 2 2", "nu": "f"}, out_dims="T F B 2 2"
    )
    matches = [
        r"broadcast",  # JAX's message
        r"`filter_multi_vmap\(_scale\)` raised this while tracing its body on one "
        r"element",
        r"vis: float32\[2,2\] per element \(given float32\[3,4,5,2,2\], dims "
        r"'T F B 2 2'\)",
        r"nu: float32\[4\] whole \(dims 'f'\)",
        r"Mapped dims \(named by `out_dims`\): T=3, F=4, B=5\.",
        r"Core dims, which the body sees whole: f=4 \(named by no output\)\.",
        r"Did you mean 'F' for 'f'\?\s+'f' is named only by `nu` \('f'\),\s+while "
        r"'F' is named by `out_dims`, `vis` \('T F B 2 2'\)\.",
    ]
    _raises_each(ValueError, matches, lambda: w(jnp.ones((3, 4, 5, 2, 2)), jnp.ones(4)))
    with pytest.raises(ValueError) as info:
        w(jnp.ones((3, 4, 5, 2, 2)), jnp.ones(4))
    # The exception is JAX's own, not one raised in its place.
    assert type(info.value) is ValueError


def _note_count(error) -> int:
    notes = getattr(error, "__notes__", [])
    said = "raised this while tracing its body"
    return sum(said in " ".join(n.split()) for n in notes)


@pytest.mark.parametrize(
    "how",
    ["eager", "jit", "filter_jit", "grad", "plan_auto", "explain", "shim", "nested"],
)
def test_body_error_note_is_added_once(how):
    w = filter_multi_vmap(
        _scale,
        in_dims={"vis": "T F B 2 2", "nu": "f"},
        out_dims="T F B 2 2",
        plan="auto" if how == "plan_auto" else None,
    )
    vis, nu = jnp.ones((3, 4, 5, 2, 2)), jnp.ones(4)
    if how == "jit":
        w = jax.jit(w)
    elif how == "filter_jit":
        w = eqx.filter_jit(w)
    elif how == "grad":
        mapped = w
        w = jax.grad(lambda v, n: jnp.sum(mapped(v, n)))
    elif how == "explain":
        w = ft.partial(explain, w)
    elif how == "shim":
        w = multi_vmap(_scale, in_mapping="[T,F,B],[f]", out_mapping="[T,F,B]")
    elif how == "nested":
        inner = w
        w = filter_multi_vmap(
            lambda vis, nu: inner(vis, nu),
            in_dims={"vis": "S ...", "nu": None},
            out_dims="S ...",
        )
        vis = jnp.ones((2, 3, 4, 5, 2, 2))
    with pytest.raises(ValueError, match="broadcast") as info:
        w(vis, nu)
    assert _note_count(info.value) == 1
    note = [n for n in info.value.__notes__ if "while tracing" in n][0]
    assert "Did you mean 'F' for 'f'?" in note
    assert re.search(r"nu: float32\[4\] whole \(dims 'f( \.\.\.)?'\)", note)


def test_body_shape_error_shows_per_element_shapes():
    # `B` is core (named by no output): the body sees `y` whole, and `x @ y` fails.
    def mix(x, y, k):
        return x @ y * k

    w = filter_multi_vmap(
        mix, in_dims={"x": "T F", "y": "B F", "k": None}, out_dims="T"
    )
    matches = [
        r"dot_general",
        r"`filter_multi_vmap\(.*mix\)` raised this",
        r"x: float32\[4\] per element \(given float32\[3,4\], dims 'T F'\)",
        r"y: float32\[5,4\] whole \(dims 'B F'\)",
        r"k: float32\[\] whole \(`None` dims: not mapped\)",
        r"Mapped dims \(named by `out_dims`\): T=3\.",
        r"Core dims, which the body sees whole: F=4 \(named by no output\), B=5 "
        r"\(named by no output\)\.",
    ]
    args = (jnp.ones((3, 4)), jnp.ones((5, 4)), jnp.float32(2.0))
    _raises_each(TypeError, matches, lambda: w(*args))
    with pytest.raises(TypeError) as info:
        w(*args)
    assert "Did you mean" not in "\n".join(info.value.__notes__)


def test_body_error_note_lists_non_array_leaves_and_declared_core():
    def body(x, opts):
        raise RuntimeError("the user's own bug")

    w = filter_multi_vmap(
        body, in_dims={"x": "T c"}, out_dims="T c", core="c", scan="T"
    )
    matches = [
        r"the user's own bug",
        r"x: float32\[2\] per element \(given float32\[3,2\], dims 'T c'\)",
        r"opts: `str`, not an array: passed as it is",
        r"Core dims, which the body sees whole: c=2 \(declared `core`\)\.",
    ]
    _raises_each(RuntimeError, matches, lambda: w(jnp.ones((3, 2)), "fast"))


@pytest.mark.parametrize(
    "core, mapped, close",
    [
        ("f", "F", True),  # case only, any length
        ("time", "Time", True),
        ("ant", "ant1", True),  # one character added
        ("freq", "frq", True),  # one dropped
        ("ant2", "ant1", True),  # one changed
        ("atn1", "ant1", True),  # two adjacent swapped
        ("ab", "ac", False),  # short names: case only
        ("a", "b", False),
        ("ant", "nat1", False),  # two edits
        ("nu", "mu", False),
        ("Fr", "F", True),  # one or two characters added at the end
        ("fq", "F", True),
        ("Fabc", "F", False),
        ("K", "F", False),  # two one-letter names
    ],
)
def test_did_you_mean_rule(core, mapped, close):
    w = filter_multi_vmap(
        lambda x, y: x + y.sum() + None,  # always fails in the body
        in_dims=(f"T {mapped}", f"T {core} {core}"),
        out_dims=f"T {mapped}",
    )
    with pytest.raises(TypeError) as info:
        w(jnp.ones((2, 3)), jnp.ones((2, 4, 4)))
    note = "\n".join(info.value.__notes__)
    assert (f"Did you mean {mapped!r} for {core!r}?" in note) == close


def test_out_dims_naming_a_dim_no_input_has_suggests_the_close_one():
    w = filter_multi_vmap(_never_called, in_dims=("T freq",), out_dims="T Freq")
    matches = [
        r"`out_dims` names dim 'Freq',\s+so it is mapped",
        r"The named dims of the arguments are: T, freq",
        r"Did you mean 'freq' for 'Freq'\?\s+'Freq' is named only by `out_dims`,\s+"
        r"while 'freq' is named by `args\[0\]` \('T freq'\)\.",
    ]
    _raises_each(SpecError, matches, lambda: w(jnp.ones((3, 4))))


def test_misspelled_keyword_argument_at_the_call():
    w = filter_multi_vmap(
        _scale, in_dims={"vis": "T F", "nu": "F"}, out_dims="T F", scan="T"
    )
    matches = [
        r"`filter_multi_vmap\(_scale\)` was called with bad arguments",
        r"unexpected keyword arguments \('nuu',\)",
        r"The parameters are \('vis', 'nu'\)",
    ]
    _raises_each(TypeError, matches, lambda: w(jnp.ones((3, 4)), nuu=jnp.ones(4)))
    with pytest.raises(TypeError, match=r"Did you mean 'vis' \(not 'viss'\)\?"):
        w(viss=jnp.ones((3, 4)), nu=jnp.ones(4))


def test_jax_scalar_given_dims_of_rank_one():
    # A 0-d array for an argument whose dims name one axis: the rank is wrong.
    w = filter_multi_vmap(
        _scale_never_called, in_dims={"vis": "T F", "nu": "F"}, out_dims="T F"
    )
    matches = [r"argument `nu` of type float32\[\]", r"rank 0", r"'F' need exactly 1"]
    _raises_each(ShapeError, matches, lambda: w(jnp.ones((3, 4)), jnp.float32(2.0)))


def test_numpy_arrays_are_arrays():
    # NumPy arrays are mapped like JAX arrays (the output is a JAX array).
    w = filter_multi_vmap(
        _scale, in_dims={"vis": "T F", "nu": "F"}, out_dims="F T", scan="T"
    )
    vis = np.arange(12.0, dtype=np.float32).reshape(3, 4)
    nu = np.arange(4.0, dtype=np.float32)
    out = w(vis, nu)
    assert isinstance(out, jax.Array)
    assert out.shape == (4, 3) and out.dtype == jnp.float32
    np.testing.assert_array_equal(out, (vis * nu).T)


#
# Typos named when a call fails: where the dim was written, and the dim meant.
#


class _Gained(eqx.Module):
    gain: Float[Array, "T f"]  # a typo for `F`

    @filter_multi_vmap
    def apply(self, raw: Float[Array, "T F K"]) -> Float[Array, "T F"]:
        return self.gain * raw.sum()  # (F,) per element, as annotated

    @filter_multi_vmap
    def mix(self, raw: Float[Array, "T F K"]) -> Float[Array, "T F"]:
        return (self.gain * raw).sum()  # (F,) * (K,): fails in the body


@pytest.mark.parametrize("method", ["apply", "mix"])
def test_typo_in_a_module_field_is_named(method):
    # `apply` fails our rank check (the output is (16,) per element), `mix` in the
    # body (JAX's broadcasting error): both name `self.gain` and 'F'.
    model = _Gained(jnp.ones((8, 16)))
    matches = [
        r"Did you mean 'F' for 'f'\?",
        r"'f' is named only by `self\.gain` \('T f'\)",
        r"while 'F' is named by the return annotation, `raw` \('T F K'\)",
    ]
    error = ShapeError if method == "apply" else TypeError
    call = getattr(model, method)
    _raises_each(error, matches, lambda: call(jnp.ones((8, 16, 32))))
    with pytest.raises(error) as info:
        call(jnp.ones((8, 16, 32)))
    # 'K' is a core dim, and not a typo of 'T' or 'F'.
    assert "for 'K'" not in str(info.value) + "".join(info.value.__notes__)


def test_typo_in_an_argument_annotation_is_named():
    @filter_multi_vmap
    def project(
        raw: Float[Array, "T Fr K"], w: Float[Array, "T F K"]
    ) -> Float[Array, "T F"]:
        return raw @ w

    matches = [
        r"Did you mean 'F' for 'Fr'\?",
        r"'Fr' is named only by `raw` \('T Fr K'\)",
        r"while 'F' is named by the return annotation, `w` \('T F K'\)",
    ]
    _raises_each(
        ShapeError, matches, lambda: project(jnp.ones((8, 16, 4)), jnp.ones((8, 16, 4)))
    )


def test_typo_in_the_return_annotation_is_named():
    @filter_multi_vmap
    def total(raw: Float[Array, "T F K"]) -> Float[Array, "T Fq"]:
        return raw.sum(-1)

    matches = [
        r"the return annotation names dim 'Fq'",
        r"Did you mean 'F' for 'Fq'\?",
        r"'Fq' is named only by the return annotation,\s+while 'F' is named by `raw` "
        r"\('T F K'\)",
    ]
    _raises_each(SpecError, matches, lambda: total(jnp.ones((8, 16, 4))))


def test_typo_in_in_dims_when_the_body_fails():
    # An error raised while the body is traced names the typo in its note.
    def body(x, y):
        raise RuntimeError("the user's own bug")

    w = filter_multi_vmap(body, in_dims=("T F", "T F"), out_dims="T F", core="F")
    with pytest.raises(RuntimeError, match="the user's own bug") as info:
        w(jnp.ones((2, 3)), jnp.ones((2, 3)))
    assert "Did you mean" not in "".join(info.value.__notes__)
    w = filter_multi_vmap(body, in_dims=("T F", "T fr"), out_dims="T F")
    matches = [
        r"Did you mean 'F' for 'fr'\?",
        r"'fr' is named only by `y` \('T fr'\)",
    ]
    _raises_each(RuntimeError, matches, lambda: w(jnp.ones((2, 3)), jnp.ones((2, 3))))


def test_distinct_names_are_not_typos():
    # `K` and `T` are two dims, and so are `F` and the core dim `Fs`, written twice.
    @filter_multi_vmap
    def f(x: Float[Array, "T F Fs"], y: Float[Array, "K Fs"]) -> Float[Array, "T F K"]:
        return x.sum(-1) + y.sum(-1)

    x, y = jnp.ones((2, 3, 5)), jnp.ones((4, 5))
    assert f(x, y).shape == (2, 3, 4)  # no warning either: warnings are errors here

    @filter_multi_vmap
    def g(x: Float[Array, "T F Fs"], y: Float[Array, "K Fs"]) -> Float[Array, "T F K"]:
        return x + y  # fails in the body

    with pytest.raises(TypeError) as info:
        g(x, y)
    assert "Did you mean" not in "".join(info.value.__notes__)
