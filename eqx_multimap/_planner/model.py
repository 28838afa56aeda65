"""The planner's time model, its calibration, and timing compiled programs.

[`TimeModel`][] estimates the run time of a candidate nest from what XLA reports when
it compiles it (flops, transcendentals, bytes accessed), its loop trips and, on CPU,
the temporaries that every call allocates afresh. Its constants are machine
constants: [`calibrate`][] measures them with a short micro-benchmark (a matmul, an
`exp`, a streaming sum, a scan of trivial steps and, on CPU, page faults of fresh
memory), which the planner runs once per backend and device kind and keeps in its
disk cache.

[`concrete_inputs`][] makes fresh arrays of given shapes and dtypes, on which the
planner's measured mode times compiled programs (with `_timing.time_interleaved`).
"""

import ctypes
import dataclasses
import datetime
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._timing import (
    compiled as compile_program,
    fmt_bytes,
    time_interleaved as _time_interleaved,
)


DEFAULT_SOURCE = "default constants, set by hand for one 2-core x86-64"


@dataclasses.dataclass(frozen=True)
class TimeModel:
    """The estimated run time of a candidate that fits the budget (see `seconds`).

    Throughputs, the overhead of one loop iteration, and on CPU the size above which
    temporaries are allocated (and page-faulted in) afresh on every call. A
    `Planner` calibrates them on first use per backend and device kind (see
    [The planner](../planner.md)); `TimeModel()` is the hand-set default, and
    `Planner(time_model=...)` takes a model of one's own.

    - `flops`, `transcendentals`: operations per second.
    - `bandwidth`: bytes accessed per second.
    - `loop_overhead`: seconds per loop trip.
    - `page_bandwidth`: bytes per second at which fresh temporaries are
        page-faulted in.
    - `fresh_threshold`: temporaries above this many bytes are allocated afresh on
        every call (`None`: never, as with pooled device memory); `fresh_source`
        says where the threshold comes from.
    - `calibration`: how the constants were measured, or `None` for defaults.
    """

    flops: float = 5e10
    transcendentals: float = 5e9
    bandwidth: float = 2e10
    loop_overhead: float = 1e-6
    # Fresh temporaries are page-faulted in at this rate (measured 2.9-4.3 GB/s on
    # a 2-core x86-64 machine).
    page_bandwidth: float = 3e9
    # glibc's malloc serves blocks above its mmap threshold with a fresh `mmap` each
    # time; the threshold adapts to the blocks freed, up to this size (64-bit
    # Linux). `None`: no such cost (pooled device memory).
    fresh_threshold: int | None = 32 * 2**20
    fresh_source: str = "glibc malloc's largest mmap threshold"
    calibration: str | None = None

    @classmethod
    def for_backend(cls, backend: str) -> "TimeModel":
        """The default (uncalibrated) constants for a backend."""
        if backend == "cpu":
            return cls()
        return cls(
            loop_overhead=1e-5,  # an accelerator launches kernels per iteration
            fresh_threshold=None,
            fresh_source=f"{backend}: pooled device memory, no fresh pages",
        )

    @property
    def calibrated(self) -> bool:
        return self.calibration is not None

    def fresh(self, temp: int) -> int:
        """The temporary bytes that each call allocates, and page-faults in, afresh."""
        threshold = self.fresh_threshold
        return temp if threshold is not None and temp > threshold else 0

    def seconds(
        self, flops: float, trans: float, nbytes: float, trips: int, fresh: float = 0.0
    ) -> float:
        """Estimated run time, roofline-like: the larger of compute and memory
        traffic, plus the page faults of fresh temporaries, plus loop overhead.

        A rough model: it only ranks candidates that already fit the budget, and
        those do nearly the same flops; when memory-bound, it separates them by the
        bytes they move (a small block re-reads shared operands once per
        iteration); on CPU, by the temporaries that every call page-faults in afresh
        (a big block's); and when compute-bound, by their loop trips.
        """
        compute = flops / self.flops + trans / self.transcendentals
        memory = nbytes / self.bandwidth
        return (
            max(compute, memory)
            + fresh / self.page_bandwidth
            + trips * self.loop_overhead
        )

    def describe(self) -> str:
        if self.fresh_threshold is not None:
            fresh = (
                f"fresh = the temporary bytes when above "
                f"{fmt_bytes(self.fresh_threshold)}, {self.fresh_source} (allocated "
                "and page-faulted in on every call), else 0"
            )
        else:
            fresh = f"fresh = 0 ({self.fresh_source})"
        where = (
            f"calibrated: {self.calibration}"
            if self.calibrated
            else f"not calibrated: {DEFAULT_SOURCE}"
        )
        return (
            f"est. time = max(flops / {self.flops:.2g} + transcendentals / "
            f"{self.transcendentals:.2g}, bytes accessed / {self.bandwidth:.2g}) + "
            f"fresh / {self.page_bandwidth:.2g} + loop trips x "
            f"{self.loop_overhead:.2g} s; {fresh}. Constants {where}."
        )

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> "TimeModel":
        """The model stored by `to_json`; `ValueError` if it is not one."""
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, dict) or set(data) != names:
            raise ValueError(f"not a stored time model: {data!r}")
        for name in ("flops", "transcendentals", "bandwidth", "loop_overhead"):
            _positive(data[name], name)
        _positive(data["page_bandwidth"], "page_bandwidth")
        threshold = data["fresh_threshold"]
        if threshold is not None and (
            isinstance(threshold, bool) or not isinstance(threshold, int)
        ):
            raise ValueError(f"bad fresh_threshold {threshold!r}")
        if not isinstance(data["fresh_source"], str) or not (
            data["calibration"] is None or isinstance(data["calibration"], str)
        ):
            raise ValueError("bad time model descriptions")
        return cls(**data)


