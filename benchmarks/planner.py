"""How good is the planner? Its plan against the best fixed nest of a sweep.

Workloads: synthetic bodies, and real ones (`--real`, or both with `--all`): the
calibration example's per-slot Levenberg-Marquardt fit (`examples/calibration.py`)
at two sizes, an MLP with weights per element (4 layers of `tanh(W @ h)`), a stiff
diffrax solve (Tsit5 and a PID controller; each element's rate spans 3 decades, laid
out at random or along `F`), with a scalar state or a 16-vector coupled by a fixed
matrix, and the planner page's `newton_sqrt` (a while loop). Each is planned and
timed forward and under `jax.grad` (the diffrax and Newton bodies forward only:
their reverse pass is not what is benchmarked here).

For each, under a memory budget (a fraction of full vmap's forward temporaries):

- the sweep: every nest scanning a prefix of the mapped dims in any order (the
  last in chunks of a power of 2; `--quick`: 2, 8, 32...), vmapping the rest, under
  `grad` with and without `jax.checkpoint`, and the planners' picks as fixed nests;
- `plan="auto"` (a fresh planner, calibrated beforehand): its compile with planning
  over its pick's compile, CPU seconds (`cold`); `--plan measure`: measured mode
  (`tune`; forward-only workloads: an un-jitted call; `--cap`: its `Planner(cap=)`);
- the simple rule: full vmap if it fits the budget, else the largest block that
  fits on the first ladder (the dims in the order the outputs name them);
- the plan of the time model without its memory hierarchy (`no hierarchy`: one
  bandwidth, the last cache level's, whatever the working set).

Every fitting nest and each pick are timed round-robin (`harness.time_interleaved`,
the rounds in which another job held a core dropped), medians; then the auto program
against the best fitting nest and its twin (the noise floor; a second compile), and
measured mode's beside its twin, in a second pass, again after a pause if all its
rounds were disturbed: `auto / best` and `measured / best`, medians of per-round
ratios (goal: at most 1.10). Other ratios: the first pass's. `--help`.
"""

import dataclasses
import datetime
import functools as ft
import itertools
import math
import os
import pathlib
import runpy
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import harness
import jax
import jax.numpy as jnp
import numpy as np
from eqx_multimap import explain, filter_multi_vmap, Plan, Planner, SpecError, tune
from harness import compiled, fmt_bytes, temp_bytes, time_interleaved


class Workload(NamedTuple):
    name: str
    body: Callable
    kw: dict  # filter_multi_vmap's options: dims, core
    args: tuple
    fraction: float  # the budget, as a fraction of full vmap's forward temporaries
    grad: bool = True  # planned and timed under `jax.grad` too


def _normal(key, shape, scale=0.3):
    return jax.random.normal(key, shape, jnp.float32) * scale


# Synthetic bodies.
def _elementwise(x, y):
    return x * y + 1.0  # x: (C,), y: ()


def _sumexp(a, b):
    return jnp.sum(jnp.exp(a[:, None] * b[None, :]))  # fused by XLA: no temp


def _sumexp_matmul(a, b):
    # The (K, K) intermediate feeds a matmul, so it is materialised.
    return jnp.sum(jnp.exp(a[:, None] * b[None, :]) @ b)


def _outer_sumexp(x, y):
    return jnp.sum(jnp.exp(jnp.outer(x, y)) @ y)  # x: (M,), y: (K,)


def _matmul(x, w):
    return jnp.tanh(x @ w) @ w.T  # x: (K,), w: (K, M)


def _reduce(x):
    # x: (N, M): a Gram matrix and a sort, neither fused away.
    return jnp.max(x @ x.T, axis=0), jnp.sum(jnp.sort(x, axis=1)[:, -1])


def _mixed(x, y):
    return jnp.tanh(x[:, None] * x[None, :] * y) @ x  # x: (K,), y: ()


def _attention(q, k, v):
    s = q @ k.T / jnp.sqrt(jnp.float32(q.shape[-1]))  # (L, L)
    return jax.nn.softmax(s, axis=-1) @ v


