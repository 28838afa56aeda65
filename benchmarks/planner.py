"""How good is the planner? Its plan's run time against every candidate it considered.

For each workload, the plan is made under a memory budget (a fraction of what full
vmap needs, when full vmap needs any temporary memory; for two workloads, twice what
it needs, so that full vmap fits and the time model, or measuring, alone decides),
by a planner with its own, initially empty, disk cache (so planning is paid for
here, and its latency measured: cold, cached in memory, and read back from disk by a
second planner). `--plan auto` is the default planner (the calibrated time model);
`--plan measure` is `Planner(measure=True)`.

Then *every* candidate nest the planner considered (full vmap and the whole ladder
of scans, not only those it compiled) is compiled as a fixed nest and timed side by
side with the planned program, round-robin (the order rotating every round), so
that machine noise hits all of them alike; each timed call follows an untimed call
of the same program, so that none pays for the heap or caches its predecessor left
behind. The best fitting candidate of that first pass is then timed again, against
the planned program and the planned program's twin (its nest compiled as a fixed
nest: the same HLO), in a second, longer pass whose samples each last at least
20 ms: picking the fastest of many noisy medians picks a lucky one (the winner's
curse), and a fresh paired comparison does not; the twin's ratio is the noise
floor. Reported:

- `auto / best`: the planned program over the best candidate that fits the budget,
  as the median of the per-round ratios of the second pass (goal: at most 1.10);
  `first pass` is the ratio of the first pass's medians;
- `auto / fastest`: against the fastest candidate of the first pass, ignoring the
  budget;
- `temp / budget`: the planned program's compiled temporary memory over the budget
  (measured here, independently of the planner; goal: never above 1);
- `without fresh-memory term`: the plan of a time model that ignores the page faults
  of temporaries allocated afresh on every call (so full vmap whenever it fits), and
  its time over the best, from the first pass.

Run: `python benchmarks/planner.py --quick` (`--plan measure` for the measured
mode); without `--quick`, bigger sizes. `--cold` instead prices planning: a cold
`plan="auto"` compile (planning included, the time model calibrated beforehand)
over the compile of the nest it chooses as a fixed nest, forward and under
`jax.grad`, in CPU seconds of this process (the machine may be shared): medians of
interleaved rounds (3; up to 25 while the cold compiles total under 1 s), each with
fresh planner and functions, on these workloads and a Jones one.
"""

import argparse
import dataclasses
import datetime
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from eqx_multimap import explain, filter_multi_vmap, Plan, Planner, SpecError
from eqx_multimap.timing import (
    compiled as _compile,
    fmt_bytes as _fmt_bytes,
    fresh,
    normalised_hlo,
    paired_ratios,
    time_interleaved,
)


# Each workload: (name, body, options, args(quick), budget fraction of full vmap).


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


def _normal(key, shape, scale=0.3):
    return jax.random.normal(key, shape, jnp.float32) * scale