def _positive(x: Any, name: str) -> None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0:
        raise ValueError(f"`{name}` must be a positive number, got {x!r}")
    if not math.isfinite(x):
        raise ValueError(f"`{name}` must be finite, got {x!r}")


#
# The machine.
#


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def machine() -> dict[str, Any]:
    """What plans and calibrations are specific to: the backend, the device kind
    and, for the CPU backend, the host's processor and core count."""
    device = jax.devices()[0]
    out: dict[str, Any] = {
        "backend": jax.default_backend(),
        "platform": device.platform,
        "device_kind": device.device_kind,
        "n_devices": jax.device_count(),
    }
    if device.platform == "cpu":
        out["cpu"] = _cpu_model()
        out["cores"] = os.cpu_count()
        out["arch"] = platform.machine()
    return out


def describe_machine(m: dict[str, Any]) -> str:
    if m.get("platform") == "cpu":
        return f"cpu: {m.get('cpu')}, {m.get('cores')} cores"
    return f"{m.get('platform')}: {m.get('device_kind')}"


#
# Running compiled programs on fresh inputs.
#


def concrete_inputs(specs: Any) -> Any:
    """Fresh arrays of the shapes and dtypes of a pytree of `ShapeDtypeStruct`s, on
    the default device: floats uniform in `[-1, 1)`, integers and booleans zero.

    Built eagerly even while a function is being traced (the planner runs at trace
    time), and never from a caller's buffers."""
    rng = np.random.default_rng(0)

    def make(s: jax.ShapeDtypeStruct) -> Any:
        dtype = s.dtype
        if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            impl = dtype._impl  # pyright: ignore[reportAttributeAccessIssue]
            data = np.zeros(tuple(s.shape) + tuple(impl.key_shape), np.uint32)
            return jax.random.wrap_key_data(data, impl=impl.name)
        if jnp.issubdtype(dtype, jnp.complexfloating):
            x = rng.random(s.shape) + 1j * rng.random(s.shape)
            return jax.device_put(np.asarray(2 * x - (1 + 1j)).astype(dtype))
        if jnp.issubdtype(dtype, jnp.floating):
            x = rng.random(s.shape, dtype=np.float32) * 2 - 1
            return jax.device_put(np.asarray(x).astype(dtype))
        return jax.device_put(np.zeros(s.shape, dtype))

    with jax.ensure_compile_time_eval():
        return jax.tree.map(make, specs)


#
# Calibration.
#


def _best_of(fn: Callable[[], Any], repeats: int) -> float:
    """The quickest of `repeats` timed calls, after one untimed call."""
    times = _time_interleaved([fn], 0.0, repeats, repeats, min_sample=0.0, settle=0)
    return min(times[0])


