"""Memory and reductions, each section against the program written by hand (the
details, and how to read the figures: `benchmarks/README.md`):

- `reduce`: `reduce={"T": "sum"}` against materialise-then-sum and a `lax.scan` carry;
- `eager`: the resident memory a deleted wrapper leaves, per 100 fresh functions;
- `gains`: a two-level chunked nest at scale against the hand-written `lax.map` nest
    and full vmap, forward and `jax.grad`: temporaries, optimised HLO, peak RSS.

Programs are compiled first and checked to agree; `reduce` times them interleaved
(`harness.py`): medians and paired ratios, never absolute verdicts.
"""

import argparse
import contextlib
import ctypes
import gc
import os
import statistics
import subprocess
import sys
import time

import harness
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from eqx_multimap import filter_multi_vmap
from harness import compiled, fmt_bytes, fresh, temp_bytes, time_interleaved


SECTIONS = ("reduce", "eager", "gains")
# Per mode (quick or not): the T of `reduce`; the rounds and the iterations per
# round of `eager`; the antennas and chunk of `gains`.
SIZES = {
    True: dict(ts=(256, 1024, 4096), seconds=2.0, eager=(1, 30), gains=(256, 4096)),
    False: dict(
        ts=(256, 1024, 4096, 16384), seconds=4.0, eager=(3, 100), gains=(2048, 65536)
    ),
}


def body(x, y, v):
    """One element: `x: (K,)`, `y: (M,)`, `v: (M,)` -> `(K,)`."""
    return jax.nn.softmax(jnp.outer(x, y), axis=1) @ v


DIMS = dict(in_dims=("T K", "T M", "M"), core="K")
PAIRS = (
    ("reduced scan", "hand scan"),
    ("reduced chunk", "hand scan"),
    ("reduced scan", "materialise"),
    ("hand twin", "hand scan"),
)


def make_programs(chunk: int) -> dict:
    """Every program, built afresh (new function objects, compiled on their own)."""
    fun = fresh(body)

    def hand_scan(x, y, v):
        step = lambda c, e: (c + body(e[0], e[1], v), None)  # noqa: E731
        return lax.scan(step, jnp.zeros(x.shape[1:], x.dtype), (x, y))[0]

    stacked = filter_multi_vmap(fun, out_dims="T K", **DIMS)
    reduced = dict(out_dims="K", reduce={"T": "sum"}, **DIMS)
    return {
        "reduced scan": filter_multi_vmap(fun, scan="T", **reduced),
        "reduced chunk": filter_multi_vmap(fun, scan={"T": chunk}, **reduced),
        "materialise": lambda x, y, v: stacked(x, y, v).sum(0),
        "hand scan": hand_scan,
        "hand twin": fresh(hand_scan),
    }


def inputs(t: int, k: int) -> tuple:
    rng = np.random.default_rng(0)
    x, y = (0.3 * rng.standard_normal((t, k), dtype=np.float32) for _ in "xy")
    v = rng.standard_normal(k, dtype=np.float32)
    return jnp.asarray(x), jnp.asarray(y), jnp.asarray(v)


def run_reduce(size: dict, max_rounds: int, log) -> list[str]:
    k, chunk = 64, 16
    rows = []
    for t in size["ts"]:
        args = inputs(t, k)
        comp = {n: compiled(fn, *args) for n, fn in make_programs(chunk).items()}
        if not harness.agree(*[c(*args) for c in comp.values()]):
            raise AssertionError(f"the programs disagree at T={t}")
        thunks = [lambda c=c: c(*args) for c in comp.values()]
        times = time_interleaved(thunks, size["seconds"], 5, max_rounds)
        times = dict(zip(comp, times))
        temps = {n: temp_bytes(c) for n, c in comp.items()}
        ratios = {
            f"{a} / {b}": harness.paired_ratios(times[a], times[b]) for a, b in PAIRS
        }
        same = harness.same_hlo(comp["reduced scan"], comp["hand scan"])
        rows.append(dict(T=t, temps=temps, ratios=ratios, same=same))
        ms = {n: 1e3 * statistics.median(times[n]) for n in comp}
        cells = [f"{n} {fmt_bytes(temps[n])}, {ms[n]:.3f} ms" for n in comp]
        cells += [f"{pair} {harness.fmt_ratios(r)}" for pair, r in ratios.items()]
        cells.append(f"same HLO: {'yes' if same else 'no'}")
        log(f"T={t} ({len(times['hand scan'])} rounds): " + "; ".join(cells))
    lo, hi = rows[0], rows[-1]
    lines = [
        f"temp bytes, {n}: {fmt_bytes(lo['temps'][n])} at T={lo['T']}, "
        f"{fmt_bytes(hi['temps'][n])} at T={hi['T']}"
        for n in lo["temps"]
        if n != "hand twin"
    ]
    for pair in rows[0]["ratios"]:
        per_t = ", ".join(
            f"T={r['T']}: {statistics.median(r['ratios'][pair]):.2f}" for r in rows
        )
        lines.append(f"time, {pair} (paired median): {per_t}")
    lines.append(
        f"optimised HLO of reduced scan identical to hand scan's: "
        f"{sum(r['same'] for r in rows)} of {len(rows)} T (K = M = {k}, chunk {chunk})"
    )
    return lines


