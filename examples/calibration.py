"""Calibrate antenna gains per (time, frequency) slot: an optimistix solve mapped over
`T x F` with `eqx_multimap.filter_multi_vmap`.

Each antenna `a` of a radio interferometer multiplies the signal by a complex gain
`g_a(t, nu)`. For the baseline between antennas `p` and `q`, the measured
visibility is the model visibility of the sky, corrupted by both gains:

    V_pq(t, nu) = g_p(t, nu)  M_pq(t, nu)  conj(g_q(t, nu))  +  noise

Calibration solves for the gains given `V` and the sky model `M`. The gains of one
(time, frequency) slot depend only on that slot's visibilities, so the problem is
`T x F` small least-squares fits, not one big one. This example:

1. simulates `V[T, F, B]` from true gains `g[T, F, A]` and a point-source sky model
   `M[T, F, B]`, with the baselines as antenna-index arrays `ant1[B]`, `ant2[B]`;
2. fits one slot's gains with `optimistix.LevenbergMarquardt` (`solve_slot`), and
   maps that fit over `T F` with `filter_multi_vmap`: all vmapped, scanned over `T`
   in chunks, and chosen by the planner (`plan="auto"`) under a memory budget, all
   the same values;
3. solves the same data as one dense Levenberg-Marquardt over all `T F (2A - 1)`
   unknowns (`solve_dense`), and compares the fit, the time and the compiled
   temporaries;
4. shows that the Jacobian of a mapped function is block-diagonal over the mapped
   dims, so that mapping the element's `jax.jacfwd` gives just the blocks, with dims
   `T F B 2 A 2`;
5. measures, on this machine, a batched 2x2 complex matmul `a @ b @ c^H` against the
   same product written out element by element.

The gains are complex, the solver works on reals: one slot's unknowns are the real
parts of the `A` gains and the imaginary parts of all but the reference antenna's.
The reference antenna's gain is real (phase 0, `--ref-antenna`): the visibilities do
not change when every gain is multiplied by the same phase, so one phase must be
fixed for the fit to have a unique answer (the *phase gauge*). The true gains are
compared with the fitted ones in the same gauge.

    python examples/calibration.py            # T=8, F=4, A=12 (66 baselines)
    python examples/calibration.py --quick    # T=3, F=2, A=5: a smoke test
    python examples/calibration.py --times 32 --freqs 16 --antennas 24 --no-dense
"""

import argparse
import contextlib
import dataclasses
import functools as ft
import io
import statistics
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import optimistix as optx
from eqx_multimap import filter_multi_vmap
from jaxtyping import Array, Bool, Complex, Float, Int


C = 299_792_458.0  # speed of light, m/s


#
# Data.
#


class Observation(eqx.Module):
    """Simulated data: visibilities, the sky model's visibilities, the baselines,
    and the true gains and noise level they were made with."""

    vis: Complex[Array, "T F B"]
    model: Complex[Array, "T F B"]
    ant1: Int[Array, "B"]  # noqa: F821
    ant2: Int[Array, "B"]  # noqa: F821
    gains: Complex[Array, "T F A"]
    noise: float = eqx.field(static=True)  # std of the complex noise per visibility


