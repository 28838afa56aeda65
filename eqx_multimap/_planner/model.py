"""The planner's time model (`measure.calibrate` measures it) and its machine."""

import contextlib
import dataclasses
import math
import os
import pathlib
import platform
import re
from typing import Any

import jax

from .._text import fmt_bytes


# XLA:CPU splits an op over its threads only if it reads about this many bytes:
# a dot from 128 KiB, a fusion from 64-256 KiB, not at 64 KiB (`docs/design.md`).
PARALLEL_BYTES = 96 * 2**10
SLICE = 64 * 2**10  # an op too small to split: how one core's bandwidth is measured
SPILL = 4  # main memory's bandwidth from this many times what the last level holds
FALLBACK_CACHES = (48 * 2**10, 2**20, 32 * 2**20)  # the defaults' CPU's data caches
DEFAULT_BANDWIDTHS = (2.5e11, 2e11, 1.1e11)  # a streaming kernel's there, within each
DEFAULT_MEMORY = 1e10  # and past the last
DEVICE_LEVELS = ((32 * 2**20, 3e12),)  # an accelerator's on-chip memory (unverified)
DEVICE_MEMORY = 1e12  # and its HBM's bandwidth; each loop trip launches kernels


def held(caches: tuple[int, ...], cores: int) -> tuple[int, ...]:
    """The bytes each CPU cache holds at its bandwidth (what `calibrate` measures on):
    half its size (`outer sumexp`: all 32 MiB of L3 ran 1.9-5.9x slower than 16 MiB); a
    core's own caches (all but the last) once per core, each its share of a split op."""
    own = len(caches) - 1
    return tuple(s * (cores if i < own else 1) // 2 for i, s in enumerate(caches))


@dataclasses.dataclass(frozen=True)
class TimeModel:
    """The estimated run time of a candidate that fits the budget (see `seconds`).

    A `Planner` calibrates it on first use per machine ([The planner](../planner.md));
    `TimeModel()` is the hand-set default, and `Planner(time_model=...)` takes another.

    - `flops`, `transcendentals`: operations per second.
    - `levels`: each memory level's `(bytes held, bytes per second)`, smallest first
        (on CPU the data caches, see `held`; on an accelerator its on-chip memory).
    - `bandwidth`: bytes per second past the last level (main memory, HBM).
    - `loop_overhead`: seconds per loop trip.
    - `cores`: the threads XLA splits an op over if it reads `PARALLEL_BYTES` or more.
    - `calibration`: how the constants were measured, or `None` for defaults."""

    flops: float = 5e10
    transcendentals: float = 5e9
    levels: tuple[tuple[int, float], ...] = tuple(
        zip(held(FALLBACK_CACHES, 2), DEFAULT_BANDWIDTHS)
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
            sizes = held(cache_levels(), _cores())
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
        `io` bytes (inputs and outputs, each moved once) move at the bandwidth of the
        smallest level holding them all, the rest at that of the smallest holding one
        loop iteration's `working_set`; the `serial` share of compute and bytes (ops too
        small to split) runs on one of `cores`.

        It ranks only candidates that fit the budget, which do the same flops. Compute
        and traffic add, not overlap as in a roofline: on CPU a compute-heavy body
        still slows when its working set leaves the caches (`docs/design.md`)."""
        io = min(io, int(nbytes))  # inputs and outputs: from where they all fit
        memory = io / self.rate(io) + (nbytes - io) / self.rate(working_set)
        compute = flops / self.flops + trans / self.transcendentals
        one_core = 1 + (self.cores - 1) * serial
        return (compute + memory) * one_core + trips * self.loop_overhead

    @property
    def fastest(self) -> int:
        """The bytes the fastest levels hold: a smaller working set gains nothing."""
        top = max((rate for _, rate in self.levels), default=0.0)
        return max((size for size, rate in self.levels if rate >= top), default=0)

    def rate(self, nbytes: int) -> float:
        """The bandwidth of the smallest level holding `nbytes`; past the last, falling
        log-linearly to `bandwidth` at `SPILL` times what it holds (measured there by
        `calibrate`): a working set just past a cache still mostly hits it."""
        if not self.levels or nbytes <= self.levels[-1][0]:
            return next((r for s, r in self.levels if nbytes <= s), self.bandwidth)
        size, last = self.levels[-1]
        past = min(math.log(nbytes / max(size, 1)) / math.log(SPILL), 1.0)
        return last * (self.bandwidth / last) ** past

    def describe(self) -> str:
        levels = ", ".join(f"{r:.2g} within {fmt_bytes(s)}" for s, r in self.levels)
        where = "not calibrated: default constants, set by hand for one 2-core x86-64"
        where = f"calibrated: {self.calibration}" if self.calibrated else where
        return (
            f"est. time = flops / {self.flops:.2g} + transcendentals / "
            f"{self.transcendentals:.2g} + bytes accessed / bandwidth, times up to "
            f"{self.cores} for ops under {fmt_bytes(PARALLEL_BYTES)} (one core), + "
            f"loop trips x {self.loop_overhead:.2g} s; bandwidth: that of the smallest "
            "level holding the inputs and outputs, for theirs; for the rest, holding "
            f"one iteration's working set ({levels}; past the last, falling to "
            f"{self.bandwidth:.2g} at {SPILL}x it). Constants {where}."
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


def cache_levels(root: str = "/sys/devices/system/cpu/cpu0/cache") -> tuple[int, ...]:
    """The sizes of the CPU's data caches, smallest first, as the OS reports them."""
    units, found = {"K": 2**10, "M": 2**20, "G": 2**30}, {}
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
