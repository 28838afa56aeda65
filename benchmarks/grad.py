"""Differentiating `filter_multi_vmap`: its derivatives against the same derivatives
of the hand-written nest, and the memory of a derivative under a budget.

Two bodies, mapped over `T` (`T` in {500, 2000, 8000}; `--quick`: {200, 800}):

- elementwise: `tanh(a) * 2` per element of `x` of shape `(T, 256)`
  (`in_dims="T N", out_dims="T N"`);
- heavy rows: `tanh(outer(x, x)) @ x` per row of `x` of shape `(T, 32)`
  (`in_dims="T L", out_dims="T L", core="L"`).

Three nests each, ours against the hand-written program: `scan` (scan over `T`, the
rest vmapped: `lax.scan` with `jax.vmap(body)` as its step), `chunk 48` (a chunked
scan with a remainder, as `lax.map(..., batch_size=48)`: 48 does not divide `T`) and
full `vmap`. Every program is built afresh (a new function object) and compiled
first; programs are then timed side by side, interleaved, with
`jax.block_until_ready`, and ratios are paired (the median of the per-round ratios,
with their interquartile range). A second, separately compiled copy of the
hand-written program (its *twin*) is timed in the same rounds: its ratio to the
hand-written program is the noise floor.

Sections:

- `grad`: `jax.jit(jax.grad(lambda x: f(x).sum()))`, ours / hand at every `T`, and
  the growth of each from `T` to `4T` (linear: about 4x), paired too: the sizes of a
  body and nest are timed in the same rounds (every timed sample after an untimed
  one of the same program, so that a long program does not slow the next);
- `transforms`: the forward pass, `value_and_grad`, `jax.vjp` (the pullback applied
  to a cotangent) and `jax.jvp`, ours / hand at one `T`;
- `compile`: lower + compile seconds of the `grad` programs, ours / hand, fresh
  programs taking turns, several repetitions;
- `eager`: an un-jitted call of ours (the same wrapper called again and again, which
  should neither re-trace nor recompile) against an un-jitted `lax.scan` whose step
  is defined once at module level;
- `budget`: `sum(exp(outer(x, y)) @ y)` per row of `x` (a big intermediate per
  element, a scalar out) with `plan=Planner(), memory_budget=B`: the compiled
  temporary memory of the forward pass, of `jit(grad(sum of f))` and of
  `jit(value_and_grad(...))` against `B`; for comparison, the gradient of a fixed
  nest with the forward plan's `scan`/`vmap` (no planning for the backward pass)
  and of full vmap; and the three gradients' times.

    python benchmarks/grad.py --quick    # about a minute
    python benchmarks/grad.py            # T in {500, 2000, 8000}, about 2 minutes
"""

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable


sys.path.insert(0, os.path.dirname(__file__))

import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from _timing import (
    add_sections,
    chosen_sections,
    compile_seconds,
    compiled,
    fmt_bytes,
    fresh,
    hlo_note,
    median,
    paired_ratios,
    quartiles,
    ratio_spread,
    time_calibrated,
)
from eqx_multimap import explain, filter_multi_vmap, Planner


SECTIONS = ("grad", "transforms", "compile", "eager", "budget")
NESTS = ("scan", "chunk", "vmap")
TRANSFORMS = ("forward", "value_and_grad", "vjp", "jvp")
MiB = 2**20
SETTLED = "Every timed sample follows an untimed sample of the same program."


def elementwise(a):
    return jnp.tanh(a) * 2


def heavy_row(x):
    return jnp.tanh(jnp.outer(x, x)) @ x


@dataclasses.dataclass(frozen=True)
class Body:
    """A body, the shape of `x` at `T`, its dims, and the hand-written nest's step
    (the body mapped over one `T` slice)."""

    name: str
    fn: Callable
    width: int  # x has shape (T, width)
    dims: dict
    inner: str | None  # the dim vmapped inside the scan, if any

    def step(self) -> Callable:
        return jax.vmap(self.fn) if self.inner else self.fn