def workloads(quick: bool) -> list[tuple[str, Callable, dict, tuple, float]]:
    k = iter(jax.random.split(jax.random.key(0), 64))
    q = quick
    out = []
    t, b, c = (128, 64, 64) if q else (512, 128, 128)
    out.append(
        (
            "elementwise",
            _elementwise,
            dict(in_dims=("T B C", "B"), out_dims="T B C", core="C"),
            (_normal(next(k), (t, b, c)), _normal(next(k), (b,))),
            0.125,
        )
    )
    t, b, kk = (64, 32, 64) if q else (256, 64, 128)
    out.append(
        (
            "sumexp (fused)",
            _sumexp,
            dict(in_dims=("T B K", "T K"), out_dims="T B"),
            (_normal(next(k), (t, b, kk)), _normal(next(k), (t, kk))),
            0.125,
        )
    )
    t, b, kk = (32, 32, 64) if q else (128, 64, 128)
    out.append(
        (
            "sumexp @ b (big intermediate)",
            _sumexp_matmul,
            dict(in_dims=("T B K", "T K"), out_dims="T B"),
            (_normal(next(k), (t, b, kk)), _normal(next(k), (t, kk))),
            0.125,
        )
    )
    # The same with a budget that full vmap fits: does the planner still scan, as
    # it should when its temporaries are page-faulted in afresh on every call?
    out.append(
        (
            "sumexp @ b, full vmap fits",
            _sumexp_matmul,
            dict(in_dims=("T B K", "T K"), out_dims="T B"),
            (_normal(next(k), (t, b, kk)), _normal(next(k), (t, kk))),
            2.0,
        )
    )
    # One element's intermediate is (M, K): 1 MiB quick, 4 MiB full, more than L2.
    n, mm = (64, 512) if q else (256, 1024)
    out.append(
        (
            "outer sumexp, full vmap fits",
            _outer_sumexp,
            dict(in_dims=("n M", "n K"), out_dims="n"),
            (_normal(next(k), (n, mm), 0.01), _normal(next(k), (n, mm), 0.01)),
            2.0,
        )
    )
    b, n, kk, m = (8, 256, 64, 256) if q else (16, 1024, 128, 512)
    out.append(
        (
            "matmul-like",
            _matmul,
            dict(in_dims=("B N K", None), out_dims="B N K", core="K"),
            (_normal(next(k), (b, n, kk)), _normal(next(k), (kk, m), 0.1)),
            0.25,
        )
    )
    a, n, bb, m = (16, 64, 8, 32) if q else (32, 128, 16, 64)
    out.append(
        (
            "reductions",
            _reduce,
            dict(in_dims="A N B M", out_dims=("A B N", "B A"), core="N"),
            (_normal(next(k), (a, n, bb, m)),),
            0.2,
        )
    )
    p, qq, r, kk = (3, 200, 7, 32) if q else (3, 1000, 7, 64)
    out.append(
        (
            "mixed sizes",
            _mixed,
            dict(in_dims=("P Q R K", "R P"), out_dims="R Q P K", core="K"),
            (_normal(next(k), (p, qq, r, kk)), _normal(next(k), (r, p))),
            0.1,
        )
    )
    b, h, seq, d = (4, 4, 128, 32) if q else (8, 8, 256, 64)
    qkv = [_normal(next(k), (b, h, seq, d)) for _ in range(3)]
    out.append(
        (
            "attention",
            _attention,
            dict(in_dims="B H L D", out_dims="B H L D", core="L D"),
            tuple(qkv),
            0.5,
        )
    )
    return out


def _jones() -> tuple[str, Callable, dict, tuple, None]:
    t, f, a = 32, 32, 48
    i, j = np.triu_indices(a, 1)  # B = 1128 baselines
    k = jax.random.split(jax.random.key(1), 2)
    g = jax.lax.complex(_normal(k[0], (t, f, a, 2, 2)), _normal(k[1], (t, f, a, 2, 2)))
    m = jnp.ones((t, f, len(i), 2, 2), jnp.complex64)
    dims = {"g": "T F A 2 2", "m": "T F B 2 2", "i": "B", "j": "B"}

    def jones(g, m, i, j):
        return g[i] @ m @ jnp.conj(g[j]).T

    return "jones", jones, dict(in_dims=dims, out_dims="T F B 2 2"), (g, m, i, j), None


def _cpu_compile(fn: Callable, args: tuple) -> float:
    start = time.process_time()
    _compile(fn, *args)
    return time.process_time() - start


def _loss(fn: Callable, args: tuple) -> Callable:
    wrt = tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.inexact))

    def loss(*a: Any) -> Any:
        return sum(jnp.sum(jnp.abs(o) ** 2) for o in jax.tree.leaves(fn(*a)))

    return jax.grad(loss, wrt)


def _budget(body: Callable, kw: dict, args: tuple, fraction: float) -> tuple[int, int]:
    """A workload's budget, and full vmap's temporaries (of which it is `fraction`)."""
    full = _compile(filter_multi_vmap(body, **kw), *args)
    need = full.memory_analysis().temp_size_in_bytes
    return max(1024, int(need * fraction)), need


