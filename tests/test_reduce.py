"""`reduce=`: reductions over mapped dims, computed inside the nest.

Values against an independent loop reference (`loop_reference`, then numpy's
reduction over the reduced axes) for every op and strategy; dtypes as `jnp.sum`,
`jnp.mean`, `jnp.max` and `jnp.min` give them; compiled temporaries of a reduced
scan O(1) in the dim's size; gradients against autodiff of the hand-written nest;
the planner; and the errors, before the body is traced.
"""

import inspect
import re

import hypothesis.strategies as st
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
import pytest
from eqx_multimap import (
    explain,
    filter_multi_vmap,
    Monoid,
    Planner,
    ShapeError,
    SpecError,
)
from hypothesis import given, settings
from jaxtyping import Array, Float

from .helpers import loop_reference


def _rand(shape, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal(shape).astype(dtype))


_NP = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}
_JNP = {"sum": jnp.sum, "mean": jnp.mean, "max": jnp.max, "min": jnp.min}
OPS = list(_NP)
STRATEGIES = {
    "vmap": {},
    "scan": {"scan": "T"},
    "chunk": {"scan": {"T": 3}},  # T=7: 2 chunks of 3 and a remainder of 1
    "chunk exact": {"scan": {"T": 7}},
    "scan outer": {"scan": "T F"},
    "scan inner": {"scan": "F T"},
    "chunk inner": {"scan": {"F": None, "T": 2}},
}


def _reference(body, args, in_dims, out_mapped, reduced, out_dims, op):
    """The loop reference over every mapped dim (reduced ones first), then numpy's
    reduction over the reduced axes."""
    mapped = tuple(reduced) + tuple(out_mapped)
    full = " ".join(reduced) + " " + out_dims
    stacked = np.asarray(loop_reference(body, args, in_dims, mapped, full))
    return _NP[op](stacked, axis=tuple(range(len(reduced))))


def _body(x, nu):
    return jnp.sin(x) * nu + jnp.cos(x * nu)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("op", OPS)
