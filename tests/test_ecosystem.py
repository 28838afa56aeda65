"""Whole programs as the body: the Equinox ecosystem's solvers (optimistix, lineax,
diffrax), an `eqx.nn` module, linear algebra, custom derivative rules, control flow
on data, sorting and random numbers, each mapped over two named dims `T F` under
every strategy (vmap, scan, chunked scan with a remainder, `plan="auto"` and `shard`
on 4 simulated devices), against plain nested `jax.vmap` of the same body: value
and, where differentiable, grad."""

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import lineax as lx
import numpy as np
import optimistix as optx
import pytest
from eqx_multimap import filter_multi_vmap
from jax.sharding import AxisType, PartitionSpec as P


pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 4, reason="needs 4 (simulated) devices; see conftest.py"
)

# T has a remainder when scanned in chunks of 2; F splits over 4 devices.
T, F = 5, 4


def _mesh():
    return jax.make_mesh(
        (4,), ("d",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4]
    )


# How each strategy maps `T F`. `plan="auto"` gets a budget (16 KiB) small enough
# that vmapping everything does not fit every body (the solvers' derivatives).
STRATEGIES: dict[str, Callable[[], dict[str, Any]]] = {
    "vmap": lambda: {},
    "scan": lambda: {"scan": "T"},
    "chunked": lambda: {"scan": {"T": 2}},
    "auto": lambda: {"plan": "auto", "memory_budget": 16 * 1024},
    "shard": lambda: {"shard": {"F": "d"}, "mesh": _mesh()},
}


@dataclasses.dataclass(frozen=True)
class Case:
    """A body, the dims of its arguments (`None`: passed whole), its arguments, and
    the positions of the arguments to differentiate (empty: value only)."""

    body: Callable
    in_dims: tuple[str | None, ...]
    out_dims: Any
    args: Callable[[], tuple[Any, ...]]
    grad_argnums: tuple[int, ...] = ()
    rtol: float = 1e-5
    atol: float = 1e-6
    # Whether its grad under `shard` fails upstream, whoever maps the body (see
    # `test_plain_shard_map_fails_too`); its value is checked all the same.
    shard_fails: bool = False


def reference(case: Case) -> Callable:
    """Plain nested `jax.vmap`: F inside, T outside; unmapped arguments whole."""

    def axes(dim: str):
        out = []
        for dims in case.in_dims:
            toks = [] if dims is None else dims.split()
            if dim == "F":
                toks = [t for t in toks if t != "T"]  # T is vmapped outside
            out.append(toks.index(dim) if dim in toks else None)
        return tuple(out)

    inner = jax.vmap(case.body, in_axes=axes("F"))
    return jax.vmap(inner, in_axes=axes("T"))


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _f32(x) -> jax.Array:
    return jnp.asarray(x, dtype=jnp.float32)


#
# The bodies.
#


def lm_fit(y, x):
    """Fit `y = a exp(b x)` by Levenberg-Marquardt; returns `(a, b)`."""

    def residual(p, data):
        y, x = data
        return p[0] * jnp.exp(p[1] * x) - y

    solver = optx.LevenbergMarquardt(rtol=1e-6, atol=1e-6)
    sol = optx.least_squares(
        residual, solver, jnp.array([1.0, 0.0]), args=(y, x), max_steps=64
    )
    return sol.value


def lm_args():
    rng = _rng(1)
    x = _f32(np.linspace(0.0, 1.0, 8))
    a = rng.uniform(0.5, 2.0, size=(T, F, 1))
    b = rng.uniform(-1.0, 1.0, size=(T, F, 1))
    y = a * np.exp(b * np.asarray(x)) + 0.01 * rng.normal(size=(T, F, 8))
    return _f32(y), x


def newton_root(a):
    """The root `z` of `z**3 + z - a` (unique), by Newton's method."""
    sol = optx.root_find(
        lambda z, a: z**3 + z - a,
        optx.Newton(rtol=1e-6, atol=1e-6),
        jnp.zeros_like(a),
        args=a,
        max_steps=64,
    )
    return sol.value


def newton_args():
    return (_f32(_rng(2).uniform(-3.0, 3.0, size=(T, F))),)


def linear_solve(a, b):
    return lx.linear_solve(lx.MatrixLinearOperator(a), b).value


def linear_args():
    rng = _rng(3)
    a = rng.normal(size=(T, F, 3, 3)) + 4.0 * np.eye(3)
    return _f32(a), _f32(rng.normal(size=(T, F, 3)))


def decay(y0, k):
    """`dy/dt = -k y` from `y0` over `[0, 1]`, 20 Tsit5 steps: `y0 exp(-k)`."""
    term = diffrax.ODETerm(lambda t, y, k: -k * y)
    sol = diffrax.diffeqsolve(
        term,
        diffrax.Tsit5(),
        t0=0.0,
        t1=1.0,
        dt0=0.05,
        y0=y0,
        args=k,
        saveat=diffrax.SaveAt(t1=True),
        max_steps=32,
    )
    return sol.ys[0]