BODIES = {
    "elementwise": Body(
        "tanh(a) * 2", elementwise, 256, dict(in_dims="T N", out_dims="T N"), "N"
    ),
    "heavy": Body(
        "tanh(outer(x, x)) @ x",
        heavy_row,
        32,
        dict(in_dims="T L", out_dims="T L", core="L"),
        None,
    ),
}


def nest_label(nest: str, chunk: int) -> str:
    return {"scan": "scan", "chunk": f"chunk {chunk}", "vmap": "vmap"}[nest]


def hand(body: Body, nest: str, chunk: int) -> Callable:
    """The hand-written nest: a new function object on every call."""
    step = body.step()
    if nest == "scan":
        return lambda x: lax.scan(lambda c, xt: (c, step(xt)), None, x)[1]
    if nest == "chunk":
        return lambda x: lax.map(step, x, batch_size=chunk)
    if nest == "vmap":
        return lambda x: jax.vmap(step)(x)
    raise ValueError(f"Unrecognised nest '{nest}'; choose from {', '.join(NESTS)}.")


def ours(body: Body, nest: str, chunk: int) -> Callable:
    """`filter_multi_vmap` with the same nest: a new wrapper (of a new function
    object, so not equal to an earlier one) on every call."""
    fun = fresh(body.fn)
    inner = dict(vmap=body.inner) if body.inner else {}
    if nest == "scan":
        return filter_multi_vmap(fun, **body.dims, scan="T", **inner)
    if nest == "chunk":
        return filter_multi_vmap(fun, **body.dims, scan={"T": chunk}, **inner)
    if nest == "vmap":
        both = f"T {body.inner}" if body.inner else "T"
        return filter_multi_vmap(fun, **body.dims, vmap=both)
    raise ValueError(f"Unrecognised nest '{nest}'; choose from {', '.join(NESTS)}.")


def program(transform: str, f: Callable) -> Callable:
    """A new function: `transform` of the mapped function `f`, on `(x,)` or, for
    `vjp` and `jvp`, `(x, cotangent)` and `(x, tangent)`."""
    if transform == "grad":
        return jax.grad(lambda x: f(x).sum())
    if transform == "forward":
        return lambda x: f(x)
    if transform == "value_and_grad":
        return jax.value_and_grad(lambda x: f(x).sum())
    if transform == "vjp":
        return lambda x, ct: jax.vjp(f, x)[1](ct)
    if transform == "jvp":
        return lambda x, t: jax.jvp(f, (x,), (t,))
    raise ValueError(
        f"Unrecognised transform '{transform}'; choose from grad, "
        f"{', '.join(TRANSFORMS)}."
    )


def program_args(transform: str, x: jax.Array) -> tuple:
    if transform in ("vjp", "jvp"):
        return x, jnp.cos(x)
    return (x,)


def inputs(body: Body, T: int) -> jax.Array:
    return jax.random.normal(jax.random.key(T), (T, body.width), jnp.float32) * 0.5


@dataclasses.dataclass
class Config:
    t_sizes: tuple[int, ...]
    t_one: int  # the T of the transforms and compile sections
    chunk: int
    transform_nests: tuple[str, ...]
    compile_nests: tuple[str, ...]
    max_rounds: int
    budget_s: float  # timing budget per group of programs
    compile_repeats: int
    eager_calls: int  # repeated un-jitted calls counted for re-traces
    budget_n: int  # budget workload: x (n, m), y (k,)
    budget_m: int
    budget_k: int
    budget_bytes: int
    min_rounds: int = 5
    nests: tuple[str, ...] = NESTS  # of the grad section


