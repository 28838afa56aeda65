"""Every reading of the body's jaxpr is total: collectives detection, slice isolation,
the rebinding that hoists closures (and rewrites collectives under `shard`), and the
planner's fingerprint handle any jaxpr JAX produces (`Literal`s in and out of nested
jaxprs, `DropVar`s, the jaxprs of calls, control flow and custom rules, primitives
they do not know) without raising, and keep their answers where they are known."""

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.extend.core
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
import pytest
from eqx_multimap import filter_multi_vmap
from eqx_multimap._jaxpr import _reads, collectives, inputs_to_isolate, rebind
from hypothesis import example, given, HealthCheck, note, settings
from jax._src.interpreters import partial_eval as pe
from jax.sharding import AxisType

from .test_ecosystem import CASES


SPEC = jax.ShapeDtypeStruct((3,), jnp.float32)
AXIS_ENV = [("F", 2)]


def _with_dropvars(closed):
    """`closed` with every unused output of its equations a `DropVar` (as JAX's
    transformations may leave them; `make_jaxpr` itself names them `_`)."""
    jaxpr = closed.jaxpr
    core = jax.extend.core
    used = {v for e in jaxpr.eqns for v in e.invars if isinstance(v, core.Var)}
    used |= {v for v in jaxpr.outvars if isinstance(v, core.Var)}
    eqns = [
        e.replace(outvars=[v if v in used else core.DropVar(v.aval) for v in e.outvars])
        for e in jaxpr.eqns
    ]
    return core.ClosedJaxpr(jaxpr.replace(eqns=eqns), closed.consts)


def _jaxprs_of(fun, specs, axis_env=()):
    """The jaxpr of `fun`, with `DropVar`s, dead-code-eliminated, and the jaxpr of
    its linearization."""
    closed = jax.make_jaxpr(fun, axis_env=list(axis_env))(*specs)
    dced, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
    out = [
        closed,
        _with_dropvars(closed),
        jax.extend.core.ClosedJaxpr(dced, closed.consts),
    ]

    def linearized(*xs):
        where = [i for i, x in enumerate(xs) if jnp.issubdtype(x.dtype, jnp.inexact)]

        def of_floats(*floats):
            ys = list(xs)
            for i, y in zip(where, floats):
                ys[i] = y
            return fun(*ys)

        floats = [xs[i] for i in where]
        return jax.linearize(of_floats, *floats)[1](*floats)

    lin = jax.make_jaxpr(linearized, axis_env=list(axis_env))(*specs)
    out.append(lin)
    return out


def _walk(closed, axis_env=()):
    """Every analysis of ours on `closed`: none may raise."""
    jaxpr = closed.jaxpr
    found = collectives(jaxpr)
    for v in jaxpr.invars:  # the analysis itself, without `inputs_to_isolate`'s guard
        _reads(jaxpr, {v: frozenset({()})})
    isolated = inputs_to_isolate(closed)
    rebound = jax.make_jaxpr(
        lambda *xs: rebind(jaxpr, closed.consts, list(xs)), axis_env=list(axis_env)
    )(*[jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in jaxpr.invars])
    assert [v.aval.shape for v in rebound.jaxpr.outvars] == [
        v.aval.shape for v in jaxpr.outvars
    ]
    assert str(jaxpr)  # the planner's fingerprint prints it
    return found, isolated


#
# Known answers.
#


def _isolated(fun, *specs):
    closed = jax.make_jaxpr(fun)(*specs)
    return inputs_to_isolate(closed)


def outer(x):
    return jnp.sum(x[:, None] * x[None, :], axis=0)


def _custom_jvp(f):
    g = jax.custom_jvp(f)
    g.defjvp(lambda p, t: jax.jvp(f, p, t))
    return g


def _custom_vjp(f):
    g = jax.custom_vjp(f)
    g.defvjp(lambda x: jax.vjp(f, x), lambda vjp, ct: vjp(ct))
    return g


WRAPS = {
    "plain": lambda f: f,
    "jit": jax.jit,
    "jit-jit": lambda f: jax.jit(jax.jit(f)),
    "checkpoint": jax.checkpoint,
    "custom_jvp": _custom_jvp,
    "custom_vjp": _custom_vjp,
    "jit-literal-out": lambda f: lambda x: jax.jit(lambda v: (f(v), 1.0))(x)[0],
}


@pytest.mark.parametrize("wrap", sorted(WRAPS))
def test_outer_isolated_through_calls(wrap):
    # `outer(x, x)` reads x through two index maps in one fusion, through any call.
    assert _isolated(WRAPS[wrap](outer), SPEC) == frozenset({0})
    assert _isolated(WRAPS[wrap](lambda x: 2.0 * x + 1.0), SPEC) == frozenset()


def test_literal_output_of_a_call_is_not_a_read():
    # A nested jaxpr's output can be a `Literal` (unhashable): before the fix, the
    # walk crashed here, as on every optimistix and diffrax body.
    def body(x):
        y, one = jax.jit(lambda v: (v * 2.0, 1.0))(x)
        return outer(y) * one

    assert _isolated(body, SPEC) == frozenset({0})