def decay_args():
    rng = _rng(4)
    return _f32(rng.normal(size=(T, F, 2))), _f32(rng.uniform(0.5, 2.0, size=(F,)))


MLP = eqx.nn.MLP(3, 2, 8, 2, key=jr.key(0))


def mlp_closed(x):
    return MLP(x)


def mlp_passed(x, mlp):
    return mlp(x)


def linalg(m, b):
    sym = m + m.T
    w = jnp.linalg.eigh(sym)[0]
    s = jnp.linalg.svd(m, compute_uv=False)
    x = jnp.linalg.solve(m + 4.0 * jnp.eye(3, dtype=m.dtype), b)
    return w, s, x


def linalg_args():
    rng = _rng(5)
    return _f32(rng.normal(size=(T, F, 3, 3))), _f32(rng.normal(size=(T, F, 3)))


@jax.custom_jvp
def softplus(x):
    return jnp.log1p(jnp.exp(x))


@softplus.defjvp
def _softplus_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return softplus(x), jax.nn.sigmoid(x) * t


@jax.custom_vjp
def clip_grad(x):
    return jnp.sin(x)


def _clip_fwd(x):
    return jnp.sin(x), jnp.cos(x)


def _clip_bwd(cos, g):
    return (jnp.clip(cos * g, -0.5, 0.5),)


clip_grad.defvjp(_clip_fwd, _clip_bwd)


def custom_rules(x):
    return softplus(x) * clip_grad(x)


def control_flow(x, i):
    y = jax.lax.cond(jnp.sum(x) > 0, lambda v: jnp.sin(v), lambda v: v**2, x)
    z = jax.lax.switch(i, [lambda v: v + 1.0, lambda v: 2.0 * v, jnp.cos], x)
    return y + z, jnp.sort(x)


def control_args():
    rng = _rng(6)
    return _f32(rng.normal(size=(T, F, 4))), jnp.asarray(
        rng.integers(0, 3, size=(T, F)), dtype=jnp.int32
    )


def random_body(key, scale):
    return scale * jr.normal(key, (3,))


def random_args():
    keys = jr.split(jr.key(7), T * F).reshape(T, F)
    return keys, _f32(_rng(7).uniform(1.0, 2.0, size=(F,)))


def vector_args(seed: int, n: int) -> Callable[[], tuple[jax.Array]]:
    return lambda: (_f32(_rng(seed).normal(size=(T, F, n))),)


def mlp_args():
    return (_f32(_rng(8).normal(size=(T, F, 3))), MLP)


CASES = {
    "lm": Case(
        lm_fit, ("T F n", "n"), "T F 2", lm_args, (0,), 1e-4, 1e-5, shard_fails=True
    ),
    "newton": Case(newton_root, ("T F",), "T F", newton_args, (0,), shard_fails=True),
    "lineax": Case(
        linear_solve,
        ("T F 3 3", "T F 3"),
        "T F 3",
        linear_args,
        (0, 1),
        shard_fails=True,
    ),
    "diffrax": Case(
        decay, ("T F 2", "F"), "T F 2", decay_args, (0, 1), 1e-4, shard_fails=True
    ),
    "mlp_closed": Case(mlp_closed, ("T F 3",), "T F 2", vector_args(8, 3), (0,)),
    "mlp_passed": Case(mlp_passed, ("T F 3", None), "T F 2", mlp_args, (0, 1)),
    "linalg": Case(
        linalg,
        ("T F 3 3", "T F 3"),
        ("T F 3", "T F 3", "T F 3"),
        linalg_args,
        (0, 1),
        1e-4,
        1e-5,
    ),
    "custom_rules": Case(custom_rules, ("T F 4",), "T F 4", vector_args(9, 4), (0,)),
    "control_flow": Case(
        control_flow, ("T F 4", "T F"), ("T F 4", "T F 4"), control_args, (0,)
    ),
    "random": Case(random_body, ("T F", "F"), "T F 3", random_args, (1,)),
}


def _allclose(x, y, rtol, atol):
    x_leaves, x_def = jax.tree.flatten(x)
    y_leaves, y_def = jax.tree.flatten(y)
    assert x_def == y_def
    for a, b in zip(x_leaves, y_leaves):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def _value_and_grad(case: Case, f: Callable, args: tuple) -> tuple[Any, Any]:
    """`f(*args)`, and the grad of `sum(sin(f(*args)))` with respect to the
    arguments `case.grad_argnums` (`None` without), in one compiled call."""

    @eqx.filter_jit
    def run(args):
        if not case.grad_argnums:
            return f(*args), None

        def of_diff(diff):
            full = list(args)
            for i, d in zip(case.grad_argnums, diff):
                full[i] = d
            return f(*full)

        diff = tuple(args[i] for i in case.grad_argnums)
        out, vjp = eqx.filter_vjp(of_diff, diff)
        return out, vjp(jax.tree.map(jnp.cos, out))[0]

    return run(args)


@functools.cache
def _expected(name: str) -> tuple[Any, Any]:
    """Nested `jax.vmap`'s value and grad, once per body."""
    case = CASES[name]
    return _value_and_grad(case, reference(case), case.args())


