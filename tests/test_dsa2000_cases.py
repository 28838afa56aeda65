"""DSA2000-Cal's `multi_vmap` cases, as data, against `eqx_multimap.multi_vmap`.

`tests/dsa2000_upstream.py` runs DSA2000-Cal's own tests when a checkout is at hand;
this file covers the same mappings without one. Each case gives, written out by
hand, the whole-shape dims of each argument and of the output, from which
`loop_reference` (which shares no code with `eqx_multimap`) computes the expected
values by a Python loop. The inputs are random, so that a misplaced axis shows.
Then: DSA2000-Cal's free-text labels (primes, numbers), `auto=True`, calls by
keyword, `None` arguments, and each error with its message.
"""

import collections
import functools as ft
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from eqx_multimap import multi_vmap, ShapeError, SpecError

from .helpers import loop_reference


N1, N2, N3, N4, N5 = 3, 4, 5, 6, 2


def _rand(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _add(x, y):
    if x is None:
        return y
    return x + y


def _add_sub(x, y):
    return x + y, x - y


def _check(out, ref):
    """Same pytree structure, shapes, dtypes and values."""
    out_leaves, out_def = jax.tree.flatten(out)
    ref_leaves, ref_def = jax.tree.flatten(ref)
    assert out_def == ref_def
    for a, b in zip(out_leaves, ref_leaves):
        assert a.shape == b.shape
        assert a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


# in_mapping, out_mapping, input shapes (None: pass `None`), and for the reference:
# the whole-shape dims of each input, the mapped dims, the output dims.
SINGLE = [
    ("[n1,n2],[n1,n2]", "[n1,n2]", [(N1, N2), (N1, N2)], ("n1 n2", "n1 n2"), "n1 n2"),
    ("[n2,n1],[n1,n2]", "[n1,n2]", [(N2, N1), (N1, N2)], ("n2 n1", "n1 n2"), "n1 n2"),
    (
        "[n1,n2,n3],[n1,n2]",
        "[n1,n2]",
        [(N1, N2, N3), (N1, N2)],
        ("n1 n2 n3", "n1 n2"),
        "n1 n2 n3",
    ),
    (
        "[n1,n2,n3],[n1,n2]",
        "[n1,n2,~n3]",
        [(N1, N2, N3), (N1, N2)],
        ("n1 n2 n3", "n1 n2"),
        "n1 n2 n3",
    ),
    (
        "[n3,n1,n2],[n1,n2]",
        "[...,n1,n2]",
        [(N3, N1, N2), (N1, N2)],
        ("n3 n1 n2", "n1 n2"),
        "n3 n1 n2",
    ),
    (
        "[n3,n1,n2],[n1,n2]",
        "[~n3,n1,n2]",
        [(N3, N1, N2), (N1, N2)],
        ("n3 n1 n2", "n1 n2"),
        "n3 n1 n2",
    ),
    # Here n3 is mapped too (it is in `out_mapping`); `y` has no n3.
    (
        "[n3,n1,n2],[n1,n2]",
        "[n3,n1,n2]",
        [(N3, N1, N2), (N1, N2)],
        ("n3 n1 n2", "n1 n2"),
        "n3 n1 n2",
    ),
    # `None` arguments pass through.
    ("[],[n1,n2]", "[n1,n2]", [None, (N1, N2)], (None, "n1 n2"), "n1 n2"),
    ("[n1],[n1,n2]", "[n1,n2]", [None, (N1, N2)], (None, "n1 n2"), "n1 n2"),
]

MULTI = [
    (
        "[n1,n2],[n1,n2]",
        "[n1,n2],[n2,n1]",
        [(N1, N2), (N1, N2)],
        ("n1 n2", "n1 n2"),
        ("n1 n2", "n2 n1"),
    ),
    (
        "[n1,...,n2],[n1,n2]",
        "[n1,...,n2],[n2,...,n1]",
        [(N1, N3, N2), (N1, N2)],
        ("n1 n3 n2", "n1 n2"),
        ("n1 n3 n2", "n2 n3 n1"),
    ),
    (
        "[n1,...,n2,n4],[n1,n2]",
        "[n1,...,n2,~n4],[n2,...,n1,~n4]",
        [(N1, N3, N2, N4), (N1, N2)],
        ("n1 n3 n2 n4", "n1 n2"),
        ("n1 n3 n2 n4", "n2 n3 n1 n4"),
    ),
    (
        "[n5,n1,...,n2,n4],[n1,n2]",
        "[~n5,n1,...,n2,~n4],[~n5,n2,...,n1,~n4]",
        [(N5, N1, N3, N2, N4), (N1, N2)],
        ("n5 n1 n3 n2 n4", "n1 n2"),
        ("n5 n1 n3 n2 n4", "n5 n2 n3 n1 n4"),
    ),
]


def _mapped(out_mapping):
    return [
        t for t in re.findall(r"[\w']+|~\w+", out_mapping.split("]")[0]) if t[0] != "~"
    ]


def _args(shapes):
    return [None if s is None else _rand(s, seed) for seed, s in enumerate(shapes)]


def _run(fun, in_mapping, out_mapping, shapes, scan_first):
    mapped = _mapped(out_mapping)
    scan_dims = {mapped[0]} if scan_first else None
    f_multi = multi_vmap(fun, in_mapping, out_mapping, scan_dims=scan_dims)
    args = _args(shapes)
    return f_multi(*(None if a is None else jnp.asarray(a) for a in args)), args


@pytest.mark.parametrize("scan_first", [False, True])
@pytest.mark.parametrize("in_mapping, out_mapping, shapes, in_dims, out_dims", SINGLE)
def test_single_output(in_mapping, out_mapping, shapes, in_dims, out_dims, scan_first):
    out, args = _run(_add, in_mapping, out_mapping, shapes, scan_first)
    ref = loop_reference(_add, args, in_dims, _mapped(out_mapping), out_dims)
    _check(out, ref)


@pytest.mark.parametrize("scan_first", [False, True])
@pytest.mark.parametrize("in_mapping, out_mapping, shapes, in_dims, out_dims", MULTI)
def test_tuple_output(in_mapping, out_mapping, shapes, in_dims, out_dims, scan_first):
    out, args = _run(_add_sub, in_mapping, out_mapping, shapes, scan_first)
    ref = loop_reference(_add_sub, args, in_dims, _mapped(out_mapping), out_dims)
    _check(out, ref)


def test_vs_vectorize_and_jit():
    x, y = jnp.asarray(_rand((3, 4), 0)), jnp.asarray(_rand((3, 4), 1))
    f_multi = multi_vmap(_add_sub, "[n1,n2],[n1,n2]", "[n1,n2],[n1,n2]")
    ref = jnp.vectorize(_add_sub, signature="(),()->(),()")(x, y)
    _check(f_multi(x, y), ref)
    _check(jax.jit(f_multi)(x, y), ref)


#
# Free-text labels: primes, numbers, unchecked `~X`.
#


def _kernel(x1, s1, t1, x2, s2, t2):
    # x, s: (3,), t: () -> ()
    return (x1 * x2).sum() + (s1 * s2).sum() * t1 - t2


@pytest.mark.parametrize("scan_dims", [None, {"D'"}, {"T", "A'"}])
def test_primed_labels(scan_dims):
    # DSA2000-Cal's ionosphere kernel: the same dims twice, told apart by primes.
    d, t, a, d2, t2, a2 = 2, 3, 2, 3, 1, 2
    args = [
        _rand((d, t, a, 3), 0),
        _rand((d, t, a, 3), 1),
        _rand((d, t, a), 2),
        _rand((d2, t2, a2, 3), 3),
        _rand((d2, t2, a2, 3), 4),
        _rand((d2, t2, a2), 5),
    ]
    f_multi = multi_vmap(
        _kernel,
        in_mapping="[D,T,A,3],[D,T,A,3],[D,T,A],[D',T',A',3],[D',T',A',3],[D',T',A']",
        out_mapping="[D,T,A,D',T',A']",
        scan_dims=scan_dims,
    )
    out = f_multi(*map(jnp.asarray, args))
    ref = loop_reference(
        _kernel,
        args,
        ["D T A 3", "D T A 3", "D T A", "D' T' A' 3", "D' T' A' 3", "D' T' A'"],
        ["D", "T", "A", "D'", "T'", "A'"],
        "D T A D' T' A'",
    )
    _check(out, ref)
    assert out.shape == (d, t, a, d2, t2, a2)


def _vis(uvw, freq):
    # uvw: (B, 3), freq: () -> (B,)
    return uvw.sum(-1) * freq


@pytest.mark.parametrize("n_xyz", [3, 4])
def test_number_labels_are_unchecked(n_xyz):
    # DSA2000-Cal's visibility pattern: `3` only labels an axis (of any size here),
    # `~B` is an unmapped axis of the output.
    uvw, freq = _rand((2, 5, n_xyz), 0), _rand((4,), 1)
    f_multi = multi_vmap(
        _vis, in_mapping="[T,B,3],[C]", out_mapping="[T,~B,C]", scan_dims={"C"}
    )
    out = f_multi(jnp.asarray(uvw), jnp.asarray(freq))
    ref = loop_reference(_vis, [uvw, freq], ["T B _", "C"], ["T", "C"], "T B C")
    _check(out, ref)
    assert out.shape == (2, 5, 4)


def test_unmapped_named_labels_are_checked():
    # Stricter than DSA2000-Cal: a name that is not mapped still has one size.
    f_multi = multi_vmap(lambda x, y: x @ y, "[T,K],[T,K]", "[T]")
    x = jnp.asarray(_rand((2, 3), 0))
    _check(f_multi(x, x), loop_reference(np.dot, [x, x], ["T K", "T K"], "T", "T"))
    with pytest.raises(ShapeError, match=r"inconsistent sizes for dim 'K'"):
        f_multi(x, jnp.ones((2, 4)))


def test_no_mapped_dims_calls_f():
    # DSA2000-Cal's wgridder pattern: only `~` labels in `out_mapping`.
    f_multi = multi_vmap(lambda image: image.sum(0), "[Nl,Nm]", "[~B]")
    image = jnp.asarray(_rand((3, 4), 0))
    _check(f_multi(image), image.sum(0))


def test_outputs_counted_as_dsa():
    x = jnp.asarray(_rand((3,), 0))
    one = multi_vmap(lambda a: (2 * a,), "[T]", "[T]")  # a 1-tuple is unpacked
    _check(one(x), 2 * x)
    pair = collections.namedtuple("pair", "a b")
    nt = multi_vmap(lambda a: pair(a, -a), "[T]", "[T]")  # a namedtuple is one
    _check(nt(x), pair(x, -x))


#
# `auto=True`, calls by keyword, `None`, methods.
#


@pytest.mark.parametrize("auto_kwargs", [None, {"memory_budget": 2**16}])
def test_auto(auto_kwargs):
    x, y = _rand((8, 6, 4), 0), _rand((6,), 1)
    f_multi = multi_vmap(
        lambda a, b: jnp.tanh(a) * b,
        "[T,F],[F]",
        "[F,T]",
        auto=True,
        auto_kwargs=auto_kwargs,
    )
    out = f_multi(jnp.asarray(x), jnp.asarray(y))
    ref = loop_reference(
        lambda a, b: np.tanh(a) * b, [x, y], ["T F _", "F"], ["F", "T"], "F T _"
    )
    _check(out, ref)


def test_keyword_calls():
    x, y = _rand((3, 4, 2, 2), 0), _rand((3, 4, 2, 2), 1)
    f_multi = multi_vmap(_add, "[n1,n2],[n1,n2,2,2]", "[...,n1,n2]")
    ref = loop_reference(
        _add, [x, y], ["n1 n2 _ _", "n1 n2 _ _"], ["n1", "n2"], "_ _ n1 n2"
    )
    xj, yj = jnp.asarray(x), jnp.asarray(y)
    for out in (
        f_multi(xj, yj),
        f_multi(x=xj, y=yj),
        f_multi(y=yj, x=xj),
        f_multi(xj, y=yj),
    ):
        _check(out, ref)


def test_keyword_none_passes_through():
    y = _rand((3, 4), 0)
    f_multi = multi_vmap(_add, "[n1],[n1,n2]", "[n1,n2]")
    _check(f_multi(x=None, y=jnp.asarray(y)), jnp.asarray(y))


def test_method():
    class Scale:
        def __init__(self, w):
            self.w = w

        @ft.partial(multi_vmap, in_mapping="[],[T]", out_mapping="[T]")
        def __call__(self, x):
            return self.w * x

    x = jnp.asarray(_rand((5,), 0))
    _check(Scale(2.0)(x), 2.0 * x)


#
# Errors.
#


def _f2(x, y):
    return x + y


def _star(*args):
    return args[0] + args[1]


SPEC_ERRORS = [
    # (in_mapping, out_mapping, multi_vmap kwargs, regex fragments)
    ("T,F", "[T]", {}, [r"in_mapping='T,F'", r"bracketed groups", r"\[T,F,B\]"]),
    ("[T-1],[T]", "[T]", {}, [r"'T-1' is not a dim label", r"\"D'\""]),
    ("[T],[T]", "[T,3]", {}, [r"the number '3' would be a mapped dim", r"'~3'"]),
    (
        "[T],[T]",
        "[T,~X,~X]",
        {},
        [r"'~X' appears twice", r"must be unique in output dims"],
    ),
    ("[T,...,...],[T]", "[T]", {}, [r"'\.\.\.' more than once", r"must be unique"]),
    (
        "[T],[F]",
        "[T,F],[T]",
        {},
        [r"output \[T\] must contain all mapped dims \['T', 'F'\]", r"lacks \['F'\]"],
    ),
    ("[T],[T]", "[T,K]", {}, [r"mapped dim 'K' must be in some input dims", r"'~K'"]),
    (
        "[T],[T]",
        "[T]",
        {"scan_dims": {"F"}},
        [r"scan_dims=\.\.\.\)` names \['F'\]", r"mapped dims are \['T'\]"],
    ),
    (
        "[T],[T]",
        "[T]",
        {"auto": True, "scan_dims": {"T"}},
        [r"auto=True, scan_dims=\{'T'\}", r"planner chooses which dims to scan"],
    ),
    (
        "[T],[T]",
        "[T]",
        {"auto": True, "auto_kwargs": {"max_scan_dims": 2}},
        [
            r"'max_scan_dims' has no counterpart",
            r"The one key allowed is 'memory_budget'",
        ],
    ),
    (
        "[T],[T]",
        "[T]",
        {"auto": True, "auto_kwargs": {"budget": 2}},
        [r"'budget' is not an option", r"'memory_budget'"],
    ),
    (
        "[T],[T]",
        "[T]",
        {"auto_kwargs": {"memory_budget": 2**20}},
        [r"only used with\s+`auto=True`"],
    ),
    ("[T],[T],[T]", "[T]", {}, [r"`multi_vmap\(_f2\)`", r"has 3 groups", r"takes 2"]),
]


@pytest.mark.parametrize("in_mapping, out_mapping, kwargs, matches", SPEC_ERRORS)
def test_spec_errors(in_mapping, out_mapping, kwargs, matches):
    for match in matches:
        with pytest.raises(SpecError, match=match):
            multi_vmap(_f2, in_mapping, out_mapping, **kwargs)


T3 = jnp.arange(3.0)

CALL_ERRORS = [
    # (function, in_mapping, out_mapping, call args, call kwargs, error, fragments)
    (
        _f2,
        "[n1],[n2]",
        "[n1,n2]",
        (None, jnp.ones((3, 4))),
        {},
        SpecError,
        [r"size of mapped dim 'n1' is unknown", r"`x` is None", r"passes through"],
    ),
    (
        _f2,
        "[],[T]",
        "[T]",
        (T3,),
        {},
        SpecError,
        [
            r"mapped dim 'T' is unknown",
            r"group of `y` names it, and `y` was not passed",
        ],
    ),
    (
        _f2,
        "[T],[T]",
        "[T]",
        (T3, T3, T3),
        {},
        SpecError,
        [r"called with 3 positional arguments", r"parameters \('x', 'y'\)"],
    ),
    (
        _f2,
        "[T],[T]",
        "[T]",
        (T3,),
        {"y": T3, "z": T3},
        SpecError,
        [r"called with `z`", r"`\[\]` for one that is not mapped"],
    ),
    (
        _f2,
        "[T],[T]",
        "[T]",
        (T3,),
        {"x": T3},
        TypeError,
        [r"multiple values for argument `x`"],
    ),
    (
        _star,
        "[T],[T]",
        "[T]",
        (),
        {"x": T3},
        SpecError,
        [r"`multi_vmap\(_star\)`", r"by position only", r"\('x',\)"],
    ),
    (
        _star,
        "[T],[T]",
        "[T]",
        (T3,),
        {},
        SpecError,
        [r"called with 1 positional argument,", r"has 2 groups, one per argument"],
    ),
    (
        lambda x: (x, x),
        "[T]",
        "[T]",
        (T3,),
        {},
        SpecError,
        [r"returned a tuple of 2", r"number of outputs must match output mapping"],
    ),
    (
        lambda x: x,
        "[T]",
        "[T],[T]",
        (T3,),
        {},
        SpecError,
        [r"returned one output \(not a tuple\)", r"has 2 groups"],
    ),
    (
        _f2,
        "[T],[T]",
        "[T]",
        (T3, 2.0),
        {},
        ShapeError,
        [r"argument `y` is the Python `float` 2\.0", r"rank 0, but dims 'T \.\.\.'"],
    ),
]


@pytest.mark.parametrize(
    "fun, in_mapping, out_mapping, args, kwargs, error, matches", CALL_ERRORS
)
def test_call_errors(fun, in_mapping, out_mapping, args, kwargs, error, matches):
    f_multi = multi_vmap(fun, in_mapping, out_mapping)
    for match in matches:
        with pytest.raises(error, match=match):
            f_multi(*args, **kwargs)