def workloads(quick: bool) -> list[Workload]:
    k = iter(jax.random.split(jax.random.key(0), 64))
    n = lambda shape, scale=0.3: _normal(next(k), shape, scale)  # noqa: E731
    q, W = quick, Workload
    t, b, c = (128, 64, 64) if q else (512, 128, 128)
    kw = dict(in_dims=("T B C", "B"), out_dims="T B C", core="C")
    out = [W("elementwise", _elementwise, kw, (n((t, b, c)), n((b,))), 0.125)]
    t, b, kk = (64, 32, 64) if q else (256, 64, 128)
    kw = dict(in_dims=("T B K", "T K"), out_dims="T B")
    out.append(W("sumexp (fused)", _sumexp, kw, (n((t, b, kk)), n((t, kk))), 0.125))
    t, b, kk = (32, 32, 64) if q else (128, 64, 128)
    args = (n((t, b, kk)), n((t, kk)))
    out.append(W("sumexp @ b (big intermediate)", _sumexp_matmul, kw, args, 0.125))
    # Full vmap fits: does the planner still scan, as it should when its
    # temporaries are page-faulted in afresh on every call?
    out.append(W("sumexp @ b, full vmap fits", _sumexp_matmul, kw, args, 2.0))
    # One element's intermediate is (M, K): 1 MiB quick, 4 MiB full, more than L2.
    nn, mm = (64, 512) if q else (256, 1024)
    args = (n((nn, mm), 0.01), n((nn, mm), 0.01))
    kw = dict(in_dims=("n M", "n K"), out_dims="n")
    out.append(W("outer sumexp, full vmap fits", _outer_sumexp, kw, args, 2.0))
    b, nn, kk, m = (8, 256, 64, 256) if q else (16, 1024, 128, 512)
    kw = dict(in_dims=("B N K", None), out_dims="B N K", core="K")
    out.append(W("matmul-like", _matmul, kw, (n((b, nn, kk)), n((kk, m), 0.1)), 0.25))
    a, nn, bb, m = (16, 64, 8, 32) if q else (32, 128, 16, 64)
    kw = dict(in_dims="A N B M", out_dims=("A B N", "B A"), core="N")
    out.append(W("reductions", _reduce, kw, (n((a, nn, bb, m)),), 0.2))
    p, qq, r, kk = (3, 200, 7, 32) if q else (3, 1000, 7, 64)
    kw = dict(in_dims=("P Q R K", "R P"), out_dims="R Q P K", core="K")
    out.append(W("mixed sizes", _mixed, kw, (n((p, qq, r, kk)), n((r, p))), 0.1))
    b, h, seq, d = (4, 4, 128, 32) if q else (8, 8, 256, 64)
    kw = dict(in_dims="B H L D", out_dims="B H L D", core="L D")
    qkv = tuple(n((b, h, seq, d)) for _ in range(3))
    out.append(W("attention", _attention, kw, qkv, 0.5))
    return out


# Real workloads.
def _mlp(w, h):
    for layer in w:  # w: (4, K, K) per element, h: (K,)
        h = jnp.tanh(layer @ h)
    return h


def _stiff(rate, y0, coupling=None):
    """`dy/dt = -rate (y - cos t)`, plus `coupling @ y` with a vector state."""
    import diffrax

    def vector_field(t, y, args):
        r, c = args
        dy = -r * (y - jnp.cos(t))
        return dy if c is None else dy + c @ y

    pid = diffrax.PIDController(rtol=1e-5, atol=1e-5)
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(vector_field), diffrax.Tsit5(), 0.0, 1.0, 0.01, y0,
        (rate, coupling), stepsize_controller=pid, max_steps=1024,
    )  # fmt: skip
    return sol.ys[-1]


def _newton_sqrt(a):  # the planner page's: a while loop, its cost the data's
    def step(s):
        return 0.5 * (s[0] + a / s[0]), s[1] + 1

    def more(s):
        return (jnp.abs(s[0] ** 2 - a) > 1e-5 * a) & (s[1] < 200)

    return jax.lax.while_loop(more, step, (a, 0))[0]