def _check(name: str, strategy: str) -> None:
    case = CASES[name]
    args = case.args()
    options = STRATEGIES[strategy]()
    mapped = filter_multi_vmap(
        case.body, in_dims=case.in_dims, out_dims=case.out_dims, **options
    )
    fails = strategy == "shard" and case.shard_fails
    want_value, want_grad = _expected(name)
    _allclose(mapped(*args), want_value, case.rtol, case.atol)
    # An explicitly sharded output's cotangent needs the mesh in context.
    with contextlib.ExitStack() as stack:
        if "mesh" in options:
            stack.enter_context(jax.set_mesh(options["mesh"]))
        if fails:
            with pytest.raises(UPSTREAM):
                _value_and_grad(case, mapped, args)
            return
        value, grad = _value_and_grad(case, mapped, args)
    _allclose(value, want_value, case.rtol, case.atol)
    _allclose(grad, want_grad, case.rtol, case.atol)


# What fails inside `jax.shard_map` upstream (see `test_plain_shard_map_fails_too`).
UPSTREAM = (ValueError, NotImplementedError, AssertionError)

# The fast suite's share: every strategy once, on bodies cheap to compile. The rest
# (the solvers, `plan="auto"`, which compiles candidates) take from 5 s to a minute
# or more each on 2 cores, and run with the slow tests.
FAST = {
    ("custom_rules", "vmap"),
    ("custom_rules", "scan"),
    ("custom_rules", "chunked"),
    ("custom_rules", "shard"),
    ("control_flow", "vmap"),
    ("control_flow", "shard"),
    ("mlp_passed", "vmap"),
    ("mlp_passed", "shard"),
    ("random", "shard"),
    ("linalg", "vmap"),
    ("lineax", "shard"),  # traced for inside `shard_map` as it traces outside
}


def _combinations(fast: bool) -> list[tuple[str, str]]:
    return [
        (name, strategy)
        for name in sorted(CASES)
        for strategy in sorted(STRATEGIES)
        if ((name, strategy) in FAST) == fast
    ]


@pytest.mark.parametrize("name,strategy", _combinations(fast=True))
def test_body(name, strategy):
    _check(name, strategy)


@pytest.mark.slow
@pytest.mark.parametrize("name,strategy", _combinations(fast=False))
def test_body_slow(name, strategy):
    _check(name, strategy)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c.shard_fails))
def test_plain_shard_map_fails_too(name):
    """The bodies whose grad fails under `shard` fail inside a plain `jax.shard_map`
    of nested `jax.vmap` too, under the mesh (`jax.set_mesh`) that an explicitly
    sharded grad needs: with JAX 0.10.2, lineax 0.1.1, optimistix 0.1.0 and diffrax
    0.7.2, their solves compare or close over structures that carry the mesh
    (optimistix's fail under `jax.set_mesh` even without `shard_map`). When this
    test fails, upstream has fixed it: drop `shard_fails`."""
    case = CASES[name]
    args = case.args()
    mesh = _mesh()
    specs = tuple(
        P() if d is None else P(*("d" if t == "F" else None for t in d.split()))
        for d in case.in_dims
    )
    plain = jax.jit(
        jax.shard_map(
            reference(case),
            mesh=mesh,
            in_specs=specs,
            out_specs=jax.tree.map(lambda _: P(None, "d"), case.out_dims),
            check_vma=False,
        )
    )

    def loss(*args):
        return sum(jnp.sum(o) for o in jax.tree.leaves(plain(*args)))

    with jax.set_mesh(mesh), pytest.raises(UPSTREAM):
        args = tuple(a if s == P() else jax.reshard(a, s) for a, s in zip(args, specs))
        plain(*args)
        jax.jit(jax.grad(loss, argnums=case.grad_argnums))(*args)


def test_newton_grad_is_the_implicit_one():
    # The root z(a) of z**3 + z - a: dz/da = 1 / (3 z**2 + 1), mapped over T (scanned)
    # and F (vmapped).
    (a,) = newton_args()
    mapped = filter_multi_vmap(newton_root, in_dims="T F", out_dims="T F", scan="T")
    z = mapped(a)
    np.testing.assert_allclose(np.asarray(z**3 + z), np.asarray(a), atol=1e-5)
    grad = jax.grad(lambda a: jnp.sum(mapped(a)))(a)
    np.testing.assert_allclose(
        np.asarray(grad), np.asarray(1.0 / (3.0 * z**2 + 1.0)), rtol=1e-5
    )
    assert grad.shape == a.shape and grad.dtype == a.dtype


def test_diffrax_against_the_exact_solution():
    y0, k = decay_args()
    mapped = filter_multi_vmap(
        decay, in_dims=("T F 2", "F"), out_dims="T F 2", scan="T"
    )
    exact = np.asarray(y0) * np.exp(-np.asarray(k))[None, :, None]
    np.testing.assert_allclose(np.asarray(mapped(y0, k)), exact, rtol=1e-5, atol=1e-6)
