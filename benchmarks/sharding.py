"""Sharded against unsharded `filter_multi_vmap`, on 1, 2, 4 and 8 simulated devices.

The same per-element function (a 2x2 matrix product with transcendentals, over
`vis: "T F B 2 2"` and `nu: "F"`) is run twice for each device count `n`: unsharded
on one device, and with `shard={"F": "d"}` over a mesh of the first `n` devices
(inputs placed with their sharding beforehand, as they would be in real use); both,
and the unsharded program's twin, timed side by side (`harness.time_interleaved`).
Reported: medians, paired ratios sharded / unsharded and twin / unsharded (median
and quartiles per round; below 1, sharding is faster), and the sharded program's
collectives (a pure map has none).

The devices are *simulated* (`--xla_force_host_platform_device_count=8`: one CPU
as 8 devices, sharing this machine's physical cores), so this shows the overhead of
`shard_map` itself (the `n = 1` rows), that the sharded program has no
communication, and how far the work spreads over the physical cores; not scaling
beyond them, nor the cost of real interconnects (`docs/sharding.md`).

`python benchmarks/sharding.py` runs the full grid; `--quick`, small sizes.
"""

import os


# Must be set before JAX initialises its backends.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import re
import statistics

import harness
import jax
import jax.numpy as jnp
from eqx_multimap import filter_multi_vmap
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


COLLECTIVES = re.compile(
    r"\b(all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)"
    r"(-start)?\("
)


def body(vis, nu):
    # vis: (2, 2), nu: ()
    a = jnp.sin(vis * nu) @ jnp.cos(vis).T
    return jnp.tanh(a @ vis) + jnp.exp(-(a**2))


NESTS = {
    "vmap T F B": dict(vmap="T F B"),
    "scan T, vmap F B": dict(scan="T", vmap="F B"),
}


def make(nest: str, mesh=None, fn=body):
    kw = dict(in_dims={"vis": "T F B 2 2", "nu": "F"}, out_dims="T F B 2 2")
    kw.update(NESTS[nest])
    if mesh is not None:
        kw.update(shard={"F": "d"}, mesh=mesh)
    return filter_multi_vmap(fn, **kw)


def main(argv=None) -> int:
    args = harness.parser(__doc__).parse_args(argv)
    (t, f, b), repeats = ((8, 32, 128), 7) if args.quick else ((32, 64, 512), 15)
    repeats = args.repeats or repeats
    devices = jax.devices()
    assert len(devices) >= 8, devices

    key_vis, key_nu = jax.random.split(jax.random.key(0))
    vis = jax.random.normal(key_vis, (t, f, b, 2, 2), jnp.float32)
    nu = jax.random.normal(key_nu, (f,), jnp.float32)
    vis1, nu1 = jax.device_put((vis, nu), devices[0])

    print(
        f"jax {jax.__version__}; {len(devices)} simulated {devices[0].platform} "
        f"devices on {os.cpu_count()} logical CPUs; T={t} F={f} B={b} (2x2 per "
        f"element, {vis.nbytes / 2**20:.1f} MiB in); {repeats} repeats"
    )
    print(
        "\n| devices | nest | unsharded (ms) | sharded (ms) | sharded / unsharded "
        "| twin / unsharded (noise) | collectives |"
    )
    print("|---:|---|---:|---:|---|---|---:|")
    for nest in NESTS:
        unsharded = harness.compiled(make(nest), vis1, nu1)
        twin = harness.compiled(make(nest, fn=harness.fresh(body)), vis1, nu1)
        for n in (1, 2, 4, 8):
            mesh = jax.make_mesh(
                (n,), ("d",), axis_types=(AxisType.Auto,), devices=devices[:n]
            )
            vis_n = jax.device_put(vis, NamedSharding(mesh, P(None, "d")))
            nu_n = jax.device_put(nu, NamedSharding(mesh, P("d")))
            sharded = harness.compiled(make(nest, mesh), vis_n, nu_n)
            n_coll = len(COLLECTIVES.findall(sharded.as_text()))
            out = sharded(vis_n, nu_n)
            assert harness.agree(unsharded(vis1, nu1), out, rtol=0.0, atol=1e-5)
            thunks = [lambda: unsharded(vis1, nu1), lambda: sharded(vis_n, nu_n)]
            thunks.append(lambda: twin(vis1, nu1))
            t_u, t_s, t_t = harness.time_interleaved(thunks, 1.0, repeats, repeats)
            ms_u, ms_s = (1e3 * statistics.median(t) for t in (t_u, t_s))
            print(
                f"| {n} | {nest} | {ms_u:.2f} | {ms_s:.2f} "
                f"| {harness.fmt_ratios(harness.paired_ratios(t_s, t_u))} "
                f"| {harness.fmt_ratios(harness.paired_ratios(t_t, t_u))} | {n_coll} |",
                flush=True,
            )
    print(
        f"\nThe simulated devices share {os.cpu_count()} logical CPUs, so a ratio "
        f"below about 1/{os.cpu_count()} is not possible here, and more devices than "
        "cores only add scheduling overhead. The n = 1 rows measure the overhead of "
        "shard_map itself."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