def make_config(args) -> Config:
    if args.quick:
        return Config(
            t_sizes=(200, 800),
            t_one=800,
            chunk=48,
            transform_nests=("scan",),
            compile_nests=("scan",),
            max_rounds=args.repeats or 11,
            budget_s=0.25,
            compile_repeats=3,
            eager_calls=20,
            budget_n=128,
            budget_m=128,
            budget_k=128,
            budget_bytes=1 * MiB,
        )
    return Config(
        t_sizes=(500, 2000, 8000),
        t_one=2000,
        chunk=48,
        transform_nests=NESTS,
        compile_nests=NESTS,
        max_rounds=args.repeats or 21,
        budget_s=1.5,
        compile_repeats=5,
        eager_calls=50,
        budget_n=256,
        budget_m=256,
        budget_k=256,
        budget_bytes=4 * MiB,
    )


def agree(a, b) -> bool:
    return all(
        np.allclose(np.asarray(u), np.asarray(v), rtol=1e-4, atol=1e-4)
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def compare(
    body: Body,
    nest: str,
    transform: str,
    t_sizes: tuple[int, ...],
    cfg: Config,
    twin: bool,
) -> list[dict]:
    """At each `T`, ours and the hand-written program (and its twin) compiled
    afresh and checked for the same values; then all of them timed side by side,
    in the same rounds (so that the growth from one `T` to the next is paired too).
    One row per `T`."""
    groups = []
    for T in t_sizes:
        args = program_args(transform, inputs(body, T))
        ours_c = compiled(program(transform, ours(body, nest, cfg.chunk)), *args)
        hand_fn = program(transform, hand(body, nest, cfg.chunk))
        progs = [ours_c, compiled(hand_fn, *args)]
        if twin:
            progs.append(compiled(fresh(hand_fn), *args))
        groups.append((T, args, progs))
    # The sizes run in the same rounds, and what a long program leaves behind slows
    # the next (see `_timing.time_side_by_side`): every timed sample follows an
    # untimed one of the same program.
    settle = 1
    times = iter(
        time_calibrated(
            [lambda c=c, a=args: c(*a) for _, args, progs in groups for c in progs],
            budget_s=cfg.budget_s * len(t_sizes),
            max_rounds=cfg.max_rounds,
            min_rounds=cfg.min_rounds,
            settle=settle,
            groups=[i for i, (_, _, progs) in enumerate(groups) for _ in progs],
        )
    )
    rows = []
    for T, args, progs in groups:
        t_ours, t_hand = next(times), next(times)
        row = dict(
            body=body.name,
            key=next(k for k, b in BODIES.items() if b is body),
            nest=nest,
            transform=transform,
            T=T,
            t_ours=t_ours,
            t_hand=t_hand,
            ours_ms=1e3 * median(t_ours),
            hand_ms=1e3 * median(t_hand),
            ratios=paired_ratios(t_ours, t_hand),
            rounds=len(t_ours),
            same_hlo=hlo_note(progs[0], progs[1]),
            agree=agree(progs[0](*args), progs[1](*args)),
        )
        if twin:
            row["twin"] = paired_ratios(next(times), t_hand)
            row["twin_same_hlo"] = hlo_note(progs[2], progs[1]) == "yes"
        rows.append(row)
    return rows


#
# Sections.
#


def run_grad(cfg: Config, log: Callable[[str], None]) -> list[dict]:
    log("\n## `jit(grad(lambda x: f(x).sum()))`, ours against hand-written\n")
    log("The sizes of a body and nest were timed in the same rounds.\n")
    log(
        "| body | T | nest | ours (ms) | hand (ms) | ours / hand, paired (IQR) | "
        "twin / hand (noise) | rounds | same HLO | values agree |"
    )
    log("|---|---:|---|---:|---:|---|---|---:|---|---|")
    rows = []
    for key, body in BODIES.items():
        for nest in cfg.nests:
            for r in compare(body, nest, "grad", cfg.t_sizes, cfg, twin=True):
                rows.append(r)
                log(
                    f"| {key} | {r['T']} | {nest_label(nest, cfg.chunk)} | "
                    f"{r['ours_ms']:.3f} | {r['hand_ms']:.3f} | "
                    f"{ratio_spread(r['ratios'])} | {ratio_spread(r['twin'])} | "
                    f"{r['rounds']} | {r['same_hlo']} | "
                    f"{'yes' if r['agree'] else 'NO'} |"
                )
    log(f"\n{SETTLED}")
    steps = list(zip(cfg.t_sizes, cfg.t_sizes[1:]))
    log(
        "\n### Growth of the gradient's time with T (time at the larger T / at the "
        "smaller, paired: the sizes were timed in the same rounds; IQR)\n"
    )
    log(
        "| body | nest | "
        + " | ".join(f"ours {a}->{b} | hand {a}->{b}" for a, b in steps)
        + " |"
    )
    log("|---|---|" + "---|---|" * len(steps))
    for key in BODIES:
        for nest in cfg.nests:
            cells = [
                f"{ratio_spread(ours)} | {ratio_spread(hand)}"
                for ours, hand in growths(rows, key, nest)
            ]
            log(
                f"| {key} | {nest_label(nest, cfg.chunk)} | " + " | ".join(cells) + " |"
            )
    return rows


def growths(
    rows: list[dict], key: str, nest: str
) -> list[tuple[list[float], list[float]]]:
    """Per step from one T to the next: the per-round ratios of ours' time at the
    larger T over its time at the smaller, and the hand-written nest's."""
    rs = sorted(
        (r for r in rows if r["key"] == key and r["nest"] == nest), key=lambda r: r["T"]
    )
    return [
        (
            paired_ratios(b["t_ours"], a["t_ours"]),
            paired_ratios(b["t_hand"], a["t_hand"]),
        )
        for a, b in zip(rs, rs[1:])
    ]


def run_transforms(cfg: Config, log: Callable[[str], None]) -> list[dict]:
    log(f"\n## Other transforms at T = {cfg.t_one}, ours against hand-written\n")
    log(
        "| body | nest | transform | ours (ms) | hand (ms) | ours / hand, paired "
        "(IQR) | rounds | same HLO | values agree |"
    )
    log("|---|---|---|---:|---:|---|---:|---|---|")
    rows = []
    for key, body in BODIES.items():
        for nest in cfg.transform_nests:
            for transform in TRANSFORMS:
                (r,) = compare(body, nest, transform, (cfg.t_one,), cfg, twin=False)
                rows.append(r)
                log(
                    f"| {key} | {nest_label(nest, cfg.chunk)} | {transform} | "
                    f"{r['ours_ms']:.3f} | {r['hand_ms']:.3f} | "
                    f"{ratio_spread(r['ratios'])} | {r['rounds']} | "
                    f"{r['same_hlo']} | {'yes' if r['agree'] else 'NO'} |"
                )
    log(f"\n{SETTLED}")
    return rows


def run_compile(cfg: Config, log: Callable[[str], None]) -> list[dict]:
    log(
        f"\n## Compile time of `jit(grad(...))` at T = {cfg.t_one} (lower + compile "
        "of fresh programs, seconds)\n"
    )
    log("| body | nest | ours (s) | hand (s) | ours / hand, paired (IQR) | reps |")
    log("|---|---|---:|---:|---|---:|")
    rows = []
    for key, body in BODIES.items():
        x = jax.ShapeDtypeStruct((cfg.t_one, body.width), jnp.float32)
        for nest in cfg.compile_nests:
            s_ours, s_hand = compile_seconds(
                [
                    lambda: program("grad", ours(body, nest, cfg.chunk)),
                    lambda: program("grad", hand(body, nest, cfg.chunk)),
                ],
                (x,),
                cfg.compile_repeats,
            )
            ratios = paired_ratios(s_ours, s_hand)
            rows.append(dict(key=key, nest=nest, ratios=ratios))
            log(
                f"| {key} | {nest_label(nest, cfg.chunk)} | {median(s_ours):.3f} | "
                f"{median(s_hand):.3f} | {ratio_spread(ratios)} | {len(ratios)} |"
            )
    return rows


# The un-jitted hand-written nests: their steps are defined once, at module level, so
# that `lax.scan` finds its traced step in its cache on every call.
_elementwise_row = jax.vmap(elementwise)


def _elementwise_step(c, xt):
    return c, _elementwise_row(xt)


def _heavy_step(c, xt):
    return c, heavy_row(xt)


EAGER_STEPS = {"elementwise": _elementwise_step, "heavy": _heavy_step}


class CountCompiles:
    """Counts JAX's trace and backend-compile events while active."""

    TRACE = "/jax/core/compile/jaxpr_trace_duration"
    COMPILE = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.traces = self.compiles = 0

    def _listen(self, event: str, duration: float, **kwargs) -> None:
        del duration, kwargs
        if event == self.TRACE:
            self.traces += 1
        elif event == self.COMPILE:
            self.compiles += 1

    def __enter__(self) -> "CountCompiles":
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listen)