def _calibration(t: int, f: int, a: int) -> Workload:
    path = pathlib.Path(__file__).parent.parent / "examples" / "calibration.py"
    cal = runpy.run_path(str(path))  # its globals; its `__main__` block not run
    obs = cal["simulate"](jax.random.key(0), t, f, a)
    g0 = jnp.ones((a,), jnp.complex64)
    lm = ft.partial(cal["solve_slot"], ref=0, solver=cal["make_solver"]())
    lm.__name__ = "solve_slot"  # type: ignore[attr-defined]
    # The example's budget: half of full vmap's temporaries.
    return Workload(f"calibration LM {t}x{f}x{a}", lm, dict(core="A"),
                    (obs.vis, obs.model, obs.ant1, obs.ant2, g0), 0.5)  # fmt: skip


def _mlps(sizes: tuple, k: Any) -> list[Workload]:
    kw = dict(in_dims=("B L K J", "B J"), out_dims="B K", core="K")
    out = []
    for kk, b in sizes:
        w = _normal(next(k), (b, 4, kk, kk), 1.0 / np.sqrt(kk))
        args = (w, _normal(next(k), (b, kk), 1.0))
        name = f"MLP, W per element, K={kk}, B={b}"
        out.append(Workload(name, _mlp, kw, args, 2.0))
    return out


def _stiffs(t: int, f: int, k: Any, n: int = 0) -> list[Workload]:
    """The stiff solve, each element's rate spanning 3 decades, laid out at random or
    along `F`: a scalar state, or (`n`) an `n`-vector coupled by a fixed matrix."""
    along_f = jnp.broadcast_to(10.0 ** jnp.linspace(0.0, 3.0, f), (t, f))
    at_random = 10.0 ** jax.random.uniform(next(k), (t, f), jnp.float32, 0.0, 3.0)
    kw, tail, what = dict(in_dims=("T F", "T F"), out_dims="T F"), (), ""
    if n:  # the coupling's eigenvalues within about 0.5 of 0: the rates dominate
        kw = dict(in_dims=("T F", "T F S", None), out_dims="T F S", core="S")
        tail, what = (_normal(next(k), (n, n), 0.5 / np.sqrt(n)),), f", {n}-vector"
    y0 = jnp.ones((t, f, n) if n else (t, f), jnp.float32)
    out = []
    for layout, rate in (("at random", at_random), ("along F", along_f)):
        args = (rate.astype(jnp.float32), y0, *tail)
        name = f"stiff diffrax{what}, rates {layout}"
        out.append(Workload(name, _stiff, kw, args, 2.0, False))
    return out


def real_workloads(quick: bool) -> list[Workload]:
    q = quick
    out = [_calibration(*((4, 4, 8) if q else (32, 16, 24)))]
    out.append(_calibration(*((8, 4, 12) if q else (64, 32, 12))))  # A: the example's
    k = iter(jax.random.split(jax.random.key(1), 8))
    out += _mlps(((64, 256), (256, 32)) if q else ((64, 4096), (256, 1024)), k)
    out += _stiffs(*((4, 8) if q else (16, 32)), k)
    k = iter(jax.random.split(jax.random.key(2), 16))
    out += _mlps(((256, 256),) if q else ((256, 4096),), k)
    out += _stiffs(*((4, 8) if q else (16, 32)), k, n=16)
    kw = dict(in_dims="T F", out_dims="T F")
    sizes = ((64, 32), (256, 128)) + (() if q else ((512, 256),))
    for t, f in sizes:  # the page's law and key
        a = jnp.exp(5.0 * jax.random.normal(jax.random.key(0), (t, f), jnp.float32))
        name = f"newton_sqrt {t}x{f}, a = exp(5 N(0,1))"
        out.append(Workload(name, _newton_sqrt, kw, (a,), 2.0, False))
    if not q:
        a = jax.random.uniform(next(k), (128, 256), jnp.float32, 1.0, 2.0)
        name = "newton_sqrt 128x256, a uniform in [1, 2]"
        out.append(Workload(name, _newton_sqrt, kw, (a,), 2.0, False))
    return out


