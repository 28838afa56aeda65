"""The automatic planner behind `filter_multi_vmap(..., plan="auto")`.

A plan picks, for the mapped dims of one call signature, which dims to scan, in which
order and with which chunk sizes; the rest are vmapped. Candidates are lowered and
compiled against `jax.ShapeDtypeStruct`s of the arguments, never executed:

- `compiled.memory_analysis().temp_size_in_bytes` must fit the memory budget;
- `compiled.cost_analysis()` gives flops and bytes accessed. XLA costs the body of a
  while loop (a scan) *once*, so the body of each block of the nest is also compiled
  on its own and its cost added `trips - 1` more times (see `_corrected_cost`).

The search is bounded:

1. Full vmap is compiled first and chosen if it fits, unless its temporaries are
   allocated afresh on every call (see 3.).
2. Otherwise the candidates form ladders, one per order of the dims (the output's
   layout, the inputs' layout, by size): scan a prefix of the dims of size > 1, the
   outer ones one element at a time and the last one in chunks from a small
   geometric set (about `n/2, n/4, ...`, moved to a nearby divisor of `n` when there
   is one, so that no remainder block is needed). A ladder is sorted by the number
   of elements of one loop iteration (the block), which memory grows with; a binary
   search finds the largest block that fits. These boundary candidates (and those
   with the same block in the same ladder) get their costs, and the cheapest by
   estimated time (`TimeModel.seconds`) wins.
3. On CPU, temporaries above the fresh threshold (glibc's malloc hands blocks that
   big out as fresh `mmap`s) are page-faulted in again on *every* call. So when the
   largest fitting block of a ladder is above the threshold, a second binary search
   finds its largest block below it, which is costed too.

With `shard=`, the plan is of the local nest of one device (`_localize`): the sharded
dims keep their strategy, at their local sizes, and the budget is per device.

A [`Planner`][] owns the plan cache and its statistics; `plan="auto"` uses one
shared by the process, and `plan=Planner()` gives a wrapper its own.
"""

import collections as co
import dataclasses
import hashlib
import math
import os
import time
from collections.abc import Callable
from typing import Any, Literal

import jax
import numpy as np
from jax._src import traceback_util

from ._blocks import blocks, describe_nest, NestSpec, plural
from ._errors import SpecError
from ._nest import Build, build_levels, loop_body_inputs, run
from ._resolve import Call
from ._shard import axes_str, describe_split


traceback_util.register_exclusion(__file__)


PlanMode = Literal["auto"]
"""The planners `filter_multi_vmap(..., plan=...)` accepts by name."""

MemoryBudget = int | float | None
"""Bytes as an `int`, a fraction of device memory as a `float` in `(0, 1]`."""

DEFAULT_BUDGET_FRACTION = 0.5
"""The budget when `plan="auto"` is given without `memory_budget`."""

_MAX_CACHE = 256
# Once planning has compiled this many programs (candidates and loop bodies), it
# searches no further ladders.
_MAX_COMPILES = 12


ScanNest = tuple[tuple[str, int | None], ...]


@dataclasses.dataclass(frozen=True)
class PlanDim:
    """How one mapped dim is mapped.

    - `name`, `size`: the dim and its size.
    - `strategy`: `"scan"` or `"vmap"`.
    - `chunk`: for a scanned dim, the chunk size (`None`: one element at a time).
    - `order`: its position in the nest, `0` being outermost.
    """

    name: str
    size: int
    strategy: Literal["scan", "vmap"]
    chunk: int | None
    order: int


@dataclasses.dataclass(frozen=True)
class ShardDim:
    """A dim split over a device mesh by `shard=`, outside the planned nest.

    - `name`, `size`: the dim and its global size.
    - `mesh_axes`: the mesh axes it is split over.
    - `shards`: the number of blocks (devices along those axes).
    - `local_size`: the size of one device's block (after padding, with `pad=True`).
    """

    name: str
    size: int
    mesh_axes: tuple[str, ...]
    shards: int
    local_size: int