def run_eager(cfg: Config, log: Callable[[str], None]) -> list[dict]:
    log(
        "\n## Un-jitted calls: ours (one wrapper, called again and again) against an "
        "un-jitted `lax.scan` (step defined at module level), scan nest\n"
    )
    log(
        "| body | T | ours (ms) | lax.scan (ms) | ours / lax.scan, paired (IQR) | "
        "rounds | ours: traces, compiles in repeated calls |"
    )
    log("|---|---:|---:|---:|---|---:|---|")
    rows = []
    for key, body in BODIES.items():
        step = EAGER_STEPS[key]
        f = ours(body, "scan", cfg.chunk)
        for T in cfg.t_sizes:
            x = inputs(body, T)
            f(x)  # the first call of a signature traces and compiles
            with CountCompiles() as counts:
                for _ in range(cfg.eager_calls):
                    jax.block_until_ready(f(x))
            t_ours, t_hand = time_calibrated(
                [lambda: f(x), lambda: lax.scan(step, None, x)[1]],
                budget_s=cfg.budget_s,
                max_rounds=cfg.max_rounds,
                min_rounds=cfg.min_rounds,
            )
            r = dict(
                key=key,
                T=T,
                ratios=paired_ratios(t_ours, t_hand),
                traces=counts.traces,
                compiles=counts.compiles,
                calls=cfg.eager_calls,
            )
            rows.append(r)
            log(
                f"| {key} | {T} | {1e3 * median(t_ours):.3f} | "
                f"{1e3 * median(t_hand):.3f} | {ratio_spread(r['ratios'])} | "
                f"{len(t_ours)} | {counts.traces}, {counts.compiles} in "
                f"{cfg.eager_calls} calls |"
            )
    return rows


