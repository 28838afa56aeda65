"""Differentiation: every strategy against the hand-written nest, the structure of
the backward pass, the memory budget of the derivative, and un-jitted calls.

Structure, never speed: the optimised HLO of a gradient is the hand-written nest's,
or has no full-size accumulation inside its backward loop; compiled temporaries stay
within the budget; repeated un-jitted calls compile once.
"""

import gc
import re
import weakref

import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
import pytest
from eqx_multimap import explain, filter_multi_vmap, Planner

from .helpers import load_benchmark, loop_reference


harness = load_benchmark("harness")  # the benchmarks' timing harness


def _rand(shape, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32) * scale)


def _hlo(fn, *args) -> str:
    return harness.normalised_hlo(harness.compiled(fn, *args))


def _cheap(a):
    return jnp.tanh(a) * 2.0


def _heavy(a):
    # Reads the scanned row through two index maps: isolated on CPU.
    return jnp.tanh(a[:, None] * a[None, :]) @ a


def _hand(body, strategy: str, k: int = 3):
    row = jax.vmap(body)
    if strategy == "scan":
        return lambda xs: lax.scan(lambda c, x: (c, row(x)), None, xs)[1]
    if strategy == "chunk":

        def chunked(xs):
            n, rest = divmod(xs.shape[0], k)
            main = xs[: n * k].reshape(n, k, *xs.shape[1:])
            ys = lax.scan(lambda c, x: (c, jax.vmap(row)(x)), None, main)[1]
            ys = ys.reshape(n * k, *ys.shape[2:])
            return jnp.concatenate([ys, jax.vmap(row)(xs[n * k :])]) if rest else ys

        return chunked
    if strategy == "chunk2":  # chunks of `k` rows, each of chunks of 2 columns
        inner = lambda x: lax.map(body, x, batch_size=2)  # noqa: E731
        return lambda xs: lax.map(inner, xs, batch_size=k)
    return jax.vmap(row)


def _ours(body, strategy: str, k: int = 3):
    kw = dict(in_dims="T B K", out_dims="T B K", core="K")
    if strategy == "scan":
        return filter_multi_vmap(body, scan="T", **kw)
    if strategy == "chunk":
        return filter_multi_vmap(body, scan={"T": k}, **kw)
    if strategy == "chunk2":
        return filter_multi_vmap(body, scan={"T": k, "B": 2}, **kw)
    return filter_multi_vmap(body, **kw)


def _loss(fn):
    return lambda xs: jnp.sum(jnp.sin(fn(xs)))