@dataclasses.dataclass(frozen=True)
class PlanCandidate:
    """One nest the planner considered, with its compiled estimates.

    `temp_bytes`, `flops`, `transcendentals`, `bytes_accessed`, `working_set` (the
    memory one loop iteration touches), `fresh_bytes` (the temporary bytes allocated,
    and page-faulted in, afresh on every call: see `fresh_threshold`) and `seconds`
    (the estimated run time) are `None` when the candidate was not compiled; all but
    `temp_bytes` are also `None` for a compiled candidate that did not fit. `fits` is
    `None` when there is no budget (a fixed nest) or the candidate was not compiled.
    """

    scan: ScanNest
    vmap: tuple[str, ...]
    block: int
    trips: int
    source: str
    temp_bytes: int | None = None
    flops: float | None = None
    transcendentals: float | None = None
    bytes_accessed: float | None = None
    working_set: int | None = None
    seconds: float | None = None
    fits: bool | None = None
    fresh_bytes: int | None = None

    @property
    def spec(self) -> NestSpec:
        return NestSpec(self.scan, self.vmap)

    def nest(self, sizes: dict[str, int]) -> str:
        return describe_nest(self.spec, sizes)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The nest chosen for one call signature, and how it was chosen.

    Returned by [`eqx_multimap.explain`][]; printed by `verbose=True` when planning.
    `str(plan)` is a readable table.

    - `fun_name`: the wrapped function, as in error messages.
    - `auto`: `True` for `plan="auto"`, `False` for a fixed nest.
    - `sizes`: `(name, size)` of every dim bound by the arguments.
    - `dims`: one `PlanDim` (name, size, strategy, chunk, order) per mapped dim, in
        nest order.
    - `scan`, `vmap`: the chosen strategies, as `filter_multi_vmap` takes them.
    - `chosen`: the chosen candidate.
    - `candidates`: every `PlanCandidate` considered, compiled or not; compiled ones
        carry their temporary memory, trip-count-corrected cost, working set,
        estimated time and whether they fit.
    - `budget_bytes`, `budget_source`: the memory budget and where it came from.
    - `n_compiled`: how many compiles planning took (candidates and loop bodies).
    - `seconds`: how long planning took.
    - `shard`: with `shard=`, one `ShardDim` per sharded dim. The nest is then
        `shard_map` outermost, and `sizes`, `dims`, the candidates and the budget
        are *per device* (the local nest on one device's block).
    - `backward`: `True` for the plan of the nest run under differentiation: its
        candidates' memory is that of their reverse-mode derivative, and
        `checkpoint` says whether its scan bodies are checkpointed.
    - `gradient`: from `explain`, the plan of the nest that differentiation runs
        (or, if none fits the budget, the error that differentiating would raise).
    - `time_model`: the time model that ranked the candidates.
    """

    fun_name: str
    auto: bool
    sizes: tuple[tuple[str, int], ...]
    dims: tuple[PlanDim, ...]
    chosen: PlanCandidate
    candidates: tuple[PlanCandidate, ...]
    budget_bytes: int | None
    budget_source: str
    n_compiled: int
    seconds: float
    shard: tuple[ShardDim, ...] = ()
    backward: bool = False
    checkpoint: bool = False
    gradient: "Plan | str | None" = None
    time_model: "TimeModel | None" = None

    @property
    def spec(self) -> NestSpec:
        """The chosen nest."""
        return self.chosen.spec

    @property
    def scan(self) -> dict[str, int | None]:
        return dict(self.chosen.scan)

    @property
    def vmap(self) -> tuple[str, ...]:
        return self.chosen.vmap

    @property
    def n_candidates(self) -> int:
        return len(self.candidates)

    def __str__(self) -> str:
        sizes = dict(self.sizes)
        head = "plan='auto'" if self.auto else "fixed nest"
        if self.backward:
            head += ", under differentiation (reverse mode)"
        lines = [f"{self.fun_name}: {head}"]
        if self.budget_bytes is not None:
            what = "of the derivative" if self.backward else "of temporary memory"
            lines.append(
                f"memory budget: {_fmt_bytes(self.budget_bytes)} {what} "
                f"({self.budget_source})"
            )
        nest = self.chosen.nest(sizes)
        if self.shard:
            parts = "; ".join(
                describe_split(d.name, d.size, d.mesh_axes, d.shards, d.local_size)
                for d in self.shard
            )
            nest = f"shard_map({parts}) -> {nest}"
            lines.append(
                "sharded: sizes, candidates and the budget below are per device"
            )
        lines.append(f"nest: {nest}")
        lines.append("")
        sharded = {d.name: d for d in self.shard}
        rows = [("dim", "size", "strategy", "chunk", "order")]
        if sharded:
            rows = [rows[0] + ("sharded",)]
        for d in self.dims:
            chunk = "1" if d.chunk is None else str(d.chunk)
            chunk = "-" if d.strategy == "vmap" else chunk
            row = (d.name, str(d.size), d.strategy, chunk, str(d.order))
            if sharded:
                s = sharded.get(d.name)
                row += (
                    "-"
                    if s is None
                    else f"{s.size} over {axes_str(s.mesh_axes)} "
                    f"({plural(s.shards, 'shard')})",
                )
            rows.append(row)
        lines.extend(_table(rows))
        lines.append("")
        n_cand = sum(c.temp_bytes is not None for c in self.candidates)
        lines.append(
            f"candidates: {self.n_candidates} considered, {n_cand} compiled "
            f"({self.n_compiled} compiles including loop bodies, "
            f"{self.seconds:.2f} s)"
        )
        rows = [
            (
                "",
                "nest",
                "temp memory",
                "flops",
                "bytes accessed",
                "working set",
                "fresh",
                "est. time",
                "fits",
            )
        ]
        for c in self.candidates:
            mark = "*" if c == self.chosen else ""
            fits = "-" if c.fits is None else ("yes" if c.fits else "no")
            rows.append(
                (
                    mark,
                    c.nest(sizes),
                    "-" if c.temp_bytes is None else _fmt_bytes(c.temp_bytes),
                    _fmt_num(c.flops),
                    _fmt_num(c.bytes_accessed),
                    "-" if c.working_set is None else _fmt_bytes(c.working_set),
                    "-" if c.fresh_bytes is None else _fmt_bytes(c.fresh_bytes),
                    "-" if c.seconds is None else f"{c.seconds * 1e3:.3g} ms",
                    fits,
                )
            )
        lines.extend(_table(rows))
        if self.backward and self.checkpoint:
            lines.append(
                "scan bodies checkpointed: the backward pass recomputes each block"
            )
        if self.auto and self.time_model is not None:
            lines.append("")
            lines.append(self.time_model.describe())
        if self.gradient is not None:
            lines.append("")
            lines.append(str(self.gradient))
        return "\n".join(lines)


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for j, r in enumerate(rows):
        out.append(" | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if j == 0:
            out.append("-+-".join("-" * w for w in widths))
    return out


def _fmt_bytes(n: int | float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _fmt_num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


#
# Options and budget
#

#
# Options and budget
#


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """A wrapper's planning options: its planner and memory budget. Not a pytree."""

    planner: "Planner"
    memory_budget: MemoryBudget
    verbose: bool = False

    def __repr__(self) -> str:
        budget = "" if self.memory_budget is None else f", {self.memory_budget!r}"
        return f"{self.planner!r}{budget}"


def plan_options(plan: Any, memory_budget: Any, verbose: bool) -> "PlanOptions | None":
    """Validate `plan=` and `memory_budget=` at decoration time."""
    if plan is not None and plan != "auto" and not isinstance(plan, Planner):
        raise SpecError(
            f"`filter_multi_vmap(..., plan=...)` must be 'auto', an "
            f"`eqx_multimap.Planner`, or `None`, but got {plan!r}."
        )
    if memory_budget is not None:
        _check_budget(plan, memory_budget)
    if plan is None:
        return None
    planner = DEFAULT_PLANNER if plan == "auto" else plan
    return PlanOptions(planner, memory_budget, bool(verbose))


def _check_budget(plan: Any, memory_budget: Any) -> None:
    if plan is None:
        raise SpecError(
            f"`filter_multi_vmap(..., memory_budget={memory_budget!r})` is only used "
            "by the planner: pass `plan='auto'` too, or drop `memory_budget`."
        )
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float)):
        raise SpecError(
            "`filter_multi_vmap(..., memory_budget=...)` must be an `int` (bytes) or "
            "a `float` in (0, 1] (a fraction of device memory), but got "
            f"{memory_budget!r} of type `{type(memory_budget).__name__}`."
        )
    if isinstance(memory_budget, int):
        if memory_budget < 1:
            raise SpecError(
                f"`filter_multi_vmap(..., memory_budget={memory_budget!r})`: a budget "
                "in bytes must be a positive `int`."
            )
    elif not (0.0 < memory_budget <= 1.0):
        raise SpecError(
            f"`filter_multi_vmap(..., memory_budget={memory_budget!r})`: a `float` "
            "budget is a fraction of device memory and must be in (0, 1]; give "
            "bytes as an `int`, e.g. `memory_budget=2**30`."
        )