def test_scan_outputs_do_not_read_the_input():
    # A scan's outputs are new buffers (stacked), not reads of its inputs: `outer`
    # of them reads no slice of `x` twice. (Followed as a call, they did.)
    def body(x):
        ys = lax.scan(lambda c, xi: (c, xi * 2.0), 0.0, x)[1]
        return outer(ys)

    assert _isolated(body, SPEC) == frozenset()


def test_loop_and_branch_outputs_do_not_read_the_input():
    def looped(x):
        step = lambda s: (s[0] + 1, s[1] * 2.0)
        y = lax.while_loop(lambda s: s[0] < 2, step, (0, x))[1]
        return outer(y)

    def branched(x):
        return outer(lax.cond(x[0] > 0, lambda v: v * 2.0, lambda v: -v, x))

    assert _isolated(looped, SPEC) == frozenset()
    assert _isolated(branched, SPEC) == frozenset()


def test_dropvars_are_walked():
    # The call's second output is not used: a `DropVar`. Its first is `x` read
    # through one index map, then two.
    def body(x):
        a, _ = jax.jit(lambda v: (v * 2.0, v * 3.0))(x)
        return outer(a)

    closed = _with_dropvars(jax.make_jaxpr(body)(SPEC))
    outs = [v for e in closed.jaxpr.eqns for v in e.outvars]
    assert any(isinstance(v, jax.extend.core.DropVar) for v in outs)
    jax.extend.core.check_jaxpr(closed.jaxpr)
    assert _walk(closed) == ([], frozenset({0}))


def _psum_inside(kind):
    def body(x):
        f = lambda v: lax.psum(v, "F")
        if kind == "cond":
            return lax.cond(x[0] > 0, f, lambda v: v, x)
        if kind == "switch":
            return lax.switch(0, [lambda v: v, f], x)
        if kind == "while":
            return lax.while_loop(
                lambda s: s[0] < 2, lambda s: (s[0] + 1, f(s[1])), (0, x)
            )[1]
        if kind == "scan":
            return lax.scan(lambda c, _: (f(c), 1.0), x, None, length=2)[0]
        if kind == "checkpoint":
            return jax.checkpoint(f)(x)
        if kind == "custom_jvp":
            return _custom_jvp(f)(x)
        return jax.jit(f)(x)

    return body


@pytest.mark.parametrize(
    "kind", ["cond", "switch", "while", "scan", "checkpoint", "custom_jvp", "jit"]
)
def test_collective_inside_control_flow_is_found(kind):
    closed = jax.make_jaxpr(_psum_inside(kind), axis_env=AXIS_ENV)(SPEC)
    assert ("psum", ("F",)) in collectives(closed.jaxpr)


@pytest.mark.parametrize("kind", ["cond", "while", "scan"])
def test_collective_inside_control_flow_blocks_a_scan(kind):
    f = filter_multi_vmap(_psum_inside(kind), in_dims="F 3", out_dims="F 3", scan="F")
    with pytest.raises(Exception, match="uses the collective `psum` over dim 'F'"):
        f(jnp.ones((2, 3)))


_my_collective = jax.extend.core.Primitive("my_collective")
_my_collective.def_abstract_eval(lambda x, **_: x)


def test_unknown_primitive_naming_axes_counts_as_a_collective():
    # Conservative: a primitive we do not know that names a dim in an axis-name
    # parameter is taken for a collective over it.
    def body(x):
        return _my_collective.bind(x, axis_names=("F", 0), shift=1)

    closed = jax.make_jaxpr(body)(SPEC)
    assert collectives(closed.jaxpr) == [("my_collective", ("F",))]
    assert _isolated(body, SPEC) == frozenset()


def test_collective_inside_closed_call_under_shard():
    # `closed_call` keeps its jaxpr under `call_jaxpr`: rewritten for the mesh by
    # inlining, as `jit`.
    inner = jax.make_jaxpr(lambda v: lax.psum(v, "F"), axis_env=AXIS_ENV)(SPEC)

    def body(x):
        call = jax.extend.core.primitives.closed_call_p
        return call.bind(x, **call.get_bind_params({"call_jaxpr": inner}))[0]

    mesh = jax.make_mesh(
        (2,), ("d",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2]
    )
    x = jnp.arange(12.0, dtype=jnp.float32).reshape(4, 3)
    f = filter_multi_vmap(
        body, in_dims="F 3", out_dims="F 3", shard={"F": "d"}, mesh=mesh
    )
    np.testing.assert_allclose(np.asarray(f(x)), np.broadcast_to(x.sum(0), (4, 3)))


#
# Ecosystem bodies and random ones: no walk raises.
#