# The sweep and the timing.
def sweep(sizes: dict[str, int], base: int = 2) -> list[tuple[tuple, tuple]]:
    """Every nest `(scan, vmap)` scanning a prefix of some order of the dims: the
    outer ones one at a time, the last one at a time or in chunks of 2 times a
    power of `base` (2; 4 with `--quick`)."""
    names = [n for n, s in sizes.items() if s > 1]
    out = {((), frozenset(names)): ((), tuple(names))}
    for order in itertools.permutations(names):
        for k, d in enumerate(order):
            rest = tuple(n for n in names if n not in order[: k + 1])
            chunks = [2 * base**i for i in range(30) if 2 * base**i < sizes[d]]
            for c in [None, *chunks]:
                scan = tuple((n, None) for n in order[:k]) + ((d, c),)
                out.setdefault((scan, frozenset(rest)), (scan, rest))
    return list(out.values())


def _inexact(tree: Any) -> list:
    return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]


def _program(w: Workload, full_vmap: Callable, mode: str) -> tuple[Callable, tuple]:
    """A map to the program a row times, and its arguments: the map itself, or under
    `grad` its reverse-mode derivative as the planner compiles it (the pullback of
    its inexact outputs, the cotangents an argument)."""
    if mode != "grad":
        return (lambda f: f), w.args
    diff = [i for i, a in enumerate(w.args) if jnp.issubdtype(a.dtype, jnp.inexact)]

    def of(fn: Callable) -> Callable:
        def pullback(values: list, cts: list) -> Any:
            def inexact(xs: list) -> list:
                given = dict(zip(diff, xs))
                return _inexact(fn(*[given.get(i, v) for i, v in enumerate(values)]))

            return jax.vjp(inexact, [values[i] for i in diff])[1](cts)

        return pullback

    outs = _inexact(jax.eval_shape(full_vmap, *w.args))
    return of, (list(w.args), [jnp.ones(o.shape, o.dtype) for o in outs])


def _cpu(thunk: Callable) -> tuple[Any, float]:
    start = time.process_time()
    return thunk(), time.process_time() - start


def _key(nest: tuple, checkpoint: bool) -> tuple:
    return nest[0], frozenset(nest[1]), checkpoint and bool(nest[0])


AUTO = ("auto", "measure")  # the planners whose budget is checked


