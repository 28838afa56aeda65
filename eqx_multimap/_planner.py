"""The automatic planner behind `filter_multi_vmap(..., plan="auto")`.

A plan picks, for the mapped dims of one call signature that no strategy names,
which to scan, in which order and with which chunk sizes; the rest are vmapped. Dims
named by `scan=`, `vmap=` or `shard=` keep the strategy given (the given scans
outermost, in their order, with their chunks), and dims that the body uses in
collectives are never scanned. Candidates are lowered and compiled against
`jax.ShapeDtypeStruct`s of the arguments:

- `compiled.memory_analysis().temp_size_in_bytes` must fit the memory budget;
- `compiled.cost_analysis()` gives flops and bytes accessed. XLA costs the body of a
  while loop (a scan) *once*, so the body of each block of the nest is also compiled
  on its own and its cost added `trips - 1` more times (see `_corrected_cost`).

The search is bounded:

1. Full vmap (of the planned dims) is compiled first and chosen if it fits, unless
   its temporaries are allocated afresh on every call (see 3.) or the planner
   measures.
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
4. With `Planner(measure=True)`, up to `_MAX_MEASURED` candidates that fit (among
   every block that fits in the ladders searched: the model's best estimates, and
   an even spread over the rest, `_measured_pool`) are run on fresh inputs of the
   call's shapes, side by side, and the fastest wins unless the model's own choice
   measured within `_KEEP_WITHIN` of it: the model cannot see what the chunk shape
   does to XLA:CPU's code, and timings of near-equal nests shift with the load.

With `shard=`, the plan is of the local nest of one device (`_localize`): the sharded
dims keep their strategy, at their local sizes, and the budget is per device.

A [`Planner`][] owns the plan cache (in memory, and on disk: `_plan_cache`), the time
model (calibrated on first use: `_time_model`) and its statistics; `plan="auto"`
uses one shared by the process, and `plan=Planner(...)` gives a wrapper its own.
"""

import collections as co
import dataclasses
import datetime
import hashlib
import importlib.metadata
import logging
import math
import os
import re
import time
from collections.abc import Callable
from typing import Any, Literal

import jax
import jaxlib
import numpy as np
from jax._src import traceback_util

from ._blocks import blocks, describe_nest, NestSpec, plural
from ._errors import SpecError
from ._nest import Build, build_levels, loop_body_inputs, run
from ._plan_cache import default_cache_dir, DiskCache
from ._resolve import Call
from ._shard import axes_str, describe_split
from ._time_model import (
    calibrate,
    concrete_inputs,
    fmt_bytes,
    fmt_seconds,
    machine,
    time_interleaved,
    TimeModel,
)


traceback_util.register_exclusion(__file__)

logger = logging.getLogger("eqx_multimap")


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
# Measured mode: how many candidates are timed, and for about how long.
_MAX_MEASURED = 12
_MEASURE_SECONDS = 2.0
# Measured mode keeps the time model's choice unless another candidate measured
# faster than it by more than this factor: timings of near-equal nests shift with
# the machine's load (`benchmarks/contention.py`), the model's ranking does not.
_KEEP_WITHIN = 1.10
# Planning that has taken longer than this reports its progress.
_PROGRESS_AFTER = 1.0
# Bumped whenever the search changes what it chooses: plans on disk from another
# version are not used.
_SEARCH_VERSION = 3


ScanNest = tuple[tuple[str, int | None], ...]


def _version() -> str:
    try:
        return importlib.metadata.version("eqx_multimap")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