def cold(quick: bool, only: str | None, rounds: int = 3) -> None:
    """Print cold plans' compile times over the chosen nests' (see the docstring)."""
    model = Planner(cache_dir=False).time_model  # calibrated once, not counted
    ratios: dict[str, list[float]] = {"forward": [], "grad": []}
    for name, body, kw, args, fraction in [_jones(), *workloads(quick)]:
        if only is not None and only not in name:
            continue
        budget = {}
        if fraction is not None:
            budget = {"memory_budget": _budget(body, kw, args, fraction)[0]}
        for mode in ("forward", "grad"):
            wrap = fresh if mode == "forward" else (lambda f: _loss(f, args))
            times: dict[str, list[float]] = {"auto": [], "fixed": []}
            # Compiles of a few ms scatter by a few ms: more rounds for them.
            while len(times["auto"]) < (25 if sum(times["auto"]) < 1 else rounds):
                planner = Planner(cache_dir=False, time_model=model)
                auto = filter_multi_vmap(body, plan=planner, **budget, **kw)
                try:
                    times["auto"].append(_cpu_compile(wrap(auto), args))
                except SpecError as e:
                    print(f"{name}, {mode}: no nest fits ({str(e)[:60]}...)")
                    break
                n, plan = planner.n_compiles, explain(auto, *args)
                plan = plan if mode == "forward" else plan.gradient
                nest = dict(scan=plan.scan, vmap=plan.vmap, checkpoint=plan.checkpoint)
                fixed = filter_multi_vmap(body, **nest, **kw)
                times["fixed"].append(_cpu_compile(wrap(fixed), args))
            if times["fixed"]:
                t_auto, t_fixed = (statistics.median(t) for t in times.values())
                ratios[mode].append(t_auto / t_fixed)
                compiles = f"{n} planning compile{'' if n == 1 else 's'}"
                print(
                    f"{name}, {mode}: cold plan='auto' {t_auto:.3f} s / fixed nest "
                    f"{t_fixed:.3f} s = {t_auto / t_fixed:.2f}x ({len(times['auto'])} "
                    f"rounds); {compiles}; {plan.chosen.nest(dict(plan.sizes))}",
                    flush=True,
                )
    for mode, rs in ratios.items():
        if rs:
            print(
                f"cold plan / compile, {mode}: geometric mean {_gmean(rs):.2f}, max "
                f"{max(rs):.2f}; {sum(r <= 2 for r in rs)} of {len(rs)} within 2x"
            )


def _explain_seconds(fn: Callable, args: tuple) -> tuple[Plan, float]:
    t0 = time.perf_counter()
    plan = explain(fn, *args)
    return plan, time.perf_counter() - t0