def test_values_every_op_and_strategy(op, strategy):
    x, nu = _rand((7, 3, 4, 2), seed=1), _rand((3,), seed=2)
    f = filter_multi_vmap(
        _body,
        in_dims=("T F B 2", "F"),
        out_dims="B F 2",
        reduce={"T": op},
        **STRATEGIES[strategy],
    )
    out = f(x, nu)
    ref = _reference(_body, (x, nu), ("T F B 2", "F"), ("F", "B"), "T", "B F 2", op)
    assert out.shape == (4, 3, 2) and out.dtype == jnp.float32
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kw",
    [{}, {"scan": "T"}, {"scan": {"T": 2}}, {"scan": {"F": 2}, "vmap": "T"}],
    ids=["vmap", "scan T", "chunk T", "chunk F"],
)
@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_several_dims_at_once(op, kw):
    # T and F reduced, B kept; with a mix of sum and mean too.
    x = _rand((5, 3, 4), seed=3)
    body = lambda a: jnp.tanh(a) + 1.0  # noqa: E731
    f = filter_multi_vmap(body, in_dims="T F B", out_dims="B", reduce={"T F": op}, **kw)
    ref = _reference(body, (x,), ("T F B",), ("B",), ("T", "F"), "B", op)
    np.testing.assert_allclose(f(x), ref, rtol=1e-5, atol=1e-5)
    if op != "max":
        mixed = filter_multi_vmap(
            body, in_dims="T F B", out_dims="B", reduce={"T": "sum", "F": "mean"}, **kw
        )
        want = _NP["mean"](_NP["sum"](np.tanh(np.asarray(x)) + 1.0, axis=0), axis=0)
        np.testing.assert_allclose(mixed(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw", [{}, {"scan": "T"}, {"scan": {"T": 2}}])
def test_every_mapped_dim_reduced(kw):
    # The output is one element: dims "".
    x = _rand((5, 3), seed=4)
    f = filter_multi_vmap(
        jnp.exp, in_dims="T B", out_dims="", reduce={"T B": "sum"}, **kw
    )
    out = f(x)
    assert out.shape == ()
    np.testing.assert_allclose(out, np.exp(np.asarray(x, np.float64)).sum(), rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "dtype, op",
    [
        (jnp.int32, "sum"),
        (jnp.int8, "sum"),
        (jnp.uint8, "sum"),
        (jnp.bool_, "sum"),
        (jnp.int32, "mean"),
        (jnp.int32, "max"),
        (jnp.int8, "min"),
        (jnp.bool_, "max"),
        (jnp.float16, "sum"),
        (jnp.float16, "mean"),
    ],
)
@pytest.mark.parametrize("kw", [{}, {"scan": "T"}, {"scan": {"T": 3}}])
def test_dtypes_as_jnp(dtype, op, kw):
    rng = np.random.default_rng(5)
    if dtype == jnp.bool_:
        x = jnp.asarray(rng.integers(0, 2, (7, 4)).astype(bool))
    elif jnp.issubdtype(dtype, jnp.integer):
        x = jnp.asarray(rng.integers(0, 20, (7, 4)).astype(dtype))
    else:
        x = jnp.asarray(rng.uniform(0, 1, (7, 4)).astype(dtype))
    f = filter_multi_vmap(
        lambda a: a, in_dims="T B", out_dims="B", reduce={"T": op}, **kw
    )
    out = f(x)
    assert out.dtype == _JNP[op](x, axis=0).dtype, (out.dtype, dtype, op)
    tol = 1e-2 if dtype == jnp.float16 else 1e-6
    np.testing.assert_allclose(
        np.asarray(out, np.float64),
        _NP[op](np.asarray(x).astype(np.float64), axis=0),
        rtol=tol,
    )


#
# Monoids.
#

_MATMUL = Monoid(jnp.matmul, jnp.eye(2, dtype=jnp.float32))


@pytest.mark.parametrize(
    "kw", [{}, {"scan": "T"}, {"scan": {"T": 2}}, {"scan": {"T": 3}}, {"scan": "B T"}]
)
def test_monoid_keeps_the_order(kw):
    # A product of 2x2 matrices is associative but not commutative.
    xs = _rand((7, 3, 2, 2), seed=6)
    f = filter_multi_vmap(
        lambda a: a, in_dims="T B 2 2", out_dims="B 2 2", reduce={"T": _MATMUL}, **kw
    )
    x = np.asarray(xs, np.float64)
    ref = np.stack([np.linalg.multi_dot(list(x[:, b])) for b in range(3)])
    np.testing.assert_allclose(f(xs), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kw", [{}, {"scan": "T"}, {"scan": {"T": 3}}])
def test_monoid_logsumexp_and_empty_dim(kw):
    lse = Monoid(jnp.logaddexp, -jnp.inf)
    x = _rand((7, 4), seed=7)
    f = filter_multi_vmap(jnp.sin, in_dims="T B", out_dims="B", reduce={"T": lse}, **kw)
    ref = np.log(np.sum(np.exp(np.sin(np.asarray(x, np.float64))), axis=0))
    np.testing.assert_allclose(f(x), ref, rtol=1e-5)
    # Over no elements: the identity.
    np.testing.assert_array_equal(f(x[:0]), np.full((4,), -np.inf, np.float32))


def test_sum_over_an_empty_dim_is_zero():
    x = _rand((0, 4), seed=8)
    for kw in ({}, {"scan": "T"}, {"scan": {"T": 3}}):
        f = filter_multi_vmap(
            jnp.cos, in_dims="T B", out_dims="B", reduce={"T": "sum"}, **kw
        )
        np.testing.assert_array_equal(f(x), np.zeros((4,), np.float32))


@pytest.mark.parametrize("op", ["mean", "max", "min"])
def test_mean_max_min_over_an_empty_dim_raise(op):
    x = _rand((0, 4), seed=8)
    f = filter_multi_vmap(_never_called, in_dims="T B", out_dims="B", reduce={"T": op})
    for match in [
        rf"`reduce=\{{'T': '{op}'\}}` over dim 'T' of size 0",
        re.escape("`args[0]` axis 0 (float32[0,4]"),
        "'sum', or a `Monoid`",
    ]:
        with pytest.raises(ShapeError, match=match):
            f(x)


#
# Where the reduction happens: memory, structure.
#


def _temp(fn, *args) -> int:
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def _softmax_body(x, y, v):
    # x: (K,), y: (M,), v: (M,): a (K, M) intermediate that XLA materialises.
    return jax.nn.softmax(jnp.outer(x, y), axis=1) @ v


_SOFTMAX_DIMS = dict(in_dims=("T K", "T M", "M"), core="K")


def _softmax_args(t, structs=True, k=16):
    shapes = [(t, k), (t, k), (k,)]
    if structs:
        return [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    return [_rand(s, seed=20 + i) * 0.3 for i, s in enumerate(shapes)]


@pytest.mark.parametrize("scan", ["T", {"T": 16}])
def test_reduced_scan_temporaries_are_constant_in_T(scan):
    reduced = filter_multi_vmap(
        _softmax_body, out_dims="K", reduce={"T": "sum"}, scan=scan, **_SOFTMAX_DIMS
    )
    stacked = filter_multi_vmap(_softmax_body, out_dims="T K", **_SOFTMAX_DIMS)
    temps, materialised = {}, {}
    for t in (256, 4096):
        temps[t] = _temp(reduced, *_softmax_args(t))
        materialised[t] = _temp(lambda *a: stacked(*a).sum(0), *_softmax_args(t))
    assert temps[4096] <= 2 * temps[256]
    # The check can fail: materialise-then-sum grows with T.
    assert materialised[4096] > 8 * materialised[256] > 0
    assert temps[4096] < materialised[4096] / 8


def _primitives(jaxpr) -> list:
    out = []
    for eqn in jaxpr.eqns:
        out.append(eqn)
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
                    out.extend(_primitives(getattr(sub, "jaxpr", sub)))
    return out


def test_reduced_scan_has_a_carry_and_no_stacked_output():
    x = _rand((9, 4), seed=9)
    f = filter_multi_vmap(
        jnp.sin, in_dims="T B", out_dims="B", reduce={"T": "sum"}, scan="T"
    )
    scans = [
        e for e in _primitives(jax.make_jaxpr(f)(x).jaxpr) if e.primitive is lax.scan_p
    ]
    assert len(scans) == 1
    (scan,) = scans
    assert scan.params["length"] == 9
    # One carry (the sum, of shape (B,)) and no stacked output.
    assert scan.params["num_carry"] == 1 and len(scan.outvars) == 1
    assert scan.outvars[0].aval.shape == (4,)


#
# Gradients: against autodiff of the hand-written nest.
#


def _hand(op, strategy, k=3):
    """Hand-written: `lax.scan` with a carry, or vmap then a reduction."""
    inner = jax.vmap(jax.vmap(_tanh_body))  # over F, B
    combine = {"sum": jnp.add, "mean": jnp.add, "max": jnp.maximum, "min": jnp.minimum}
    init = {"sum": 0.0, "mean": 0.0, "max": -jnp.inf, "min": jnp.inf}

    def scanned(xs):
        def step(c, x):
            return combine[op](c, inner(x)), None

        c, _ = lax.scan(step, jnp.full(xs.shape[1:], init[op], xs.dtype), xs)
        return c

    def chunked(xs):
        n, rest = divmod(xs.shape[0], k)
        main = xs[: n * k].reshape(n, k, *xs.shape[1:])

        def step(c, x):
            return combine[op](
                c, _JNP["sum" if op == "mean" else op](jax.vmap(inner)(x), 0)
            ), None

        c, _ = lax.scan(step, jnp.full(xs.shape[1:], init[op], xs.dtype), main)
        tail = _JNP["sum" if op == "mean" else op](jax.vmap(inner)(xs[n * k :]), 0)
        return combine[op](c, tail)

    def vmapped(xs):
        return _JNP["sum" if op == "mean" else op](jax.vmap(inner)(xs), 0)

    fn = {"scan": scanned, "chunk": chunked, "vmap": vmapped}[strategy]
    if op == "mean":
        return lambda xs: fn(xs) / xs.shape[0]
    return fn


def _tanh_body(a):
    return jnp.tanh(a) * a


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["vmap", "scan", "chunk", "planned"])
@pytest.mark.parametrize("op", OPS)
def test_gradients_match_the_hand_nest(op, strategy):
    xs = _rand((7, 3, 4), seed=10)
    kw = {
        "vmap": {},
        "scan": {"scan": "T"},
        "chunk": {"scan": {"T": 3}},
        # The planner's derivative nest (scans, checkpointed) under a tight budget.
        "planned": {"plan": Planner(), "memory_budget": 600},
    }[strategy]
    ours = filter_multi_vmap(
        _tanh_body, in_dims="T F B", out_dims="F B", reduce={"T": op}, **kw
    )
    hand = _hand(op, "scan" if strategy == "planned" else strategy)
    loss = lambda f: lambda x: jnp.sum(jnp.sin(f(x)))  # noqa: E731
    np.testing.assert_allclose(ours(xs), hand(xs), rtol=1e-5, atol=1e-6)
    got = jax.jit(jax.grad(loss(ours)))(xs)
    want = jax.grad(loss(hand))(xs)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    tangent = _rand(xs.shape, seed=11)
    got = jax.jvp(ours, (xs,), (tangent,))[1]
    want = jax.jvp(hand, (xs,), (tangent,))[1]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_gradient_of_a_monoid_against_a_loop():
    lse = Monoid(jnp.logaddexp, -jnp.inf)
    xs = _rand((6, 4), seed=12)
    want = jax.grad(lambda x: jnp.sum(jax.nn.logsumexp(jnp.sin(x), axis=0)))(xs)
    for kw in ({}, {"scan": "T"}, {"scan": {"T": 4}}):
        f = filter_multi_vmap(
            jnp.sin, in_dims="T B", out_dims="B", reduce={"T": lse}, **kw
        )
        got = jax.grad(lambda x: jnp.sum(f(x)))(xs)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


#
# The planner.
#


@pytest.mark.slow
def test_planner_accounts_for_the_reduced_output():
    # A (K, M) intermediate per element, over T = 2048: fully vmapped it needs
    # (T, K, M) at once (2 MiB); with a budget of a quarter of that, the planner
    # scans T (the reduced dim), whose carry is one element's output.
    args = _softmax_args(2048, structs=False)
    budget = 2048 * 16 * 16 * 4 // 4
    f = filter_multi_vmap(
        _softmax_body,
        out_dims="K",
        reduce={"T": "sum"},
        plan=Planner(),
        memory_budget=budget,
        **_SOFTMAX_DIMS,
    )
    plan = explain(f, *args)
    assert "T" in plan.scan
    assert plan.chosen.temp_bytes is not None and plan.chosen.temp_bytes <= budget
    assert _temp(f, *args) <= budget
    # Its candidates are real nests with the reduction: materialising does not fit.
    stacked = filter_multi_vmap(_softmax_body, out_dims="T K", **_SOFTMAX_DIMS)
    assert budget < _temp(lambda *a: stacked(*a).sum(0), *args)
    ref = jax.vmap(_softmax_body, in_axes=(0, 0, None))(*args).sum(0)
    np.testing.assert_allclose(f(*args), ref, rtol=1e-4, atol=1e-5)


#
# Annotations and the repr.
#


def test_with_annotations():
    def body(x: Float[Array, "T B"], nu: Float[Array, "B"]) -> Float[Array, "B"]:  # noqa: F821
        return jnp.sin(x) * nu

    x, nu = _rand((6, 4), seed=15), _rand((4,), seed=16)
    f = filter_multi_vmap(body, reduce={"T": "mean"}, scan="T")
    ref = _reference(body, (x, nu), ("T B", "B"), ("B",), ("T",), "B", "mean")
    np.testing.assert_allclose(f(x, nu), ref, rtol=1e-5, atol=1e-6)
    assert "reduce={'T': 'mean'}" in repr(f)


def test_verbose_names_the_reduction(capsys):
    f = filter_multi_vmap(
        jnp.sin,
        in_dims="T B",
        out_dims="B",
        reduce={"T": "max"},
        scan="T",
        verbose=True,
    )
    f(_rand((3, 2)))
    assert capsys.readouterr().out.strip() == (
        "filter_multi_vmap(sin): scan(T=3) -> vmap(B=2) -> body; reduce={'T': 'max'}"
    )


#
# Errors, before the body is traced.
#


def _never_called(*args, **kwargs):
    raise AssertionError("the body was traced although the spec is invalid")


def _raises_each(error, matches, thunk):
    for match in matches:
        with pytest.raises(error, match=match):
            thunk()


# Under the suite's jaxtyping/beartype hook, values of the wrong *type* are caught by
# the annotations first; call the function itself, as users without the hook do.
_unchecked = inspect.unwrap(filter_multi_vmap)


@pytest.mark.parametrize(
    "reduce, matches",
    [
        (
            {"T": "prod"},
            [
                re.escape("`filter_multi_vmap(..., reduce={'T': 'prod'})`"),
                "unknown op 'prod' for dim 'T'",
                re.escape("'sum', 'mean', 'max', 'min', or an `eqx_multimap.Monoid"),
            ],
        ),
        (
            {"T": (jnp.add, 0.0)},
            ["the op for dim 'T' must be", re.escape("Monoid(op, identity)")],
        ),
        ({"T": 3}, ["the op for dim 'T' must be", "of type `int`"]),
        ("T", [r"reduce=\.\.\.\)` must be a dict from dim name to op", "'T'"]),
        ({"T T": "sum"}, ["names dim 'T' twice"]),
        ({"T": "sum", "F T": "sum"}, ["names dim 'T' twice"]),
        ({"T,F": "sum"}, ["separate dim names with spaces"]),
        ({"_T": "sum"}, ["'_T', which is not a dim name"]),
        (
            {"T": "sum", "F": "max"},
            [
                r"reduces dim 'T' with 'sum' and dim 'F'\s+with 'max'",
                "same op",
                "'sum' and 'mean' may mix",
            ],
        ),
    ],
)
def test_bad_reduce_at_decoration(reduce, matches):
    _raises_each(
        SpecError,
        matches,
        lambda: _unchecked(_never_called, in_dims="T F B", out_dims="B", reduce=reduce),
    )


def test_bad_monoid():
    _raises_each(
        SpecError, ["`op` must be a function of two arrays"], lambda: Monoid(3, 0.0)
    )
    _raises_each(
        SpecError,
        ["`identity` must be a number or an array"],
        lambda: Monoid(jnp.add, "zero"),
    )


def test_reduced_dim_in_the_output():
    x = _rand((3, 4))
    # With `out_dims`: at decoration.
    _raises_each(
        SpecError,
        [
            r"filter_multi_vmap\(_never_called\)",
            r"`reduce` names dim 'T',\s+which `out_dims` also names",
            "the output has no 'T' axis",
        ],
        lambda: filter_multi_vmap(
            _never_called, in_dims="T B", out_dims="T B", reduce={"T": "sum"}
        ),
    )

    # With a return annotation: at call time, before the body is traced.
    def annotated(x: Float[Array, "T B"]) -> Float[Array, "T B"]:
        raise AssertionError("traced")

    f = filter_multi_vmap(annotated, reduce={"T": "sum"})
    _raises_each(
        SpecError,
        ["`reduce` names dim 'T', which the return annotation also names"],
        lambda: f(x),
    )
    # `core` dims are output dims too.
    _raises_each(
        SpecError,
        [r"`reduce` names dim 'B',\s+which `out_dims` also names"],
        lambda: filter_multi_vmap(
            _never_called, in_dims="T B", out_dims="T B", core="B", reduce={"B": "sum"}
        ),
    )


def test_reduced_dim_not_an_input_dim():
    f = filter_multi_vmap(
        _never_called, in_dims="T B", out_dims="B", reduce={"Q": "sum"}
    )
    _raises_each(
        SpecError,
        [
            r"filter_multi_vmap\(_never_called\)",
            r"`reduce` names dim 'Q',\s+which no array argument's dims name",
            "The named dims of the arguments are: T, B",
        ],
        lambda: f(_rand((3, 4))),
    )


@pytest.mark.parametrize(
    "op, match",
    [
        (
            Monoid(lambda a, b: jnp.stack([a, b]), 0.0),
            re.escape("(one element's output 0, float32[]), but returned float32[2]"),
        ),
        (
            Monoid(lambda a, b: (a + b).astype(jnp.int32), 0.0),
            re.escape("returned int32[]"),
        ),
        (Monoid(jnp.add, jnp.zeros(3)), re.escape("identity of shape [3] does not")),
    ],
)
def test_monoid_of_the_wrong_shape(op, match):
    calls = []

    def body(x):
        calls.append(1)
        return x

    f = filter_multi_vmap(body, in_dims="T B", out_dims="B", reduce={"T": op}, scan="T")
    for m in [r"filter_multi_vmap\(.*body\)", "`reduce` over dim 'T'", match]:
        with pytest.raises(SpecError, match=m):
            f(_rand((5, 4)))
    assert calls  # checked on the body's traced output, before any nest


def test_strategy_may_name_a_reduced_dim_but_not_an_unmapped_one():
    x = _rand((5, 4))
    f = filter_multi_vmap(
        jnp.sin, in_dims="T B", out_dims="B", reduce={"T": "sum"}, vmap="T"
    )
    np.testing.assert_allclose(f(x), np.sin(np.asarray(x)).sum(0), rtol=1e-5)
    _raises_each(
        SpecError,
        ["`scan` names dim 'Q', which is not mapped", "and the reduced 'T'"],
        lambda: filter_multi_vmap(
            jnp.sin, in_dims="T B", out_dims="B", reduce={"T": "sum"}, scan="Q"
        ),
    )


#
# A property: random signatures, random reductions, random strategies.
#

_MAPPED = ("T", "F", "B")


@st.composite
def _reduce_specs(draw):
    n_mapped = draw(st.integers(1, 3))
    mapped = tuple(draw(st.permutations(_MAPPED))[:n_mapped])
    sizes = {n: draw(st.integers(1, 5)) for n in mapped}
    reduced = tuple(
        draw(
            st.lists(
                st.sampled_from(mapped), min_size=1, max_size=n_mapped, unique=True
            )
        )
    )
    op = draw(st.sampled_from(["sum", "mean", "max", "min", "sum mean"]))
    ops = {n: (op.split()[i % 2] if " " in op else op) for i, n in enumerate(reduced)}
    n_args = draw(st.integers(1, 2))
    has = [
        draw(st.lists(st.sampled_from(mapped), unique=True, max_size=n_mapped))
        for _ in range(n_args)
    ]
    for name in mapped:
        if not any(name in h for h in has):
            has[draw(st.integers(0, n_args - 1))].append(name)
    seed = draw(st.integers(0, 2**16))
    args, in_dims = [], []
    for i, h in enumerate(has):
        tokens = list(draw(st.permutations(h))) + (["c"] if draw(st.booleans()) else [])
        shape = tuple(sizes.get(t, 2) for t in tokens)
        args.append(_rand(shape, seed=seed + i))
        in_dims.append(" ".join(tokens))
    kept = [n for n in mapped if n not in reduced]
    out = " ".join(draw(st.permutations(kept)))
    return mapped, sizes, reduced, ops, args, tuple(in_dims), out


def _prop_body(*xs):
    return sum((jnp.sum(jnp.sin(x)) for x in xs), start=jnp.float32(0.5))


def _assignments(mapped, sizes):
    out = [("all vmap", {})]
    for name in mapped:
        out.append((f"scan {name}", {"scan": name}))
        chunk = max(1, sizes[name] - 1)  # a remainder whenever the size is > 1
        out.append((f"chunk {name}", {"scan": {name: chunk}}))
    out.append(("scan all", {"scan": " ".join(mapped)}))
    return out


@pytest.mark.slow
@settings(max_examples=10, deadline=None)
@given(spec=_reduce_specs())
def test_random_reductions_and_strategies(spec):
    mapped, sizes, reduced, ops, args, in_dims, out_dims = spec
    kept = [n for n in mapped if n not in reduced]
    stacked = np.asarray(
        loop_reference(
            _prop_body,
            args,
            in_dims,
            tuple(reduced) + tuple(kept),
            " ".join(reduced) + " " + out_dims,
        ),
        np.float64,
    )
    ref = stacked
    for name in reduced:  # the reduced axes lead, in the order of `reduced`
        ref = _NP[ops[name]](ref, axis=0)
    for name, kw in _assignments(mapped, sizes):
        f = filter_multi_vmap(
            _prop_body, in_dims=in_dims, out_dims=out_dims, reduce=ops, **kw
        )
        out = f(*args)
        assert out.shape == ref.shape, name
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5, err_msg=name)


def _heavy(a):
    # Reads the scanned row through two index maps: its slices are isolated on CPU.
    return jnp.tanh(jnp.outer(a, a)) @ a


@pytest.mark.slow
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU isolation")
@pytest.mark.parametrize("kw", [{"scan": "T"}, {"scan": {"T": 4}, "checkpoint": True}])
def test_reduced_scan_with_isolated_slices(kw):
    xs = _rand((9, 3, 8), seed=30) * 0.5
    f = filter_multi_vmap(
        _heavy, in_dims="T B K", out_dims="B K", core="K", reduce={"T": "sum"}, **kw
    )
    hand = lambda x: jax.vmap(jax.vmap(_heavy))(x).sum(0)  # noqa: E731
    assert "conditional" in jax.jit(f).lower(xs).compile().as_text()
    np.testing.assert_allclose(f(xs), hand(xs), rtol=1e-5, atol=1e-5)
    loss = lambda f: lambda x: jnp.sum(jnp.sin(f(x)))  # noqa: E731
    got, want = jax.grad(loss(f))(xs), jax.grad(loss(hand))(xs)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