def simulate(
    key: jax.Array,
    n_times: int = 8,
    n_freqs: int = 4,
    n_antennas: int = 12,
    n_sources: int = 5,
    noise: float = 0.1,
) -> Observation:
    """Visibilities `V = g[ant1] M conj(g[ant2]) + noise` of a random observation.

    Antennas within 1 km on the ground, `n_sources` point sources within 0.02 rad of
    the phase centre (0.5 to 3 Jy), hour angles over +-0.5 rad, 0.7 to 1.4 GHz. The
    true gains have amplitudes `1 +- 0.1` and phases within +-pi/4, independent
    from slot to slot. The noise is complex Gaussian with standard deviation `noise`.
    """
    if n_antennas < 3:
        raise ValueError(
            f"`n_antennas` must be at least 3, but got {n_antennas}: with 2 antennas "
            "there is 1 baseline (2 real equations) for 3 real unknowns."
        )
    keys = jax.random.split(key, 7)
    f32 = jnp.float32
    xy = jax.random.uniform(keys[0], (n_antennas, 2), f32, -500.0, 500.0)
    ant1, ant2 = (jnp.asarray(a, jnp.int32) for a in np.triu_indices(n_antennas, 1))
    hour_angle = jnp.linspace(-0.5, 0.5, n_times, dtype=f32)
    freq = jnp.linspace(0.7e9, 1.4e9, n_freqs, dtype=f32)
    lm = jax.random.uniform(keys[1], (n_sources, 2), f32, -0.02, 0.02)
    flux = jax.random.uniform(keys[2], (n_sources,), f32, 0.5, 3.0)

    baseline = xy[ant1] - xy[ant2]  # (B, 2), metres
    ch, sh = jnp.cos(hour_angle)[:, None], jnp.sin(hour_angle)[:, None]  # (T, 1)
    bx, by = baseline[None, :, 0], baseline[None, :, 1]  # (1, B)
    u, v = ch * bx - sh * by, sh * bx + ch * by  # (T, B): the baseline rotates
    delay = u[..., None] * lm[None, None, :, 0] + v[..., None] * lm[None, None, :, 1]
    phase = (-2 * jnp.pi / C) * delay[:, None] * freq[None, :, None, None]  # T F B S
    flux = flux[None, None, None, :]
    model = lax.complex(
        jnp.sum(flux * jnp.cos(phase), axis=-1), jnp.sum(flux * jnp.sin(phase), axis=-1)
    )

    shape = (n_times, n_freqs, n_antennas)
    amp = 1.0 + 0.1 * jax.random.normal(keys[3], shape, f32)
    angle = jax.random.uniform(keys[4], shape, f32, -jnp.pi / 4, jnp.pi / 4)
    gains = lax.complex(amp * jnp.cos(angle), amp * jnp.sin(angle))

    vis_shape = model.shape  # (T, F, B)
    scale = noise / np.sqrt(2.0)
    eps = lax.complex(
        scale * jax.random.normal(keys[5], vis_shape, f32),
        scale * jax.random.normal(keys[6], vis_shape, f32),
    )
    vis = gains[..., ant1] * model * jnp.conj(gains[..., ant2]) + eps
    return Observation(vis, model, ant1, ant2, gains, noise)


def check_baselines(ant1: Any, ant2: Any, n_antennas: int, ref: int) -> None:
    """Errors for antenna indices that `filter_multi_vmap`'s shape checks cannot see:
    the values. (The shapes, `vis` and `model` against `ant1` and `ant2` over `B`,
    are checked by `filter_multi_vmap` itself, and raise `ShapeError`.)"""
    a1, a2 = np.asarray(ant1), np.asarray(ant2)
    for name, a in (("ant1", a1), ("ant2", a2)):
        if not np.issubdtype(a.dtype, np.integer):
            raise TypeError(
                f"`{name}` must hold integer antenna indices, but got dtype {a.dtype}."
            )
        bad = np.flatnonzero((a < 0) | (a >= n_antennas))
        if bad.size:
            b = int(bad[0])
            raise ValueError(
                f"`{name}[{b}]` is {int(a.flat[b])}, but the antenna indices must be "
                f"in [0, {n_antennas}): there are {n_antennas} antennas (the size of "
                f"dim A of `g0`); {bad.size} of the {a.size} indices are out of range."
            )
    if not 0 <= ref < n_antennas:
        raise ValueError(
            f"`ref` (the reference antenna, whose phase is fixed to 0) is {ref}, but "
            f"must be in [0, {n_antennas}): there are {n_antennas} antennas."
        )
    seen = np.zeros(n_antennas, bool)
    seen[a1[a1 != a2]] = True
    seen[a2[a1 != a2]] = True
    if not seen.all():
        missing = np.flatnonzero(~seen).tolist()
        raise ValueError(
            f"antennas {missing} are in no cross-correlation baseline (`ant1 != "
            "ant2`), so their gains are not determined by the data; drop them from "
            "`g0`, or add baselines that include them."
        )
    n_eq, n_unknown = 2 * int(np.sum(a1 != a2)), 2 * n_antennas - 1
    if n_eq < n_unknown:
        raise ValueError(
            f"{n_eq // 2} cross-correlation baselines give {n_eq} real equations per "
            f"slot, fewer than the {n_unknown} real unknowns of {n_antennas} gains "
            "(with the reference antenna's phase fixed)."
        )


#
# One slot's fit.
#


# --8<-- [start:slot]
def to_params(g: Complex[Array, "A"], ref: int) -> Float[Array, "P"]:  # noqa: F821
    """Complex gains to the solver's reals: `Re g` (A), then `Im g` but the
    reference antenna's (A - 1)."""
    others = np.delete(np.arange(g.shape[-1]), ref)
    return jnp.concatenate([g.real, g.imag[..., others]], axis=-1)


