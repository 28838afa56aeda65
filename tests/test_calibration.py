"""The worked example `examples/calibration.py`: optimistix fits mapped over T F."""

import importlib.util
import math
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from eqx_multimap import explain, filter_multi_vmap, ShapeError


pytest.importorskip("optimistix")
pytest.importorskip("lineax")

_PATH = pathlib.Path(__file__).parent.parent / "examples" / "calibration.py"
_spec = importlib.util.spec_from_file_location("calibration", _PATH)
assert _spec is not None and _spec.loader is not None
cal = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cal)


def _problem(n_times=3, n_freqs=2, n_antennas=5, seed=0):
    obs = cal.simulate(jax.random.key(seed), n_times, n_freqs, n_antennas)
    g0 = jnp.ones((n_antennas,), jnp.complex64)
    return obs, (obs.vis, obs.model, obs.ant1, obs.ant2, g0)


def _array_shapes(hlo: str) -> set[tuple[int, ...]]:
    """Every array shape in an optimised HLO module's text."""
    shapes = re.findall(r"\b(?:pred|[suf]\d+|c64|c128|bf16)\[([0-9,]*)\]", hlo)
    return {tuple(int(d) for d in s.split(",") if d) for s in shapes}


def test_per_slot_program_has_no_dense_jacobian():
    # The speed structure, not a time: the per-slot fit's optimised HLO holds the
    # Jacobian (and the normal matrix) of each slot, batched over the slots, never
    # the dense Jacobian of all unknowns, which the dense solve does hold.
    n_t, n_f, n_a = 3, 2, 5
    obs, args = _problem(n_t, n_f, n_a)
    n_b = n_a * (n_a - 1) // 2
    n_slot_unknowns, n_slot_residuals = 2 * n_a - 1, 2 * n_b
    n_slots = n_t * n_f
    dense_jacobian = (n_slots * n_slot_residuals) * (n_slots * n_slot_unknowns)
    # The largest array a per-slot LM may build: the augmented system
    # [J; sqrt(lambda) I] of every slot, (2B + P) x P each, batched over the
    # slots. (A dim of size T F P alone proves nothing: the batched normal
    # matrices J^T J, (T F P) x P once flattened, have one.)
    per_slot_bound = n_slots * (n_slot_residuals + n_slot_unknowns) * n_slot_unknowns
    assert per_slot_bound < dense_jacobian

    static = dict(ref=0, solver=cal.make_solver())
    hlo = cal.per_slot().lower(*args, **static).compile().as_text()
    shapes = _array_shapes(hlo)
    assert shapes, "no shapes parsed from the HLO"
    assert max(map(math.prod, shapes)) <= per_slot_bound

    dense_hlo = cal.solve_dense.lower(*args, **static).compile().as_text()
    dense_shapes = _array_shapes(dense_hlo)
    assert max(map(math.prod, dense_shapes)) >= dense_jacobian


def test_auto_under_a_budget_that_forces_a_search():
    # The planner searches the forward nest and the gradient's (scan bodies in
    # `jax.checkpoint`, which hashes the body it wraps: the body closes over arrays).
    # Forward, `explain` and `jax.grad` against a hand-written `jax.vmap` nest.
    obs, args = _problem(n_times=4, n_freqs=2, n_antennas=6)
    solver = cal.make_solver()
    budget = 20788  # below full vmap's temporaries, forward and backward
    mapped = filter_multi_vmap(
        cal.solve_slot, core="A", plan="auto", memory_budget=budget
    )
    fit = jax.jit(mapped, static_argnames=("ref", "solver"))
    out = fit(*args, ref=0, solver=solver)

    def one(vis, model):
        return cal.solve_slot(vis, model, obs.ant1, obs.ant2, args[4], 0, solver)

    hand = jax.jit(jax.vmap(jax.vmap(one)))
    ref = hand(obs.vis, obs.model)
    assert out.gains.shape == (4, 2, 6) and out.gains.dtype == jnp.complex64
    np.testing.assert_allclose(out.gains, ref.gains, rtol=0, atol=1e-5)

    plan = explain(mapped, *args, ref=0, solver=solver)
    assert plan.auto and plan.chosen is not None and plan.chosen.scan
    grad_plan = plan.gradient
    assert not isinstance(grad_plan, (str, type(None)))
    assert grad_plan.backward and grad_plan.checkpoint and grad_plan.chosen.scan
    for p in (plan, grad_plan):
        assert p.chosen.temp_bytes <= budget
        assert any(not c.fits for c in p.candidates)  # full vmap did not fit
    assert "under differentiation" in str(plan)

    def loss(scale, call):
        return jnp.sum(jnp.abs(call(obs.vis, obs.model * scale).gains) ** 2)

    ours = jax.grad(loss)(1.0, lambda v, m: fit(v, m, *args[2:], ref=0, solver=solver))
    want = jax.grad(loss)(1.0, hand)
    assert jnp.isfinite(ours)
    np.testing.assert_allclose(ours, want, rtol=1e-4)