def evaluate(w: Workload, mode: str, model: Any, opts: Any) -> dict:
    full_vmap = filter_multi_vmap(w.body, **w.kw)
    budget = max(1024, int(temp_bytes(compiled(full_vmap, *w.args)) * w.fraction))
    prog, args = _program(w, full_vmap, mode)
    planners = {"auto": Planner(cache_dir=False, time_model=model)}
    if opts.plan == "measure":
        cap = {} if opts.cap is None else dict(cap=opts.cap)  # else the default
        planners["measure"] = Planner(
            cache_dir=False, time_model=model, measure=True, **cap
        )
    flat = model.levels[-1][1] if model.levels else model.bandwidth
    one = dataclasses.replace(model, levels=(), bandwidth=flat)
    planners["no hierarchy"] = Planner(cache_dir=False, time_model=one, measure=False)
    programs, plans, picks, cold = {}, {}, {}, {}
    for name, planner in planners.items():
        mapped = filter_multi_vmap(w.body, plan=planner, memory_budget=budget, **w.kw)
        # Measured mode times on the arguments: `tune`, the nest and its derivative's;
        # a forward-only workload, an un-jitted call (planning, compile, one run).
        tuned, eager = name == "measure", name == "measure" and not w.grad
        run = lambda: mapped(*args) if eager else [tuned and tune(mapped, *w.args)]
        cold[name] = _cpu(lambda: jax.block_until_ready(run()))[1]
        programs[name], seconds = _cpu(lambda: compiled(prog(mapped), *args))
        cold[name] += 0.0 if eager else seconds  # the un-jitted call compiled it
        plan = explain(mapped, *w.args)
        plans[name] = plan if mode == "forward" else plan.gradient
        other = plan.gradient if mode == "forward" else plan
        if tuned and not eager and isinstance(other, Plan):  # `tune` timed it too
            nest = dict(scan=other.scan, vmap=other.vmap, checkpoint=other.checkpoint)
            f = filter_multi_vmap(w.body, **w.kw, **nest)
            o_prog, o_args = _program(w, full_vmap, "grad" if mode == "forward" else "")
            cold["other"] = _cpu(lambda: compiled(o_prog(f), *o_args))[1]
        picks[name] = tuple(plans[name].chosen.scan), tuple(plans[name].chosen.vmap)
    keys = {n: _key(p, plans[n].checkpoint) for n, p in picks.items()}
    plan = plans["auto"]
    sizes = {n: s for n, s in plan.sizes if n in {*plan.scan, *plan.vmap}}
    # Under `grad`, each scanning nest with and without `jax.checkpoint` (with
    # `--quick`, with only, as the planner's).
    ckpt = {"forward": (False,), "grad": (True,) if opts.quick else (False, True)}
    swept = sweep(sizes, 4 if opts.quick else 2)
    nests = {_key(n, c): n for n in swept for c in ckpt[mode]}
    nests.update({keys[n]: p for n, p in picks.items()})
    fixed, compile_s = {}, {}
    for key, (scan, vmap) in nests.items():
        f = filter_multi_vmap(
            w.body, scan=dict(scan), vmap=vmap, checkpoint=key[2], **w.kw
        )
        fixed[key], compile_s[key] = _cpu(lambda: compiled(prog(f), *args))
    fits = [k for k in nests if temp_bytes(fixed[k]) <= budget]
    if not fits:
        raise SpecError(f"no nest of the sweep fits {fmt_bytes(budget)}")
    # The first ladder: the dims in the order the (first) output names them.
    out = w.kw.get("out_dims", " ".join(sizes))
    named = (out if isinstance(out, str) else out[0]).split()
    order = [n for n in named if n in sizes] + [n for n in sizes if n not in named]
    ladder = [  # checkpointed under `grad` whenever it scans, as the planner's
        k for k in fits if [n for n, _ in k[0]] == order[: len(k[0])]
        and k[2] == (mode == "grad" and bool(k[0]))
    ]  # fmt: skip
    block = lambda k: math.prod([c or 1 for _, c in k[0]] + [sizes[n] for n in k[1]])
    simple = max(ladder, key=lambda k: (block(k), -len(k[0])), default=None)
    timed = list(dict.fromkeys(fits + list(keys.values())))
    # The picks as their fixed nests (the auto program's twin: the same HLO).
    thunks = [lambda c=fixed[k]: c(*args) for k in timed]
    thunks.append(lambda: programs["auto"](*args))
    r, settle = opts.repeats, opts.settle
    times = time_interleaved(thunks, 0.0, r, r, 2e-3, settle, 3.0, probe=opts.probe)
    med = [statistics.median(t) for t in times]
    by_key = dict(zip(timed, med))
    by_plan = {n: by_key[k] for n, k in keys.items()}
    best, auto_key = min(fits, key=lambda k: by_key[k]), keys["auto"]
    # Second pass: auto, the best, auto's twin; measured mode's program and its twin
    # (two compiles of one program may differ: XLA:CPU places each anew).
    second = [programs["auto"], fixed[best], fixed[auto_key]]
    second += [programs["measure"], fixed[keys["measure"]]] if "measure" in keys else []
    for pause in (5, 5, 0):  # after a pause, again, while every round is disturbed
        start = len(opts.probe.times)
        pair = time_interleaved(
            [lambda c=c: c(*args) for c in second],
            opts.seconds, opts.confirm, 4 * opts.confirm, 0.02, probe=opts.probe,
        )  # fmt: skip
        if not (pause and all(opts.probe.disturbed(start))):
            break
        time.sleep(pause)
    nest = lambda k: _describe(k, sizes)  # noqa: E731
    return dict(
        name=w.name,
        mode=mode,
        sizes=" ".join(f"{n}={s}" for n, s in sizes.items()),
        budget=budget,
        auto=nest(auto_key),
        over=sum(temp_bytes(programs[n]) > budget for n in planners if n in AUTO),
        ratio=_paired(pair, 0, 1),
        first=med[-1] / by_key[best],
        noise=_paired(pair, 2, 0),
        same_hlo=harness.same_hlo(programs["auto"], fixed[auto_key]),
        best=nest(best),
        simple=nest(simple) if simple else "-",
        simple_ratio=by_key[simple] / by_key[best] if simple else float("nan"),
        measure=_paired(pair, 3, 1),
        measure_noise=_paired(pair, 4, 3),
        measure_nest=nest(keys["measure"]) if "measure" in keys else "-",
        flat=by_plan["no hierarchy"] / by_key[best],
        flat_nest=nest(keys["no hierarchy"]),
        cold=cold["auto"] / compile_s[auto_key],
        cold_goal=4.0 if plan.basis == "short" else 2.0,  # a short list timed: 4x
        cold_measure=cold.get("measure", float("nan"))
        / (compile_s[keys.get("measure", auto_key)] + cold.get("other", 0.0)),
        n=f"{len(fits)} / {len(nests)}",
        best_ms=by_key[best] * 1e3,
    )


