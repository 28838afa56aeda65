"""`shard=` on a 2-D mesh across 2 processes x 2 CPU devices under `jax.distributed`
(on the loopback address): "f" manual, the weights split over "m" (issue 42)."""

import socket
import subprocess
import sys
import textwrap

import pytest

from .helpers import clean_env


_WORKER = textwrap.dedent(
    """
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from eqx_multimap import explain, filter_multi_vmap, Planner, TimeModel

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    port, pid, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    assert jax.device_count() == 4 and jax.local_device_count() == 2
    types = (AxisType.Auto if kind == "auto" else AxisType.Explicit,) * 2
    mesh = jax.make_mesh((2, 2), ("f", "m"), axis_types=types)
    rng = np.random.default_rng(0)
    w_np = rng.normal(size=(64, 16)).astype(np.float32)
    x_np = rng.normal(size=(4, 16)).astype(np.float32)

    def put(a, spec):
        sharding = NamedSharding(mesh, spec)
        blocks = sharding.addressable_devices_indices_map(a.shape)
        return jax.make_array_from_single_device_arrays(
            a.shape, sharding, [jax.device_put(a[i], d) for d, i in blocks.items()]
        )

    w, x = put(w_np, P("m", None)), put(x_np, P("f", None))
    f = filter_multi_vmap(
        lambda w, x: jnp.tanh(w @ x),
        in_dims={"w": "M K", "x": "F K"},
        out_dims="F M",
        core="M",
        shard={"F": "f"},
    )
    loss = lambda w, x: jnp.sum(f(w, x) ** 2)
    with jax.set_mesh(mesh):
        text = jax.jit(f).lower(w, x).compile().as_text()
        out = jax.jit(f)(w, x)
        g = jax.jit(jax.grad(loss))(w, x)
    assert "f32[64,16]" not in " ".join(
        l for l in text.splitlines() if "all-gather(" in l
    ), "W gathered"
    ref = np.tanh(x_np @ w_np.T)
    ref_g = jax.grad(lambda w: jnp.sum(jnp.tanh(x_np @ w.T) ** 2))(w_np)
    for got, want in [(out, ref), (g, np.asarray(ref_g))]:
        for s in got.addressable_shards:
            np.testing.assert_allclose(s.data, want[s.index], rtol=1e-4, atol=1e-4)
    assert tuple(g.sharding.spec)[:1] == ("m",)
    # Planned, with a collective over a dim split across the processes: each must
    # run the same nest (another would send other messages), planned alike.
    planner = Planner(cache_dir=False)
    h = filter_multi_vmap(
        lambda x: jax.lax.psum(jnp.sin(x), "F"),
        in_dims="F K",
        out_dims="F K",
        shard={"F": "f"},
        plan=planner,
    )
    with jax.set_mesh(mesh):
        plan = explain(h, x)
        out = jax.jit(h)(x)
    for s in out.addressable_shards:
        want = np.broadcast_to(np.sin(x_np).sum(0), x_np.shape)
        np.testing.assert_allclose(s.data, want[s.index], rtol=1e-5, atol=1e-5)
    assert planner.n_calibrations == 0, "calibrated"
    assert plan.time_model == TimeModel.for_backend("cpu"), plan.time_model
    print("plan", plan.chosen.nest(dict(plan.sizes)))
    print("ok", pid, out.sharding.spec)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_two_processes_two_devices_each(kind):
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, port, str(pid), kind],
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in range(2)
    ]
    try:
        results = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for pid, (p, (out, err)) in enumerate(zip(procs, results)):
        assert p.returncode == 0, err[-3000:]
        assert f"ok {pid}" in out
    plans = [
        [ln for ln in out.splitlines() if ln.startswith("plan")] for out, _ in results
    ]
    assert plans[0] == plans[1] and len(plans[0]) == 1, plans
