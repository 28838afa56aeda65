"""Predict radio-interferometer visibilities over time x frequency x baseline.

A worked example of `eqx_multimap.filter_multi_vmap`. The measurement equation for
a sky of point sources seen through direction-independent antenna gains is, for the
baseline between antennas `p` and `q` at time `t` and frequency `nu`,

    V_pq(t, nu) = sum_s  G_p(t, nu)  K_pq,s(t, nu)  B_s(nu)  G_q(t, nu)^H

where `B_s` is the 2x2 brightness (coherency) matrix of source `s`, `G_p` the 2x2
Jones matrix of antenna `p`, and `K` the geometric phase

    K_pq,s = exp(-2 pi i (u l_s + v m_s + w (n_s - 1)) nu / c)
    n_s = sqrt(1 - l_s^2 - m_s^2)

with `(u, v, w)` the baseline in metres, rotated to the phase centre at hour angle
`t`. The function `visibility` is written for *one* (time, frequency, baseline)
element; `filter_multi_vmap` maps it over `T x F x B`: a `scan` over `T` (a real
loop, so memory stays bounded as the observation grows) with `vmap`s over `F` and
`B` inside it.

`average` accumulates instead: the time-averaged visibilities, `mean_t V_pq(t, nu)`,
as `reduce={"T": "mean"}`. The scan over `T` sums into its loop carry, so memory does
not grow with the number of times, and no `(T, F, B, 2, 2)` array is ever made.

    python examples/radio_interferometry.py                      # small sizes
    python examples/radio_interferometry.py --times 64 --freqs 128 --antennas 64
    python examples/radio_interferometry.py --t-chunk 8           # scan chunks of 8
"""

import argparse
import time

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from eqx_multimap import filter_multi_vmap
from jaxtyping import Array, Complex, Float, Int


C = 299_792_458.0  # speed of light, m/s


class SkyModel(eqx.Module):
    """Point sources: direction cosines and a 2x2 brightness matrix per frequency."""

    l: Float[Array, "S"]  # noqa: F821
    m: Float[Array, "S"]  # noqa: F821
    brightness: Complex[Array, "F S 2 2"]


class Gains(eqx.Module):
    """A 2x2 Jones matrix per antenna, over time and frequency."""

    jones: Complex[Array, "T F A 2 2"]


class Layout(eqx.Module):
    """Antenna positions, the baselines as antenna-index pairs, the phase centre."""

    antennas: Float[Array, "A 3"]  # equatorial X, Y, Z in metres
    ant1: Int[Array, "B"]  # noqa: F821
    ant2: Int[Array, "B"]  # noqa: F821
    dec: Float[Array, ""]  # declination of the phase centre, radians


def uvw(
    baseline: Float[Array, "3"], hour_angle: Float[Array, ""], dec: Float[Array, ""]
) -> Float[Array, "3"]:
    """Rotate an equatorial baseline `(X, Y, Z)` to `(u, v, w)` at the phase centre."""
    x, y, z = baseline
    sh, ch = jnp.sin(hour_angle), jnp.cos(hour_angle)
    sd, cd = jnp.sin(dec), jnp.cos(dec)
    return jnp.stack(
        [
            sh * x + ch * y,
            -sd * ch * x + sd * sh * y + cd * z,
            cd * ch * x - cd * sh * y + sd * z,
        ]
    )


def visibility(
    sky: SkyModel,
    gains: Gains,
    layout: Layout,
    hour_angle: Float[Array, "T"],  # noqa: F821
    freq: Float[Array, "F"],  # noqa: F821
) -> Complex[Array, "T F B 2 2"]:
    """The visibility of one baseline at one time and one frequency.

    Inside the map the arguments are one element each: `hour_angle` and `freq` are
    scalars, `sky.brightness` is `(S, 2, 2)`, `gains.jones` is `(A, 2, 2)`, and
    `layout.ant1`, `layout.ant2` are the two antenna indices of this baseline.
    """
    p, q = layout.ant1, layout.ant2
    u, v, w = uvw(layout.antennas[p] - layout.antennas[q], hour_angle, layout.dec)
    r2 = sky.l**2 + sky.m**2
    n_minus_1 = -r2 / (1 + jnp.sqrt(1 - r2))  # n - 1 without cancellation
    phase = (-2 * jnp.pi / C) * freq * (u * sky.l + v * sky.m + w * n_minus_1)  # (S,)
    k = lax.complex(jnp.cos(phase), jnp.sin(phase))  # exp(i phase): (S,), complex64
    coherency = jnp.sum(k[:, None, None] * sky.brightness, axis=0)  # (2, 2)
    g_p, g_q = gains.jones[p], gains.jones[q]
    return g_p @ coherency @ jnp.conj(g_q).T


def predict(t_chunk: int | None = None, verbose: bool = False):
    """`visibility` mapped over `T x F x B`: scan over `T` (in chunks of `t_chunk`
    times if given), vmap over `F` and `B`; jitted.

    The dims of every argument come from the jaxtyping annotations of `visibility`
    and of the modules' fields; the output order from its return annotation.
    """
    mapped = filter_multi_vmap(
        visibility,
        scan={"T": t_chunk},
        vmap="F B",
        verbose=verbose,
    )
    return jax.jit(mapped)


