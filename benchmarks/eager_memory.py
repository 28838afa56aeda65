"""Is anything kept alive after a wrapper is deleted? (A notebook re-running a cell.)

Each iteration builds a fresh function and its wrapper, calls it once on a `(T, F)`
array, deletes both and runs `gc.collect()`: what a notebook does when a cell that
defines and calls a function is run again. Reported per program: the growth of the
process's resident memory (RSS) per 100 iterations (after warm-up iterations, and
`malloc_trim`), the median over rounds in which the programs take turns, and the
backend compiles per iteration. The programs, each the same scan over `T` of a vmap
over `F`:

- `ours, eager`: `filter_multi_vmap(body, in_dims="T F", scan="T")(x)`;
- `jax.jit(ours)`: the same wrapper under `jax.jit`;
- `jax.jit(hand)`: `jax.jit` of the hand-written `lax.scan(vmap)` (a fresh function);
- `hand, eager`: the hand-written `lax.scan` called un-jitted (a fresh step function).

    python benchmarks/eager_memory.py            # 3 rounds of 100: about 3 minutes
    python benchmarks/eager_memory.py --quick    # 1 round of 50
"""

import argparse
import ctypes
import gc
import os
import statistics
from collections.abc import Callable

import jax
import jax.lax as lax
import jax.numpy as jnp
from eqx_multimap import filter_multi_vmap


T, F = 64, 256


def _element(x):
    return jnp.tanh(x) * 2.0 + jnp.sin(x)


def ours_eager(x):
    def body(x):  # a fresh function, as a re-run cell defines
        return _element(x)

    f = filter_multi_vmap(body, in_dims="T F", out_dims="T F", scan="T")
    return f(x)


def ours_jit(x):
    def body(x):
        return _element(x)

    f = jax.jit(filter_multi_vmap(body, in_dims="T F", out_dims="T F", scan="T"))
    return f(x)


def _hand_step(c, xt):
    return c, jax.vmap(_element)(xt)


def hand_jit(x):
    def hand(x):
        return lax.scan(lambda c, xt: _hand_step(c, xt), None, x)[1]

    return jax.jit(hand)(x)


def hand_eager(x):
    return lax.scan(lambda c, xt: _hand_step(c, xt), None, x)[1]


PROGRAMS: dict[str, Callable] = {
    "ours, eager": ours_eager,
    "jax.jit(ours)": ours_jit,
    "jax.jit(hand)": hand_jit,
    "hand, eager": hand_eager,
}


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass


class _Compiles:
    def __init__(self):
        self.n = 0
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event: str, duration: float, **kwargs) -> None:
        del duration, kwargs
        if event == "/jax/core/compile/backend_compile_duration":
            self.n += 1


def run(fn: Callable, x, n: int) -> None:
    for _ in range(n):
        jax.block_until_ready(fn(x))
        gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 50")
    opts = parser.parse_args()
    rounds, n = (1, 50) if opts.quick else (3, 100)
    x = jnp.linspace(0.0, 1.0, T * F, dtype=jnp.float32).reshape(T, F)
    compiles = _Compiles()
    growth: dict[str, list[float]] = {name: [] for name in PROGRAMS}
    per_call: dict[str, list[float]] = {name: [] for name in PROGRAMS}
    for fn in PROGRAMS.values():
        run(fn, x, 10)  # warm-up: JAX's own one-time allocations
    for _ in range(rounds):
        for name, fn in PROGRAMS.items():
            _trim()
            before, c0 = rss(), compiles.n
            run(fn, x, n)
            _trim()
            growth[name].append((rss() - before) / n * 100 / 2**20)
            per_call[name].append((compiles.n - c0) / n)
    print(
        f"RSS growth per 100 fresh functions, built, called once, deleted "
        f"(T={T}, F={F}; median of {rounds} round(s) of {n}; jax {jax.__version__}):"
    )
    for name in PROGRAMS:
        g = statistics.median(growth[name])
        c = statistics.median(per_call[name])
        spread = f" ({min(growth[name]):.1f} to {max(growth[name]):.1f})"
        spread = spread if rounds > 1 else ""
        print(f"  {name:<14} {g:7.1f} MiB{spread}; {c:g} compiles each")


if __name__ == "__main__":
    main()