def _paired(times: list[list[float]], a: int, b: int) -> float:
    """The median of the per-round ratios of thunk `a` to `b` (nan if not timed)."""
    if a >= len(times):
        return float("nan")
    return statistics.median(harness.paired_ratios(times[a], times[b]))


def _describe(key: tuple, sizes: dict[str, int]) -> str:
    scan = [n if c is None else f"{n}: chunks of {c}" for n, c in key[0]]
    vmap = [n for n in sizes if n in key[1]]
    parts = [f"scan({s})" for s in scan] + [f"vmap({' '.join(vmap)})"] * bool(vmap)
    return " -> ".join(parts) + ", checkpointed" * key[2]


def table(rows: list[dict]) -> str:
    head = (
        "| workload | mode | mapped sizes | budget | auto plan | auto / best (first "
        "pass) | twin / auto | best fitting nest (ms) | simple rule | simple / best "
        "| measured / best (its twin) | one bandwidth / best | cold plan / compile "
        "(measured) | fit / nests |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['mode']} | {r['sizes']} | {fmt_bytes(r['budget'])} "
            f"| `{r['auto']}` | {r['ratio']:.2f} ({r['first']:.2f}) | "
            f"{r['noise']:.2f}{'' if r['same_hlo'] else ' (not same HLO)'} | "
            f"`{r['best']}` ({r['best_ms']:.3g}) | `{r['simple']}` | "
            f"{r['simple_ratio']:.2f} | {r['measure']:.2f} ({r['measure_noise']:.2f}) "
            f"| {r['flat']:.2f} | "
            f"{r['cold']:.2f} ({r['cold_measure']:.2f}) | {r['n']} |"
        )
    cold, goals = [r["cold"] for r in rows], [r["cold_goal"] for r in rows]
    summary = [
        _summary("auto / best", [r["ratio"] for r in rows]),
        _summary("auto / best, first pass", [r["first"] for r in rows]),
        _summary("simple rule / best", [r["simple_ratio"] for r in rows]),
        _summary("measured / best", [r["measure"] for r in rows]),
        _summary("one bandwidth (no hierarchy) / best", [r["flat"] for r in rows]),
        _summary("cold plan / compile of the pick", cold, goals),
        _summary(
            "cold measured plan (`tune`, the nest and its derivative's; forward-only "
            "workloads, an un-jitted call) / their compiles",
            [r["cold_measure"] for r in rows],
            10,
        ),
    ]
    noise = [r["noise"] for r in rows]
    twins = [r["measure_noise"] for r in rows if np.isfinite(r["measure_noise"])]
    twins = [f"; twin / measured {min(twins):.3f} to {max(twins):.3f}"] if twins else []
    summary.append(
        f"Noise (second pass): twin / auto {min(noise):.3f} to {max(noise):.3f}"
        f"{''.join(twins)}. Over budget: {sum(r['over'] for r in rows)} of {len(rows)}."
    )
    return "\n".join(lines + [""] + [s for s in summary if s])