@pytest.mark.parametrize("name", sorted(CASES))
def test_walks_of_ecosystem_bodies(name):
    case = CASES[name]
    args = case.args()
    element = []
    for a, dims in zip(args, case.in_dims):
        n = 0 if dims is None else sum(t in ("T", "F") for t in dims.split())
        element.append(jax.tree.map(lambda x: x[(0,) * n] if eqx.is_array(x) else x, a))
    leaves, treedef = jax.tree.flatten(element)
    arrays = [i for i, x in enumerate(leaves) if eqx.is_array(x)]

    def fun(*xs):
        values = list(leaves)
        for i, x in zip(arrays, xs):
            values[i] = x
        return case.body(*jax.tree.unflatten(treedef, values))

    specs = [jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype) for i in arrays]
    for closed in _jaxprs_of(fun, specs):
        found, _ = _walk(closed)
        assert found == []


def _programs():
    leaf = st.sampled_from([("sin",), ("outer",), ("psum",), ("const",)])
    wrappers = ["jit", "checkpoint", "custom_jvp", "custom_vjp", "while", "scan"]

    def extend(children):
        return st.one_of(
            st.tuples(st.sampled_from(wrappers), children),
            st.tuples(st.sampled_from(["cond", "seq"]), children, children),
        )

    return st.recursive(leaf, extend, max_leaves=6)


def _build(program):
    """A body `f32[3] -> f32[3]` from `program`; nested parts also return a constant
    (a `Literal` output of their jaxpr) and an unused value (a `DropVar` once dead
    code is eliminated)."""
    kind, *parts = program
    subs = [_build(p) for p in parts]
    if kind == "sin":
        return jnp.sin
    if kind == "outer":
        # Bounded: repeated, `outer` overflows, and inf - inf is nan or -inf by the
        # order of summation, which strategies need not share.
        return lambda x: jnp.tanh(outer(x))
    if kind == "psum":
        return lambda x: lax.psum(x, "F")
    if kind == "const":
        return lambda x: jnp.ones_like(x)
    if kind == "seq":
        return lambda x: subs[1](subs[0](x))
    a = subs[0]
    three = lambda v: (a(v), 1.0, v * 3.0)  # value, constant, unused
    if kind == "jit":
        return lambda x: jax.jit(three)(x)[0]
    if kind == "checkpoint":
        return lambda x: jax.checkpoint(three)(x)[0]
    if kind == "custom_jvp":
        return lambda x: _custom_jvp(three)(x)[0]
    if kind == "custom_vjp":
        return lambda x: _custom_vjp(three)(x)[0]
    if kind == "while":
        return lambda x: lax.while_loop(
            lambda s: s[0] < 2, lambda s: (s[0] + 1, a(s[1]), 0.5), (0, x, 0.5)
        )[1]
    if kind == "scan":
        return lambda x: lax.scan(lambda c, _: (a(c), (1.0, c)), x, None, length=2)[0]
    assert kind == "cond"
    b = subs[1]
    return lambda x: lax.cond(
        x[0] > 0, lambda v: (a(v), 1.0, v), lambda v: (b(v), 2.0, v), x
    )[0]


def _has(program, kind):
    return program[0] == kind or any(
        _has(p, kind) for p in program[1:] if isinstance(p, tuple)
    )


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=_programs())
def test_walks_of_random_bodies(program):
    note(repr(program))
    body = _build(program)
    for i, closed in enumerate(_jaxprs_of(body, [SPEC], AXIS_ENV)):
        found, isolated = _walk(closed, AXIS_ENV)
        if i == 0:  # the body's own jaxpr
            assert (("psum", ("F",)) in found) == _has(program, "psum")
            assert isolated <= {0}


def _rewritable(program):
    """Whether every `psum` of `program` can be rewritten to span a mesh: reached
    through calls that are inlined (`jit`), not inside control flow or custom rules."""
    kind, *parts = program
    if kind in ("jit", "seq"):
        return all(_rewritable(p) for p in parts)
    return kind == "psum" or not _has(program, "psum")


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(program=_programs())
@example(program=("while", ("seq", ("while", ("outer",)), ("while", ("outer",)))))
def test_random_bodies_mapped(program):
    # Mapped over F (4) by every strategy, against `jax.vmap` with the axis named.
    note(repr(program))
    body = _build(program)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)), dtype=jnp.float32)
    want = jax.vmap(body, axis_name="F")(x)
    mesh = jax.make_mesh(
        (2,), ("d",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2]
    )
    psum = _has(program, "psum")
    for options in [{}, {"scan": "F"}, {"shard": {"F": "d"}, "mesh": mesh}]:
        f = filter_multi_vmap(body, in_dims="F 3", out_dims="F 3", **options)
        if psum and "scan" in options:
            with pytest.raises(Exception, match="uses the collective `psum`"):
                f(x)
        elif psum and "shard" in options and not _rewritable(program):
            with pytest.raises(Exception, match="cannot be rewritten to span the mesh"):
                f(x)
        else:
            np.testing.assert_allclose(
                np.asarray(f(x)), np.asarray(want), rtol=1e-5, atol=1e-5
            )
