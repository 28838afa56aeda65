"""The planner's time model, the machine it is for, and its calibration (measured
once per machine; the planner keeps it on disk)."""

import contextlib
import dataclasses
import datetime
import math
import os
import pathlib
import platform
import re
import time
import timeit
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._text import fmt_bytes


# XLA:CPU splits an op over its threads only if it reads about this many bytes:
# a dot from 128 KiB, a fusion from 64-256 KiB, not at 64 KiB (`docs/design.md`).
PARALLEL_BYTES = 96 * 2**10
SLICE = 64 * 2**10  # an op too small to split: how one core's bandwidth is measured
DEFAULT_SOURCE = "default constants, set by hand for one 2-core x86-64"
SYSFS_CACHES = "/sys/devices/system/cpu/cpu0/cache"
# The data caches (L1d, L2, L3) of the CPU the defaults were set on, and the
# bandwidth a streaming kernel measured there within each level and past the last.
FALLBACK_CACHES = (48 * 2**10, 2**20, 32 * 2**20)
DEFAULT_BANDWIDTHS = (2.5e11, 2e11, 1.1e11)
DEFAULT_MEMORY = 1e10
# An accelerator's defaults (unverified: no accelerator was at hand): its on-chip
# memory, its bandwidth and its HBM's; each loop trip launches kernels.
DEVICE_LEVELS = ((32 * 2**20, 3e12),)
DEVICE_MEMORY = 1e12


@dataclasses.dataclass(frozen=True)
class TimeModel:
    """The estimated run time of a candidate that fits the budget (see `seconds`).

    A `Planner` calibrates it on first use per machine (see
    [The planner](../planner.md)); `TimeModel()` is the hand-set default, and
    `Planner(time_model=...)` takes a model of one's own.

    - `flops`, `transcendentals`: operations per second.
    - `levels`: `(bytes, bandwidth)` of each level of the memory hierarchy, smallest
        first: on CPU the data caches, on an accelerator its on-chip memory; the
        bandwidth in bytes per second, for data that fits the level.
    - `bandwidth`: bytes per second past the last level (main memory, HBM).
    - `loop_overhead`: seconds per loop trip.
    - `cores`: the threads XLA spreads an op over, if the op reads at least
        `PARALLEL_BYTES`; a smaller op runs on one.
    - `calibration`: how the constants were measured, or `None` for defaults.
    """

    flops: float = 5e10
    transcendentals: float = 5e9
    levels: tuple[tuple[int, float], ...] = tuple(
        zip(FALLBACK_CACHES, DEFAULT_BANDWIDTHS)
    )
    bandwidth: float = DEFAULT_MEMORY
    loop_overhead: float = 1e-6
    cores: int = 1
    calibration: str | None = None

    @classmethod
    def for_backend(cls, backend: str) -> "TimeModel":
        """The default (uncalibrated) constants for a backend: on CPU, for the
        caches the OS reports; on an accelerator, a device profile."""
        if backend == "cpu":
            sizes = cache_levels()
            rates = DEFAULT_BANDWIDTHS + DEFAULT_BANDWIDTHS[-1:] * len(sizes)
            return cls(levels=tuple(zip(sizes, rates)), cores=_cores())
        return cls(levels=DEVICE_LEVELS, bandwidth=DEVICE_MEMORY, loop_overhead=1e-5)

    @property
    def calibrated(self) -> bool:
        return self.calibration is not None

    def seconds(
        self,
        flops: float,
        trans: float,
        nbytes: float,
        trips: int,
        working_set: int,
        serial: float = 0.0,
        io: int = 0,
    ) -> float:
        """Estimated run time: compute, plus the bytes moved, plus loop overhead. The
        `io` bytes (inputs and outputs, read or written once) move at the bandwidth
        of the smallest level that holds them all, the others at that of the
        smallest level that holds one loop iteration's `working_set`; the `serial`
        share of compute and bytes, in ops too small to split, on one of `cores`.

        It only ranks candidates that fit the budget, which do the same flops. Compute
        and traffic are added, not overlapped as in a roofline: on CPU a
        compute-heavy body still slows down when its working set leaves the caches
        (`docs/design.md`)."""
        io = min(io, int(nbytes))  # inputs and outputs: from where they all fit
        memory = io / self.rate(io) + (nbytes - io) / self.rate(working_set)
        compute = flops / self.flops + trans / self.transcendentals
        one_core = 1 + (self.cores - 1) * serial
        return (compute + memory) * one_core + trips * self.loop_overhead

    @property
    def fastest(self) -> int:
        """The bytes that the levels of the highest bandwidth hold: a block whose
        working set fits them gains nothing from being smaller."""
        top = max((rate for _, rate in self.levels), default=0.0)
        return max((size for size, rate in self.levels if rate >= top), default=0)

    def rate(self, nbytes: int) -> float:
        """The bandwidth of the smallest level that holds `nbytes`."""
        fits = (rate for size, rate in self.levels if nbytes <= size)
        return next(fits, self.bandwidth)

    def describe(self) -> str:
        levels = ", ".join(f"{r:.2g} within {fmt_bytes(s)}" for s, r in self.levels)
        where = f"calibrated: {self.calibration}" if self.calibrated else None
        where = where or f"not calibrated: {DEFAULT_SOURCE}"
        return (
            f"est. time = flops / {self.flops:.2g} + transcendentals / "
            f"{self.transcendentals:.2g} + bytes accessed / bandwidth, times up to "
            f"{self.cores} for ops under {fmt_bytes(PARALLEL_BYTES)} (one core), + "
            f"loop trips x {self.loop_overhead:.2g} s; bandwidth: that of the smallest "
            "level holding the inputs and outputs, for theirs; for the rest, holding "
            f"one iteration's working set ({levels}; else {self.bandwidth:.2g}). "
            f"Constants {where}."
        )

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "levels": [list(x) for x in self.levels]}

    @classmethod
    def from_json(cls, data: Any) -> "TimeModel":
        """The model stored by `to_json`; `ValueError` if it is not one."""
        fields = dataclasses.fields(cls)
        if not isinstance(data, dict) or set(data) != {f.name for f in fields}:
            raise ValueError(f"not a stored time model: {data!r}")
        levels = data["levels"]
        if not isinstance(levels, list) or not all(
            isinstance(x, list) and len(x) == 2 and type(x[0]) is int for x in levels
        ):
            raise ValueError(f"bad levels {levels!r}")
        numbers = [(f.name, data[f.name]) for f in fields if f.type in (float, int)]
        for name, x in numbers + [("levels", x) for level in levels for x in level]:
            if type(x) not in (int, float) or not 0 < x < math.inf:
                raise ValueError(f"`{name}` must be positive and finite, got {x!r}")
        if not isinstance(data["calibration"], (str, type(None))):
            raise ValueError("bad time model description")
        if type(data["cores"]) is not int:
            raise ValueError(f"`cores` must be an `int`, got {data['cores']!r}")
        return cls(**{**data, "levels": tuple(map(tuple, levels))})