def _device_memory() -> tuple[int, str]:
    device = jax.local_devices()[0]
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # some backends do not implement it
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"memory of {device}"
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 0
    if ram <= 0:
        raise SpecError(
            f"`filter_multi_vmap(..., plan='auto')`: a fractional `memory_budget` "
            f"needs the memory size of {device}, which is unavailable, and so is the "
            "size of physical RAM; give the budget in bytes as an `int`."
        )
    return int(ram), (
        f"physical RAM (os.sysconf), as {device.platform} reports no device memory"
    )


def resolve_budget(memory_budget: MemoryBudget) -> tuple[int, str]:
    """The budget in bytes, and a description of where it came from."""
    if isinstance(memory_budget, int):
        return memory_budget, f"memory_budget={memory_budget}"
    fraction = DEFAULT_BUDGET_FRACTION if memory_budget is None else memory_budget
    total, where = _device_memory()
    given = "default " if memory_budget is None else ""
    return int(total * fraction), (
        f"{given}memory_budget={fraction:g} of {_fmt_bytes(total)} {where}"
    )


#
# Candidates
#


def _chunk_options(n: int) -> list[int | None]:
    """Chunk sizes for a dim of size `n`, largest first; `None` is one at a time.

    About `n / m` for `m = 2, 4, 8, ...` chunks, moved to a divisor of `n` within a
    factor of `sqrt(2)` when there is one (so that no remainder block is needed).
    """
    divisors = set()
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            divisors.update((d, n // d))
    out: list[int | None] = []
    m = 2
    while n // m >= 2:
        ideal = n / m
        near = [d for d in divisors if ideal / 2**0.5 <= d <= ideal * 2**0.5]
        near = [d for d in near if 2 <= d <= n // 2]
        c = min(near, key=lambda d: abs(math.log(d / ideal))) if near else n // m
        if c not in out:
            out.append(c)
        m *= 2
    out.append(None)
    return out


def _block_and_trips(
    scan: ScanNest, vmap: tuple[str, ...], sizes: dict[str, int]
) -> tuple[int, int]:
    block = math.prod(sizes[n] for n in vmap)
    trips = 1
    for name, chunk in scan:
        if chunk is None:
            trips *= sizes[name]
        else:
            block *= chunk
            trips *= max(1, sizes[name] // chunk)
    return block, trips


def _candidate(scan: ScanNest, vmap: tuple[str, ...], sizes, source) -> PlanCandidate:
    block, trips = _block_and_trips(scan, vmap, sizes)
    return PlanCandidate(scan, vmap, block, trips, source)


def ladder(
    order: tuple[str, ...],
    layout: tuple[str, ...],
    sizes: dict[str, int],
    fixed: ScanNest = (),
    frozen: frozenset[str] = frozenset(),
) -> list[PlanCandidate]:
    """Scanned candidates, largest block first (full vmap excluded).

    Scans a prefix of `order` (dims of size 1 and `frozen` dims skipped): the outer
    dims of the prefix one element at a time, the last in chunks, inside the `fixed`
    scans. The remaining dims are vmapped, in the order of `layout`.
    """
    scannable = [n for n in order if sizes[n] > 1 and n not in frozen]
    fixed_names = {n for n, _ in fixed}
    out = []
    for k in range(1, len(scannable) + 1):
        outer, inner = scannable[: k - 1], scannable[k - 1]
        scanned = fixed_names.union(scannable[:k])
        vmap = tuple(n for n in layout if n not in scanned)
        for chunk in _chunk_options(sizes[inner]):
            scan = fixed + tuple((n, None) for n in outer) + ((inner, chunk),)
            out.append(_candidate(scan, vmap, sizes, "ladder"))
    out.sort(key=lambda c: -c.block)  # stable: fewer scanned dims first on ties
    return out


def dim_orders(call: Call, sizes: dict[str, int]) -> list[tuple[str, ...]]:
    """Orders in which the planner scans the mapped dims, first one the layout.

    The layout is the order of the mapped dims in the first output's dims: scanning
    (and vmapping) in that order stacks the output without a transpose. Then the
    order in which the inputs name them (scanning an input's leading axis needs no
    copy), then by size, largest first (the fewest scans for a given block).
    """
    mapped = call.mapped
    names = [n for n in call.out.dims[0].names if n in mapped] if call.out.dims else []
    layout = tuple(names) + tuple(n for n in mapped if n not in names)
    inputs = tuple(n for n in call.check.seen if n in mapped)
    inputs += tuple(n for n in mapped if n not in inputs)
    by_size = tuple(sorted(layout, key=lambda n: -sizes[n]))
    return list(dict.fromkeys([layout, inputs, by_size]))


#
# Lowering and compiling
#


#
# The time model.
#


@dataclasses.dataclass(frozen=True)
class TimeModel:
    """The estimated run time of a candidate that fits the budget (see `seconds`).

    Rough throughputs, the overhead of one loop iteration, and on CPU the size above
    which temporaries are allocated (and page-faulted in) afresh on every call.
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

    @classmethod
    def for_backend(cls, backend: str) -> "TimeModel":
        if backend == "cpu":
            return cls()
        return cls(
            loop_overhead=1e-5,  # an accelerator launches kernels per iteration
            fresh_threshold=None,
            fresh_source=f"{backend}: pooled device memory, no fresh pages",
        )

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
                f"{_fmt_bytes(self.fresh_threshold)}, {self.fresh_source} (allocated "
                "and page-faulted in on every call), else 0"
            )
        else:
            fresh = f"fresh = 0 ({self.fresh_source})"
        return (
            f"est. time = max(flops / {self.flops:.0e} + transcendentals / "
            f"{self.transcendentals:.0e}, bytes accessed / {self.bandwidth:.0e}) + "
            f"fresh / {self.page_bandwidth:.0e} + loop trips x "
            f"{self.loop_overhead:.0e} s; {fresh}"
        )


#
# Lowering and compiling
#


def _struct(x: Any, shape: tuple[int, ...] | None = None) -> jax.ShapeDtypeStruct:
    weak = bool(getattr(jax.typeof(x), "weak_type", False))
    return jax.ShapeDtypeStruct(
        np.shape(x) if shape is None else shape, x.dtype, weak_type=weak
    )


class _Compiler:
    """Compiles candidate nests of one resolved call, every input leaf an explicit
    argument (given as a `ShapeDtypeStruct` at the sizes planned for).

    With `backward`, a candidate's memory is that of its reverse-mode derivative
    (`jax.vjp` of the nest, every scan body checkpointed); its cost is still that of
    its forward nest, which ranks candidates alike."""

    def __init__(
        self,
        call: Call,
        sizes: dict[str, int],
        model: TimeModel,
        backward: bool = False,
    ):
        self.problem = call.problem(sizes, standalone=True)
        self.checkpoint = call.options.checkpoint
        self.isolate = call.isolate
        self.backward = backward
        self.model = model
        self.specs = []
        for v, axes in zip(call.values, call.leaf_axes):
            shape = list(np.shape(v))
            for name, ax in axes.items():
                shape[ax] = sizes[name]
            self.specs.append(_struct(v, tuple(shape)))
        self.n_compiled = 0

    def compile(self, fn: Callable[[list], Any], specs: list) -> Any:
        self.n_compiled += 1
        return jax.jit(fn).lower(specs).compile()

    def build(self, spec: NestSpec) -> Build:
        """How a candidate is built: under differentiation, every scan body
        checkpointed (so the backward pass recomputes one block at a time)."""
        checkpoint = self.checkpoint or (self.backward and bool(spec.scan))
        return Build(isolate=self.isolate, checkpoint=checkpoint)

    def _temp_bytes(self, spec: NestSpec) -> tuple[int, Any]:
        """The temporary memory of the nest (or of its derivative), and the compiled
        forward nest when that is what was compiled."""
        build = self.build(spec)

        def forward(values: list) -> Any:
            return run(self.problem, spec, build, values)

        if not self.backward:
            compiled = self.compile(forward, self.specs)
            return int(compiled.memory_analysis().temp_size_in_bytes), compiled
        outs = jax.eval_shape(forward, self.specs)
        diff_in = [i for i, s in enumerate(self.specs) if _inexact(s)]
        diff_out = [i for i, s in enumerate(outs) if _inexact(s)]

        def gradient(values: list, cts: list) -> Any:
            def of_inexact(xs: list) -> list:
                full = list(values)
                for i, x in zip(diff_in, xs):
                    full[i] = x
                out = forward(full)
                return [out[i] for i in diff_out]

            _, pullback = jax.vjp(of_inexact, [values[i] for i in diff_in])
            return pullback(cts)

        compiled = self.compile(
            lambda args: gradient(*args), [self.specs, [outs[i] for i in diff_out]]
        )
        return int(compiled.memory_analysis().temp_size_in_bytes), None

    def evaluate(self, cand: "PlanCandidate", budget: int | None) -> "PlanCandidate":
        """Compile `cand`: its temporary memory, and if it fits, its costs."""
        temp, compiled = self._temp_bytes(cand.spec)
        fits = None if budget is None else temp <= budget
        if fits is False:
            return dataclasses.replace(cand, temp_bytes=temp, fits=fits)
        if compiled is None:
            build = self.build(cand.spec)
            compiled = self.compile(
                lambda values: run(self.problem, cand.spec, build, values), self.specs
            )
        flops, trans, nbytes, ws = self._corrected_cost(compiled, cand)
        trips = cand.trips if cand.scan else 0
        fresh = self.model.fresh(temp)
        return dataclasses.replace(
            cand,
            temp_bytes=temp,
            flops=flops,
            transcendentals=trans,
            bytes_accessed=nbytes,
            working_set=ws,
            fresh_bytes=fresh,
            seconds=self.model.seconds(flops, trans, nbytes, trips, float(fresh)),
            fits=fits,
        )

    def _corrected_cost(
        self, compiled: Any, cand: "PlanCandidate"
    ) -> tuple[float, float, float, int]:
        """Flops, transcendentals, bytes and working set, loop bodies counted fully.

        XLA's cost analysis counts the body of a while loop once. For each block
        whose loops run `trips > 1` times, the block's loop body (the vmaps inside
        its scans) is compiled on its own and its cost added `trips - 1` more times.
        The working set is the largest memory footprint (arguments, outputs,
        temporaries) of one body, or of the whole candidate when nothing loops.
        """
        total = list(_costs(compiled))
        ws = 0
        looped = False
        for block in blocks(cand.spec, self.problem.sizes):
            if block.trips <= 1:
                continue
            looped = True
            specs, axes = loop_body_inputs(self.specs, self.problem.leaf_axes, block)
            body = build_levels(self.problem.body, block.vmaps, axes)
            body_compiled = self.compile(body, specs)
            costs = _costs(body_compiled)
            for j in range(3):
                total[j] += (block.trips - 1) * costs[j]
            ws = max(ws, _footprint(body_compiled))
        if not looped:
            ws = _footprint(compiled)
        return total[0], total[1], total[2], ws


def _inexact(s: Any) -> bool:
    return jax.numpy.issubdtype(s.dtype, jax.numpy.inexact)


def _footprint(compiled: Any) -> int:
    ma = compiled.memory_analysis()
    return int(
        ma.temp_size_in_bytes + ma.argument_size_in_bytes + ma.output_size_in_bytes
    )


def _costs(compiled: Any) -> tuple[float, float, float]:
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):  # older JAX: one dict per computation
        ca = ca[0] if ca else {}
    ca = ca or {}
    return (
        float(ca.get("flops", 0.0)),
        float(ca.get("transcendentals", 0.0)),
        float(ca.get("bytes accessed", 0.0)),
    )


#
# Planning
#


def _fingerprint(call: Call) -> str:
    """What determines a call's plan besides its options: the body's jaxpr, and the
    shapes and dtypes of every input leaf with its mapped axes."""
    text = str(call.body.jaxpr.jaxpr) + repr(
        [
            (str(_struct(v)), sorted(a.items()))
            for v, a in zip(call.values, call.leaf_axes)
        ]
    )
    text += repr([str(d) for d in call.out.dims])
    return hashlib.sha256(text.encode()).hexdigest()


def _dims_of(cand: PlanCandidate, sizes: dict[str, int]) -> tuple[PlanDim, ...]:
    dims = [
        PlanDim(name, sizes[name], "scan", chunk, i)
        for i, (name, chunk) in enumerate(cand.scan)
    ]
    dims.extend(
        PlanDim(name, sizes[name], "vmap", None, len(cand.scan) + i)
        for i, name in enumerate(cand.vmap)
    )
    return tuple(dims)


def _localize(call: Call) -> tuple[dict[str, int], tuple[ShardDim, ...]]:
    """The mapped sizes as one device sees them, and the sharded dims.

    With `shard=`, the sharded dims are split outside the nest (`shard_map`), so the
    planner plans, and compiles, the local nest of one device.
    """
    sp = call.shard
    if sp is None:
        return call.mapped_sizes, ()
    dims = tuple(
        ShardDim(
            name,
            sp.sizes[name],
            axes,
            math.prod(sp.mesh.shape[a] for a in axes),
            sp.local_sizes[name],
        )
        for name, axes in sp.dims
    )
    return {n: sp.local_sizes[n] for n in call.mapped}, dims


class _NoFit(Exception):
    pass


class Planner:
    """Plans nests for `plan="auto"`, and caches the plans per call signature.

    `plan="auto"` uses one `Planner` shared by the process; pass `plan=Planner()`
    to give a wrapper a planner (and a cache) of its own.

    **Arguments:**

    - `max_cache`: the most plans kept in memory.
    - `time_model`: the time model that ranks candidates (default: the one for the
        default backend).

    The counters `n_plans` (planning runs: cache misses) and `n_compiles` (programs
    compiled while planning) are read by tests and benchmarks.
    """

    def __init__(
        self, *, max_cache: int = _MAX_CACHE, time_model: TimeModel | None = None
    ):
        self.max_cache = max_cache
        self._time_model = time_model
        self._cache: co.OrderedDict[Any, Plan | str] = co.OrderedDict()
        self.n_plans = 0
        self.n_compiles = 0

    def __repr__(self) -> str:
        return "'auto'" if self is DEFAULT_PLANNER else "Planner()"

    @property
    def time_model(self) -> TimeModel:
        if self._time_model is None:
            self._time_model = TimeModel.for_backend(jax.default_backend())
        return self._time_model

    def clear(self) -> None:
        """Forget every cached plan."""
        self._cache.clear()

    def plan(self, call: Call, backward: bool = False) -> Plan:
        """The (cached) automatic plan for a resolved call.

        With `backward`, the plan of the nest that differentiation runs: the memory
        budget is then that of its reverse-mode derivative.

        With `shard=`, the plan is for the local nest inside `shard_map`: the sharded
        dims keep their strategy (scanned if in `scan`, else vmapped) at their local
        sizes; the other mapped dims are planned, under the budget per device.
        """
        options = call.options.plan
        budget, source = resolve_budget(options.memory_budget)
        sizes, shard = _localize(call)
        key = (
            call.options,
            budget,
            shard,
            tuple(sizes.items()),
            _fingerprint(call),
            backward,
        )
        if key in self._cache:
            self._cache.move_to_end(key)
            cached = self._cache[key]
            if isinstance(cached, str):  # no nest fit this signature
                raise SpecError(cached)
            return cached
        try:
            plan = self._plan(call, sizes, budget, source, shard, backward)
        except _NoFit as e:
            self._store(key, str(e))
            raise SpecError(str(e)) from None
        self._store(key, plan)
        if options.verbose:
            print(plan)
        return plan

    def _store(self, key: Any, value: "Plan | str") -> None:
        self._cache[key] = value
        if len(self._cache) > self.max_cache:
            self._cache.popitem(last=False)

    def _plan(
        self,
        call: Call,
        sizes: dict[str, int],
        budget: int,
        source: str,
        shard: tuple[ShardDim, ...],
        backward: bool,
    ) -> Plan:
        self.n_plans += 1
        start = time.perf_counter()
        mapped = call.mapped
        compiler = _Compiler(call, sizes, self.time_model, backward)
        orders = dim_orders(call, sizes)
        given = call.given_nest()
        # Sharded dims keep their local strategy: scanned (outermost) if in `scan`.
        frozen = frozenset(d.name for d in shard)
        fixed = tuple((n, c) for n, c in given.scan if n in frozen)
        layout = tuple(n for n in orders[0] if n not in dict(fixed))
        full = _candidate(fixed, layout, sizes, "full vmap")
        ladders = [ladder(order, orders[0], sizes, fixed, frozen) for order in orders]
        considered = {(full.scan, full.vmap): full}
        for c in sorted(
            (c for steps in ladders for c in steps), key=lambda c: -c.block
        ):
            considered.setdefault((c.scan, c.vmap), c)
        if call.options.scan or call.options.vmap:
            g = _candidate(given.scan, given.vmap, sizes, "given")
            considered.setdefault((g.scan, g.vmap), g)
        evaluated: dict[tuple, PlanCandidate] = {}

        def evaluate(c: PlanCandidate) -> PlanCandidate:
            k = (c.scan, c.vmap)
            if k not in evaluated:
                evaluated[k] = compiler.evaluate(c, budget)
            return evaluated[k]

        try:
            if any(sizes[n] == 0 for n in mapped):
                chosen = full  # nothing to run; no need to compile anything
            else:
                chosen = evaluate(full)
                finalists = [chosen]
                # Full vmap is kept if it fits and allocates nothing afresh per call.
                search = not chosen.fits or bool(chosen.fresh_bytes)
                for i, steps in enumerate(ladders if search else []):
                    if i > 0 and compiler.n_compiled >= _MAX_COMPILES:
                        break  # bounded planning: the first ladder is always searched
                    # Binary search for the largest block that fits.
                    j = _first(steps, 0, lambda c: bool(evaluate(c).fits))
                    # And for the largest whose temporaries are reused per call.
                    if j is not None and evaluate(steps[j]).fresh_bytes:
                        k = _first(steps, j, lambda c: not evaluate(c).fresh_bytes)
                    else:
                        k = None
                    for edge in (j, k):
                        if edge is not None:  # the boundary block, and its ties
                            finalists.extend(
                                evaluate(c)
                                for c in steps
                                if c.block == steps[edge].block
                            )
                fitting = [c for c in finalists if c.fits]
                if fitting:
                    chosen = min(fitting, key=lambda c: c.seconds or 0.0)
                if not chosen.fits:
                    _raise_no_fit(
                        call.fun_name,
                        call,
                        budget,
                        list(evaluated.values()),
                        sizes,
                        backward,
                    )
        finally:
            self.n_compiles += compiler.n_compiled
        candidates = tuple(evaluated.get(k, c) for k, c in considered.items())
        return Plan(
            fun_name=call.fun_name,
            auto=True,
            sizes=tuple({**call.sizes, **sizes}.items()),
            dims=_dims_of(chosen, sizes),
            chosen=chosen,
            candidates=candidates,
            budget_bytes=budget,
            budget_source=source,
            n_compiled=compiler.n_compiled,
            seconds=time.perf_counter() - start,
            shard=shard,
            backward=backward,
            checkpoint=compiler.build(chosen.spec).checkpoint,
            time_model=self.time_model,
        )


DEFAULT_PLANNER = Planner()
"""The planner of `plan="auto"`."""


def _first(
    steps: list[PlanCandidate], start: int, ok: Callable[[PlanCandidate], bool]
) -> int | None:
    """The first index from `start` at which `ok` holds, by binary search: `ok` is
    monotone along a ladder (false for big blocks, true from some block on)."""
    if start >= len(steps):
        return None
    lo, hi = start, len(steps) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(steps[mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo if ok(steps[lo]) else None


def _raise_no_fit(fun_name, call, budget, evaluated, sizes, backward) -> None:
    smallest = min(evaluated, key=lambda c: c.temp_bytes or 0)
    what = "the derivative (reverse mode) of " if backward else ""
    raise _NoFit(
        f"`{fun_name}` with `plan='auto'`: no nest fits "
        f"`memory_budget={call.options.plan.memory_budget!r}` ({_fmt_bytes(budget)} "
        f"of temporary memory){' under differentiation' if backward else ''}. The "
        f"smallest of the {len(evaluated)} compiled candidates needs "
        f"{_fmt_bytes(smallest.temp_bytes or 0)} for {what}{smallest.nest(sizes)}. "
        "Raise `memory_budget`, or map fewer dims."
    )


def describe_fixed(call: Call) -> Plan:
    """A `Plan` for a fixed nest: its one candidate compiled, with no budget."""
    start = time.perf_counter()
    sizes, shard = _localize(call)
    model = TimeModel.for_backend(jax.default_backend())
    compiler = _Compiler(call, sizes, model, backward=False)
    given = call.given_nest()
    cand = _candidate(given.scan, given.vmap, sizes, "given")
    if all(sizes[n] > 0 for n in call.mapped):
        cand = compiler.evaluate(cand, None)
    return Plan(
        fun_name=call.fun_name,
        auto=False,
        sizes=tuple({**call.sizes, **sizes}.items()),
        dims=_dims_of(cand, sizes),
        chosen=cand,
        candidates=(cand,),
        budget_bytes=None,
        budget_source="",
        n_compiled=compiler.n_compiled,
        seconds=time.perf_counter() - start,
        shard=shard,
    )