def element(x):
    return jnp.tanh(x) * 2.0 + jnp.sin(x)


def hand_eager(x):  # a fresh step function on every call
    return lax.scan(lambda c, xt: (c, jax.vmap(element)(xt)), None, x)[1]


def ours(**kwargs):
    return filter_multi_vmap(fresh(element), in_dims="T F", out_dims="T F", **kwargs)


EAGER = {  # each makes a fresh function, as a re-run notebook cell does
    "ours, eager": lambda: ours(scan="T"),
    "jax.jit(ours)": lambda: jax.jit(ours(scan="T")),
    "jax.jit(hand)": lambda: jax.jit(fresh(hand_eager)),
    "hand, eager": lambda: hand_eager,
}


def rss() -> int:
    """The process's resident memory in bytes, after `gc` and `malloc_trim`."""
    gc.collect()
    with contextlib.suppress(OSError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_eager(size: dict, max_rounds: int, log) -> list[str]:
    del max_rounds
    rounds, n = size["eager"]
    x = jnp.linspace(0.0, 1.0, 64 * 256, dtype=jnp.float32).reshape(64, 256)
    growth: dict[str, list[float]] = {name: [] for name in EAGER}
    compiles: dict[str, list[float]] = {name: [] for name in EAGER}

    def calls(make, k: int) -> None:
        for _ in range(k):
            jax.block_until_ready(make()(x))
            gc.collect()

    for make in EAGER.values():
        calls(make, min(n, 10))  # warm-up: JAX's own one-time allocations
    for _ in range(rounds):
        for name, make in EAGER.items():
            before = rss()
            with harness.count_compiles() as counts:
                calls(make, n)
            growth[name].append((rss() - before) / n * 100)
            compiles[name].append(counts["compiles"] / n)
    log(f"\nRSS growth per 100 fresh functions, median of {rounds} round(s) of {n}")
    log("\n| program | growth per 100 | range | compiles each |\n|---|---:|---|---:|")
    parts = []
    for name in EAGER:
        g, c = statistics.median(growth[name]), statistics.median(compiles[name])
        spread = f"{fmt_bytes(min(growth[name]))} to {fmt_bytes(max(growth[name]))}"
        log(f"| {name} | {fmt_bytes(g)} | {spread} | {c:g} |")
        parts.append(f"{name} {fmt_bytes(g)} ({c:g})")
    head = "eager: RSS growth per 100 fresh functions (compiles each): "
    return [head + "; ".join(parts)]


def gain(g, m, i, j):
    """One baseline: `g: (A, 2, 2)`, the gains of one time and frequency."""
    return g[i] @ m @ jnp.conj(g[j]).T


def gain_programs(a: int, chunk: int) -> tuple[dict, tuple]:
    """Ours, the hand-written nest and full vmap, forward and `grad`; the inputs."""
    rng = np.random.default_rng(2)
    g, m = (  # complex64, T = 2, F = 4
        lax.complex(*(rng.standard_normal(s + (2, 2), np.float32) for _ in "ri"))
        for s in ((2, 4, a), (2, 4, a * (a - 1) // 2))
    )
    i, j = (jnp.asarray(k, jnp.int32) for k in np.triu_indices(a, 1))
    dims = dict(in_dims=("T F A 2 2", "T F B 2 2", "B", "B"), out_dims="T F B 2 2")

    def hand(g, m, i, j):
        def one(gm):  # one time and frequency
            return lax.map(lambda e: gain(gm[0], *e), (gm[1], i, j), batch_size=chunk)

        return lax.map(lambda gm: lax.map(one, gm), (g, m))

    nests = {
        "ours": filter_multi_vmap(fresh(gain), **dims, scan=dict(T=1, F=1, B=chunk)),
        "hand": hand,
        "full vmap": filter_multi_vmap(fresh(gain), **dims, vmap="T F B"),
    }
    programs = {}
    for name, fn in nests.items():
        loss = lambda g, m, fn=fn: jnp.real(fn(g, m, i, j)).sum()  # noqa: E731
        programs[f"{name}, forward"] = lambda g, m, fn=fn: fn(g, m, i, j)
        programs[f"{name}, grad"] = jax.grad(loss, argnums=(0, 1))
    return programs, (g, m)


def peak_rss(a: int, chunk: int, program: str) -> list[int]:
    """A new process's RSS once `program` is compiled, and its peak as it runs."""
    args = [sys.executable, __file__, "--rss", f"{a},{chunk},{program}"]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    return [int(n) for n in out.split()[-2:]]


def rss_child(a: str, chunk: str, program: str) -> int:
    """`--rss A,chunk,program`: compile the program, reset the peak RSS (Linux), run
    the program, print the RSS before and the peak."""
    programs, args = gain_programs(int(a), int(chunk))
    program = compiled(programs[program], *args)
    before = rss()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    jax.block_until_ready(program(*args))
    with open("/proc/self/status") as f:
        print(before, next(int(x.split()[1]) * 1024 for x in f if "VmHWM" in x))
    return 0


def run_gains(size: dict, max_rounds: int, log) -> list[str]:
    del max_rounds  # nothing timed: temporaries, HLO and peak RSS
    a, chunk = size["gains"]
    programs, args = gain_programs(a, chunk)
    b, m = a * (a - 1) // 2, fmt_bytes(args[1].nbytes)
    log(f"\ngains: A={a}, B={b}, chunk {chunk}, m {m}\n")
    log("| program | temp | RSS before, peak |\n|--|--:|--|")
    lines = []
    for transform in ("forward", "grad"):
        names = [n for n in programs if n.endswith(transform)]
        comp = {n: compiled(programs[n], *args) for n in names}
        outs = [comp[n](*args) for n in names]  # ours, hand, full vmap
        if not harness.agree(outs[1], outs[0], outs[2], rtol=1e-3, atol=1e-3):
            raise AssertionError(f"ours or full vmap differ from hand: {transform}")
        temps = {n: fmt_bytes(temp_bytes(c)) for n, c in comp.items()}
        same = harness.same_hlo(comp[names[0]], comp[names[1]])  # ours, hand
        del comp, outs
        cells = []
        for n in names:
            before, peak = (fmt_bytes(b) for b in peak_rss(a, chunk, n))
            log(f"| {n} | {temps[n]} | {before}, {peak} |")
            cells.append(f"{n.split(',')[0]} temp {temps[n]}, peak RSS {peak}")
        lines.append(f"gains, {transform}: " + "; ".join(cells))
        lines[-1] += f"; ours has the hand-written HLO: {'yes' if same else 'no'}"
    return lines


RUNS = dict(reduce=run_reduce, eager=run_eager, gains=run_gains)


def main(argv=None) -> int:
    parser = harness.parser(__doc__, SECTIONS)
    parser.add_argument("--rss", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rss:
        return rss_child(*args.rss.split(",", 2))
    max_rounds = args.repeats or (15 if args.quick else 21)
    where = f"{jax.devices()[0].platform} ({os.cpu_count()} cores)"
    mode = "quick" if args.quick else "default"
    print(f"jax {jax.__version__} on {where}, {mode} mode, up to {max_rounds} rounds")
    start, size, lines = time.perf_counter(), SIZES[args.quick], []
    for section in args.sections:
        lines += RUNS[section](size, max_rounds, lambda s: print(s, flush=True))
    print(f"\nSummary (Total: {time.perf_counter() - start:.0f} s)\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