_fmt_bytes = fmt_bytes


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
    (the estimated run time) are `None` when the candidate was not compiled, or not
    costed. `fits` is `None` when there is no budget (a fixed nest) or the
    candidate was not compiled. `measured` is its median time per call when the
    planner ran it (`Planner(measure=True)`), and `reason` says why it was, or was
    not, chosen.
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
    measured: float | None = None
    reason: str = ""

    @property
    def spec(self) -> NestSpec:
        return NestSpec(self.scan, self.vmap)

    @property
    def key(self) -> tuple[ScanNest, tuple[str, ...]]:
        return (self.scan, self.vmap)

    def nest(self, sizes: dict[str, int]) -> str:
        return describe_nest(self.spec, sizes)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The nest chosen for one call signature, and how it was chosen.

    Returned by [`eqx_multimap.explain`][]; printed by `verbose=True` when planning.
    `str(plan)` is a readable table, opening with `summary`.

    - `fun_name`: the wrapped function, as in error messages.
    - `auto`: `True` for a planned nest, `False` for a fixed nest.
    - `summary`: one sentence: what was chosen, and why.
    - `sizes`: `(name, size)` of every dim bound by the arguments.
    - `dims`: one `PlanDim` (name, size, strategy, chunk, order) per mapped dim, in
        nest order.
    - `scan`, `vmap`: the chosen strategies, as `filter_multi_vmap` takes them.
    - `chosen`: the chosen candidate.
    - `candidates`: every `PlanCandidate` considered, compiled or not, each with
        the reason it was or was not chosen; compiled ones carry their temporary
        memory, trip-count-corrected cost, working set, estimated (and, when
        measured, measured) time and whether they fit.
    - `budget_bytes`, `budget_source`: the memory budget and where it came from.
    - `n_compiled`: how many compiles planning took here (candidates and loop
        bodies; `0` when the plan was read from the disk cache).
    - `seconds`: how long planning (or reading the plan) took.
    - `measured`: whether candidates were timed (`Planner(measure=True)`).
    - `given`: the mapped dims whose strategy was given (`scan=`, `vmap=`,
        `shard=`), which the planner kept; `collective`: the dims the body uses in
        collectives, which it never scans.
    - `cache`: where the plan came from: planned now (and stored on disk, or not),
        or read from the disk cache.
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
    time_model: TimeModel | None = None
    summary: str = ""
    measured: bool = False
    given: tuple[str, ...] = ()
    collective: tuple[str, ...] = ()
    cache: str = ""

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
        if not self.auto:
            head = "fixed nest"
        else:
            head = "plan='auto'" + (", measured" if self.measured else "")
        if self.backward:
            head += ", under differentiation (reverse mode)"
        lines = [f"{self.fun_name}: {head}"]
        if self.summary:
            lines.append(self.summary)
        if self.budget_bytes is not None:
            what = "of the derivative" if self.backward else "of temporary memory"
            lines.append(
                f"memory budget: {fmt_bytes(self.budget_bytes)} {what} "
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
        if self.auto and self.given:
            planned = [d.name for d in self.dims if d.name not in self.given]
            lines.append(
                f"strategies given, kept: {', '.join(self.given)}; planned: "
                f"{', '.join(planned) or 'none'}"
            )
        if self.collective:
            lines.append(
                f"used in collectives, never scanned: {', '.join(self.collective)}"
            )
        if self.cache:
            lines.append(f"plan cache: {self.cache}")
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
        n_timed = sum(c.measured is not None for c in self.candidates)
        timed = f", {n_timed} measured" if self.measured else ""
        lines.append(
            f"candidates: {self.n_candidates} considered, {n_cand} compiled{timed} "
            f"({self.n_compiled} compiles including loop bodies, "
            f"{self.seconds:.2f} s)"
        )
        header = (
            "",
            "nest",
            "temp memory",
            "flops",
            "bytes accessed",
            "working set",
            "fresh",
            "est. time",
        )
        header += ("measured",) if self.measured else ()
        rows = [header + ("fits", "why")]
        for c in self.candidates:
            mark = "*" if c == self.chosen else ""
            fits = "-" if c.fits is None else ("yes" if c.fits else "no")
            row = (
                mark,
                c.nest(sizes),
                "-" if c.temp_bytes is None else fmt_bytes(c.temp_bytes),
                _fmt_num(c.flops),
                _fmt_num(c.bytes_accessed),
                "-" if c.working_set is None else fmt_bytes(c.working_set),
                "-" if c.fresh_bytes is None else fmt_bytes(c.fresh_bytes),
                "-" if c.seconds is None else fmt_seconds(c.seconds),
            )
            if self.measured:
                row += ("-" if c.measured is None else fmt_seconds(c.measured),)
            rows.append(row + (fits, c.reason))
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


def _fmt_num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


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
        f"{given}memory_budget={fraction:g} of {fmt_bytes(total)} {where}"
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


def dim_orders(
    call: Call, sizes: dict[str, int], names: tuple[str, ...] | None = None
) -> list[tuple[str, ...]]:
    """Orders in which the planner scans the mapped dims (or `names` of them),
    the first one the layout.

    The layout is the order of the mapped dims in the first output's dims: scanning
    (and vmapping) in that order stacks the output without a transpose. Then the
    order in which the inputs name them (scanning an input's leading axis needs no
    copy), then by size, largest first (the fewest scans for a given block).
    """
    mapped = call.mapped if names is None else names
    names_out = call.out.dims[0].names if call.out.dims else ()
    first = [n for n in names_out if n in mapped]
    layout = tuple(first) + tuple(n for n in mapped if n not in first)
    inputs = tuple(n for n in call.check.seen if n in mapped)
    inputs += tuple(n for n in mapped if n not in inputs)
    by_size = tuple(sorted(layout, key=lambda n: -sizes[n]))
    return list(dict.fromkeys([layout, inputs, by_size]))


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
    (`jax.vjp` of the nest, every scan body checkpointed), and the program that
    measured mode runs is that derivative; its estimated cost is still that of its
    forward nest, which ranks candidates alike."""

    def __init__(
        self,
        call: Call,
        sizes: dict[str, int],
        model: TimeModel,
        backward: bool = False,
        on_compile: Callable[[str], None] | None = None,
    ):
        self.problem = call.problem(sizes, standalone=True)
        self.checkpoint = call.options.checkpoint
        self.isolate = call.isolate
        self.backward = backward
        self.model = model
        self.sizes = sizes
        self.on_compile = on_compile
        self.specs = []
        for v, axes in zip(call.values, call.leaf_axes):
            shape = list(np.shape(v))
            for name, ax in axes.items():
                shape[ax] = sizes[name]
            self.specs.append(_struct(v, tuple(shape)))
        self.n_compiled = 0
        # The compiled program of each candidate compiled for its memory (the
        # forward nest, or its derivative), by nest: what measured mode runs.
        self.programs: dict[NestSpec, Any] = {}
        self._program_args: Any = None

    def compile(self, fn: Callable[[list], Any], specs: Any, what: str = "") -> Any:
        if self.on_compile is not None:
            self.on_compile(what or "compiling a loop body")
        self.n_compiled += 1
        return jax.jit(fn).lower(specs).compile()

    def build(self, spec: NestSpec) -> Build:
        """How a candidate is built: under differentiation, every scan body
        checkpointed (so the backward pass recomputes one block at a time)."""
        checkpoint = self.checkpoint or (self.backward and bool(spec.scan))
        return Build(isolate=self.isolate, checkpoint=checkpoint)

    def _program(self, spec: NestSpec) -> tuple[Callable, Any]:
        """The program whose memory counts (and which measured mode runs): the
        forward nest, or with `backward` its reverse-mode derivative; and the
        `ShapeDtypeStruct`s of its one argument."""
        build = self.build(spec)

        def forward(values: list) -> Any:
            return run(self.problem, spec, build, values)

        if not self.backward:
            return forward, self.specs
        outs = jax.eval_shape(forward, self.specs)
        diff_in = [i for i, s in enumerate(self.specs) if _inexact(s)]
        diff_out = [i for i, s in enumerate(outs) if _inexact(s)]

        def gradient(args: list) -> Any:
            values, cts = args

            def of_inexact(xs: list) -> list:
                full = list(values)
                for i, x in zip(diff_in, xs):
                    full[i] = x
                out = forward(full)
                return [out[i] for i in diff_out]

            _, pullback = jax.vjp(of_inexact, [values[i] for i in diff_in])
            return pullback(cts)

        return gradient, [self.specs, [outs[i] for i in diff_out]]

    def memory(self, cand: PlanCandidate) -> int:
        """Compile the candidate's program; its temporary memory."""
        fn, specs = self._program(cand.spec)
        compiled = self.compile(fn, specs, f"compiling {cand.nest(self.sizes)}")
        self.programs[cand.spec] = compiled
        if self._program_args is None:
            self._program_args = specs
        return int(compiled.memory_analysis().temp_size_in_bytes)

    def program_inputs(self) -> Any:
        """Fresh concrete arguments for the compiled programs."""
        return concrete_inputs(self._program_args)

    def costs(self, cand: PlanCandidate) -> PlanCandidate:
        """A compiled candidate with its costs and estimated time."""
        assert cand.temp_bytes is not None
        if self.backward:
            build = self.build(cand.spec)
            compiled = self.compile(
                lambda values: run(self.problem, cand.spec, build, values),
                self.specs,
                f"compiling the forward nest of {cand.nest(self.sizes)}",
            )
        else:
            compiled = self.programs[cand.spec]
        flops, trans, nbytes, ws = self._corrected_cost(compiled, cand)
        trips = cand.trips if cand.scan else 0
        fresh = self.model.fresh(cand.temp_bytes)
        return dataclasses.replace(
            cand,
            flops=flops,
            transcendentals=trans,
            bytes_accessed=nbytes,
            working_set=ws,
            fresh_bytes=fresh,
            seconds=self.model.seconds(flops, trans, nbytes, trips, float(fresh)),
        )

    def evaluate(self, cand: PlanCandidate, budget: int | None) -> PlanCandidate:
        """Compile `cand`: its temporary memory, and if it fits, its costs."""
        temp = self.memory(cand)
        fits = None if budget is None else temp <= budget
        cand = dataclasses.replace(cand, temp_bytes=temp, fits=fits)
        return cand if fits is False else self.costs(cand)

    def _corrected_cost(
        self, compiled: Any, cand: PlanCandidate
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
            body_compiled = self.compile(
                body, specs, f"costing the loop body of {cand.nest(self.sizes)}"
            )
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
# Progress
#


class _Progress:
    """Reports what a long planning run is doing.

    Once planning has taken `after` seconds, every step is logged at INFO level on
    the `"eqx_multimap"` logger and, with `verbose`, shown on a `tqdm` progress bar
    (if `tqdm` is installed; it is optional)."""

    def __init__(self, what: str, verbose: bool, after: float = _PROGRESS_AFTER):
        self.what = what
        self.verbose = verbose
        self.after = after
        self.start = time.perf_counter()
        self.n = 0
        self.bar: Any = None
        self.reported = False

    def step(self, doing: str) -> None:
        self.n += 1
        elapsed = time.perf_counter() - self.start
        if elapsed < self.after:
            return
        self.reported = True
        logger.info(
            "%s: %s (step %d, %.1f s so far)", self.what, doing, self.n, elapsed
        )
        if self.verbose and self.bar is None:
            try:
                from tqdm.auto import tqdm
            except ImportError:  # optional: the `bench` extra installs it
                self.verbose = False
            else:
                self.bar = tqdm(desc=self.what, initial=self.n - 1, leave=False)
        if self.bar is not None:
            self.bar.set_postfix_str(doing, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.reported:
            logger.info(
                "%s: planned in %.1f s (%d steps)",
                self.what,
                time.perf_counter() - self.start,
                self.n,
            )


#
# Planning
#


def _fingerprint(call: Call) -> str:
    """What determines a call's plan besides its options: the body's jaxpr, and the
    shapes and dtypes of every input leaf with its mapped axes.

    Stable from process to process (object addresses that a jaxpr may print, e.g.
    of callbacks, are dropped), so it can key the disk cache."""
    text = str(call.body.jaxpr.jaxpr) + repr(
        [
            (str(_struct(v)), sorted(a.items()))
            for v, a in zip(call.values, call.leaf_axes)
        ]
    )
    text += repr([str(d) for d in call.out.dims])
    text = re.sub(r" at 0x[0-9a-fA-F]+", "", text)
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


def _given_dims(call: Call) -> tuple[str, ...]:
    """The mapped dims whose strategy the user gave, in nest order."""
    named = set(call.options.scan_names) | set(call.options.vmap)
    named |= set(call.options.shard_names)
    return tuple(n for n in call.given_nest().dims if n in named)


def _collective_dims(call: Call) -> tuple[str, ...]:
    used = call.collective_dims
    return tuple(n for n in call.mapped if n in used)


class _NoFit(Exception):
    def __init__(self, message: str, smallest: PlanCandidate, n: int):
        super().__init__(message)
        self.smallest = smallest
        self.n = n


def _no_fit_message(
    call: Call,
    budget: int,
    smallest: PlanCandidate,
    n: int,
    sizes: dict[str, int],
    backward: bool,
) -> str:
    what = "the derivative (reverse mode) of " if backward else ""
    given = ""
    if _given_dims(call):
        given = " (or give fewer dims a strategy in `scan=`/`vmap=`)"
    return (
        f"`{call.fun_name}` with `plan='auto'`: no nest fits "
        f"`memory_budget={call.options.plan.memory_budget!r}` ({fmt_bytes(budget)} "
        f"of temporary memory){' under differentiation' if backward else ''}. The "
        f"smallest of the {n} compiled candidates needs "
        f"{fmt_bytes(smallest.temp_bytes or 0)} for {what}{smallest.nest(sizes)}. "
        f"Raise `memory_budget`, or map fewer dims{given}."
    )


@dataclasses.dataclass
class _Ladder:
    """One ladder, as searched: the index of its largest block that fits (`j`) and
    of its largest below the fresh threshold (`k`)."""

    steps: list[PlanCandidate]
    searched: bool = False
    j: int | None = None
    k: int | None = None


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


class _Search:
    """One planning run: compiles candidates (each at most once), remembers what it
    learnt about each, and says why each was or was not chosen."""

    def __init__(
        self,
        call: Call,
        sizes: dict[str, int],
        budget: int,
        model: TimeModel,
        backward: bool,
        measure: bool,
        progress: _Progress,
    ):
        self.call = call
        self.sizes = sizes
        self.budget = budget
        self.model = model
        self.measure = measure
        self.progress = progress
        self.compiler = _Compiler(call, sizes, model, backward, progress.step)
        self.known: dict[tuple, PlanCandidate] = {}  # by key: compiled ones
        self.notes: dict[tuple, str] = {}  # by key: why an uncompiled one was not

    def memory(self, c: PlanCandidate) -> PlanCandidate:
        if c.key not in self.known:
            temp = self.compiler.memory(c)
            self.known[c.key] = dataclasses.replace(
                c, temp_bytes=temp, fits=temp <= self.budget
            )
        return self.known[c.key]

    def costed(self, c: PlanCandidate) -> PlanCandidate:
        c = self.memory(c)
        if c.fits and c.seconds is None:
            self.known[c.key] = self.compiler.costs(c)
        return self.known[c.key]

    def fits(self, c: PlanCandidate) -> bool:
        return bool(self.memory(c).fits)

    def fresh(self, c: PlanCandidate) -> bool:
        return bool(self.model.fresh(self.memory(c).temp_bytes or 0))

    def note(self, c: PlanCandidate, why: str) -> None:
        if c.key not in self.known:
            self.notes.setdefault(c.key, why)

    def search(self, lad: _Ladder, full_fits: bool) -> None:
        """Find the ladder's largest block that fits, and (if that one allocates
        afresh per call) its largest block below the fresh threshold."""
        steps = lad.steps
        lad.searched = True
        # Memory grows with the block: if full vmap fits, every step does.
        j = 0 if full_fits else _first(steps, 0, self.fits)
        k = None
        if j is not None and self.fresh(steps[j]):
            k = _first(steps, j, lambda c: not self.fresh(c))
        lad.j, lad.k = j, k
        for edge in (j, k):
            if edge is not None:  # the boundary block, and its ties
                for c in steps:
                    if c.block == steps[edge].block:
                        self.costed(c)
        # Why the others were not compiled.
        sizes = self.sizes
        for i, c in enumerate(steps):
            if c.key in self.known:
                continue
            if j is None or i < j:
                over = next(
                    (
                        s
                        for s in steps[i:]
                        if s.key in self.known and self.known[s.key].fits is False
                    ),
                    None,
                )
                if over is not None:
                    self.note(
                        c,
                        f"not compiled: a larger block than {over.nest(sizes)}, "
                        "which is over budget",
                    )
            elif k is not None and i < k:
                self.note(
                    c,
                    f"not compiled: allocates afresh per call, as the larger "
                    f"{steps[j].nest(sizes)} does, and loops more",
                )
            else:
                edge = steps[k if k is not None else j]
                self.note(
                    c,
                    f"not compiled: a smaller block than {edge.nest(sizes)}, "
                    "which fits: more loop trips, not needed",
                )

    def estimate(self, c: PlanCandidate, lad: _Ladder) -> float:
        """The estimated time of a candidate of a searched ladder that fits: its
        own if costed, else from the costs of its ladder's boundary (the same
        arithmetic), with its own trips and temporaries."""
        known = self.known.get(c.key, c)
        if known.seconds is not None:
            return known.seconds
        assert lad.j is not None
        edge = self.known[lad.steps[lad.j].key]
        if known.temp_bytes is not None:
            temp = known.temp_bytes
        else:
            temp = int((edge.temp_bytes or 0) * c.block / max(edge.block, 1))
        return self.model.seconds(
            edge.flops or 0.0,
            edge.transcendentals or 0.0,
            edge.bytes_accessed or 0.0,
            c.trips if c.scan else 0,
            float(self.model.fresh(temp)),
        )

    def time(self, cands: list[PlanCandidate]) -> dict[tuple, float]:
        """Run each candidate's compiled program on fresh inputs, side by side; the
        median seconds per call of each."""
        args = self.compiler.program_inputs()
        programs = [self.compiler.programs[c.spec] for c in cands]
        fns = [lambda p=p: p(args) for p in programs]

        def on_round(r: int, rounds: int) -> None:
            self.progress.step(f"timing {len(cands)} candidates, round {r + 1}")

        times = time_interleaved(fns, _MEASURE_SECONDS, on_round=on_round)
        return {c.key: float(np.median(ts)) for c, ts in zip(cands, times)}


class Planner:
    """Plans nests for `plan="auto"`, and caches the plans, in memory and on disk.

    `plan="auto"` uses one `Planner` shared by the process; pass `plan=Planner(...)`
    to give a wrapper a planner (and an in-memory cache) of its own.

    **Arguments:**

    - `measure`: `False` (the default) ranks the candidates that fit the budget by
        the time model's estimate; `True` also compiles the model's best few and
        runs them on fresh inputs of the call's shapes and dtypes, side by side,
        and takes the fastest (keeping the model's choice when it measured
        within 1.10x of the fastest). Slower to plan (seconds), but right where
        the model cannot see the difference.
    - `cache_dir`: where plans and calibrations are kept on disk, so that a plan
        (a measured one in particular) is paid for once per machine. `None` (the
        default): the environment variable `EQX_MULTIMAP_CACHE_DIR` (`off`
        disables the disk cache), else `$XDG_CACHE_HOME/eqx_multimap`, else
        `~/.cache/eqx_multimap`. `False`: no disk cache.
    - `time_model`: the [`eqx_multimap.TimeModel`][] that ranks candidates.
        `None` (the default): calibrated on first use for the backend and device
        kind (a micro-benchmark of about a second, kept in the disk cache).
    - `max_cache`: the most plans kept in memory.

    The counters `n_plans` (planning runs), `n_compiles` (programs compiled while
    planning), `n_disk_hits` (plans read from disk) and `n_calibrations` are read by
    tests and benchmarks.
    """

    def __init__(
        self,
        *,
        measure: bool = False,
        cache_dir: Any = None,  # a path, `False` or `None`; checked below
        time_model: TimeModel | None = None,
        max_cache: int = _MAX_CACHE,
    ):
        if not isinstance(measure, bool):
            raise SpecError(
                f"`eqx_multimap.Planner(measure=...)` must be `True` or `False`, but "
                f"got {measure!r}."
            )
        if not (
            cache_dir is None
            or cache_dir is False
            or isinstance(cache_dir, (str, os.PathLike))
        ):
            raise SpecError(
                "`eqx_multimap.Planner(cache_dir=...)` must be a path, `None` (the "
                "default location) or `False` (no disk cache), but got "
                f"{cache_dir!r}."
            )
        if time_model is not None and not isinstance(time_model, TimeModel):
            raise SpecError(
                "`eqx_multimap.Planner(time_model=...)` must be an "
                f"`eqx_multimap.TimeModel` or `None`, but got {time_model!r}."
            )
        self.measure = measure
        self.max_cache = max_cache
        self._cache_dir = cache_dir
        self._disk: DiskCache | None = None
        self._disk_resolved = False
        self._time_model = time_model
        self._cache: co.OrderedDict[Any, Plan | str] = co.OrderedDict()
        self.n_plans = 0
        self.n_compiles = 0
        self.n_disk_hits = 0
        self.n_calibrations = 0

    def __repr__(self) -> str:
        if self is DEFAULT_PLANNER:
            return "'auto'"
        return "Planner(measure=True)" if self.measure else "Planner()"

    @property
    def cache_dir(self) -> str | None:
        """The disk cache's directory, or `None` if there is no disk cache."""
        disk = self._disk_cache()
        return None if disk is None else disk.root

    def _disk_cache(self) -> DiskCache | None:
        if not self._disk_resolved:
            where = self._cache_dir
            if where is None:
                where = default_cache_dir()
            self._disk = None if where in (None, False) else DiskCache(os.fspath(where))
            self._disk_resolved = True
        return self._disk

    @property
    def time_model(self) -> TimeModel:
        """The time model: the one given, else calibrated for this machine (read
        from the disk cache, or measured and stored there)."""
        if self._time_model is None:
            self._time_model = self._calibrated()
        return self._time_model

    def _calibrated(self) -> TimeModel:
        disk = self._disk_cache()
        key = {"machine": machine(), "versions": _versions(), "calibration": 1}
        if disk is not None:
            stored = disk.read("calibration", key)
            if stored is not None:
                try:
                    return TimeModel.from_json(stored)
                except ValueError as e:
                    disk.invalid(disk.path("calibration", key), str(e))
        logger.info("eqx_multimap: calibrating the planner's time model")
        try:
            model = calibrate()
        except Exception as e:  # a backend that cannot run the micro-benchmark
            logger.warning(
                "eqx_multimap: could not calibrate the planner's time model (%s: "
                "%s); using the default constants",
                type(e).__name__,
                e,
            )
            return TimeModel.for_backend(jax.default_backend())
        self.n_calibrations += 1
        if disk is not None:
            disk.write("calibration", key, model.to_json())
        return model

    def clear(self) -> None:
        """Forget every plan cached in memory (the disk cache is kept)."""
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
        collective = _collective_dims(call)
        fingerprint = _fingerprint(call)
        key = (
            call.options,
            budget,
            shard,
            tuple(sizes.items()),
            fingerprint,
            backward,
            collective,
        )
        if key in self._cache:
            self._cache.move_to_end(key)
            cached = self._cache[key]
            if isinstance(cached, str):  # no nest fit this signature
                raise SpecError(cached)
            return cached
        start = time.perf_counter()
        model = self.time_model
        disk = self._disk_cache()
        disk_key = path = None
        if disk is not None:
            disk_key = self._disk_key(
                call, sizes, shard, collective, fingerprint, budget, backward, model
            )
            path = disk.path("plans", disk_key)
            stored = disk.read("plans", disk_key)
            if stored is not None:
                try:
                    found = _from_json(
                        stored, call, sizes, budget, source, shard, backward, model
                    )
                except (ValueError, KeyError, TypeError, IndexError) as e:
                    disk.invalid(path, f"its plan is not valid here ({e})")
                else:
                    self.n_disk_hits += 1
                    if isinstance(found, str):
                        self._store(key, found)
                        raise SpecError(found)
                    found = dataclasses.replace(
                        found,
                        seconds=time.perf_counter() - start,
                        cache=f"hit: read from {path} ({found.cache}); "
                        "nothing compiled now",
                    )
                    self._store(key, found)
                    if options.verbose:
                        print(found)
                    return found
        what = f"{call.fun_name}: planning" + (" (backward)" if backward else "")
        progress = _Progress(what, options.verbose)
        try:
            plan = self._plan(
                call, sizes, budget, source, shard, backward, model, progress
            )
        except _NoFit as e:
            message = str(e)
            if disk is not None and disk_key is not None:
                disk.write(
                    "plans",
                    disk_key,
                    {"no_fit": {"smallest": _cand_json(e.smallest), "n": e.n}},
                )
            self._store(key, message)
            raise SpecError(message) from None
        finally:
            progress.close()
        how = f"planned in {plan.seconds:.2f} s with {plan.n_compiled} compiles"
        if disk is None:
            cache = f"off: {how}, kept in memory only"
        else:
            assert disk_key is not None
            written = disk.write("plans", disk_key, _plan_json(plan, how))
            cache = (
                f"miss: {how}, written to {written}"
                if written is not None
                else f"miss: {how}; could not write it to {path}"
            )
        plan = dataclasses.replace(plan, cache=cache)
        self._store(key, plan)
        if options.verbose:
            print(plan)
        return plan

    def _disk_key(
        self,
        call: Call,
        sizes: dict[str, int],
        shard: tuple[ShardDim, ...],
        collective: tuple[str, ...],
        fingerprint: str,
        budget: int,
        backward: bool,
        model: TimeModel,
    ) -> dict[str, Any]:
        """Everything that determines a plan, as JSON."""
        return {
            "body": fingerprint,
            "sizes": [[n, s] for n, s in sizes.items()],
            "scan": [[n, c] for n, c in call.options.scan],
            "vmap": list(call.options.vmap),
            "shard": [dataclasses.astuple(d) for d in shard],
            "collective": list(collective),
            "checkpoint": call.options.checkpoint,
            "budget": budget,
            "backward": backward,
            "measure": self.measure,
            "search": [_SEARCH_VERSION, _MAX_COMPILES, _MAX_MEASURED, _KEEP_WITHIN],
            "time_model": model.to_json(),
            "machine": machine(),
            "versions": _versions(),
        }

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
        model: TimeModel,
        progress: _Progress,
    ) -> Plan:
        self.n_plans += 1
        start = time.perf_counter()
        fixed = call.options.scan  # the given scans, outermost, as given
        collective = _collective_dims(call)
        given_dims = _given_dims(call)
        frozen = frozenset(given_dims) | frozenset(collective)
        free = tuple(n for n in call.mapped if n not in frozen)
        # Unscanned dims are vmapped: those of `vmap=` in the order given, then the
        # others in the order of the output's dims (no transpose).
        scanned = set(call.options.scan_names)
        layout = call.options.vmap + tuple(
            n
            for n in dim_orders(call, sizes)[0]
            if n not in call.options.vmap and n not in scanned
        )
        full = _candidate(
            fixed, layout, sizes, "full vmap" if not fixed else "given scans"
        )
        orders = dim_orders(call, sizes, free) if free else []
        ladders = [
            _Ladder(ladder(order, layout, sizes, fixed, frozen)) for order in orders
        ]
        considered = {full.key: full}
        for c in sorted(
            (c for lad in ladders for c in lad.steps), key=lambda c: -c.block
        ):
            considered.setdefault(c.key, c)
        search = _Search(call, sizes, budget, model, backward, self.measure, progress)
        compiler = search.compiler
        timed: dict[tuple, float] = {}
        compared: list[PlanCandidate] = []
        measure_note = ""
        try:
            if any(sizes[n] == 0 for n in call.mapped):
                chosen = full  # nothing to run; no need to compile anything
                for c in considered.values():
                    search.note(c, "not compiled: a mapped dim has size 0")
                summary = (
                    f"Chose {full.nest(sizes)}: a mapped dim has size 0, so nothing "
                    "runs and nothing was compiled."
                )
            else:
                f = search.costed(full)
                # Full vmap is kept if it fits, allocates nothing afresh per call,
                # and the planner does not measure.
                go = bool(ladders) and (
                    not f.fits or bool(f.fresh_bytes) or self.measure
                )
                for i, lad in enumerate(ladders if go else []):
                    if i > 0 and compiler.n_compiled >= _MAX_COMPILES:
                        for c in lad.steps:
                            search.note(
                                c,
                                "not compiled: beyond the compile cap "
                                f"({_MAX_COMPILES} compiles)",
                            )
                        continue  # the first ladder is always searched
                    search.search(lad, bool(f.fits))
                if not go:
                    why = (
                        "full vmap fits and reuses its temporaries from call to "
                        "call: nothing else needed"
                    )
                    for c in considered.values():
                        search.note(c, f"not compiled: {why}")
                fitting = [
                    c for c in search.known.values() if c.fits and c.seconds is not None
                ]
                if not fitting:
                    evaluated = list(search.known.values())
                    smallest = min(evaluated, key=lambda c: c.temp_bytes or 0)
                    raise _NoFit(
                        _no_fit_message(
                            call, budget, smallest, len(evaluated), sizes, backward
                        ),
                        smallest,
                        len(evaluated),
                    )
                chosen = min(fitting, key=lambda c: c.seconds or 0.0)
                compared = fitting
                if self.measure and (go or len(fitting) > 1):
                    chosen, compared, timed, measure_note = self._measure(
                        search, ladders, full, chosen
                    )
                f = search.known[full.key]
                summary = _summary(
                    chosen,
                    f,
                    compared,
                    timed,
                    go,
                    bool(free),
                    budget,
                    model,
                    sizes,
                    measure_note,
                )
        finally:
            self.n_compiles += compiler.n_compiled
        candidates = tuple(
            _with_reason(
                search.known.get(k, c),
                chosen,
                search.notes.get(k),
                timed,
                self.measure,
                budget,
                compared,
            )
            for k, c in considered.items()
        )
        chosen = next(c for c in candidates if c.key == chosen.key)
        return _auto_plan(
            call,
            sizes,
            chosen,
            candidates,
            budget,
            source,
            shard,
            backward,
            n_compiled=compiler.n_compiled,
            seconds=time.perf_counter() - start,
            checkpoint=compiler.build(chosen.spec).checkpoint,
            time_model=model,
            summary=summary,
            measured=self.measure,
        )

    def _measure(
        self,
        search: _Search,
        ladders: list[_Ladder],
        full: PlanCandidate,
        model_choice: PlanCandidate,
    ) -> tuple[PlanCandidate, list[PlanCandidate], dict[tuple, float], str]:
        """Time the model's best few candidates that fit; the fastest, those timed,
        their times, and a note if timing was impossible."""
        estimates: dict[tuple, float] = {}
        for c in search.known.values():
            if c.fits and c.seconds is not None:
                estimates[c.key] = c.seconds
        for lad in ladders:
            if not lad.searched or lad.j is None:
                continue
            for c in lad.steps[lad.j :]:
                known = search.known.get(c.key)
                if known is not None and known.fits is False:
                    continue
                estimates.setdefault(c.key, search.estimate(c, lad))
        by_key = {c.key: c for lad in ladders for c in lad.steps}
        by_key[full.key] = full
        ranked = sorted(estimates, key=lambda k: estimates[k])
        pool = _measured_pool(model_choice.key, ranked)
        for k in pool:
            if k not in search.known:
                search.notes.pop(k, None)
        timed_cands = [c for c in (search.memory(by_key[k]) for k in pool) if c.fits]
        for k in ranked:
            if k not in pool and k not in search.known:
                search.notes[k] = (
                    f"not compiled: est. {fmt_seconds(estimates[k])}, not among the "
                    f"{_MAX_MEASURED} measured (the best estimates and a spread of "
                    f"the rest)"
                )
        try:
            timed = search.time(timed_cands)
        except Exception as e:  # e.g. inputs of a dtype we cannot make
            note = f"could not measure ({type(e).__name__}: {e}), so estimated"
            return model_choice, [c for c in timed_cands if c.seconds], {}, note
        fastest = min(timed_cands, key=lambda c: timed[c.key])
        kept = timed[model_choice.key] <= _KEEP_WITHIN * timed[fastest.key]
        return (model_choice if kept else fastest), timed_cands, timed, ""


def _measured_pool(first: tuple, ranked: list[tuple]) -> list[tuple]:
    """The candidates measured mode times: `first` (the model's choice), then, of
    the rest `ranked` by estimate, all if they are few, else the best half of
    `_MAX_MEASURED` and an even spread over the others. The estimates cannot see
    the chunk-shape effects that measuring is for, so a candidate far down the
    ranking (many small blocks) can be the fastest; a spread samples it."""
    rest = [k for k in ranked if k != first]
    room = _MAX_MEASURED - 1
    if len(rest) > room:
        head, tail = rest[: room // 2], rest[room // 2 :]
        m = room - len(head)
        picks = [tail[round(i * (len(tail) - 1) / max(m - 1, 1))] for i in range(m)]
        rest = head + list(dict.fromkeys(picks))
    return [first, *rest]


DEFAULT_PLANNER = Planner()
"""The planner of `plan="auto"`."""


def _versions() -> dict[str, str]:
    return {
        "jax": jax.__version__,
        "jaxlib": getattr(jaxlib, "__version__", "unknown"),
        "eqx_multimap": _version(),
    }


#
# Why: the summary, and a reason per candidate.
#


def _summary(
    chosen: PlanCandidate,
    full: PlanCandidate,
    compared: list[PlanCandidate],
    timed: dict[tuple, float],
    searched: bool,
    free: bool,
    budget: int,
    model: TimeModel,
    sizes: dict[str, int],
    measure_note: str,
) -> str:
    nest = chosen.nest(sizes)
    temp, b = fmt_bytes(full.temp_bytes or 0), fmt_bytes(budget)
    if not free:
        return (
            f"Chose {nest}: every mapped dim has a strategy given (`scan=`, `vmap=`, "
            f"`shard=`), so there was nothing to plan; it needs {temp} of the {b} "
            "budget."
        )
    whole = "full vmap" if full.source == "full vmap" else "vmapping every planned dim"
    if not searched:
        return (
            f"Chose {nest}: {whole} fits the budget ({temp} <= {b}) and reuses its "
            "temporaries from call to call, so nothing else was compiled."
        )
    if not full.fits:
        why = f"{whole} needs {temp} > {b} budget"
    elif full.fresh_bytes:
        threshold = fmt_bytes(model.fresh_threshold or 0)
        why = (
            f"{whole} fits ({temp} <= {b}) but allocates {temp} afresh on every "
            f"call (above {threshold})"
        )
    else:
        why = f"{whole} fits ({temp} <= {b})"
    n = len(compared)
    if timed and timed[chosen.key] > min(timed.values()):
        how = (
            f"of the {n} candidates that fit and were timed, this one, the time "
            f"model's choice, measured {fmt_seconds(timed[chosen.key])}, within "
            f"{_KEEP_WITHIN}x of the fastest ({fmt_seconds(min(timed.values()))}), "
            "so it was kept"
        )
    elif timed:
        others = sorted(t for k, t in timed.items() if k != chosen.key)
        nxt = f"; next {fmt_seconds(others[0])}" if others else ""
        how = (
            f"of the {n} candidates that fit and were timed, this one was the "
            f"fastest (measured {fmt_seconds(timed[chosen.key])}{nxt})"
        )
    elif n == 1:
        how = (
            "it is the largest block that fits, and the only candidate costed "
            "(smaller blocks loop more)"
        )
        if measure_note:
            how += f" ({measure_note})"
    else:
        how = (
            f"of the {n} candidates that fit and were costed, this one is the "
            "fastest by the time model's estimate"
        )
        if measure_note:
            how += f" ({measure_note})"
    return f"Chose {nest}: {why}; {how}."


def _with_reason(
    c: PlanCandidate,
    chosen: PlanCandidate,
    note: str | None,
    timed: dict[tuple, float],
    measure: bool,
    budget: int,
    compared: list[PlanCandidate],
) -> PlanCandidate:
    measured = timed.get(c.key)
    c = dataclasses.replace(c, measured=measured)
    if c.key == chosen.key:
        if measured is not None and measured > min(timed.values()):
            why = (
                f"chosen: the time model's choice, measured within {_KEEP_WITHIN}x "
                f"of the fastest ({fmt_seconds(measured)} vs "
                f"{fmt_seconds(min(timed.values()))})"
            )
        elif measured is not None:
            why = f"chosen: fastest measured ({fmt_seconds(measured)})"
        elif c.temp_bytes is None:
            why = "chosen: nothing to compile"
        elif len(compared) <= 1:
            why = "chosen: the only candidate that fits and was costed"
        else:
            why = "chosen: fastest by the estimate"
        return dataclasses.replace(c, reason=why)
    if c.temp_bytes is None:
        return dataclasses.replace(c, reason=note or "not compiled")
    if not c.fits:
        return dataclasses.replace(
            c,
            reason=f"over budget: {_over(c.temp_bytes, budget)}",
        )
    if measured is not None and chosen.key in timed:
        vs = f"measured {fmt_seconds(measured)} vs {fmt_seconds(timed[chosen.key])}"
        why = (
            f"faster, {vs}, but within {_KEEP_WITHIN}x: the time model's choice "
            "was kept"
            if measured < timed[chosen.key]
            else f"slower: {vs}"
        )
    elif c.seconds is not None and chosen.seconds is not None:
        est = f"est. {fmt_seconds(c.seconds)} vs {fmt_seconds(chosen.seconds)}"
        why = (
            f"not measured: {est}, not among the {_MAX_MEASURED} measured"
            if measure and timed
            else f"slower ({est})"
        )
    else:
        why = note or (
            "fits, not costed: a smaller block than the largest that fits in its ladder"
        )
    return dataclasses.replace(c, reason=why)


#
# Plans as JSON, for the disk cache.
#

_CAND_FIELDS = tuple(f.name for f in dataclasses.fields(PlanCandidate))


def _finite(x: Any) -> Any:
    return None if isinstance(x, float) and not math.isfinite(x) else x


def _cand_json(c: PlanCandidate) -> dict[str, Any]:
    d = {name: _finite(getattr(c, name)) for name in _CAND_FIELDS}
    d["scan"] = [[n, k] for n, k in c.scan]
    d["vmap"] = list(c.vmap)
    return d


def _plan_json(plan: Plan, how: str) -> dict[str, Any]:
    return {
        "plan": {
            "chosen": plan.candidates.index(plan.chosen),
            "candidates": [_cand_json(c) for c in plan.candidates],
            "checkpoint": plan.checkpoint,
            "summary": plan.summary,
            "measured": plan.measured,
            "how": how,
            "created": datetime.datetime.now()
            .astimezone()
            .isoformat(timespec="seconds"),
        }
    }


def _opt(x: Any, kinds: tuple[type, ...]) -> Any:
    if x is not None and (isinstance(x, bool) or not isinstance(x, kinds)):
        raise ValueError(f"bad value {x!r}")
    return x


def _cand_from_json(d: Any, call: Call, sizes: dict[str, int]) -> PlanCandidate:
    """A stored candidate, checked to be a valid nest of this call."""
    if not isinstance(d, dict) or set(d) != set(_CAND_FIELDS):
        raise ValueError("a candidate does not have the fields of one")
    scan = tuple((str(n), None if k is None else int(k)) for n, k in d["scan"])
    vmap = tuple(str(n) for n in d["vmap"])
    names = [n for n, _ in scan] + list(vmap)
    if sorted(names) != sorted(call.mapped):
        raise ValueError(f"a candidate maps {names}, not the mapped dims")
    if any(k is not None and not 1 <= k <= sizes[n] for n, k in scan):
        raise ValueError("a candidate has a chunk out of range")
    if scan[: len(call.options.scan)] != call.options.scan:
        raise ValueError("a candidate does not keep the scans given")
    planned = {n for n, _ in scan[len(call.options.scan) :]}
    if planned & (set(_given_dims(call)) | set(_collective_dims(call))):
        raise ValueError("a candidate scans a dim it must not")
    block, trips = _block_and_trips(scan, vmap, sizes)
    fits = d["fits"]
    if fits is not None and not isinstance(fits, bool):
        raise ValueError("bad `fits`")
    if not isinstance(d["source"], str) or not isinstance(d["reason"], str):
        raise ValueError("bad descriptions")
    num = (int, float)
    return PlanCandidate(
        scan=scan,
        vmap=vmap,
        block=block,
        trips=trips,
        source=d["source"],
        temp_bytes=_opt(d["temp_bytes"], (int,)),
        flops=_opt(d["flops"], num),
        transcendentals=_opt(d["transcendentals"], num),
        bytes_accessed=_opt(d["bytes_accessed"], num),
        working_set=_opt(d["working_set"], (int,)),
        seconds=_opt(d["seconds"], num),
        fits=fits,
        fresh_bytes=_opt(d["fresh_bytes"], (int,)),
        measured=_opt(d["measured"], num),
        reason=d["reason"],
    )


def _from_json(
    stored: Any,
    call: Call,
    sizes: dict[str, int],
    budget: int,
    source: str,
    shard: tuple[ShardDim, ...],
    backward: bool,
    model: TimeModel,
) -> "Plan | str":
    """A stored plan (or no-fit error message), checked against this call; raises
    `ValueError` (or `KeyError`, `TypeError`) if it is not a valid one."""
    if not isinstance(stored, dict):
        raise ValueError("not a stored plan")
    if "no_fit" in stored:
        nf = stored["no_fit"]
        smallest = _cand_from_json(nf["smallest"], call, sizes)
        if smallest.temp_bytes is None or smallest.temp_bytes <= budget:
            raise ValueError("the stored no-fit result is inconsistent")
        return _no_fit_message(call, budget, smallest, int(nf["n"]), sizes, backward)
    p = stored["plan"]
    candidates = tuple(_cand_from_json(d, call, sizes) for d in p["candidates"])
    index = p["chosen"]
    if isinstance(index, bool) or not isinstance(index, int):
        raise ValueError("bad chosen index")
    chosen = candidates[index]
    if not chosen.fits and not any(sizes[n] == 0 for n in call.mapped):
        raise ValueError("the chosen candidate does not fit the budget")
    if chosen.temp_bytes is not None and chosen.temp_bytes > budget:
        raise ValueError("the chosen candidate does not fit the budget")
    checkpoint, measured = p["checkpoint"], p["measured"]
    if not isinstance(checkpoint, bool) or not isinstance(measured, bool):
        raise ValueError("bad flags")
    for text in (p["summary"], p["how"], p["created"]):
        if not isinstance(text, str):
            raise ValueError("bad descriptions")
    return _auto_plan(
        call,
        sizes,
        chosen,
        candidates,
        budget,
        source,
        shard,
        backward,
        n_compiled=0,
        seconds=0.0,
        checkpoint=checkpoint,
        time_model=model,
        summary=p["summary"],
        measured=measured,
        cache=f"{p['how']} on {p['created']}",
    )


def _auto_plan(
    call: Call,
    sizes: dict[str, int],
    chosen: PlanCandidate,
    candidates: tuple[PlanCandidate, ...],
    budget: int,
    source: str,
    shard: tuple[ShardDim, ...],
    backward: bool,
    **fields: Any,
) -> Plan:
    """The `Plan` of `plan="auto"`: planned now, or read from the disk cache."""
    return Plan(
        fun_name=call.fun_name,
        auto=True,
        sizes=tuple({**call.sizes, **sizes}.items()),
        dims=_dims_of(chosen, sizes),
        chosen=chosen,
        candidates=candidates,
        budget_bytes=budget,
        budget_source=source,
        shard=shard,
        backward=backward,
        given=_given_dims(call),
        collective=_collective_dims(call),
        **fields,
    )


#
# A fixed nest, described.
#


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
    cand = dataclasses.replace(cand, reason="the nest the strategies give")
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
        summary=(
            f"Fixed nest {cand.nest(sizes)}: the strategies given (`scan=`, `vmap=`, "
            "`shard=`), not planned."
        ),
    )


def _over(temp: int, budget: int) -> str:
    """`1.2 GiB > 512.0 MiB`, in bytes when the two would print alike."""
    a, b = fmt_bytes(temp), fmt_bytes(budget)
    if a == b:
        a, b = f"{temp:,} B", f"{budget:,} B"
    return f"{a} > {b}"