def _cores() -> int:
    """The cores this process may run on: XLA:CPU's threads."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1


def cache_levels(root: str = SYSFS_CACHES) -> tuple[int, ...]:
    """The sizes of the CPU's data caches, smallest first, as the OS reports them."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    found: dict[int, int] = {}
    try:
        for index in sorted(pathlib.Path(root).glob("index*")):
            if (index / "type").read_text().strip() in ("Data", "Unified"):
                text = (index / "size").read_text().strip().upper()
                size = int(text.rstrip("KMG")) * units.get(text[-1:], 1)
                found[int((index / "level").read_text())] = size
    except (OSError, ValueError):
        found = {}
    return tuple(found[k] for k in sorted(found)) or FALLBACK_CACHES


def machine() -> dict[str, Any]:
    """What plans and calibrations are specific to."""
    device = jax.devices()[0]
    out: dict[str, Any] = {
        "backend": jax.default_backend(),
        "platform": device.platform,
        "device_kind": device.device_kind,
        "n_devices": jax.device_count(),
    }
    if device.platform == "cpu":
        info = ""
        with contextlib.suppress(OSError):
            info = pathlib.Path("/proc/cpuinfo").read_text()
        name = re.search(r"^model name[^:]*:(.*)$", info, re.MULTILINE)
        cpu = name and name[1].strip() or platform.processor() or platform.machine()
        out.update(cpu=cpu or "?", cores=_cores(), arch=platform.machine())
        out["caches"] = list(cache_levels())
    return out


def concrete_inputs(specs: Any) -> Any:
    """Fresh arrays of the shapes and dtypes of a pytree of `ShapeDtypeStruct`s,
    built eagerly even while tracing (the planner runs at trace time)."""
    rng = np.random.default_rng(0)

    def make(s: jax.ShapeDtypeStruct) -> Any:
        dtype = s.dtype
        if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            impl = dtype._impl  # pyright: ignore[reportAttributeAccessIssue]
            data = np.zeros(tuple(s.shape) + tuple(impl.key_shape), np.uint32)
            return jax.random.wrap_key_data(data, impl=impl.name)
        if jnp.issubdtype(dtype, jnp.complexfloating):
            x = 2 * (rng.random(s.shape) + 1j * rng.random(s.shape)) - (1 + 1j)
        elif jnp.issubdtype(dtype, jnp.floating):
            x = rng.random(s.shape, dtype=np.float32) * 2 - 1
        else:
            x = np.zeros(s.shape, dtype)
        return jax.device_put(np.asarray(x).astype(dtype))

    with jax.ensure_compile_time_eval():
        return jax.tree.map(make, specs)


def best_of(fn: Callable[[], Any], repeats: int, timer: Callable = time.perf_counter):
    """The quickest of `repeats` timed calls of `fn`, after one untimed call: as
    `timeit` advises, so that another job's noise on the machine does not move it."""
    run = lambda: jax.block_until_ready(fn())  # noqa: E731
    run()
    return min(timeit.repeat(run, timer=timer, repeat=repeats, number=1))


