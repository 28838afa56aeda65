import collections as co
import dataclasses

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.extend as jex
import jax.lax as lax
import jax.numpy as jnp
import jax.test_util as jtu_test
import numpy as np
import pytest
from eqx_multimap import filter_multi_vmap, SpecError
from eqx_multimap._blocks import describe_nest, NestSpec
from hypothesis import given, settings

from .helpers import load_benchmark, loop_reference, tree_allclose


harness = load_benchmark("harness")  # the benchmarks' timing harness


def _rand(shape, seed=0, dtype=np.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(dtype))


def _primitives(jaxpr) -> list[str]:
    """Names of every primitive in a (closed) jaxpr, sub-jaxprs included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    names = []
    for eqn in jaxpr.eqns:
        names.append(eqn.primitive.name)
        for param in eqn.params.values():
            subs = param if isinstance(param, (tuple, list)) else (param,)
            for sub in subs:
                if isinstance(sub, (jex.core.Jaxpr, jex.core.ClosedJaxpr)):
                    names.extend(_primitives(sub))
    return names


def _assert_same(out, ref, rtol=1e-5, atol=1e-6):
    assert jax.tree.structure(out) == jax.tree.structure(ref)
    for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        assert o.shape == r.shape
        assert o.dtype == r.dtype
    assert tree_allclose(out, ref, rtol=rtol, atol=atol)


#
# Equivalence with the loop reference: parametrized cases.
#


def _body(x, nu):
    return jnp.sin(x) * nu + 1.0


@pytest.mark.parametrize(
    "scan, vmap",
    [
        (None, "T F"),
        (None, "F T"),
        ("T", "F"),
        ("F", "T"),
        ("T F", None),
        ("F T", None),
        ({"T": 2}, "F"),
        ({"T": 3}, "F"),
        ({"T": 8}, "F"),
        ({"T": 1, "F": 2}, None),
        ({"F": 2, "T": None}, None),
    ],
)
@pytest.mark.parametrize("out_dims", ["T F B 2", "B T 2 F"])
def test_equivalence_cases(scan, vmap, out_dims):
    x = _rand((5, 3, 4, 2), seed=1)
    nu = _rand((3,), seed=2)
    w = filter_multi_vmap(
        _body, in_dims=("T F B 2", "F"), out_dims=out_dims, scan=scan, vmap=vmap
    )
    ref = loop_reference(_body, (x, nu), ("T F B 2", "F"), ("T", "F"), out_dims)
    _assert_same(w(x, nu), ref)


@pytest.mark.parametrize("size", [0, 1, 2, 3])
@pytest.mark.parametrize("scan", [None, "T", {"T": 2}])
def test_sizes_zero_and_small(size, scan):
    x = _rand((size, 3), seed=3)
    w = filter_multi_vmap(
        lambda a: jnp.cos(a) * 2.0,
        in_dims="T B",
        out_dims="B T",
        scan=scan,
        vmap="B" if scan else "T B",
    )
    ref = loop_reference(lambda a: jnp.cos(a) * 2.0, (x,), ("T B",), ("T", "B"), "B T")
    _assert_same(w(x), ref)
    assert w(x).shape == (3, size)


def test_default_strategy_vmaps_out_dims_names():
    # No `vmap`/`scan`: every named dim of `out_dims` is vmapped, so the body sees
    # scalars.
    shapes = []

    def f(x, y):
        shapes.append((x.shape, y.shape))
        return x * y

    x = _rand((2, 3), seed=4)
    y = _rand((3,), seed=5)
    out = filter_multi_vmap(f, in_dims=("T F", "F"), out_dims="F T")(x, y)
    assert shapes[-1] == ((), ())
    ref = loop_reference(lambda a, b: a * b, (x, y), ("T F", "F"), ("T", "F"), "F T")
    _assert_same(out, ref)


def test_out_dims_are_needed_without_a_return_annotation():
    x = _rand((2, 3, 4), seed=6)
    y = _rand((4, 2), seed=7)

    def f(a, b):
        return a + b[0]

    w = filter_multi_vmap(f, in_dims=("F T _", "_ F"), scan="T")
    with pytest.raises(
        SpecError, match=r"has no\s+`out_dims`\s+and no\s+return\s+annotation"
    ):
        w(x, y)
    w = filter_multi_vmap(f, in_dims=("F T _", "_ F"), out_dims="F T ...", scan="T")
    ref = loop_reference(f, (x, y), ("F T _", "_ F"), ("F", "T"), "F T ...")
    _assert_same(w(x, y), ref)


def test_ellipsis_and_core_dims():
    x = _rand((2, 5, 6, 3, 4), seed=8)  # T ... F c
    m = _rand((4, 4), seed=9)  # c c
    f = lambda a, mm: a @ mm
    w = filter_multi_vmap(
        f,
        in_dims=("T ... F c", "c c"),
        out_dims="F ... c T",
        core="c",
        scan={"T": 1},
        vmap="F",
    )
    ref = loop_reference(f, (x, m), ("T ... F c", "c c"), ("T", "F"), "F ... c T")
    _assert_same(w(x, m), ref, rtol=1e-4, atol=1e-5)


#
# Equivalence with the loop reference: random signatures.
#

_MAPPED = ("T", "F", "B")
_CORE = ("c", "d", "2", "1", "_", "...")


@dataclasses.dataclass
class Signature:
    mapped: tuple[str, ...]
    args: list
    in_dims: tuple
    out_dims: tuple
    core: tuple
    scan: object
    vmap: object
    sizes: dict


@st.composite
def signatures(draw):
    n_mapped = draw(st.integers(1, 3))
    mapped = tuple(draw(st.permutations(_MAPPED))[:n_mapped])
    sizes = {n: draw(st.sampled_from([0, 1, 2, 3])) for n in mapped}
    sizes["c"] = draw(st.integers(1, 3))
    sizes["d"] = draw(st.integers(0, 2))
    n_args = draw(st.integers(1, 3))
    has = [
        draw(st.lists(st.sampled_from(mapped), unique=True, max_size=n_mapped))
        for _ in range(n_args)
    ]
    for name in mapped:
        if not any(name in h for h in has):
            has[draw(st.integers(0, n_args - 1))].append(name)
    seed = draw(st.integers(0, 2**16))
    args, in_dims, out_dims = [], [], []
    for i in range(n_args):
        core = draw(st.lists(st.sampled_from(_CORE), max_size=3))
        if core.count("...") > 1:
            core = [t for t in core if t != "..."] + ["..."]
        tokens = list(draw(st.permutations(list(has[i]) + core)))
        shape = []
        for tok in tokens:
            if tok in sizes:
                shape.append(sizes[tok])
            elif tok == "...":
                shape.extend(draw(st.lists(st.integers(0, 2), max_size=2)))
            elif tok == "_":
                shape.append(draw(st.integers(1, 3)))
            else:
                shape.append(int(tok))
        args.append(_rand(tuple(shape), seed=seed + i))
        unmapped = not has[i] and draw(st.booleans())
        in_dims.append(None if unmapped else " ".join(tokens))
        # The body returns one output per argument, with that argument's core axes;
        # put every mapped dim anywhere among them.
        out = [t for t in tokens if t not in mapped]
        for name in draw(st.permutations(mapped)):
            out.insert(draw(st.integers(0, len(out))), name)
        out_dims.append(" ".join(out))
    order = draw(st.permutations(mapped))
    n_scan = draw(st.integers(0, n_mapped))
    scanned, vmapped = order[:n_scan], order[n_scan:]
    chunks = {n: draw(st.one_of(st.none(), st.integers(1, 4))) for n in scanned}
    if any(c is not None for c in chunks.values()):
        scan = chunks
    else:
        scan = draw(st.sampled_from([" ".join(scanned), tuple(scanned), chunks]))
        if not scanned:
            scan = None
    vmap = (
        None
        if not vmapped
        else draw(st.sampled_from([" ".join(vmapped), tuple(vmapped)]))
    )
    # Named core dims that the outputs keep are declared `core`; a mapped dim that
    # no strategy names is vmapped, so `vmap` may leave some out.
    core = tuple(n for n in ("c", "d") if any(n in o.split() for o in out_dims))
    if vmapped and draw(st.booleans()):
        vmap = draw(st.sampled_from([None, " ".join(vmapped[: len(vmapped) // 2])]))
    return Signature(
        mapped, args, tuple(in_dims), tuple(out_dims), core, scan, vmap, sizes
    )


def _mixing_body(*xs):
    total = sum((jnp.sum(jnp.cos(x)) for x in xs), start=jnp.float32(0))
    return tuple(jnp.sin(x) + 0.5 * total for x in xs)


def _flipping_body(*xs):
    # Reads each input through two index maps: sliced apart from the kernels on CPU.
    total = sum((jnp.sum(jnp.cos(x)) for x in xs), start=jnp.float32(0))
    return tuple(jnp.sin(x * jnp.flip(x)) + 0.5 * total for x in xs)


_BODIES = st.sampled_from([_mixing_body, _flipping_body])


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(sig=signatures(), use_jit=st.booleans(), body=_BODIES)
def test_equivalence_random_signatures(sig, use_jit, body):
    w = filter_multi_vmap(
        body,
        in_dims=sig.in_dims,
        out_dims=sig.out_dims,
        core=sig.core,
        scan=sig.scan,
        vmap=sig.vmap,
    )
    out = jax.jit(w)(*sig.args) if use_jit else w(*sig.args)
    ref = loop_reference(body, sig.args, sig.in_dims, sig.mapped, sig.out_dims)
    _assert_same(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@settings(max_examples=10, deadline=None)
@given(sig=signatures(), checkpoint=st.booleans(), body=_BODIES)
def test_grad_random_signatures(sig, checkpoint, body):
    w = filter_multi_vmap(
        body,
        in_dims=sig.in_dims,
        out_dims=sig.out_dims,
        core=sig.core,
        scan=sig.scan,
        vmap=sig.vmap,
        checkpoint=checkpoint,
    )

    def ref(*args):
        return loop_reference(body, args, sig.in_dims, sig.mapped, sig.out_dims, xp=jnp)

    def loss(fn):
        def _loss(*args):
            outs = fn(*args)
            return sum(
                (jnp.sum(jnp.cos(o) * (i + 1.0)) for i, o in enumerate(outs)),
                start=jnp.float32(0),
            )

        return _loss

    argnums = tuple(range(len(sig.args)))
    g = jax.jit(jax.grad(loss(w), argnums=argnums))(*sig.args)
    g_ref = jax.grad(loss(ref), argnums=argnums)(*sig.args)
    _assert_same(g, g_ref, rtol=1e-4, atol=1e-4)


#
# Lowering: scan is a loop; vmap is not.
#


def test_scan_lowers_to_loop():
    x = _rand((4, 3, 2), seed=10)
    f = lambda a: jnp.sin(a)
    scanned = filter_multi_vmap(f, in_dims="T F B", out_dims="T F B", scan="T F")
    assert _primitives(jax.make_jaxpr(scanned)(x)).count("scan") == 2
    one = filter_multi_vmap(f, in_dims="T F B", out_dims="T F B", scan="T", vmap="F B")
    assert _primitives(jax.make_jaxpr(one)(x)).count("scan") == 1
    chunked = filter_multi_vmap(
        f, in_dims="T F B", out_dims="T F B", scan={"T": 2}, vmap="F"
    )
    assert _primitives(jax.make_jaxpr(chunked)(x)).count("scan") == 1
    vmapped = filter_multi_vmap(f, in_dims="T F B", out_dims="T F B", vmap="T F B")
    assert "scan" not in _primitives(jax.make_jaxpr(vmapped)(x))
    for w in (scanned, one, chunked, vmapped):
        _assert_same(w(x), jnp.sin(x))


def _optimised_hlo(fn, *args) -> str:
    return harness.normalised_hlo(harness.compiled(fn, *args))


def _heavy(a):
    # Reads `a` through two index maps in one fusion: its slices are isolated on CPU.
    return jnp.tanh(a[:, None] * a[None, :]) @ a


def _hand_heavy(xs):
    # `_heavy` over `T B K`: the hand-written `lax.scan` over T of a vmap over B.
    return lax.scan(lambda c, x: (c, jax.vmap(_heavy)(x)), None, xs)[1]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU-only workaround")
def test_scanned_slices_isolated_where_it_pays():
    # On CPU a body that does more than elementwise work gets each scanned leaf
    # sliced inside a conditional (`_nest.take`), so that XLA does not fuse the
    # slice into the body's kernels, where it stops LLVM from vectorising them. An
    # elementwise body is the hand-written `lax.scan`, HLO for HLO.
    x = _rand((5, 3, 8), seed=12)
    w = filter_multi_vmap(
        _heavy, in_dims="T B K", out_dims="T B K", core="K", scan="T", vmap="B"
    )
    assert "conditional(" in _optimised_hlo(w, x)
    _assert_same(w(x), _hand_heavy(x), rtol=1e-5, atol=1e-6)
    cheap = lambda a: jnp.sin(a * a + 1.0)
    w = filter_multi_vmap(cheap, in_dims="T B K", out_dims="T B K", scan="T")
    hand = lambda xs: lax.scan(
        lambda c, x: (c, jax.vmap(jax.vmap(cheap))(x)), None, xs
    )[1]
    assert _optimised_hlo(w, x) == _optimised_hlo(hand, x)
    _assert_same(w(x), hand(x))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU-only workaround")
def test_isolated_loop_of_one_trip_is_the_hand_written_program():
    # XLA inlines a loop of one trip, and the conditional on its index with it:
    # index 0 takes the branch that forwards the slices bare, so the program is
    # `lax.map`'s, HLO for HLO (the barrier's branch reordered the kernels).
    x = _rand((4, 5, 8), seed=14)
    w = filter_multi_vmap(
        _heavy,
        in_dims="T B K",
        out_dims="T B K",
        core="K",
        scan={"T": 4},
        vmap="B",
    )
    hand = lambda xs: lax.map(jax.vmap(_heavy), xs, batch_size=4)  # noqa: E731
    assert _optimised_hlo(w, x) == _optimised_hlo(hand, x)
    _assert_same(w(x), hand(x), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU-only workaround")
@pytest.mark.parametrize(
    "scan, isolated",
    [
        ({"T": None, "B": 5}, 1),  # one whole chunk: a loop of one trip, inlined
        ({"T": None, "B": 4}, 1),  # one whole chunk and a remainder
        ({"T": 2, "B": 4}, 1),
        ({"T": None, "B": 2}, 2),  # two chunks (isolated there too), a remainder
        ({"T": None, "B": None}, 1),  # B loops: its slices are the kernels' only
    ],
)
def test_slices_isolated_where_the_kernels_read_them(scan, isolated):
    # The kernels of a chunk that XLA inlines, or of a remainder, read the slices
    # of the scan outside: those are isolated too (else, with B = 3 in chunks of 2,
    # 4x slower on CPU).
    x = _rand((4, 5, 8), seed=13)
    w = filter_multi_vmap(
        _heavy, in_dims="T B K", out_dims="T B K", core="K", scan=scan
    )
    assert _optimised_hlo(w, x).count("conditional(") == isolated
    _assert_same(w(x), _hand_heavy(x), rtol=1e-5, atol=1e-6)
    grad = jax.grad(lambda x: jnp.sum(jnp.sin(w(x))))(x)
    ref = jax.grad(lambda x: jnp.sum(jnp.sin(_hand_heavy(x))))(x)
    _assert_same(grad, ref, rtol=1e-4)


def test_scan_is_outermost_in_declared_order():
    x = _rand((4, 3, 2), seed=11)
    w = filter_multi_vmap(
        lambda a: a * 2.0, in_dims="T F B", out_dims="T F B", scan="F T", vmap="B"
    )
    jaxpr = jax.make_jaxpr(w)(x)
    outer = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert len(outer) == 1
    assert outer[0].params["length"] == 3  # F first
    inner = [
        e for e in outer[0].params["jaxpr"].jaxpr.eqns if e.primitive.name == "scan"
    ]
    assert len(inner) == 1
    assert inner[0].params["length"] == 4
    _assert_same(w(x), x * 2.0)


@pytest.mark.slow
def test_chunked_remainder_finite_under_debug_nans():
    x = jnp.asarray(np.linspace(1.0, 2.0, 5 * 3, dtype=np.float32).reshape(5, 3))
    # log(x - 0.5) would be NaN on zero padding.
    f = lambda a: jnp.log(a - 0.5)
    old = jax.config.jax_debug_nans
    jax.config.update("jax_debug_nans", True)
    try:
        for chunk in (2, 3, 4, 7):
            w = filter_multi_vmap(f, in_dims="T B", out_dims="T B", scan={"T": chunk})
            out = w(x)
            out_jit = jax.jit(w)(x)
            assert bool(jnp.all(jnp.isfinite(out)))
            ref = loop_reference(f, (x,), ("T B",), ("T",), "T B")
            _assert_same(out, ref)
            _assert_same(out_jit, ref)
    finally:
        jax.config.update("jax_debug_nans", old)


def test_chunked_remainder_never_sees_padding():
    seen = []

    def f(a):
        seen.append(a.shape)
        return a + 1.0

    x = _rand((7, 2), seed=12)
    w = filter_multi_vmap(f, in_dims="T B", out_dims="B T", scan={"T": 3}, vmap="B")
    out = w(x)
    _assert_same(out, (x + 1.0).T)
    # Every trace of the body sees one element; the nest never pads.
    assert all(s == () for s in seen)


#
# Dtypes and PRNG keys.
#


@pytest.mark.slow
@pytest.mark.parametrize(
    "dtype, fn",
    [
        (jnp.bfloat16, lambda a, b: a * b + a),
        (jnp.float16, lambda a, b: a * b + a),
        (jnp.complex64, lambda a, b: a * jnp.conj(b)),
        (jnp.int32, lambda a, b: a * b + a),
        (jnp.bool_, lambda a, b: a & ~b),
    ],
)
@pytest.mark.parametrize("scan", [None, "T", {"T": 2}])
def test_dtypes_preserved(dtype, fn, scan):
    rng = np.random.default_rng(13)
    if dtype == jnp.bool_:
        x = jnp.asarray(rng.integers(0, 2, (5, 3)).astype(bool))
        y = jnp.asarray(rng.integers(0, 2, (3,)).astype(bool))
    elif dtype == jnp.int32:
        x = jnp.asarray(rng.integers(-5, 5, (5, 3)), dtype=jnp.int32)
        y = jnp.asarray(rng.integers(-5, 5, (3,)), dtype=jnp.int32)
    elif dtype == jnp.complex64:
        x = jnp.asarray(
            (rng.standard_normal((5, 3)) + 1j * rng.standard_normal((5, 3))).astype(
                np.complex64
            )
        )
        y = jnp.asarray(
            (rng.standard_normal(3) + 1j * rng.standard_normal(3)).astype(np.complex64)
        )
    else:
        x = jnp.asarray(rng.standard_normal((5, 3)), dtype=dtype)
        y = jnp.asarray(rng.standard_normal((3,)), dtype=dtype)
    w = filter_multi_vmap(
        fn, in_dims=("T F", "F"), out_dims="F T", scan=scan, vmap="F" if scan else "T F"
    )
    out = w(x, y)
    assert out.dtype == dtype
    ref = loop_reference(fn, (x, y), ("T F", "F"), ("T", "F"), "F T")
    _assert_same(out, ref, rtol=1e-2, atol=1e-2)


@pytest.mark.slow
@pytest.mark.parametrize("scan", [None, "T", {"T": 2}, {"T": 4}])
def test_prng_keys(scan):
    keys = jax.random.split(jax.random.key(0), (5, 3))
    mu = _rand((3,), seed=14)

    def f(key, m):
        return jax.random.normal(key, (2,)) + m

    w = filter_multi_vmap(
        f,
        in_dims=("T B", "B"),
        out_dims="B T 2",
        scan=scan,
        vmap="B" if scan else "T B",
    )
    out = w(keys, mu)
    ref = jax.vmap(jax.vmap(f, in_axes=(0, 0)), in_axes=(0, None))(keys, mu)
    _assert_same(out, jnp.transpose(ref, (1, 0, 2)))


def test_prng_keys_output():
    keys = jax.random.split(jax.random.key(1), (4, 3))
    w = filter_multi_vmap(
        lambda k: jax.random.fold_in(k, 7),
        in_dims="T B",
        out_dims="B T",
        scan={"T": 3},
        vmap="B",
    )
    out = w(keys)
    ref = jax.vmap(jax.vmap(lambda k: jax.random.fold_in(k, 7)))(keys).T
    assert out.shape == ref.shape
    assert out.dtype == ref.dtype
    assert bool(jnp.all(jax.random.key_data(out) == jax.random.key_data(ref)))


#
# Autodiff.
#


def _grad_body(x, w):
    return jnp.sin(x * w) * jnp.cos(x)


def _grad_inputs():
    return _rand((5, 3), seed=15), _rand((3,), seed=16)


@pytest.mark.slow
@pytest.mark.parametrize(
    "scan, checkpoint, order", [("T", False, 2), ({"T": 2}, False, 1), ("T", True, 1)]
)
def test_check_grads(scan, checkpoint, order):
    x, w = _grad_inputs()
    f = filter_multi_vmap(
        _grad_body,
        in_dims=("T F", "F"),
        out_dims="F T",
        scan=scan,
        vmap="F",
        checkpoint=checkpoint,
    )
    jtu_test.check_grads(f, (x, w), order=order, modes=("fwd", "rev"), eps=1e-2)


@pytest.mark.slow
@pytest.mark.parametrize("scan", ["T", {"T": 2}, {"T": 3}])
@pytest.mark.parametrize("checkpoint", [False, True])
def test_grad_matches_hand_written_nest(scan, checkpoint):
    x, w = _grad_inputs()
    f = filter_multi_vmap(
        _grad_body,
        in_dims=("T F", "F"),
        out_dims="F T",
        scan=scan,
        vmap="F",
        checkpoint=checkpoint,
    )

    def hand(x, w):
        def body(carry, xt):
            return carry, jax.vmap(_grad_body)(xt, w)

        _, ys = lax.scan(body, None, x)
        return ys.T

    loss = lambda fn: lambda x, w: jnp.sum(fn(x, w) ** 2)
    _assert_same(f(x, w), hand(x, w))
    g = jax.grad(loss(f), argnums=(0, 1))(x, w)
    g_ref = jax.grad(loss(hand), argnums=(0, 1))(x, w)
    _assert_same(g, g_ref, rtol=1e-5, atol=1e-6)


_REMAT = {"checkpoint", "remat", "remat2"}  # the primitive's name varies by version


def test_checkpoint_is_applied():
    x, w = _grad_inputs()
    f = filter_multi_vmap(
        _grad_body,
        in_dims=("T F", "F"),
        out_dims="F T",
        scan="T",
        vmap="F",
        checkpoint=True,
    )
    assert _REMAT & set(_primitives(jax.make_jaxpr(f)(x, w)))
    g = filter_multi_vmap(
        _grad_body, in_dims=("T F", "F"), out_dims="F T", scan="T", vmap="F"
    )
    assert not _REMAT & set(_primitives(jax.make_jaxpr(g)(x, w)))


#
# Composition with other transforms.
#


def _composition_wrapper():
    return filter_multi_vmap(
        _grad_body, in_dims=("T F", "F"), out_dims="F T", scan={"T": 2}, vmap="F"
    )


def _composition_ref(x, w):
    return loop_reference(_grad_body, (x, w), ("T F", "F"), ("T", "F"), "F T")


def test_jit_and_filter_jit():
    x, w = _grad_inputs()
    f = _composition_wrapper()
    ref = _composition_ref(x, w)
    _assert_same(jax.jit(f)(x, w), ref)
    _assert_same(eqx.filter_jit(f)(x, w), ref)
    _assert_same(jax.jit(lambda a, b: f(a, b))(x, w), ref)


def test_wrapper_hashable_and_jittable_directly():
    f = _composition_wrapper()
    assert hash(f) == hash(f)
    assert isinstance(hash(_composition_wrapper()), int)
    x, w = _grad_inputs()
    jitted = jax.jit(f)
    _assert_same(jitted(x, w), _composition_ref(x, w))
    # A static argument: the wrapper itself is hashable.
    out = jax.jit(lambda fn, a, b: fn(a, b), static_argnums=0)(f, x, w)
    _assert_same(out, _composition_ref(x, w))


def test_grad_composition():
    x, w = _grad_inputs()
    f = _composition_wrapper()
    g = jax.grad(lambda a, b: jnp.sum(f(a, b)), argnums=1)(x, w)
    ref_loss = lambda a, b: jnp.sum(jnp.sin(a * b[None]) * jnp.cos(a))
    g_ref = jax.grad(ref_loss, argnums=1)(x, w)
    _assert_same(g, g_ref)
    g_jit = jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b)), argnums=1))(x, w)
    _assert_same(g_jit, g_ref)


def test_outer_vmap():
    xs = _rand((4, 5, 3), seed=17)
    w = _rand((3,), seed=18)
    f = _composition_wrapper()
    out = jax.vmap(f, in_axes=(0, None))(xs, w)
    ref = jnp.stack([_composition_ref(xs[i], w) for i in range(4)])
    _assert_same(out, ref)
    out2 = jax.vmap(f, in_axes=(2, None), out_axes=1)(jnp.moveaxis(xs, 0, 2), w)
    _assert_same(out2, jnp.moveaxis(ref, 0, 1))


#
# API forms.
#


def test_decorator_with_arguments():
    @filter_multi_vmap(in_dims=("T F", "F"), out_dims="F T", scan="T", vmap="F")
    def f(x, w):
        return _grad_body(x, w)

    x, w = _grad_inputs()
    _assert_same(f(x, w), _composition_ref(x, w))
    assert f.__wrapped__.__name__ == "f"
    assert f.__name__ == "f"


def test_decorator_without_arguments():
    @filter_multi_vmap
    def f(x):
        return x

    assert f.__wrapped__.__name__ == "f"
    # With no dims at all there is nothing to map; the error says how to fix it.
    with pytest.raises(
        SpecError, match=r"no\s+`out_dims`\s+and no\s+return\s+annotation"
    ):
        f(jnp.ones(3))


def test_method_of_module():
    class Model(eqx.Module):
        gain: jax.Array
        name: str = eqx.field(static=True)

        @filter_multi_vmap(in_dims={"x": "T F"}, out_dims="F T", scan="T", vmap="F")
        def apply(self, x):
            assert self.gain.shape == (3,)
            return x * self.gain[0] + self.gain[1]

        @filter_multi_vmap(
            in_dims={"self": "F", "x": "T F"},
            out_dims="F T",
            scan="T",
            vmap="F",
        )
        def apply_mapped(self, x):
            assert self.gain.shape == ()
            assert self.name == "m"
            return x * self.gain

    gain = _rand((3,), seed=19)
    x = _rand((4, 3), seed=20)
    m = Model(gain, "m")
    _assert_same(m.apply(x), (x * gain[0] + gain[1]).T)
    _assert_same(m.apply_mapped(x), (x * gain[None]).T)
    _assert_same(jax.jit(lambda mm, xx: mm.apply_mapped(xx))(m, x), (x * gain[None]).T)
    _assert_same(eqx.filter_jit(Model.apply_mapped)(m, x), (x * gain[None]).T)


def test_kwargs_and_keyword_only():
    def f(x, *, scale, **extra):
        return x * scale + extra["nu"]

    w = filter_multi_vmap(
        f,
        in_dims={"x": "T F", "scale": "F", "nu": "T"},
        out_dims="T F",
        scan="T",
        vmap="F",
    )
    x = _rand((4, 3), seed=21)
    scale = _rand((3,), seed=22)
    nu = _rand((4,), seed=23)
    out = w(x, scale=scale, nu=nu)
    ref = loop_reference(
        lambda a, s, n: a * s + n,
        (x, scale, nu),
        ("T F", "F", "T"),
        ("T", "F"),
        "T F",
    )
    _assert_same(out, ref)
    # `**extra` given by its own name, as a dict prefix.
    w2 = filter_multi_vmap(
        f,
        in_dims={"x": "T F", "scale": "F", "extra": {"nu": "T"}},
        out_dims="T F",
        scan="T",
        vmap="F",
    )
    _assert_same(w2(x, scale=scale, nu=nu), ref)


def test_dict_and_tuple_in_dims():
    def f(a, b, c):
        return a * b + c

    a = _rand((4, 3), seed=24)
    b = _rand((3,), seed=25)
    c = _rand((4,), seed=26)
    ref = loop_reference(f, (a, b, c), ("T F", "F", "T"), ("T", "F"), "F T")
    tup = filter_multi_vmap(
        f, in_dims=("T F", "F", "T"), out_dims="F T", scan="T", vmap="F"
    )
    dct = filter_multi_vmap(
        f, in_dims={"c": "T", "a": "T F", "b": "F"}, out_dims="F T", scan="T", vmap="F"
    )
    _assert_same(tup(a, b, c), ref)
    _assert_same(dct(a, b, c), ref)
    _assert_same(dct(a, c=c, b=b), ref)
    # A single dims string for every argument.
    same = filter_multi_vmap(lambda p, q: p - q, in_dims="T F", out_dims="F T")
    _assert_same(same(a, a * 2.0), (a - a * 2.0).T)


def test_module_typed_spec():
    class Model(eqx.Module):
        flux: jax.Array
        gain: jax.Array
        label: str = eqx.field(static=True)

    def f(m):
        assert m.label == "m"
        return m.flux * m.gain[0]

    model = Model(_rand((4, 3), seed=35), _rand((2,), seed=36), "m")
    w = filter_multi_vmap(
        f, in_dims=(Model("T F", None, "m"),), out_dims="F T", scan="T", vmap="F"
    )
    _assert_same(w(model), (model.flux * model.gain[0]).T)


def test_pytree_argument_with_prefix_dims():
    x = {"flux": _rand((4, 3), seed=27), "nu": _rand((3,), seed=28)}
    f = lambda d, k: d["flux"] * d["nu"] + k
    w = filter_multi_vmap(
        f,
        in_dims=({"flux": "T F", "nu": "F"}, None),
        out_dims="T F",
        scan={"T": 3},
        vmap="F",
    )
    k = jnp.float32(2.0)
    out = w(x, k)
    ref = loop_reference(
        lambda a, b: a * b + k, (x["flux"], x["nu"]), ("T F", "F"), ("T", "F"), "T F"
    )
    _assert_same(out, ref)


def test_non_array_leaves_pass_through():
    class Config(eqx.Module):
        weight: jax.Array
        label: str = eqx.field(static=True)
        power: int = eqx.field(static=True)

    def act(z):
        return jnp.tanh(z)

    seen = []

    def f(x, cfg, scale, tag, fn, nothing):
        seen.append((type(scale), tag, fn, nothing, cfg.label, cfg.power))
        return {
            "y": fn(x * cfg.weight) ** cfg.power * scale,
            "tag": tag,
            "fn": fn,
            "nothing": nothing,
            "scale": scale,
        }

    cfg = Config(_rand((3,), seed=29), "cfg", 2)
    x = _rand((4, 3), seed=30)
    w = filter_multi_vmap(
        f,
        in_dims={"x": "T F", "cfg": "F"},
        out_dims={"y": "F T", "tag": None, "fn": None, "nothing": None, "scale": None},
        scan="T",
        vmap="F",
    )
    out = w(x, cfg, 1.5, "hello", act, None)
    assert out["tag"] == "hello"
    assert out["fn"] is act
    assert out["nothing"] is None
    assert out["scale"] == 1.5 and type(out["scale"]) is float
    assert all(s == (float, "hello", act, None, "cfg", 2) for s in seen)
    ref = (jnp.tanh(x * cfg.weight[None]) ** 2 * 1.5).T
    _assert_same(out["y"], ref)


class _Pair(co.namedtuple("_Pair", ["a", "b"])):
    pass


class _Out(eqx.Module):
    mean: jax.Array
    table: jax.Array
    label: str = eqx.field(static=True)


@pytest.mark.parametrize("scan", ["T", {"T": 2}, None])
def test_output_pytrees(scan):
    x = _rand((3, 2, 4), seed=32)  # T B c
    vmap = "B" if scan else "T B"

    def f(v):
        return (
            v.sum(),
            {"sq": v**2, "neg": -v},
            _Pair(v[0], jnp.outer(v, v)),
            _Out(v.mean(), jnp.stack([v, v]), "lbl"),
        )

    out_dims = (
        "T B",
        {"sq": "c B T", "neg": "B T c"},
        _Pair("B T", "T c c B"),
        "B T ...",  # a prefix: both array leaves of the Module
    )
    w = filter_multi_vmap(
        f, in_dims="T B c", out_dims=out_dims, core="c", scan=scan, vmap=vmap
    )
    out = w(x)
    ref = loop_reference(f, (x,), ("T B c",), ("T", "B"), out_dims)
    assert isinstance(out[2], _Pair)
    assert isinstance(out[3], _Out)
    assert out[3].label == "lbl"
    assert out[3].table.shape == (2, 3, 2, 4)
    _assert_same(out, ref)


def test_no_transpose_when_order_matches():
    x = _rand((4, 3, 2), seed=33)
    w = filter_multi_vmap(
        lambda a: a * 2.0, in_dims="T F c", out_dims="T F c", scan="T", vmap="F"
    )
    assert "transpose" not in _primitives(jax.make_jaxpr(w)(x))
    w2 = filter_multi_vmap(
        lambda a: a * 2.0, in_dims="T F c", out_dims="F T c", scan="T", vmap="F"
    )
    assert _primitives(jax.make_jaxpr(w2)(x)).count("transpose") == 1
    _assert_same(w2(x), jnp.transpose(x * 2.0, (1, 0, 2)))


def test_core_dims_bound_by_outputs_only():
    # `k` appears only in out_dims: bound by the body's output.
    x = _rand((3, 2), seed=34)
    w = filter_multi_vmap(
        lambda a: jnp.stack([a, a + 1.0, a + 2.0]),
        in_dims="T B",
        out_dims="k B T",
        core="k",
        scan="T",
        vmap="B",
    )
    out = w(x)
    ref = loop_reference(
        lambda a: jnp.stack([a, a + 1.0, a + 2.0]), (x,), ("T B",), ("T", "B"), "k B T"
    )
    _assert_same(out, ref)


def test_var_positional_in_dims_by_name():
    def f(scale, *xs):
        return sum((x * scale for x in xs), start=jnp.float32(0))

    a = _rand((4, 3), seed=37)
    b = _rand((4, 3), seed=38)
    scale = _rand((3,), seed=39)
    ref = loop_reference(
        lambda s, x, y: x * s + y * s,
        (scale, a, b),
        ("F", "T F", "T F"),
        ("T", "F"),
        "F T",
    )
    for spec in ("T F", ("T F", "T F"), ["T F", "T F"]):
        w = filter_multi_vmap(
            f, in_dims={"scale": "F", "xs": spec}, out_dims="F T", scan="T", vmap="F"
        )
        _assert_same(w(scale, a, b), ref)


def test_describe_nest_counts():
    sizes = {"T": 5, "F": 4}
    assert describe_nest(NestSpec((("T", 3),), ("F",)), sizes) == (
        "scan(T: 1 chunk of 3) + vmap(T remainder=2) -> vmap(F=4) -> body"
    )
    assert describe_nest(NestSpec((("F", 2),)), sizes) == (
        "scan(F: 2 chunks of 2) -> body"
    )


def test_repr_names_the_function_dims_and_strategies():
    mesh = jax.make_mesh((1,), ("x",))
    assert repr(
        filter_multi_vmap(
            _body, in_dims=("T F B 2", "F"), out_dims="T F B 2", scan={"T": 2}
        )
    ) == (
        "filter_multi_vmap(_body, in_dims=('T F B 2', 'F'), out_dims='T F B 2', "
        "scan={'T': 2})"
    )
    assert repr(
        filter_multi_vmap(
            jnp.sin,
            in_dims="T F",
            out_dims="T F",
            core="F",
            vmap="T",
            plan="auto",
            memory_budget=2**20,
            checkpoint=True,
        )
    ) == (
        "filter_multi_vmap(sin, in_dims='T F', out_dims='T F', core='F', vmap='T', "
        "plan='auto', memory_budget=1048576, checkpoint=True)"
    )
    assert repr(
        filter_multi_vmap(
            jnp.sin, in_dims="T", out_dims="T", shard={"T": "x"}, mesh=mesh, pad=True
        )
    ) == (
        "filter_multi_vmap(sin, in_dims='T', out_dims='T', shard={'T': 'x'}, "
        "mesh=Mesh('x': 1), pad=True)"
    )


class _Member(eqx.Module):
    w: jax.Array
    n: int
    name: str = "member"
    act: object = jnp.tanh


def test_prefix_dims_map_array_leaves_only():
    # As `eqx.filter_vmap(in_axes=eqx.if_array(0))`: a dims string given as a prefix
    # of a Module applies to its array leaves; its int, str and callable fields pass
    # through unchanged, in and out.
    ensemble = _Member(w=_rand((4, 3, 2), seed=40), n=3)
    x = _rand((2,), seed=41)

    def f(m, v):
        assert m.n == 3 and m.name == "member" and m.act is jnp.tanh
        assert m.w.shape == (3, 2)
        return m.act(m.w @ v + m.n), m.name

    w = filter_multi_vmap(f, in_dims=("E ...", None), out_dims=("E ...", None))
    out, name = w(ensemble, x)
    assert name == "member"
    ref = np.stack(
        [np.tanh(np.asarray(ensemble.w[e]) @ np.asarray(x) + 3) for e in range(4)]
    )
    assert out.shape == (4, 3) and out.dtype == jnp.float32
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)

    # An unbound method, `self` mapped.
    class Model(eqx.Module):
        w: jax.Array
        n: int

        @filter_multi_vmap(in_dims={"self": "E ..."}, out_dims="E")
        def score(self, v):
            return jnp.sum(self.w * v) + self.n

    m = Model(_rand((5, 2), seed=42), 2)
    np.testing.assert_allclose(
        m.score(x), np.asarray(m.w) @ np.asarray(x) + 2, rtol=1e-5, atol=1e-6
    )


def test_docstring_states_the_default_memory_budget():
    # `help(filter_multi_vmap)` says what `memory_budget=None` means.
    from eqx_multimap._planner.search import DEFAULT_BUDGET_FRACTION

    doc = filter_multi_vmap.__doc__
    assert doc is not None
    assert f"The default, `None`, is `{DEFAULT_BUDGET_FRACTION}`" in doc