def outer_sumexp(x, y):
    return jnp.sum(jnp.exp(jnp.outer(x, y)) @ y)  # x: (M,), y: (K,)


def temp_bytes(c) -> int:
    """The temporary memory of a compiled program."""
    return int(c.memory_analysis().temp_size_in_bytes)


def run_budget(cfg: Config, log: Callable[[str], None]) -> dict:
    n, m, k, B = cfg.budget_n, cfg.budget_m, cfg.budget_k, cfg.budget_bytes
    x = jax.random.normal(jax.random.key(1), (n, m), jnp.float32) * 0.1
    y = jax.random.normal(jax.random.key(2), (k,), jnp.float32) * 0.1
    dims = dict(in_dims=("N M", None), out_dims="N")
    planned = filter_multi_vmap(outer_sumexp, **dims, plan=Planner(), memory_budget=B)
    plan = explain(planned, x, y)
    assert plan.gradient is not None
    sizes = dict(plan.sizes)
    fixed = filter_multi_vmap(
        fresh(outer_sumexp), **dims, scan=plan.scan, vmap=plan.vmap
    )
    vmapped = filter_multi_vmap(fresh(outer_sumexp), **dims, vmap="N")

    def grad(f):
        return jax.grad(lambda x, y: f(x, y).sum(), argnums=(0, 1))

    def value_and_grad(f):
        return jax.value_and_grad(lambda x, y: f(x, y).sum(), argnums=(0, 1))

    fwd_nest = plan.chosen.nest(sizes)
    bwd_nest = plan.gradient.chosen.nest(sizes)
    if plan.gradient.checkpoint:
        bwd_nest += ", scan bodies checkpointed"
    vmap_nest = f"vmap(N={n})"
    rows = [
        ("forward", "forward, planned", fwd_nest, planned),
        ("grad", "jit(grad(sum of f)), planned", bwd_nest, grad(planned)),
        (
            "value_and_grad",
            "jit(value_and_grad(sum of f)), planned",
            bwd_nest,
            value_and_grad(planned),
        ),
        (
            "fixed_grad",
            "jit(grad), the forward plan's nest, no backward planning",
            fwd_nest,
            grad(fixed),
        ),
        ("vmap_grad", "jit(grad), full vmap", vmap_nest, grad(vmapped)),
        ("vmap_forward", "forward, full vmap", vmap_nest, vmapped),
    ]
    comp = {key: compiled(fn, x, y) for key, _, _, fn in rows}
    temps = {key: temp_bytes(c) for key, c in comp.items()}
    log(
        f"\n## Memory of the derivative under a budget: `sum(exp(outer(x, y)) @ y)`, "
        f"x ({n}, {m}) mapped over N, y ({k},) broadcast; "
        f"`plan=Planner(), memory_budget={B}` ({fmt_bytes(B)})\n"
    )
    log("| program | nest | temp bytes | temp | temp / budget |")
    log("|---|---|---:|---:|---:|")
    for key, what, nest, _ in rows:
        t = temps[key]
        log(f"| {what} | {nest} | {t} | {fmt_bytes(t)} | {t / B:.2f} |")

    grads = [comp["grad"], comp["fixed_grad"], comp["vmap_grad"]]
    values = [c(x, y) for c in grads]
    same = all(agree(values[0], v) for v in values[1:])
    times = time_calibrated(
        [lambda c=c: c(x, y) for c in grads],
        budget_s=cfg.budget_s,
        max_rounds=cfg.max_rounds,
        min_rounds=cfg.min_rounds,
        settle=1,  # temporaries differ a lot: see `_timing.time_side_by_side`
    )
    log("\n| gradient | time (ms) | planned / this, paired (IQR) |")
    log("|---|---:|---|")
    names = ("planned", "forward plan's nest", "full vmap")
    for name, t in zip(names, times):
        log(
            f"| {name} | {1e3 * median(t):.3f} | "
            f"{ratio_spread(paired_ratios(times[0], t))} |"
        )
    log(f"\nThe three gradients agree: {'yes' if same else 'NO'}.")
    return dict(
        budget=B,
        temps=temps,
        forward_nest=fwd_nest,
        backward_nest=bwd_nest,
        vs_fixed=median(paired_ratios(times[0], times[1])),
        vs_vmap=median(paired_ratios(times[0], times[2])),
        agree=same,
    )