def _timed(fn: Callable, specs: list, repeats: int, key: str = "") -> float | None:
    """Runs of `fn`'s compiled program per second (the best of `repeats`), or with
    `key`, XLA's `cost_analysis()[key]` per second."""
    compiled = jax.jit(fn).lower(*specs).compile()
    args = concrete_inputs(specs)
    seconds = best_of(lambda: compiled(*args), repeats)
    amount = float((compiled.cost_analysis() or {}).get(key, 1.0)) if key else 1.0
    return amount / seconds if amount > 0 and seconds > 0 else None


def stream_bandwidth(nbytes: int, repeats: int, one_core: bool = False) -> float | None:
    """Bytes per second read and written by `y = a * y + b` over `nbytes`, in a
    loop so that the data stays in the level it fits; with `one_core`, a slice of
    at most `SLICE` bytes at a time, an op too small for XLA to split."""
    n = max(nbytes // 4, 256)
    k = min(n, SLICE // 4) if one_core else n  # elements per op
    n, reps = n // k * k, max(2, 2**28 // (4 * k))

    def step(i: Any, y: Any) -> Any:
        if k == n:
            return y * 0.999 + 1.0
        at = (i % (n // k)) * k
        part = jax.lax.dynamic_slice(y, (at,), (k,))
        return jax.lax.dynamic_update_slice(y, part * 0.999 + 1.0, (at,))

    loop = lambda x: jax.lax.fori_loop(0, reps, step, x)
    per_second = _timed(loop, [jax.ShapeDtypeStruct((n,), jnp.float32)], repeats)
    return 8 * k * reps * per_second if per_second else None


def _loop_overhead(repeats: int, trips: int = 2048) -> float | None:
    """Seconds per trip of a scan of a few small kernels (a sort, two 16x16
    matmuls, an `exp`, a max), their arithmetic included (`docs/design.md` says
    why): the fixed cost of a loop body, which larger blocks pay less often."""

    def step(carry: Any, x: Any) -> tuple[Any, Any]:
        w = jnp.eye(16, dtype=x.dtype) * 0.5
        y = jnp.sort(x) @ w
        return carry + jnp.max(y), jnp.exp(y) @ w

    steps = lambda xs: jax.lax.scan(step, jnp.zeros((), xs.dtype), xs)[1]
    spec = jax.ShapeDtypeStruct((trips, 16), jnp.float32)
    per_second = _timed(steps, [spec], repeats)
    return 1 / (per_second * trips) if per_second else None


def calibrate(repeats: int = 7) -> TimeModel:
    """Measure the time model's constants on the default backend's first device: a
    matmul, an `exp`, a streaming kernel inside each level of the memory hierarchy
    (a core's own levels on one core) and past the last, and a scan of small steps.
    A constant that cannot be measured keeps its default."""
    start = time.perf_counter()
    default = TimeModel.for_backend(jax.default_backend())
    matmul = [jax.ShapeDtypeStruct((256, 256), jnp.float32)] * 2
    vector = [jax.ShapeDtypeStruct((2**20,), jnp.float32)]
    exp = lambda x: jnp.sum(jnp.exp(x))
    sizes = [size for size, _ in default.levels]
    # A core's own caches (all but the last level): one core's bandwidth times the
    # cores (an op split over them pays for waking threads, which hides the level's
    # speed); the last level and memory, which they share: ops split over them all.
    one_core = [stream_bandwidth(s // 2, repeats, True) for s in sizes[:-1]]
    rates = [r and r * default.cores for r in one_core]
    rates += [stream_bandwidth(s // 2, repeats) for s in sizes[-1:]]
    memory = stream_bandwidth(min(4 * max(sizes, default=2**24), 2**28), repeats)
    # A smaller level is never slower than a larger one: noise is.
    floor, levels = memory or default.bandwidth, []
    for (size, old), rate in reversed(list(zip(default.levels, rates))):
        floor = max(rate or old, floor)
        levels.insert(0, (size, floor))
    measured = {
        "flops": _timed(lambda a, b: a @ b, matmul, repeats, "flops"),
        "transcendentals": _timed(exp, vector, repeats, "transcendentals"),
        "bandwidth": memory,
        "loop_overhead": _loop_overhead(repeats),
    }
    kept = {k: v for k, v in measured.items() if v}  # each `None` or positive
    missing = sorted(set(measured) - set(kept)) + ["levels"] * (None in rates)
    m = machine()
    where = f"{m['platform']}: {m['device_kind']}"
    if m["platform"] == "cpu":
        caches = "/".join(fmt_bytes(s) for s in m["caches"])
        where = f"cpu: {m['cpu']}, {m['cores']} cores, caches {caches}"
    when = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M")
    note = f"{where}, in {time.perf_counter() - start:.2f} s on {when}"
    note += f" ({', '.join(missing)}: default, not measurable here)" * bool(missing)
    return dataclasses.replace(default, levels=tuple(levels), calibration=note, **kept)
