"""The worked example `examples/radio_interferometry.py`, run on small sizes."""

import importlib.util
import pathlib

import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
import pytest
from eqx_multimap import ShapeError


_PATH = pathlib.Path(__file__).parent.parent / "examples" / "radio_interferometry.py"
_spec = importlib.util.spec_from_file_location("radio_interferometry", _PATH)
assert _spec is not None and _spec.loader is not None
ri = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ri)


def numpy_reference(sky, gains, layout, hour_angle, freq):
    """The measurement equation by plain loops over t, f, b and s, in float64."""
    l = np.asarray(sky.l, np.float64)
    m = np.asarray(sky.m, np.float64)
    bright = np.asarray(sky.brightness, np.complex128)  # (F, S, 2, 2)
    jones = np.asarray(gains.jones, np.complex128)  # (T, F, A, 2, 2)
    xyz = np.asarray(layout.antennas, np.float64)  # (A, 3)
    ant1, ant2 = np.asarray(layout.ant1), np.asarray(layout.ant2)
    dec = float(layout.dec)
    n_t, n_f, n_b, n_s = len(hour_angle), len(freq), len(ant1), len(l)
    out = np.zeros((n_t, n_f, n_b, 2, 2), np.complex128)
    for t in range(n_t):
        h = float(hour_angle[t])
        rot = np.array(
            [
                [np.sin(h), np.cos(h), 0.0],
                [-np.sin(dec) * np.cos(h), np.sin(dec) * np.sin(h), np.cos(dec)],
                [np.cos(dec) * np.cos(h), -np.cos(dec) * np.sin(h), np.sin(dec)],
            ]
        )
        for f in range(n_f):
            nu = float(freq[f])
            for b in range(n_b):
                p, q = ant1[b], ant2[b]
                u, v, w = rot @ (xyz[p] - xyz[q])
                for s in range(n_s):
                    n = np.sqrt(1.0 - l[s] ** 2 - m[s] ** 2)
                    delay = u * l[s] + v * m[s] + w * (n - 1.0)
                    k = np.exp(-2j * np.pi * delay * nu / ri.C)
                    out[t, f, b] += (
                        jones[t, f, p] @ (k * bright[f, s]) @ jones[t, f, q].conj().T
                    )
    return out


def hand_nest(sky, gains, layout, hour_angle, freq, t_chunk=None):
    """The same map written by hand: `lax.map` over T (in batches of `t_chunk`) of
    vmap over F of vmap over B."""

    def per_time(ha, jones_t):
        def per_freq(nu, bright_f, jones_tf):
            def per_baseline(p, q):
                return ri.visibility(
                    ri.SkyModel(l=sky.l, m=sky.m, brightness=bright_f),
                    ri.Gains(jones=jones_tf),
                    ri.Layout(antennas=layout.antennas, ant1=p, ant2=q, dec=layout.dec),
                    ha,
                    nu,
                )

            return jax.vmap(per_baseline)(layout.ant1, layout.ant2)

        return jax.vmap(per_freq)(freq, sky.brightness, jones_t)

    xs = (hour_angle, gains.jones)
    return lax.map(lambda x: per_time(*x), xs, batch_size=t_chunk)


@pytest.mark.slow
@pytest.mark.parametrize(
    "sizes, t_chunk",
    [
        ((4, 8, 6, 5), None),  # the defaults of `main`
        ((3, 2, 2, 1), None),  # one baseline, one source
        ((5, 3, 4, 3), 2),  # chunked scan over T with a remainder of 1
    ],
)
def test_against_numpy_loop_and_hand_nest(sizes, t_chunk):
    n_t, n_f, n_a, n_s = sizes
    problem = ri.make_problem(jax.random.key(0), n_t, n_f, n_a, n_s)
    vis = ri.predict(t_chunk)(*problem)
    n_b = n_a * (n_a - 1) // 2
    assert vis.shape == (n_t, n_f, n_b, 2, 2)
    assert vis.dtype == jnp.complex64

    hand = jax.jit(hand_nest, static_argnums=5)(*problem, t_chunk)
    assert hand.shape == vis.shape and hand.dtype == vis.dtype
    np.testing.assert_array_equal(vis, hand)

    ref = numpy_reference(*problem)
    scale = np.abs(ref).max()
    # float32 phases of up to ~3000 rad: errors of ~1e-4 rad per source.
    np.testing.assert_allclose(vis, ref, rtol=0, atol=2e-4 * scale)


@pytest.mark.slow
@pytest.mark.parametrize(
    "sizes, t_chunk",
    [((6, 3, 4, 3), None), ((5, 2, 3, 2), 2)],  # the second: a remainder of 1
)
def test_time_average_against_numpy_loop(sizes, t_chunk):
    n_t, n_f, n_a, n_s = sizes
    problem = ri.make_problem(jax.random.key(3), n_t, n_f, n_a, n_s)
    mean = ri.average(t_chunk)(*problem)
    n_b = n_a * (n_a - 1) // 2
    assert mean.shape == (n_f, n_b, 2, 2) and mean.dtype == jnp.complex64
    # The numpy loop accumulates over t itself, in float64.
    ref = numpy_reference(*problem).sum(axis=0) / n_t
    scale = np.abs(ref).max()
    np.testing.assert_allclose(mean, ref, rtol=0, atol=2e-4 * scale)


def test_time_average_has_no_time_axis_in_memory():
    # The scan carries one (F, B, 2, 2) sum: no (T, F, B, 2, 2) output or temporary.
    def problem(n_times):
        make = lambda key: ri.make_problem(key, n_times, 2, 3, 2)  # noqa: E731
        return jax.eval_shape(make, jax.random.key(4))

    small, large = problem(8), problem(256)

    def temp(*problem):
        compiled = ri.average().lower(*problem).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temp(*large) == temp(*small)


@pytest.mark.slow
def test_time_is_a_real_loop():
    problem = ri.make_problem(jax.random.key(1), 3, 2, 3, 2)
    jaxpr = jax.make_jaxpr(ri.predict())(*problem)
    eqns = jaxpr.jaxpr.eqns
    # `jax.jit` puts the map in one call; the scan is the nest's outer level.
    inner = eqns[0].params["jaxpr"].jaxpr.eqns if len(eqns) == 1 else eqns
    scans = [e for e in inner if e.primitive is lax.scan_p]
    assert len(scans) == 1
    assert scans[0].params["length"] == 3


@pytest.mark.slow
def test_mismatched_times_name_the_field_and_the_argument():
    problem = ri.make_problem(jax.random.key(2), 2, 3, 4, 2)
    sky, gains, layout, hour_angle, freq = problem
    bad = ri.Gains(jones=gains.jones[:1])  # 1 time, but 2 hour angles
    matches = [
        r"inconsistent sizes for dim 'T'",
        r"size 1: `gains\.jones` axis 0 \(complex64\[1,3,4,2,2\]",
        r"size 2: `hour_angle` axis 0 \(float32\[2\]",
    ]
    for match in matches:
        with pytest.raises(ShapeError, match=match):
            ri.predict()(sky, bad, layout, hour_angle, freq)


@pytest.mark.slow
def test_main_runs(capsys):
    assert ri.main(["--times", "3", "--freqs", "2", "--antennas", "3"]) == 0
    out = capsys.readouterr().out
    assert "scan(T=3) -> vmap(F=2) -> vmap(B=3) -> body" in out
    assert "visibilities: complex64[3, 2, 3, 2, 2]" in out
    assert "-> body; reduce={'T': 'mean'}" in out
    assert "time-averaged visibilities: complex64[2, 3, 2, 2]" in out