def to_gains(x: Float[Array, "P"], ref: int) -> Complex[Array, "A"]:  # noqa: F821
    """The inverse of `to_params`: the reference antenna's gain is real."""
    n = (x.shape[-1] + 1) // 2
    others = np.delete(np.arange(n), ref)
    imag = jnp.zeros(x.shape[:-1] + (n,), x.dtype).at[..., others].set(x[..., n:])
    return lax.complex(x[..., :n], imag)


def slot_residual(x: Float[Array, "P"], args: tuple) -> Float[Array, "R"]:  # noqa: F821
    """One slot's residuals `V - g[ant1] M conj(g[ant2])`, as reals (2B)."""
    vis, model, ant1, ant2, ref = args
    g = to_gains(x, ref)
    r = vis - g[ant1] * model * jnp.conj(g[ant2])
    return jnp.concatenate([r.real, r.imag])


class SlotFit(eqx.Module):
    """Fitted gains, and the solver's step count and success, per slot."""

    gains: Complex[Array, "T F A"]
    steps: Int[Array, "T F"]
    converged: Bool[Array, "T F"]


def make_solver(
    rtol: float = 1e-5, atol: float = 1e-5, linear_solver: str = "cholesky"
) -> optx.LevenbergMarquardt:
    """Levenberg-Marquardt. `"cholesky"` solves each damped step by the normal
    equations (`lineax.Normal(lineax.Cholesky())`); `"qr"` is optimistix's default,
    `lineax.QR()`, better conditioned but slow on XLA:CPU for large matrices."""
    if linear_solver == "cholesky":
        solve = lx.Normal(lx.Cholesky())
    elif linear_solver == "qr":
        solve = lx.QR()
    else:
        raise ValueError(
            f"`linear_solver` must be 'cholesky' or 'qr', but got {linear_solver!r}."
        )
    return optx.LevenbergMarquardt(rtol=rtol, atol=atol, linear_solver=solve)


def solve_slot(
    vis: Complex[Array, "T F B"],
    model: Complex[Array, "T F B"],
    ant1: Int[Array, "B"],  # noqa: F821
    ant2: Int[Array, "B"],  # noqa: F821
    g0: Complex[Array, "A"],  # noqa: F821
    ref: int,
    solver: optx.AbstractLeastSquaresSolver,
) -> SlotFit:
    """The gains of *one* slot. The annotations describe the whole arrays; the body
    sees `vis`, `model`: (B,), `ant1`, `ant2`: (B,), `g0`: (A,). The return type's
    fields name `T F`, so `T` and `F` are mapped (`A` is declared core); `B`, named
    by no output, is core. `ref` and `solver` are not arrays: passed through."""
    sol = optx.least_squares(
        slot_residual,
        solver,
        to_params(g0, ref),
        args=(vis, model, ant1, ant2, ref),
        max_steps=100,
        throw=False,
    )
    return SlotFit(
        gains=to_gains(sol.value, ref),
        steps=sol.stats["num_steps"],
        converged=sol.result == optx.RESULTS.successful,
    )


# --8<-- [end:slot]


# --8<-- [start:map]
@ft.cache  # one jitted function per strategy, so that calls reuse its compile
def per_slot(
    t_chunk: int | None = None,
    plan: str | None = None,
    memory_budget: int | None = None,
    verbose: bool = False,
) -> Callable[..., SlotFit]:
    """`solve_slot` mapped over `T F`, jitted. All vmapped by default; with
    `t_chunk`, a scan over `T` (in chunks of `t_chunk` times, vmapped inside);
    `plan="auto"` lets the planner choose under `memory_budget` (bytes)."""
    scan = None if t_chunk is None else "T" if t_chunk == 1 else {"T": t_chunk}
    mapped = filter_multi_vmap(
        solve_slot,
        core="A",
        scan=scan,
        plan=plan,
        memory_budget=memory_budget,
        verbose=verbose,
    )
    return jax.jit(mapped, static_argnames=("ref", "solver"))