@pytest.mark.slow
def test_per_slot_against_hand_vmap_nest():
    # The mapped fit is the nest one would write by hand (values, dtypes, shapes).
    obs, args = _problem(n_times=2, n_freqs=3, n_antennas=4, seed=1)
    solver = cal.make_solver()
    fit = cal.per_slot()(*args, ref=1, solver=solver)

    def one(vis, model):
        return cal.solve_slot(vis, model, obs.ant1, obs.ant2, args[4], 1, solver)

    hand = jax.jit(jax.vmap(jax.vmap(one)))(obs.vis, obs.model)
    assert fit.gains.shape == (2, 3, 4) and fit.gains.dtype == jnp.complex64
    assert fit.steps.shape == fit.converged.shape == (2, 3)
    np.testing.assert_allclose(fit.gains, hand.gains, rtol=0, atol=1e-6)
    assert bool(jnp.all(fit.converged))
    # The reference antenna's gain is real (phase 0) in every slot.
    assert float(jnp.max(jnp.abs(fit.gains[..., 1].imag))) == 0.0


@pytest.mark.slow
def test_main_quick(capsys):
    argv = ["--quick", "--t-chunk", "2", "--repeats", "2", "--matmul-size", "64"]
    fig = cal.main(argv)
    out = capsys.readouterr().out
    assert fig.sizes == dict(T=3, F=2, A=5, B=10, S=5)
    # The fit: the residual is the noise left after fitting 2A - 1 reals to 2B
    # per slot, and every strategy and the dense solve give the same gains.
    for figs in (*fig.per_slot.values(), fig.dense):
        assert figs["converged"]
        assert 0.8 * fig.expected_rms < figs["rms"] < 1.25 * fig.expected_rms
    for figs in fig.per_slot.values():
        assert figs["max_diff"] < 1e-4
    assert fig.max_diff_dense < 1e-4
    assert fig.per_slot["auto"]["nest"].startswith("scan(T")
    # The recovered gains, in the gauge of the reference antenna: close to the
    # truth (the noise is 0.1 per visibility, |M| is a few Jy).
    assert fig.max_gain_error < 0.1
    jac = fig.jacobian
    assert jac["diagonal_equal"] and jac["off_diagonal_zero"]
    assert jac["dense_bytes"] == 3 * 2 * jac["blocks_bytes"]
    assert fig.matmul["max_abs_diff"] < 1e-4
    for line in [
        "per slot, vmap | vmap(T=3) -> vmap(F=2)",
        "per slot, scan | scan(T: 1 chunk of 2) + vmap(T remainder=1) -> vmap(F=2)",
        "one dense LM   | 54 unknowns, 120 residuals",
        "same entries on the (t, f) diagonal: True; zero off it: True",
    ]:
        assert line in out


def test_bad_antenna_indices():
    obs, (vis, model, ant1, ant2, g0) = _problem()
    bad = ant2.at[3].set(5)  # 5 antennas: indices 0 to 4
    with pytest.raises(ValueError, match=r"`ant2\[3\]` is 5, .* in \[0, 5\)"):
        cal.calibrate(vis, model, ant1, bad, g0)
    with pytest.raises(ValueError, match=r"`ant1\[0\]` is -1"):
        cal.calibrate(vis, model, ant1.at[0].set(-1), ant2, g0)
    with pytest.raises(TypeError, match=r"`ant1` must hold integer antenna indices"):
        cal.calibrate(vis, model, ant1.astype(jnp.float32), ant2, g0)
    with pytest.raises(ValueError, match=r"`ref` .* is 7, but must be in \[0, 5\)"):
        cal.calibrate(vis, model, ant1, ant2, g0, ref=7)
    keep = np.asarray(ant2) != 4  # no baseline to antenna 4 but from it: 0-3 only
    keep &= np.asarray(ant1) != 4
    with pytest.raises(ValueError, match=r"antennas \[4\] are in no cross-corr"):
        cal.calibrate(vis[..., keep], model[..., keep], ant1[keep], ant2[keep], g0)


def test_bad_shapes_are_shape_errors():
    obs, (vis, model, ant1, ant2, g0) = _problem()
    # One baseline fewer in the visibilities than in the index arrays.
    matches = [
        r"inconsistent sizes for dim 'B'",
        r"size 9: `vis` axis 2",
        r"size 10: `model` axis 2",
    ]
    for match in matches:
        with pytest.raises(ShapeError, match=match):
            cal.calibrate(vis[..., :9], model, ant1, ant2, g0)
    with pytest.raises(ShapeError, match=r"`model`"):
        cal.calibrate(vis, model[:2], ant1, ant2, g0)


def test_simulate_rejects_two_antennas():
    with pytest.raises(ValueError, match=r"`n_antennas` must be at least 3"):
        cal.simulate(jax.random.key(0), 2, 2, 2)


def test_jones_product_written_out_is_matmul():
    keys = jax.random.split(jax.random.key(3), 6)
    a, b, c = (
        jax.lax.complex(
            jax.random.normal(keys[2 * i], (7, 2, 2)),
            jax.random.normal(keys[2 * i + 1], (7, 2, 2)),
        )
        for i in range(3)
    )
    a64, b64, c64 = (np.asarray(x, np.complex128) for x in (a, b, c))
    ref = np.einsum("nij,njk,nlk->nil", a64, b64, c64.conj())
    np.testing.assert_allclose(cal.jones_matmul(a, b, c), ref, rtol=0, atol=1e-5)
    np.testing.assert_allclose(cal.jones_elementwise(a, b, c), ref, rtol=0, atol=1e-5)