def _rate(fn: Callable, specs: list, key: str, repeats: int = 5) -> float | None:
    """XLA's `cost_analysis()[key]` of `fn` over the seconds it takes (best of
    `repeats`), or `None` if either is unavailable."""
    compiled = compile_program(fn, *specs)
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    amount = float((ca or {}).get(key, 0.0))
    args = concrete_inputs(specs)
    seconds = _best_of(lambda: compiled(*args), repeats)
    if amount <= 0 or seconds <= 0:
        return None
    return amount / seconds


def _loop_overhead(trips: int = 2048) -> float | None:
    """Seconds per trip of a scan whose body runs a few small kernels (a sort, two
    16x16 matmuls, an `exp`, a max): what a loop trip costs beyond its arithmetic,
    which is negligible here."""

    def step(carry: Any, x: Any) -> tuple[Any, Any]:
        w = jnp.eye(16, dtype=x.dtype) * 0.5
        y = jnp.sort(x) @ w
        return carry + jnp.max(y), jnp.exp(y) @ w

    def steps(xs: Any) -> Any:
        return jax.lax.scan(step, jnp.zeros((), xs.dtype), xs)[1]

    spec = jax.ShapeDtypeStruct((trips, 16), jnp.float32)
    compiled = compile_program(steps, spec)
    args = concrete_inputs(spec)
    seconds = _best_of(lambda: compiled(args), 5)
    return seconds / trips if seconds > 0 else None


def _page_bandwidth(nbytes: int = 64 * 2**20) -> float | None:
    """Bytes per second at which fresh `malloc`ed memory above glibc's mmap threshold
    is written (page-faulted in), beyond the rate of rewriting memory in place."""
    try:
        libc = ctypes.CDLL(None)
        malloc, free = libc.malloc, libc.free
    except (OSError, AttributeError):
        return None
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    free.restype, free.argtypes = None, [ctypes.c_void_p]
    kept = malloc(nbytes)
    if not kept:
        return None
    try:

        def fresh() -> float:
            p = malloc(nbytes)
            if not p:
                raise MemoryError
            t0 = time.perf_counter()
            ctypes.memset(p, 1, nbytes)
            dt = time.perf_counter() - t0
            free(p)
            return dt

        def reused() -> float:
            t0 = time.perf_counter()
            ctypes.memset(kept, 1, nbytes)
            return time.perf_counter() - t0

        reused()
        t_fresh = min(fresh() for _ in range(3))
        t_reused = min(reused() for _ in range(3))
    except MemoryError:
        return None
    finally:
        free(kept)
    faults = t_fresh - t_reused
    return nbytes / faults if faults > 0 else None


def calibrate() -> TimeModel:
    """Measure the time model's constants on the default backend's first device.

    About half a second on a 2-core CPU (four small programs compiled and run a few
    times, and on CPU 64 MiB of fresh memory written three times). A constant that
    cannot be measured keeps its default."""
    start = time.perf_counter()
    backend = jax.default_backend()
    default = TimeModel.for_backend(backend)
    f32 = jnp.float32
    n = 256
    flops = _rate(
        lambda a, b: a @ b,
        [jax.ShapeDtypeStruct((n, n), f32)] * 2,
        "flops",
    )
    trans = _rate(
        lambda x: jnp.sum(jnp.exp(x)),
        [jax.ShapeDtypeStruct((2**20,), f32)],
        "transcendentals",
    )
    bandwidth = _rate(
        lambda x: jnp.sum(x), [jax.ShapeDtypeStruct((2**23,), f32)], "bytes accessed"
    )
    loop = _loop_overhead()
    page = _page_bandwidth() if default.fresh_threshold is not None else None
    measured = {
        "flops": flops,
        "transcendentals": trans,
        "bandwidth": bandwidth,
        "loop_overhead": loop,
        "page_bandwidth": page,
    }
    kept = {k: v for k, v in measured.items() if v is not None and v > 0}
    missing = sorted(set(measured) - set(kept))
    seconds = time.perf_counter() - start
    when = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M")
    note = f"{describe_machine(machine())}, in {seconds:.2f} s on {when}"
    if missing:
        note += f" ({', '.join(missing)}: default, not measurable here)"
    return dataclasses.replace(default, calibration=note, **kept)