def run(
    quick: bool,
    repeats: int,
    confirm: int,
    verbose: bool,
    only: str | None,
    measure: bool,
    cache_dir: str,
) -> list[dict]:
    rows = []
    planner = Planner(measure=measure, cache_dir=cache_dir)
    print(planner.time_model.describe(), flush=True)
    # The same (calibrated) model with the fresh-memory term off.
    no_fresh = dataclasses.replace(
        planner.time_model, fresh_threshold=None, fresh_source="off"
    )
    for name, body, kw, args, fraction in workloads(quick):
        if only is not None and only not in name:
            continue
        budget, full_temp = _budget(body, kw, args, fraction)
        auto = filter_multi_vmap(body, plan=planner, memory_budget=budget, **kw)
        # Planning latency: `explain` plans the map and its derivative.
        plan, cold = _explain_seconds(auto, args)
        _, cached = _explain_seconds(auto, args)
        warm = Planner(measure=measure, cache_dir=cache_dir)
        again = filter_multi_vmap(body, plan=warm, memory_budget=budget, **kw)
        warm_plan, from_disk = _explain_seconds(again, args)
        assert warm.n_compiles == 0 and warm_plan.chosen == plan.chosen, warm_plan
        # The plan without the fresh-memory term, timed in the same round-robin for
        # a side-by-side comparison.
        base = filter_multi_vmap(
            body,
            plan=Planner(time_model=no_fresh, cache_dir=False),
            memory_budget=budget,
            **kw,
        )
        base_plan = explain(base, *args)
        sizes = dict(plan.sizes)
        mapped = {d.name for d in plan.dims}

        auto_compiled = _compile(auto, *args)
        auto_temp = auto_compiled.memory_analysis().temp_size_in_bytes
        # Every candidate, as a fixed nest; measured memory decides which fit.
        timed: list[tuple[str, Any, int]] = []
        for cand in plan.candidates:
            fixed = filter_multi_vmap(
                body, **{**kw, "scan": dict(cand.scan), "vmap": cand.vmap}
            )
            compiled = _compile(fixed, *args)
            temp = compiled.memory_analysis().temp_size_in_bytes
            timed.append((cand.nest(sizes), compiled, temp))
        everyone = timed + [("auto", auto_compiled, auto_temp)]
        # Each timed call follows an untimed one of the same program (`settle`).
        times = time_interleaved(
            [lambda fn=fn: fn(*args) for _, fn, _ in everyone],
            0.0,
            min_rounds=repeats,
            max_rounds=repeats,
            min_sample=0.0,
        )
        medians = [statistics.median(ts) for ts in times]
        if verbose:
            print(plan)
            for (nest, _, temp), med in zip(everyone, medians):
                print(f"  {med * 1e3:9.3f} ms  {_fmt_bytes(temp):>10}  {nest}")
        auto_time = medians[-1]
        fitting = [i for i, (_, _, temp) in enumerate(timed) if temp <= budget]
        best = min(fitting, key=lambda i: medians[i])
        fastest = min(range(len(timed)), key=lambda i: medians[i])
        chosen = plan.chosen.nest(sizes)
        same = [i for i, (nest, _, _) in enumerate(timed) if nest == chosen]
        # The second pass: the planned program against the best fitting candidate
        # and against its twin (its own nest compiled as a fixed nest, the same
        # HLO), whose ratio is the noise floor. Samples of at least 20 ms (several
        # calls of a quick program), every round interleaved.
        twin = timed[same[0]][1] if same else auto_compiled
        pair = time_interleaved(
            [
                lambda: auto_compiled(*args),
                lambda: timed[best][1](*args),
                lambda: twin(*args),
            ],
            3.0 if quick else 8.0,
            min_rounds=confirm,
            max_rounds=4 * confirm,
            min_sample=0.02,
        )
        base_nest = base_plan.chosen.nest(sizes)
        base = [i for i, (nest, _, _) in enumerate(timed) if nest == base_nest]
        rows.append(
            dict(
                name=name,
                sizes=" ".join(f"{n}={s}" for n, s in sizes.items() if n in mapped),
                budget=budget,
                full_temp=full_temp,
                auto_nest=chosen,
                auto_temp=auto_temp,
                auto_time=auto_time,
                best_nest=timed[best][0],
                best_time=medians[best],
                ratio=statistics.median(paired_ratios(pair[0], pair[1])),
                noise=statistics.median(paired_ratios(pair[2], pair[0])),
                fastest_nest=timed[fastest][0],
                fastest_time=medians[fastest],
                n_fit=len(fitting),
                n_cand=len(timed),
                same_time=medians[same[0]] if same else float("nan"),
                same_hlo=bool(same)
                and normalised_hlo(auto_compiled) == normalised_hlo(timed[same[0]][1]),
                base_nest=base_nest,
                base_time=medians[base[0]] if base else float("nan"),
                n_compiled=plan.n_compiled,
                plan_seconds=plan.seconds,
                explain_cold=cold,
                explain_cached=cached,
                explain_disk=from_disk,
            )
        )
        r = rows[-1]
        print(
            f"{name}: auto {auto_time * 1e3:.3f} ms ({r['auto_nest']}), best fitting "
            f"{r['best_time'] * 1e3:.3f} ms ({r['best_nest']}); second pass auto / "
            f"best {r['ratio']:.3f} (noise: twin / auto {r['noise']:.3f}); explain "
            f"{cold:.2f} s cold, {cached * 1e3:.1f} ms "
            f"cached, {from_disk * 1e3:.0f} ms from disk",
            flush=True,
        )
    return rows