def calibrate(
    vis: Complex[Array, "T F B"],
    model: Complex[Array, "T F B"],
    ant1: Int[Array, "B"],  # noqa: F821
    ant2: Int[Array, "B"],  # noqa: F821
    g0: Complex[Array, "A"] | None = None,  # noqa: F821
    *,
    n_antennas: int | None = None,
    ref: int = 0,
    solver: optx.AbstractLeastSquaresSolver | None = None,
    t_chunk: int | None = None,
    plan: str | None = None,
    memory_budget: int | None = None,
) -> SlotFit:
    """Fit the gains of every slot: the entry point a user calls. Checks the
    antenna indices, then runs `per_slot(t_chunk, plan, memory_budget)`. `g0` (the
    starting gains, shared by every slot) defaults to ones for `n_antennas`
    antennas (default: the largest index in `ant1` and `ant2`, plus 1)."""
    if g0 is None:
        if n_antennas is None:
            n_antennas = int(max(np.max(ant1), np.max(ant2))) + 1
        g0 = jnp.ones((n_antennas,), jnp.complex64)
    check_baselines(ant1, ant2, g0.shape[-1], ref)
    solver = make_solver() if solver is None else solver
    fit = per_slot(t_chunk, plan, memory_budget)
    return fit(vis, model, ant1, ant2, g0, ref=ref, solver=solver)


# --8<-- [end:map]


#
# One dense solve.
#


# --8<-- [start:dense]
@ft.partial(jax.jit, static_argnames=("ref", "solver"))
def solve_dense(vis, model, ant1, ant2, g0, ref, solver):
    """The same fit as one Levenberg-Marquardt over all `T F (2A - 1)` unknowns at
    once: its Jacobian is dense, `(T F 2B) x (T F (2A - 1))`. Returns the gains
    (T, F, A), the step count and whether it converged."""
    n_t, n_f, _ = vis.shape
    x0 = jnp.broadcast_to(to_params(g0, ref), (n_t, n_f, 2 * g0.shape[-1] - 1))

    def residual(x, args):  # every slot's residuals, from every slot's unknowns
        x = x.reshape(x0.shape)
        per = lambda xs, v, m: slot_residual(xs, (v, m, ant1, ant2, ref))  # noqa: E731
        return jax.vmap(jax.vmap(per))(x, vis, model).reshape(-1)

    sol = optx.least_squares(
        residual, solver, x0.reshape(-1), max_steps=100, throw=False
    )
    return (
        to_gains(sol.value.reshape(x0.shape), ref),
        sol.stats["num_steps"],
        sol.result == optx.RESULTS.successful,
    )


# --8<-- [end:dense]


#
# Jacobians by named dims.
#


# --8<-- [start:jacobian]
def predict_slot(
    gains: Float[Array, "T F A 2"],
    model: Complex[Array, "T F B"],
    ant1: Int[Array, "B"],  # noqa: F821
    ant2: Int[Array, "B"],  # noqa: F821
) -> Float[Array, "T F B 2"]:
    """One slot's model visibilities from its gains, as (re, im) pairs."""
    g = lax.complex(gains[:, 0], gains[:, 1])
    v = g[ant1] * model * jnp.conj(g[ant2])
    return jnp.stack([v.real, v.imag], axis=-1)


predict = jax.jit(filter_multi_vmap(predict_slot))

# The element's Jacobian, d(vis[b, i]) / d(gains[a, j]): (B, 2, A, 2) per slot. The
# output dims say what it is: for each t and f, the block of that slot.
jacobian_blocks = jax.jit(
    filter_multi_vmap(
        jax.jacfwd(predict_slot),
        in_dims={"gains": "T F A 2", "model": "T F B", "ant1": "B", "ant2": "B"},
        out_dims="T F B 2 A 2",
        core=("B", "A"),
    )
)
# The Jacobian of the whole map: (T, F, B, 2, T, F, A, 2), zero off the diagonal
# of (t, f) x (t', f').
jacobian_dense = jax.jit(jax.jacfwd(filter_multi_vmap(predict_slot)))


# --8<-- [end:jacobian]


#
# A note for XLA:CPU: 2x2 complex products.
#


# --8<-- [start:jones]
def jones_matmul(a, b, c):
    """`a @ b @ c^H` for stacks of 2x2 complex matrices, with `jnp.matmul`."""
    return a @ b @ jnp.conj(jnp.swapaxes(c, -1, -2))