#
# Summary.
#


def _ratios_by(rows: list[dict], **match) -> list[float]:
    return [
        median(r["ratios"]) for r in rows if all(r[k] == v for k, v in match.items())
    ]


def summary_lines(results: dict, cfg: Config) -> list[str]:
    """One line per section, computed from its rows."""
    lines = []
    if "grad" in results:
        rows = results["grad"]
        parts = []
        for key in BODIES:
            for nest in cfg.nests:
                vals = _ratios_by(rows, key=key, nest=nest)
                parts.append(
                    f"{key} {nest_label(nest, cfg.chunk)} {median(vals):.2f} "
                    f"({min(vals):.2f} to {max(vals):.2f})"
                )
        twins = [median(r["twin"]) for r in rows]
        lo, _, hi = quartiles(twins)
        same = {
            key: sum(r["same_hlo"] == "yes" for r in rows if r["key"] == key)
            for key in BODIES
        }
        counts = {key: sum(r["key"] == key for r in rows) for key in BODIES}
        lines.append(
            "grad: ours / hand, median over T (range): "
            + "; ".join(parts)
            + f"; noise floor {median(twins):.2f} (IQR {lo:.2f} to {hi:.2f}); "
            + "same HLO: "
            + ", ".join(f"{k} {same[k]} of {counts[k]}" for k in BODIES)
            + "; values agree in "
            + f"{sum(r['agree'] for r in rows)} of {len(rows)}"
        )
        parts = []
        for key in BODIES:
            for nest in cfg.nests:
                g = growths(rows, key, nest)
                ours_g = ", ".join(f"{median(a):.1f}" for a, _ in g)
                hand_g = ", ".join(f"{median(b):.1f}" for _, b in g)
                parts.append(
                    f"{key} {nest_label(nest, cfg.chunk)} {ours_g} (hand {hand_g})"
                )
        lines.append(
            "grad growth T -> 4T (paired time ratio; linear ~4): " + "; ".join(parts)
        )
    if "transforms" in results:
        rows = results["transforms"]
        parts = []
        for transform in TRANSFORMS:
            vals = _ratios_by(rows, transform=transform)
            parts.append(
                f"{transform} {median(vals):.2f} ({min(vals):.2f} to {max(vals):.2f})"
            )
        lines.append(
            f"transforms at T={cfg.t_one}: ours / hand, median over bodies and nests "
            "(range): " + "; ".join(parts)
        )
    if "compile" in results:
        rows = results["compile"]
        parts = [
            f"{r['key']} {nest_label(r['nest'], cfg.chunk)} {median(r['ratios']):.2f}"
            for r in rows
        ]
        lines.append(
            "compile grad: ours / hand (lower + compile, median of paired "
            "repetitions): " + ", ".join(parts) + " (target <= 1.3)"
        )
    if "eager" in results:
        rows = results["eager"]
        parts = [f"{r['key']} T={r['T']} {median(r['ratios']):.2f}" for r in rows]
        traces = sum(r["traces"] for r in rows)
        compiles = sum(r["compiles"] for r in rows)
        calls = sum(r["calls"] for r in rows)
        lines.append(
            "eager: un-jitted ours / un-jitted lax.scan: "
            + ", ".join(parts)
            + f" (target <= 2); ours re-traced {traces} and recompiled {compiles} "
            f"times in {calls} repeated calls"
        )
    if "budget" in results:
        r = results["budget"]
        B, temps = r["budget"], r["temps"]

        def of(what: str) -> str:
            t = temps[what]
            return f"{fmt_bytes(t)} ({t / B:.2f} B)"

        lines.append(
            f"budget: B = {fmt_bytes(B)}: planned grad {of('grad')}, value_and_grad "
            f"{of('value_and_grad')}, forward {of('forward')}; grad without backward "
            f"planning {of('fixed_grad')}, full vmap grad {of('vmap_grad')}; planned "
            f"grad time / forward plan's nest's {r['vs_fixed']:.2f}, / full vmap's "
            f"{r['vs_vmap']:.2f}; gradients agree: {'yes' if r['agree'] else 'NO'}"
        )
    return lines


RUNNERS = {
    "grad": run_grad,
    "transforms": run_transforms,
    "compile": run_compile,
    "eager": run_eager,
    "budget": run_budget,
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes")
    parser.add_argument("--repeats", type=int, default=None, help="max timed rounds")
    add_sections(parser, SECTIONS)
    args = parser.parse_args(argv)
    sections = chosen_sections(parser, args.sections, SECTIONS)
    cfg = make_config(args)

    def log(line: str) -> None:
        print(line, flush=True)

    log(
        f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} "
        f"cores), {'quick' if args.quick else 'default'} mode, T in "
        f"{list(cfg.t_sizes)}, up to {cfg.max_rounds} rounds per group"
    )
    start = time.perf_counter()
    results = {}
    for section in SECTIONS:
        if section in sections:
            t0 = time.perf_counter()
            results[section] = RUNNERS[section](cfg, log)
            log(f"\n({section}: {time.perf_counter() - t0:.0f} s)")
    log(f"\nSummary (Total: {time.perf_counter() - start:.0f} s)\n")
    for line in summary_lines(results, cfg):
        log(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