STRATEGIES = ["scan", "chunk", "vmap"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("body", [_cheap, _heavy], ids=["cheap", "heavy"])
def test_derivatives_match_the_hand_nest(strategy, body):
    xs = _rand((7, 3, 5), seed=1, scale=0.5)
    ours, hand = _ours(body, strategy), _hand(body, strategy)
    tangent = _rand(xs.shape, seed=2)
    for transform in (
        lambda f: jax.grad(_loss(f)),
        lambda f: lambda x: jax.value_and_grad(_loss(f))(x)[1],
        lambda f: lambda x: jax.vjp(f, x)[1](jnp.cos(f(x)))[0],
        lambda f: lambda x: jax.jvp(f, (x,), (tangent,))[1],
    ):
        got = jax.jit(transform(ours))(xs)
        want = transform(hand)(xs)
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # Second order too.
    small = xs[:2, :1, :3]
    h_ours = jax.hessian(_loss(_ours(body, strategy, k=1)))(small)
    h_hand = jax.hessian(_loss(_hand(body, strategy, k=1)))(small)
    np.testing.assert_allclose(h_ours, h_hand, rtol=1e-4, atol=1e-5)


def test_gradient_against_a_loop():
    # Independent of any nest: a Python loop over (T, B), in numpy, differentiated
    # by hand (d/dx sum(sin(tanh(x) * 2)) = cos(tanh(x) * 2) * 2 * (1 - tanh(x)^2)).
    xs = _rand((5, 4, 3), seed=3)
    x = np.asarray(xs, np.float64)
    want = np.cos(np.tanh(x) * 2) * 2 * (1 - np.tanh(x) ** 2)
    for strategy in STRATEGIES:
        got = jax.jit(jax.grad(_loss(_ours(_cheap, strategy))))(xs)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", ["scan", "chunk", "chunk2", "vmap"])
def test_gradient_hlo_is_the_hand_nest(strategy):
    # A body that is not isolated: forward and backward are the hand nest, HLO for
    # HLO (fresh functions for every program compiled, so no cache is reused). The
    # chunks divide the rows: with a remainder, ours slices each chunk inside its
    # iteration where `lax.map` copies the chunks out first (`test_nest_memory`).
    # Two chunked levels: no iteration of the inner one transposes its block.
    xs = _rand((9 if strategy.startswith("chunk") else 10, 4, 8), seed=4)
    ours = _ours(_cheap, strategy)
    hand = _hand(_cheap, strategy)
    assert _hlo(ours, xs) == _hlo(hand, xs)
    assert _hlo(jax.grad(_loss(ours)), xs) == _hlo(jax.grad(_loss(hand)), xs)
    fwd_bwd = lambda f: lambda x: jax.value_and_grad(_loss(f))(x)  # noqa: E731
    assert _hlo(fwd_bwd(ours), xs) == _hlo(fwd_bwd(hand), xs)


def _full_size_adds(hlo: str, shape: tuple[int, ...]) -> list[str]:
    """Adds of arrays of `shape` inside loop bodies (by the op names XLA keeps)."""
    dims = ",".join(map(str, shape))
    add = re.compile(rf"= f32\[{dims}\]\S* add\(")
    return [
        line.strip()[:120]
        for line in hlo.splitlines()
        if add.search(line) and "while/body" in line
    ]


@pytest.mark.slow
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU isolation")
@pytest.mark.parametrize("strategy", ["scan", "chunk"])
def test_isolated_gradient_has_no_full_size_accumulation(strategy):
    # The heavy body's scanned slices are isolated on CPU (a conditional in the
    # forward program). The slices are the scan's own, so the backward loop stacks
    # their cotangents: no add of a full-size buffer in any loop body.
    xs = _rand((24, 3, 8), seed=5, scale=0.5)
    ours = _ours(_heavy, strategy)
    text = jax.jit(jax.grad(_loss(ours))).lower(xs).compile().as_text()
    assert "conditional" in jax.jit(ours).lower(xs).compile().as_text()
    assert _full_size_adds(text, xs.shape) == []

    # The detector finds the accumulation of the old isolation: a slice of a
    # closed-over input taken inside a conditional.
    def closed_over(xs):
        def step(i, _):
            x = lax.cond(
                i < xs.shape[0],
                lambda: lax.dynamic_index_in_dim(xs, i, 0, keepdims=False),
                lambda: xs[0],
            )
            return i + 1, jax.vmap(_heavy)(x)

        return lax.scan(step, 0, None, length=xs.shape[0])[1]

    bad = jax.jit(jax.grad(_loss(closed_over))).lower(xs).compile().as_text()
    assert _full_size_adds(bad, xs.shape)


def test_closed_over_values_are_differentiated():
    # The body closes over `w`, which is differentiated: the gradient flows through
    # the closure, for every strategy, under jit and not.
    xs = _rand((6, 4), seed=6)

    def make(w, strategy):
        kw = dict(in_dims="T B", out_dims="T B", core="B")  # rows of B
        if strategy == "scan":
            kw["scan"] = "T"
        elif strategy == "chunk":
            kw["scan"] = {"T": 4}
        return filter_multi_vmap(lambda a: jnp.tanh(a * w), **kw)

    def ref(w):
        return jnp.sum(jnp.sin(jnp.tanh(xs * jnp.broadcast_to(w, xs.shape))))

    for strategy in STRATEGIES:
        loss = lambda w, s=strategy: jnp.sum(jnp.sin(make(w, s)(xs)))  # noqa: E731
        for w in (jnp.float32(0.7), _rand((4,), seed=7)):
            want = jax.grad(ref)(w)
            for got in (jax.grad(loss)(w), jax.jit(jax.grad(loss))(w)):
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_unjitted_calls_compile_once(strategy):
    xs = _rand((9, 4, 8), seed=8)
    f = _ours(_heavy, strategy)
    ref = _hand(_heavy, strategy)(xs)
    np.testing.assert_allclose(f(xs), ref, rtol=1e-5, atol=1e-6)
    with harness.count_compiles() as counts:
        for _ in range(5):
            out = f(xs)
    assert counts["compiles"] == 0
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    # A new shape compiles once more, then not again.
    fewer = xs[:5]
    with harness.count_compiles() as counts:
        f(fewer)
        f(fewer)
    assert counts["compiles"] == 1


def test_unjitted_calls_keep_nothing_after_the_function():
    # As with `jax.jit(fun)`: what un-jitted calls compiled is released with the
    # function, as when a notebook re-runs a cell that defines and calls one.
    xs = _rand((9, 4, 8), seed=8)
    ref = 2 * _hand(_heavy, "scan")(xs)
    scale = jnp.asarray(2.0)  # a constant of the compiled program

    def body(x):
        return _heavy(x) * scale

    alive = weakref.ref(body)
    f = _ours(body, "scan")
    np.testing.assert_allclose(f(xs), ref, rtol=1e-5, atol=1e-6)
    # Another wrapper of the same function runs the same program.
    with harness.count_compiles() as counts:
        out = _ours(body, "scan")(xs)
    assert counts["compiles"] == 0
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    del f, body
    gc.collect()
    assert alive() is None


def _sumexp(x, y):
    # A (M, K) intermediate per element; the output is one number per element.
    return jnp.sum(jnp.exp(jnp.outer(x, y)) @ y)


def _temps(fn, *args) -> int:
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


# With `scan=`, the given chunk is kept: the derivative of 16 rows fits the budget.
@pytest.mark.slow
@pytest.mark.parametrize("scan", [None, {"N": 16}])
def test_budget_covers_the_derivative(scan):
    # The gradient of a planned map stays within the budget, although a plain
    # gradient of the forward plan would store every block's intermediate.
    x, y = _rand((512, 128), seed=9, scale=0.05), _rand((64,), seed=10, scale=0.05)
    budget = 4 * 2**20
    f = filter_multi_vmap(
        _sumexp,
        in_dims=("N M", "K"),
        out_dims="N",
        scan=scan,
        plan=Planner(),
        memory_budget=budget,
    )
    loss = lambda x, y: jnp.sum(f(x, y))  # noqa: E731
    grad = jax.grad(loss, argnums=(0, 1))
    value_and_grad = jax.value_and_grad(loss, argnums=(0, 1))
    full = 512 * 128 * 64 * 4  # every element's intermediate at once
    assert _temps(f, x, y) <= budget
    assert _temps(grad, x, y) <= budget < full
    assert _temps(value_and_grad, x, y) <= budget
    # The forward plan differentiated plainly would not fit.
    plan = explain(f, x, y)
    assert plan.gradient is not None and plan.gradient.backward
    plain = filter_multi_vmap(
        _sumexp, in_dims=("N M", "K"), out_dims="N", scan=plan.scan or None
    )
    assert _temps(jax.grad(lambda x, y: jnp.sum(plain(x, y))), x, y) > budget
    # And the values are those of a hand-written vmap.
    ref = jax.vmap(_sumexp, in_axes=(0, None))
    want = jax.grad(lambda x, y: jnp.sum(ref(x, y)), argnums=(0, 1))(x, y)
    for got, w in zip(jax.jit(grad)(x, y), want):
        np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-4)
    text = plan.describe(gradient=True)
    assert "under differentiation (reverse mode)" in text
    assert "scan bodies checkpointed" in text


@pytest.mark.slow
def test_loop_reference_grad_through_plan():
    # The planned derivative against an independent loop reference.
    x, y = _rand((40, 16), seed=11, scale=0.1), _rand((8,), seed=12, scale=0.1)
    f = filter_multi_vmap(
        _sumexp,
        in_dims=("N M", "K"),
        out_dims="N",
        plan=Planner(),
        memory_budget=16 * 16 * 8 * 4,
    )

    def ref(x, y):
        return loop_reference(_sumexp, (x, y), ("N M", None), ("N",), "N", xp=jnp).sum()

    got = jax.grad(lambda x, y: f(x, y).sum(), argnums=(0, 1))(x, y)
    want = jax.grad(ref, argnums=(0, 1))(x, y)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