def jones_elementwise(a, b, c):
    """The same product written out element by element."""
    a00, a01, a10, a11 = a[..., 0, 0], a[..., 0, 1], a[..., 1, 0], a[..., 1, 1]
    b00, b01, b10, b11 = b[..., 0, 0], b[..., 0, 1], b[..., 1, 0], b[..., 1, 1]
    c00, c01, c10, c11 = (jnp.conj(c[..., i, j]) for i in (0, 1) for j in (0, 1))
    ab00, ab01 = a00 * b00 + a01 * b10, a00 * b01 + a01 * b11
    ab10, ab11 = a10 * b00 + a11 * b10, a10 * b01 + a11 * b11
    # (a b c^H)_ij = sum_k (a b)_ik conj(c_jk)
    row0 = jnp.stack([ab00 * c00 + ab01 * c01, ab00 * c10 + ab01 * c11], axis=-1)
    row1 = jnp.stack([ab10 * c00 + ab11 * c01, ab10 * c10 + ab11 * c11], axis=-1)
    return jnp.stack([row0, row1], axis=-2)


# --8<-- [end:jones]


#
# Measuring.
#


def compile_timed(jitted, *args, **kwargs):
    """`jitted.lower(...).compile()`, and the seconds it took."""
    t0 = time.perf_counter()
    compiled = jitted.lower(*args, **kwargs).compile()
    return compiled, time.perf_counter() - t0


def ft_call(compiled, args):
    """A thunk that calls `compiled(*args)`."""
    return lambda: compiled(*args)


def traced_nest(printed: str) -> str:
    """The nest that `verbose=True` printed when `solve_slot` was traced."""
    lines = [
        line.split(": ", 1)[1].removesuffix(" -> body")
        for line in printed.splitlines()
        if line.startswith("filter_multi_vmap(solve_slot): ") and "-> body" in line
    ]
    if not lines:
        raise RuntimeError(f"no nest was printed while tracing; got:\n{printed}")
    return lines[-1]


def temp_bytes(compiled) -> int:
    """XLA's compiled temporaries: the peak scratch memory of one call."""
    return int(compiled.memory_analysis().temp_size_in_bytes)


def interleaved_medians(thunks: dict[str, Callable[[], Any]], repeats: int):
    """The median seconds of each thunk, run in rounds (the order rotating each
    round), so that a change in the machine's load affects all of them alike; and
    each thunk's output."""
    names = list(thunks)
    times: dict[str, list[float]] = {n: [] for n in names}
    outputs = {}
    for r in range(repeats):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            outputs[n] = jax.block_until_ready(thunks[n]())
            times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(ts) for n, ts in times.items()}, outputs


def rms_residual(obs: Observation, gains: jax.Array) -> float:
    """`sqrt(mean |V - g[ant1] M conj(g[ant2])|^2)` over every visibility."""
    pred = gains[..., obs.ant1] * obs.model * jnp.conj(gains[..., obs.ant2])
    return float(jnp.sqrt(jnp.mean(jnp.abs(obs.vis - pred) ** 2)))


def in_gauge(gains: jax.Array, ref: int) -> jax.Array:
    """Gains rotated so that the reference antenna's phase is 0, slot by slot."""
    angle = jnp.angle(gains[..., ref : ref + 1])
    return gains * lax.complex(jnp.cos(angle), -jnp.sin(angle))


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


@dataclasses.dataclass
class Figures:
    """What `run` measured; `main` prints it."""

    sizes: dict[str, int]
    noise: float
    expected_rms: float  # the noise left after fitting 2A - 1 reals to 2B per slot
    per_slot: dict[str, dict[str, Any]]  # by strategy: nest, compile_s, temp, ...
    dense: dict[str, Any]
    speedup: float
    max_gain_error: float  # |fitted - true| in the gauge, per-slot fit
    max_diff_dense: float  # |per-slot - dense| gains
    jacobian: dict[str, Any]
    matmul: dict[str, Any]
    fits: dict[str, SlotFit] = dataclasses.field(repr=False)