def table(rows: list[dict]) -> str:
    head = (
        "| workload | mapped sizes | budget (full vmap needs) | auto plan | "
        "temp / budget | auto ms | same nest as a candidate, ms (same HLO) | "
        "best fitting candidate | best ms | auto / best (first pass) | "
        "twin / auto (noise) | "
        "auto / fastest (any budget) | fit / candidates | planning (compiles) | "
        "explain: cold / cached / from disk | "
        "without fresh-memory term: plan | its / best |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        first = r["auto_time"] / r["best_time"]
        same = r["base_nest"] == r["auto_nest"]
        base_nest = "same" if same else f"`{r['base_nest']}`"
        lines.append(
            f"| {r['name']} | {r['sizes']} | {_fmt_bytes(r['budget'])} "
            f"({_fmt_bytes(r['full_temp'])}) | `{r['auto_nest']}` | "
            f"{r['auto_temp'] / r['budget']:.2f} | {r['auto_time'] * 1e3:.3f} | "
            f"{r['same_time'] * 1e3:.3f} ({'yes' if r['same_hlo'] else 'no'}) | "
            f"`{r['best_nest']}` | {r['best_time'] * 1e3:.3f} | "
            f"{r['ratio']:.2f} ({first:.2f}) | {r['noise']:.2f} | "
            f"{r['auto_time'] / r['fastest_time']:.2f} | {r['n_fit']} / "
            f"{r['n_cand']} | {r['plan_seconds']:.2f} s ({r['n_compiled']}) | "
            f"{r['explain_cold']:.2f} s / {r['explain_cached'] * 1e3:.1f} ms / "
            f"{r['explain_disk'] * 1e3:.0f} ms | "
            f"{base_nest} | {r['base_time'] / r['best_time']:.2f} |"
        )
    ratios = [r["ratio"] for r in rows]
    firsts = [r["auto_time"] / r["best_time"] for r in rows]
    # The auto plan's nest is also among the candidates: timing it twice shows the
    # noise of the machine.
    same = [r["same_time"] / r["best_time"] for r in rows]
    noise = [r["noise"] for r in rows]
    over = sum(r["auto_temp"] > r["budget"] for r in rows)
    base = [r["base_time"] / r["best_time"] for r in rows]
    lines.append("")
    lines.append(
        f"auto / best: geometric mean {_gmean(ratios):.3f}, max {max(ratios):.3f}; "
        f"{sum(x <= 1.10 for x in ratios)} of {len(ratios)} within 1.10x (second "
        f"pass; first pass: geometric mean {_gmean(firsts):.3f}, max "
        f"{max(firsts):.3f}; {sum(x <= 1.10 for x in firsts)} of {len(firsts)} "
        f"within 1.10x). Noise, the auto program against its twin (same HLO) in the "
        f"second pass: {min(noise):.3f} to {max(noise):.3f}. Its nest timed as a "
        f"candidate / best: geometric mean "
        f"{_gmean(same):.3f}, max {max(same):.3f}; {sum(x <= 1.10 for x in same)} "
        f"of {len(same)} within 1.10x; same HLO as the auto program in "
        f"{sum(r['same_hlo'] for r in rows)} of {len(rows)}. Over "
        f"budget: {over} of {len(rows)}. Without the fresh-memory term: geometric mean "
        f"{_gmean(base):.3f}, max {max(base):.3f}; {sum(x <= 1.10 for x in base)} "
        f"of {len(base)} within 1.10x."
    )
    return "\n".join(lines)


def _gmean(xs: list[float]) -> float:
    return float(np.exp(np.mean(np.log(xs))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument(
        "--plan",
        choices=("auto", "measure"),
        default="auto",
        help="the planner: the time model ('auto'), or Planner(measure=True)",
    )
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--confirm", type=int, help="rounds of the second pass")
    parser.add_argument("--verbose", action="store_true", help="every candidate")
    parser.add_argument("--only", help="workloads whose name has this")
    parser.add_argument("--cold", action="store_true", help="price planning instead")
    parser.add_argument("--cache-dir", help="the planner's disk cache (default: new)")
    opts = parser.parse_args()
    repeats = opts.repeats or (7 if opts.quick else 21)
    confirm = opts.confirm or (15 if opts.quick else 31)
    start = time.perf_counter()
    print(
        f"python benchmarks/planner.py {' '.join(sys.argv[1:])}\n"
        f"jax {jax.__version__}, {jax.devices()[0].platform}, "
        f"{os.cpu_count()} cores; {datetime.date.today()}; repeats={repeats}, "
        f"second pass at least {confirm} rounds",
        flush=True,
    )
    if opts.cold:
        cold(opts.quick, opts.only)
        return
    with tempfile.TemporaryDirectory(prefix="planner_bench_cache_") as tmp:
        measure, cache = opts.plan == "measure", opts.cache_dir or tmp
        rows = run(
            opts.quick, repeats, confirm, opts.verbose, opts.only, measure, cache
        )
    print()
    print(table(rows))
    print(f"\nTotal: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