def _summary(what: str, xs: list[float], goal: float | list[float] = 1.10) -> str:
    """A line of the summary; `goal`: one for all rows, or each row's own."""
    goals = goal if isinstance(goal, list) else [goal] * len(xs)
    kept = [(x, g) for x, g in zip(xs, goals) if np.isfinite(x)]
    if not kept:
        return ""
    mean = float(np.exp(np.mean(np.log([x for x, _ in kept]))))
    worst = max(x for x, _ in kept)
    within = ", ".join(
        f"{sum(x <= u for x, g in kept if g == u)} of "
        f"{sum(g == u for _, g in kept)} within {u:.2f}x"
        for u in sorted({g for _, g in kept})
    )
    return f"{what}: geometric mean {mean:.3f}, max {worst:.3f}; {within}"


def main(argv: list[str] | None = None) -> None:
    parser = harness.parser(__doc__, repeats="rounds of the first pass")
    parser.add_argument("--real", action="store_true", help="the real workloads")
    parser.add_argument("--all", action="store_true", help="synthetic and real")
    parser.add_argument("--plan", choices=("auto", "measure"), default="auto")
    parser.add_argument("--forward", action="store_true", help="no jax.grad rows")
    parser.add_argument("--confirm", type=int, help="rounds of the second pass")
    parser.add_argument("--only", help="workloads whose name has this")
    parser.add_argument("--cap", type=float, help="measured mode's `Planner(cap=)`")
    opts = parser.parse_args(argv)
    opts.repeats = opts.repeats or (5 if opts.quick else 9)
    opts.confirm = opts.confirm or (9 if opts.quick else 21)
    # Untimed calls before each sample: 1 (0 at full size, where calls are long).
    opts.seconds, opts.settle = (2.0, 1) if opts.quick else (8.0, 0)
    start = time.perf_counter()
    print(
        f"python benchmarks/planner.py {' '.join(sys.argv[1:])}\njax "
        f"{jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} cores; "
        f"{datetime.date.today()}; first pass {opts.repeats} rounds, second pass at "
        f"least {opts.confirm}",
        flush=True,
    )
    model = Planner(cache_dir=False).time_model  # calibrated once, not counted
    opts.probe = harness.Probe()  # finds the rounds in which another job held a core
    print(model.describe(), flush=True)
    chosen = [] if opts.real else workloads(opts.quick)
    chosen += real_workloads(opts.quick) if opts.real or opts.all else []
    jax.block_until_ready([w.args for w in chosen])  # all made before a clock starts
    chosen = [w for w in chosen if opts.only is None or opts.only in w.name]
    rows = []
    for w in chosen:
        grad = w.grad and not opts.forward
        for mode in ("forward", "grad") if grad else ("forward",):
            try:
                rows.append(evaluate(w, mode, model, opts))
            except SpecError as e:
                print(f"{w.name}, {mode}: no nest fits ({str(e)[:80]}...)")
                continue
            r = rows[-1]
            print(
                f"{w.name}, {mode}: auto {r['auto']} / best {r['best']} = "
                f"{r['ratio']:.3f} (twin {r['noise']:.3f}); measured "
                f"{r['measure_nest']} {r['measure']:.2f} (twin "
                f"{r['measure_noise']:.2f}); simple {r['simple']} "
                f"{r['simple_ratio']:.2f}; one bandwidth {r['flat_nest']} "
                f"{r['flat']:.2f}; cold plan / compile {r['cold']:.2f}",
                flush=True,
            )
    print(f"\n{table(rows)}")
    bad, n = sum(opts.probe.disturbed()), len(opts.probe.times)
    print(f"Rounds dropped, another job holding a core (`Probe`): {bad} of {n}")
    print(f"\nTotal: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