def run(
    n_times: int = 8,
    n_freqs: int = 4,
    n_antennas: int = 12,
    n_sources: int = 5,
    noise: float = 0.1,
    *,
    ref: int = 0,
    t_chunk: int = 1,
    memory_budget: int | None = None,
    linear_solver: str = "cholesky",
    repeats: int = 3,
    dense: bool = True,
    matmul_size: int = 1 << 16,
    seed: int = 0,
) -> Figures:
    """Simulate, fit per slot three ways and densely, compare; return the figures.

    `memory_budget` (bytes) for `plan="auto"` defaults to half the compiled
    temporaries of the all-vmapped fit, so that the planner has to scan."""
    obs = simulate(jax.random.key(seed), n_times, n_freqs, n_antennas, n_sources, noise)
    n_b = int(obs.ant1.shape[0])
    g0 = jnp.ones((n_antennas,), jnp.complex64)
    check_baselines(obs.ant1, obs.ant2, n_antennas, ref)
    solver = make_solver(linear_solver=linear_solver)
    args = (obs.vis, obs.model, obs.ant1, obs.ant2, g0)
    static = dict(ref=ref, solver=solver)

    # Per slot, three ways. Compiling `plan="auto"` plans it (several compiles).
    # `verbose=True` prints each nest as it is traced: kept for the table.
    strategies = {
        "vmap": {},
        "scan": dict(t_chunk=t_chunk),
        "auto": dict(plan="auto", memory_budget=memory_budget),
    }
    compiled, seconds, nests = {}, {}, {}
    for name, strategy in strategies.items():
        if name == "auto" and memory_budget is None:
            strategy["memory_budget"] = max(temp_bytes(compiled["vmap"]) // 2, 1)
        fn = per_slot(**strategy, verbose=True)
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            compiled[name], seconds[name] = compile_timed(fn, *args, **static)
        nests[name] = traced_nest(printed.getvalue())
    memory_budget = strategies["auto"]["memory_budget"]

    thunks = {k: ft_call(c, args) for k, c in compiled.items()}
    if dense:
        dense_c, dense_s = compile_timed(solve_dense, *args, **static)
        thunks["dense"] = ft_call(dense_c, args)
    medians, fits = interleaved_medians(thunks, repeats)
    dense_out = fits.pop("dense", None)

    reference = fits["vmap"]
    per_slot_figs = {}
    for k, c in compiled.items():
        per_slot_figs[k] = dict(
            nest=nests[k],
            compile_s=seconds[k],
            temp=temp_bytes(c),
            run_s=medians[k],
            rms=rms_residual(obs, fits[k].gains),
            max_diff=float(jnp.max(jnp.abs(fits[k].gains - reference.gains))),
            steps=int(jnp.max(fits[k].steps)),
            converged=bool(jnp.all(fits[k].converged)),
        )
    per_slot_figs["auto"]["budget"] = memory_budget

    n_unknown = n_times * n_freqs * (2 * n_antennas - 1)
    n_resid = n_times * n_freqs * 2 * n_b
    dense_figs: dict[str, Any] = dict(unknowns=n_unknown, residuals=n_resid)
    speedup = float("nan")
    max_diff_dense = float("nan")
    if dense_out is not None:
        gains_d, steps_d, conv_d = dense_out
        dense_figs.update(
            compile_s=dense_s,
            temp=temp_bytes(dense_c),
            run_s=medians["dense"],
            rms=rms_residual(obs, gains_d),
            steps=int(steps_d),
            converged=bool(conv_d),
        )
        speedup = medians["dense"] / medians["vmap"]
        max_diff_dense = float(jnp.max(jnp.abs(gains_d - reference.gains)))

    # Jacobians by named dims.
    gains_ri = jnp.stack([obs.gains.real, obs.gains.imag], axis=-1)  # T F A 2
    jargs = (gains_ri, obs.model, obs.ant1, obs.ant2)
    jb_c, _ = compile_timed(jacobian_blocks, *jargs)
    blocks = np.asarray(jb_c(*jargs))
    jacobian: dict[str, Any] = dict(
        blocks_shape=blocks.shape,
        blocks_bytes=blocks.nbytes,
        blocks_temp=temp_bytes(jb_c),
    )
    if dense:  # the whole map's Jacobian is (T F)^2 B A 16 bytes: dense too
        jd_c, _ = compile_timed(jacobian_dense, *jargs)
        whole = np.asarray(jd_c(*jargs))
        jacobian.update(
            dense_shape=whole.shape,
            dense_bytes=whole.nbytes,
            dense_temp=temp_bytes(jd_c),
            **compare_jacobians(blocks, whole),
        )

    # Milliseconds each, so cheap to repeat more: a steadier median.
    matmul = measure_matmul(matmul_size, repeats=max(5 * repeats, 15), seed=seed)

    return Figures(
        sizes=dict(T=n_times, F=n_freqs, A=n_antennas, B=n_b, S=n_sources),
        noise=noise,
        expected_rms=noise * float(np.sqrt(1 - (2 * n_antennas - 1) / (2 * n_b))),
        per_slot=per_slot_figs,
        dense=dense_figs,
        speedup=speedup,
        max_gain_error=float(
            jnp.max(jnp.abs(reference.gains - in_gauge(obs.gains, ref)))
        ),
        max_diff_dense=max_diff_dense,
        jacobian=jacobian,
        matmul=matmul,
        fits=fits,
    )


def compare_jacobians(blocks: np.ndarray, whole: np.ndarray) -> dict[str, Any]:
    """Checks that `whole` (T F B 2 T F A 2) is `blocks` (T F B 2 A 2) on its
    (t, f) = (t', f') diagonal, exactly, and zero elsewhere."""
    n_t, n_f, n_b, _, n_a, _ = blocks.shape
    n = n_t * n_f
    w = whole.reshape(n, n_b * 2, n, n_a * 2)
    diag = np.stack([w[i, :, i, :] for i in range(n)])
    off = w.copy()
    for i in range(n):
        off[i, :, i, :] = 0
    same = bool(np.array_equal(diag, blocks.reshape(n, n_b * 2, n_a * 2)))
    return dict(
        diagonal_equal=same,
        off_diagonal_zero=bool(not np.any(off)),
        nonzero=int(np.count_nonzero(whole)),
        nonzero_blocks=int(np.count_nonzero(blocks)),
    )


def measure_matmul(n: int, repeats: int = 5, seed: int = 0) -> dict[str, Any]:
    """Time `a @ b @ c^H` over `n` 2x2 complex64 matrices, both ways."""
    k = jax.random.split(jax.random.key(seed + 1), 6)
    a, b, c = (
        lax.complex(
            jax.random.normal(k[2 * i], (n, 2, 2)),
            jax.random.normal(k[2 * i + 1], (n, 2, 2)),
        )
        for i in range(3)
    )
    mm, _ = compile_timed(jax.jit(jones_matmul), a, b, c)
    ew, _ = compile_timed(jax.jit(jones_elementwise), a, b, c)
    err = float(jnp.max(jnp.abs(mm(a, b, c) - ew(a, b, c))))
    med, _ = interleaved_medians(
        {"matmul": ft_call(mm, (a, b, c)), "elementwise": ft_call(ew, (a, b, c))},
        repeats,
    )
    return dict(
        n=n,
        matmul_s=med["matmul"],
        elementwise_s=med["elementwise"],
        ratio=med["matmul"] / med["elementwise"],
        max_abs_diff=err,
    )


def print_figures(fig: Figures) -> None:
    s = fig.sizes
    print(
        f"T={s['T']} times x F={s['F']} freqs, A={s['A']} antennas "
        f"(B={s['B']} baselines), S={s['S']} sources; noise {fig.noise} per "
        f"visibility, so an rms residual of ~{fig.expected_rms:.4f} is expected"
    )
    print(
        f"on {jax.devices()[0].device_kind}, JAX {jax.__version__}; times are "
        "medians of interleaved runs after compiling"
    )
    print()
    keys = ("compile_s", "temp", "run_s", "rms", "steps", "converged")
    rows = [
        ("per slot, " + k, f["nest"], *(f[x] for x in keys))
        for k, f in fig.per_slot.items()
    ]
    d = fig.dense
    if "run_s" in d:
        shape = f"{d['unknowns']} unknowns, {d['residuals']} residuals"
        rows.append(("one dense LM", shape, *(d[x] for x in keys)))
    head = ("solve", "nest", "compile", "temp memory", "run", "rms residual")
    head += ("max steps", "converged")
    table = [head] + [
        (a, b, f"{c:.2f} s", fmt_bytes(t), f"{r * 1e3:.2f} ms", f"{e:.5f}")
        + (str(st), str(cv))
        for a, b, c, t, r, e, st, cv in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for j, row in enumerate(table):
        print(" | ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip())
        if j == 0:
            print("-+-".join("-" * w for w in widths))
    print()
    auto = fig.per_slot["auto"]
    print(
        f"plan='auto' with memory_budget={auto['budget']} ({fmt_bytes(auto['budget'])})"
        f" chose {auto['nest']}"
    )
    diffs = ", ".join(f"{k} {f['max_diff']:.1e}" for k, f in fig.per_slot.items())
    print(f"max |gains - gains of vmap|: {diffs}")
    print(
        f"max |fitted - true gains| (reference antenna phase 0): "
        f"{fig.max_gain_error:.4f}"
    )
    if "run_s" in d:
        print(f"max |per slot - dense gains|: {fig.max_diff_dense:.1e}")
        print(
            f"speedup of the per-slot fit (vmap) over the dense one: "
            f"{fig.speedup:.0f}x; temporaries {fmt_bytes(fig.per_slot['vmap']['temp'])}"
            f" vs {fmt_bytes(d['temp'])} "
            f"({d['temp'] / fig.per_slot['vmap']['temp']:.0f}x)"
        )
    j = fig.jacobian
    print()
    print(
        f"Jacobian blocks, T F B 2 A 2 = {list(j['blocks_shape'])}: "
        f"{fmt_bytes(j['blocks_bytes'])} (compiled temporaries "
        f"{fmt_bytes(j['blocks_temp'])})"
    )
    if "dense_shape" in j:
        print(
            f"jax.jacfwd of the whole map, {list(j['dense_shape'])}: "
            f"{fmt_bytes(j['dense_bytes'])} (compiled temporaries "
            f"{fmt_bytes(j['dense_temp'])}); "
            f"{j['dense_bytes'] / j['blocks_bytes']:.0f}x the memory"
        )
        print(
            f"same entries on the (t, f) diagonal: {j['diagonal_equal']}; zero off "
            f"it: {j['off_diagonal_zero']}; nonzero entries {j['nonzero']} vs "
            f"{j['nonzero_blocks']}"
        )
    m = fig.matmul
    print()
    print(
        f"XLA:CPU, a @ b @ c^H over {m['n']} 2x2 complex64 matrices: jnp.matmul "
        f"{m['matmul_s'] * 1e3:.2f} ms, written out element by element "
        f"{m['elementwise_s'] * 1e3:.2f} ms: matmul is {m['ratio']:.1f}x the time "
        f"(max |difference| {m['max_abs_diff']:.1e})"
    )


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only where it is a value (not `None` or a flag's `False`)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def main(argv: list[str] | None = None) -> Figures:
    parser = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split()),  # first paragraph
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--times", type=int, default=8, help="T")
    parser.add_argument("--freqs", type=int, default=4, help="F")
    parser.add_argument(
        "--antennas", type=int, default=12, help="A; the baselines B = A (A - 1) / 2"
    )
    parser.add_argument("--sources", type=int, default=5, help="sky model sources")
    parser.add_argument("--noise", type=float, default=0.1, help="std per visibility")
    parser.add_argument(
        "--quick", action="store_true", help="T=3, F=2, A=5: a smoke test"
    )
    parser.add_argument("--ref-antenna", type=int, default=0, help="phase 0 here")
    parser.add_argument("--t-chunk", type=int, default=1, help="the scan's chunk of T")
    parser.add_argument(
        "--memory-budget",
        type=int,
        default=None,
        help="bytes, for plan='auto' (default: half the all-vmap fit's temporaries)",
    )
    parser.add_argument(
        "--linear-solver",
        choices=("cholesky", "qr"),
        default="cholesky",
        help="LM's linear solve, for both fits",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each")
    parser.add_argument(
        "--no-dense",
        action="store_true",
        help="skip the dense solve and the whole map's Jacobian (for large sizes)",
    )
    parser.add_argument(
        "--matmul-size", type=int, default=1 << 16, help="2x2 products timed"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="random seed of the simulated data"
    )
    args = parser.parse_args(argv)
    sizes = (args.times, args.freqs, args.antennas)
    repeats = args.repeats
    if args.quick:
        sizes = (3, 2, 5)
    positive = [("--times", sizes[0]), ("--freqs", sizes[1])]
    positive += [("--sources", args.sources), ("--t-chunk", args.t_chunk)]
    positive += [("--repeats", repeats), ("--matmul-size", args.matmul_size)]
    for name, n in positive:
        if n < 1:
            parser.error(f"`{name}` must be at least 1, but got {n}.")
    if args.noise < 0:
        parser.error(f"`--noise` must be at least 0, but got {args.noise}.")
    fig = run(
        *sizes,
        n_sources=args.sources,
        noise=args.noise,
        ref=args.ref_antenna,
        t_chunk=min(args.t_chunk, sizes[0]),
        memory_budget=args.memory_budget,
        linear_solver=args.linear_solver,
        repeats=repeats,
        dense=not args.no_dense,
        matmul_size=args.matmul_size,
        seed=args.seed,
    )
    print_figures(fig)
    return fig


if __name__ == "__main__":
    main()