def average(t_chunk: int | None = None, verbose: bool = False):
    """The time-averaged visibilities, `mean_t V_pq(t, nu)`: `visibility` mapped over
    `T x F x B` and averaged over `T` inside the scan; jitted.

    `out_dims` overrides the return annotation, which names `T`: the average has no
    time axis.
    """
    mapped = filter_multi_vmap(
        visibility,
        out_dims="F B 2 2",
        reduce={"T": "mean"},
        scan={"T": t_chunk},
        vmap="F B",
        verbose=verbose,
    )
    return jax.jit(mapped)


def make_problem(
    key: jax.Array,
    n_times: int = 4,
    n_freqs: int = 8,
    n_antennas: int = 6,
    n_sources: int = 5,
) -> tuple[SkyModel, Gains, Layout, jax.Array, jax.Array]:
    """A random but physically sensible observation.

    Antennas within 1 km, sources within 0.05 of the phase centre with a power-law
    spectrum and a few percent of linear and circular polarisation, gains near the
    identity that drift slowly over time and frequency. Returns
    `(sky, gains, layout, hour_angle, freq)`.
    """
    keys = jax.random.split(key, 8)
    f32 = jnp.float32
    antennas = jax.random.uniform(keys[0], (n_antennas, 3), f32, -500.0, 500.0)
    ant1, ant2 = np.triu_indices(n_antennas, k=1)
    layout = Layout(
        antennas=antennas,
        ant1=jnp.asarray(ant1, jnp.int32),
        ant2=jnp.asarray(ant2, jnp.int32),
        dec=jnp.asarray(0.6, f32),
    )
    hour_angle = jnp.linspace(-0.5, 0.5, n_times, dtype=f32)  # radians
    freq = jnp.linspace(0.7e9, 2.0e9, n_freqs, dtype=f32)  # Hz

    l, m = jax.random.uniform(keys[1], (2, n_sources), f32, -0.05, 0.05)
    stokes_i = jax.random.uniform(keys[2], (n_sources,), f32, 0.5, 5.0)
    alpha = jax.random.uniform(keys[3], (n_sources,), f32, -1.0, 0.0)
    q, u, v = jax.random.uniform(keys[4], (3, n_sources), f32, -0.05, 0.05)
    spectrum = (freq[:, None] / freq[0]) ** alpha[None, :]  # (F, S)
    i_f = stokes_i[None, :] * spectrum
    q_f, u_f, v_f = (x[None, :] * i_f for x in (q, u, v))
    # Linear feeds: B = [[I + Q, U + iV], [U - iV, I - Q]].
    zero = jnp.zeros_like(i_f)
    brightness = jnp.stack(
        [
            jnp.stack([lax.complex(i_f + q_f, zero), lax.complex(u_f, v_f)], -1),
            jnp.stack([lax.complex(u_f, -v_f), lax.complex(i_f - q_f, zero)], -1),
        ],
        axis=-2,
    )  # (F, S, 2, 2), complex64
    sky = SkyModel(l=l, m=m, brightness=brightness)

    shape = (n_times, n_freqs, n_antennas, 2, 2)
    noise = lax.complex(
        jax.random.normal(keys[5], shape, f32), jax.random.normal(keys[6], shape, f32)
    )
    angle = jax.random.uniform(keys[7], shape[:3] + (1, 1), f32, -0.3, 0.3)
    drift = lax.complex(jnp.cos(angle), jnp.sin(angle))  # (T, F, A, 1, 1)
    eye = jnp.eye(2, dtype=jnp.complex64).reshape(1, 1, 1, 2, 2)
    gains = Gains(jones=drift * eye + 0.05 * noise)
    return sky, gains, layout, hour_angle, freq


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--times", type=int, default=4, help="T (default 4)")
    parser.add_argument("--freqs", type=int, default=8, help="F (default 8)")
    parser.add_argument(
        "--antennas", type=int, default=6, help="A (default 6; B = A (A - 1) / 2)"
    )
    parser.add_argument("--sources", type=int, default=5, help="S (default 5)")
    parser.add_argument(
        "--t-chunk", type=int, default=None, help="scan over chunks of this many times"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    args = parser.parse_args(argv)

    problem = make_problem(
        jax.random.key(args.seed), args.times, args.freqs, args.antennas, args.sources
    )
    sky, gains, layout, hour_angle, freq = problem
    fn = predict(args.t_chunk, verbose=True)
    t0 = time.perf_counter()
    vis = jax.block_until_ready(fn(*problem))
    t_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    vis = jax.block_until_ready(fn(*problem))
    t_run = time.perf_counter() - t0

    n_t, n_f, n_b = vis.shape[:3]
    print(
        f"T={n_t} times x F={n_f} freqs x B={n_b} baselines "
        f"({layout.antennas.shape[0]} antennas), S={sky.l.shape[0]} sources"
    )
    print(f"visibilities: {vis.dtype}{list(vis.shape)}")
    print(f"first call (trace + compile + run): {t_first:.3f} s, then {t_run:.4f} s")
    xx = np.abs(np.asarray(vis[..., 0, 0]))
    print(f"|V_xx|: min {xx.min():.3f}, median {np.median(xx):.3f}, max {xx.max():.3f}")
    mean = jax.block_until_ready(average(args.t_chunk, verbose=True)(*problem))
    print(f"time-averaged visibilities: {mean.dtype}{list(mean.shape)}")
    xx = np.abs(np.asarray(mean[..., 0, 0]))
    print(f"|mean_t V_xx|: median {np.median(xx):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
