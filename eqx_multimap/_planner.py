"""The automatic planner behind `filter_multi_vmap(..., plan="auto")`, and `explain`.

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
   estimated time (`_seconds`) wins.
3. On CPU, temporaries above `fresh_threshold()` (glibc's malloc hands blocks that
   big out as fresh `mmap`s) are page-faulted in again on *every* call, at about
   3 GB/s: measured, 32.3 MiB of temporaries cost 8258 page faults and 11 ms per
   call, 28.2 MiB none. So when the largest fitting block of a ladder is above the
   threshold, a second binary search finds its largest block below it, which is
   costed too. The time model charges the fresh bytes (`_PAGE_BANDWIDTH`), so the
   cheaper of the two wins, and full vmap is kept only when that cost is worth it.

With `shard=`, the plan is of the local nest of one device (`_localize`): the sharded
dims keep their strategy, at their local sizes, and the budget is per device.

Plans are cached per (function, treedef, shapes, dtypes, static leaves, strategy,
budget), so a second call with the same signature plans nothing.
"""

import collections as co
import dataclasses
import functools as ft
import math
import os
import time
from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np

from ._args import is_array
from ._dims import Dims, parse_dims
from ._errors import SpecError
from ._nest import _drop_axis, build_nest, describe_nest, Level, plural, run_blocks
from ._shard import axes_str, describe_split


PlanMode = Literal["auto"]
"""The planners `filter_multi_vmap(..., plan=...)` accepts."""

MemoryBudget = int | float | None
"""Bytes as an `int`, a fraction of device memory as a `float` in `(0, 1]`."""

DEFAULT_BUDGET_FRACTION = 0.5
"""The budget when `plan="auto"` is given without `memory_budget`."""

# The time model that ranks candidates which all fit the budget (see `_seconds`):
# rough throughputs, and the overhead of one loop iteration.
_FLOPS = 5e10
_TRANSCENDENTALS = 5e9
_BANDWIDTH = 2e10
_LOOP_OVERHEAD_CPU = 1e-6
_LOOP_OVERHEAD_OTHER = 1e-5  # an accelerator launches kernels per iteration
# Temporaries allocated afresh on every call (`fresh_threshold`) are page-faulted in
# at this rate (CPU only; measured 2.9-4.3 GB/s on a 2-core x86-64 machine).
_PAGE_BANDWIDTH = 3e9
# glibc's malloc serves blocks above its mmap threshold with a fresh `mmap` each time;
# the threshold adapts to the blocks freed, up to this size (64-bit Linux).
_MMAP_THRESHOLD_MAX = 32 * 2**20

_MAX_CACHE = 256
# Once planning has compiled this many programs (candidates and loop bodies), it
# searches no further ladders.
_MAX_COMPILES = 12
# Plans by signature; a string is the message of a signature that no nest fits.
_CACHE: "co.OrderedDict[Any, Plan | str]" = co.OrderedDict()
# Counters read by the tests: planning runs (cache misses) and compiles.
_STATS = {"plans": 0, "compiles": 0}


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

    def nest(self, sizes: dict[str, int]) -> str:
        return describe_nest(dict(self.scan), self.vmap, sizes)


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
        lines = [f"{self.fun_name}: " + ("plan='auto'" if self.auto else "fixed nest")]
        if self.budget_bytes is not None:
            lines.append(
                f"memory budget: {_fmt_bytes(self.budget_bytes)} of temporary memory "
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
        if self.auto:
            lines.append("")
            lines.append(time_model())
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


def check_plan_options(plan: Any, memory_budget: Any) -> None:
    """Validate `plan=` and `memory_budget=` at decoration time."""
    if plan is not None and plan != "auto":
        raise SpecError(
            f"`filter_multi_vmap(..., plan=...)` must be 'auto' or `None`, but got "
            f"{plan!r}."
        )
    if memory_budget is None:
        return
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


def dim_orders(call: Any) -> list[tuple[str, ...]]:
    """Orders in which the planner scans the mapped dims, first one the layout.

    The layout is the order of the mapped dims in the first output's dims: scanning
    (and vmapping) in that order stacks the output without a transpose. Then the
    order in which the inputs name them (scanning an input's leading axis needs no
    copy), then by size, largest first (the fewest scans for a given block).
    """
    mapped = tuple(call.mapped)
    spec = call.default_out if call.out_dims is None else call.out_dims
    layout = mapped
    for leaf in jtu.tree_leaves(spec, is_leaf=lambda x: isinstance(x, (str, Dims))):
        dims = parse_dims(leaf) if isinstance(leaf, str) else leaf
        if isinstance(dims, Dims):
            names = [n for n in dims.names if n in mapped]
            layout = tuple(names) + tuple(n for n in mapped if n not in names)
            break
    inputs = tuple(n for n in call.check.seen if n in mapped)
    inputs += tuple(n for n in mapped if n not in inputs)
    sizes = call.check.sizes
    by_size = tuple(sorted(layout, key=lambda n: -sizes[n]))
    return list(dict.fromkeys([layout, inputs, by_size]))


#
# Lowering and compiling
#


def _spec(x: Any) -> jax.ShapeDtypeStruct:
    weak = bool(getattr(jax.typeof(x), "weak_type", False))
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, weak_type=weak)


class _Compiler:
    """Compiles functions of one resolved call, with every array an explicit input.

    Array fields of `fun` (an `equinox.Module`, say) become inputs too, so that no
    tracer of an enclosing `jax.jit` is closed over by what is compiled here.
    """

    def __init__(self, call: Any, checkpoint: bool):
        self.call = call
        self.checkpoint = checkpoint
        fun_arrays, self.fun_static = eqx.partition(call.fun, eqx.is_array)
        self.fun_specs = jtu.tree_map(_spec, fun_arrays)
        # Mapped axes take the sizes of `call.check` (per device, when sharded).
        self.dyn_specs = []
        for v, axes in zip(call.values, call.axes):
            s = _spec(v)
            shape = list(s.shape)
            for name, ax in axes.items():
                shape[ax] = call.check.sizes[name]
            self.dyn_specs.append(
                jax.ShapeDtypeStruct(tuple(shape), s.dtype, weak_type=s.weak_type)
            )
        self.n_compiled = 0

    def compile(self, run: Callable[[Any, list], Any], dyn_specs: list) -> Any:
        call, fun_static = self.call, self.fun_static

        def f(dyn, fun_arrays):
            fun = eqx.combine(fun_arrays, fun_static)
            return run(dataclasses.replace(call, fun=fun), dyn)

        self.n_compiled += 1
        _STATS["compiles"] += 1
        return jax.jit(f).lower(dyn_specs, self.fun_specs).compile()

    def evaluate(self, cand: PlanCandidate, budget: int | None) -> PlanCandidate:
        """Compile `cand`: its temporary memory, and if it fits, its costs."""
        scan, vmap, ckpt = dict(cand.scan), cand.vmap, self.checkpoint

        def run(call, dyn):
            return run_blocks(
                call.make_core, dyn, call.axes, call.check.sizes, scan, vmap, ckpt
            )[0]

        compiled = self.compile(run, self.dyn_specs)
        temp = int(compiled.memory_analysis().temp_size_in_bytes)
        fits = None if budget is None else temp <= budget
        if fits is False:
            return dataclasses.replace(cand, temp_bytes=temp, fits=fits)
        flops, trans, nbytes, ws = _corrected_cost(self, compiled, cand)
        trips = cand.trips if cand.scan else 0
        fresh = _fresh(temp)
        return dataclasses.replace(
            cand,
            temp_bytes=temp,
            flops=flops,
            transcendentals=trans,
            bytes_accessed=nbytes,
            working_set=ws,
            fresh_bytes=fresh,
            seconds=_seconds(flops, trans, nbytes, trips, float(fresh)),
            fits=fits,
        )


def _seconds(
    flops: float, trans: float, nbytes: float, trips: int, fresh: float = 0.0
) -> float:
    """Estimated run time, roofline-like: the larger of compute and memory traffic,
    plus the page faults of fresh temporaries, plus loop overhead.

    A rough model: it only ranks candidates that already fit the budget, and those
    do nearly the same flops; when memory-bound, it separates them by the bytes they
    move (a small block re-reads shared operands once per iteration); on CPU, by the
    temporaries that every call page-faults in afresh (a big block's); and when
    compute-bound, by their loop trips.
    """
    cpu = jax.default_backend() == "cpu"
    overhead = _LOOP_OVERHEAD_CPU if cpu else _LOOP_OVERHEAD_OTHER
    compute = flops / _FLOPS + trans / _TRANSCENDENTALS
    memory = nbytes / _BANDWIDTH
    return max(compute, memory) + fresh / _PAGE_BANDWIDTH + trips * overhead


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


@dataclasses.dataclass(frozen=True)
class _Block:
    """One block of a nest (main chunks or remainder of each chunked dim)."""

    trips: int
    levels: tuple[Level, ...]
    shapes: tuple[tuple[int, ...], ...]
    axes: tuple[dict[str, int], ...]


def blocks(
    scan: dict[str, int | None],
    vmap: tuple[str, ...],
    sizes: dict[str, int],
    shapes: list[tuple[int, ...]],
    leaf_axes: list[dict[str, int]],
) -> list[_Block]:
    """The loop body of each block of a nest: levels and per-iteration leaf shapes.

    Mirrors the blocks that `run_blocks` builds: for a chunked dim, a main block (a
    scan over `n // k` chunks, `k` vmapped inside) and a remainder block (`n % k`
    vmapped); the body of a block is everything inside its scans.
    """
    chunked = [(n, c) for n, c in scan.items() if c is not None]
    choices = []
    for name, chunk in chunked:
        n_full, rest = divmod(sizes[name], chunk)
        opts = [("main", n_full)] if n_full > 0 else []
        choices.append(opts + ([("rest", rest)] if rest > 0 else []))
    out = []
    for combo in _product(choices):
        which = dict(zip((n for n, _ in chunked), combo))
        trips = 1
        new_shapes = [list(s) for s in shapes]
        new_axes = [dict(a) for a in leaf_axes]
        levels = []
        for name, chunk in scan.items():
            if chunk is None:
                trips *= sizes[name]
                for i, axes in enumerate(new_axes):
                    if name in axes:
                        del new_shapes[i][axes[name]]
                    new_axes[i] = _drop_axis(axes, name)
                continue
            kind, count = which[name]
            size = chunk if kind == "main" else count
            trips *= count if kind == "main" else 1
            for i, axes in enumerate(new_axes):
                if name in axes:
                    new_shapes[i][axes[name]] = size
            levels.append(Level(name, "vmap", size))
        levels.extend(Level(name, "vmap", sizes[name]) for name in vmap)
        out.append(
            _Block(
                trips,
                tuple(levels),
                tuple(tuple(s) for s in new_shapes),
                tuple(new_axes),
            )
        )
    return out


def _product(choices: list[list[Any]]) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = [()]
    for opts in choices:
        out = [prefix + (o,) for prefix in out for o in opts]
    return out


def _corrected_cost(
    compiler: _Compiler, compiled: Any, cand: PlanCandidate
) -> tuple[float, float, float, int]:
    """Flops, transcendentals, bytes and working set, loop bodies counted fully.

    XLA's cost analysis counts the body of a while loop once. For each block whose
    loops run `trips > 1` times, the block's body (the vmaps inside its scans) is
    compiled on its own and its cost added `trips - 1` more times. The working set is
    the largest memory footprint (arguments, outputs, temporaries) of one body, or of
    the whole candidate when nothing loops.
    """
    total = list(_costs(compiled))
    ws = 0
    call = compiler.call
    shapes = [s.shape for s in compiler.dyn_specs]
    sizes = call.check.sizes
    looped = False
    for block in blocks(dict(cand.scan), cand.vmap, sizes, shapes, call.axes):
        if block.trips <= 1:
            continue
        looped = True
        specs = [
            jax.ShapeDtypeStruct(shape, s.dtype, weak_type=s.weak_type)
            for shape, s in zip(block.shapes, compiler.dyn_specs)
        ]
        levels, axes = list(block.levels), list(block.axes)

        def run(call, dyn, levels=levels, axes=axes):
            core, _ = call.make_core()
            return build_nest(core, levels, axes, False)(dyn)

        body_compiled = compiler.compile(run, specs)
        body = _costs(body_compiled)
        for j in range(3):
            total[j] += (block.trips - 1) * body[j]
        ws = max(ws, _footprint(body_compiled))
    if not looped:
        ws = _footprint(compiled)
    return total[0], total[1], total[2], ws


@ft.cache
def fresh_threshold() -> tuple[int | None, str]:
    """The size above which temporaries are allocated afresh on every call.

    On CPU, XLA allocates a program's temporaries with `malloc` on every call.
    glibc's malloc serves blocks above its mmap threshold with a new `mmap`, whose
    pages the kernel faults in (and zeroes) on first touch; smaller blocks are reused
    from the heap. That threshold adapts to the blocks freed, up to 32 MiB. (The
    `MALLOC_MMAP_THRESHOLD_` and `MALLOC_TRIM_THRESHOLD_` variables move it, but
    measured, blocks of 258 MiB were still page-faulted in on every call with both
    set to GiBs, so the planner assumes glibc's defaults.) Other backends pool
    device memory: `None`, no such cost.
    """
    if jax.default_backend() != "cpu":
        return None, f"{jax.default_backend()}: pooled device memory, no fresh pages"
    n = _MMAP_THRESHOLD_MAX
    return n, f"{_fmt_bytes(n)}, glibc malloc's largest mmap threshold"


def _fresh(temp: int) -> int:
    """The temporary bytes that each call allocates, and page-faults in, afresh."""
    threshold, _ = fresh_threshold()
    return temp if threshold is not None and temp > threshold else 0


def time_model() -> str:
    """The time model of `_seconds`, in words, with this machine's constants."""
    cpu = jax.default_backend() == "cpu"
    overhead = _LOOP_OVERHEAD_CPU if cpu else _LOOP_OVERHEAD_OTHER
    threshold, where = fresh_threshold()
    fresh = (
        "fresh = the temporary bytes when above "
        f"{where} (allocated and page-faulted in on every call), else 0"
        if threshold is not None
        else f"fresh = 0 ({where})"
    )
    return (
        f"est. time = max(flops / {_FLOPS:.0e} + transcendentals / "
        f"{_TRANSCENDENTALS:.0e}, bytes accessed / {_BANDWIDTH:.0e}) + fresh / "
        f"{_PAGE_BANDWIDTH:.0e} + loop trips x {overhead:.0e} s; {fresh}"
    )


#
# Planning
#


class _ById:
    """A cache-key part compared by identity, for values that are not hashable."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ById) and other.value is self.value


def _key_part(x: Any) -> Any:
    if is_array(x):
        s = _spec(x)
        return ("array", s.shape, str(s.dtype), s.weak_type)
    try:
        hash(x)
    except TypeError:
        return _ById(x)
    return x


def _cache_key(wrapper: Any, call: Any, budget: int, shard: Any) -> Any:
    fun_arrays, fun_static = eqx.partition(call.fun, eqx.is_array)
    return (
        shard,
        wrapper._in_dims,
        wrapper._out_dims,
        wrapper._scan,
        wrapper._vmap,
        wrapper._checkpoint,
        wrapper._memory_budget,
        budget,
        _key_part(fun_static),
        jtu.tree_structure(fun_arrays),
        tuple(_key_part(x) for x in jtu.tree_leaves(fun_arrays)),
        call.bound.treedef,
        tuple(_key_part(leaf.value) for leaf in call.bound.leaves),
    )


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


def _localize(wrapper: Any, call: Any) -> tuple[Any, tuple[ShardDim, ...]]:
    """With `shard=`, the call as one device sees it: its dims at local sizes.

    The sharded dims are split outside the nest (`shard_map`), so the planner plans,
    and compiles, the local nest of one device.
    """
    if wrapper._shard is None:
        return call, ()
    sp = wrapper._shard.plan(call.fun_name, call.check)
    shard = tuple(
        ShardDim(
            name,
            sp.sizes[name],
            axes,
            math.prod(sp.mesh.shape[a] for a in axes),
            sp.local_sizes[name],
        )
        for name, axes in sp.dims
    )
    check = dataclasses.replace(call.check, sizes=dict(sp.local_sizes))
    return dataclasses.replace(call, check=check), shard


def plan_call(wrapper: Any, call: Any) -> Plan:
    """The (cached) automatic plan for a resolved call of a `plan="auto"` wrapper.

    With `shard=`, the plan is for the local nest inside `shard_map`: the sharded
    dims keep their strategy (scanned if in `scan`, else vmapped) at their local
    sizes; the other mapped dims are planned, under the budget per device.
    """
    budget, source = resolve_budget(wrapper._memory_budget)
    call, shard = _localize(wrapper, call)
    try:
        key = _cache_key(wrapper, call, budget, shard)
        hash(key)
    except TypeError:
        key = None
    if key is not None and key in _CACHE:
        _CACHE.move_to_end(key)
        cached = _CACHE[key]
        if isinstance(cached, str):  # no nest fit this signature
            raise SpecError(cached)
        return cached
    try:
        plan = _plan(wrapper, call, budget, source, shard)
    except _NoFit as e:
        _store(key, str(e))
        raise SpecError(str(e)) from None
    _store(key, plan)
    if wrapper._verbose:
        print(plan)
    return plan


def _store(key: Any, value: "Plan | str") -> None:
    if key is not None:
        _CACHE[key] = value
        if len(_CACHE) > _MAX_CACHE:
            _CACHE.popitem(last=False)


class _NoFit(Exception):
    pass


def _plan(
    wrapper: Any, call: Any, budget: int, source: str, shard: tuple[ShardDim, ...]
) -> Plan:
    _STATS["plans"] += 1
    start = time.perf_counter()
    sizes = dict(call.check.sizes)
    mapped = tuple(call.mapped)
    compiler = _Compiler(call, wrapper._checkpoint)
    orders = dim_orders(call)
    # Sharded dims keep their local strategy: scanned (outermost) if in `scan`.
    frozen = frozenset(d.name for d in shard)
    fixed = tuple((n, c) for n, c in call.scan.items() if n in frozen)
    layout = tuple(n for n in orders[0] if n not in dict(fixed))
    full = _candidate(fixed, layout, sizes, "full vmap")
    ladders = [ladder(order, orders[0], sizes, fixed, frozen) for order in orders]
    considered = {(full.scan, full.vmap): full}
    for c in sorted((c for steps in ladders for c in steps), key=lambda c: -c.block):
        considered.setdefault((c.scan, c.vmap), c)
    if wrapper._scan or wrapper._vmap:
        given = _candidate(tuple(call.scan.items()), tuple(call.vmap), sizes, "given")
        considered.setdefault((given.scan, given.vmap), given)
    evaluated: dict[tuple, PlanCandidate] = {}

    def evaluate(c: PlanCandidate) -> PlanCandidate:
        k = (c.scan, c.vmap)
        if k not in evaluated:
            evaluated[k] = compiler.evaluate(c, budget)
        return evaluated[k]

    if any(sizes[n] == 0 for n in mapped):
        chosen = full  # nothing to run; no need to compile anything
    else:
        chosen = evaluate(full)
        finalists = [chosen]
        # Full vmap is kept if it fits and allocates nothing afresh per call.
        search = not chosen.fits or bool(chosen.fresh_bytes)
        for i, steps in enumerate(ladders if search else []):
            if i > 0 and compiler.n_compiled >= _MAX_COMPILES:
                break  # bounded planning time: the first ladder is always searched
            # Binary search for the largest block that fits (memory grows with it).
            j = _first(steps, 0, lambda c: bool(evaluate(c).fits))
            # And for the largest whose temporaries are reused from call to call.
            if j is not None and evaluate(steps[j]).fresh_bytes:
                k = _first(steps, j, lambda c: not evaluate(c).fresh_bytes)
            else:
                k = None
            for edge in (j, k):
                if edge is not None:  # the boundary block, and its ties in the ladder
                    finalists.extend(
                        evaluate(c) for c in steps if c.block == steps[edge].block
                    )
        fitting = [c for c in finalists if c.fits]
        if fitting:
            chosen = min(fitting, key=lambda c: c.seconds or 0.0)
        if not chosen.fits:
            tried = list(evaluated.values())
            _raise_no_fit(call.fun_name, wrapper, budget, tried, sizes)
    candidates = tuple(evaluated.get(k, c) for k, c in considered.items())
    return Plan(
        fun_name=call.fun_name,
        auto=True,
        sizes=tuple(sizes.items()),
        dims=_dims_of(chosen, sizes),
        chosen=chosen,
        candidates=candidates,
        budget_bytes=budget,
        budget_source=source,
        n_compiled=compiler.n_compiled,
        seconds=time.perf_counter() - start,
        shard=shard,
    )


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


def _raise_no_fit(fun_name, wrapper, budget, evaluated, sizes) -> None:
    smallest = min(evaluated, key=lambda c: c.temp_bytes or 0)
    raise _NoFit(
        f"`{fun_name}` with `plan='auto'`: no nest fits "
        f"`memory_budget={wrapper._memory_budget!r}` ({_fmt_bytes(budget)} of "
        f"temporary memory). The smallest of the {len(evaluated)} compiled "
        f"candidates needs {_fmt_bytes(smallest.temp_bytes or 0)}: "
        f"{smallest.nest(sizes)}. Raise `memory_budget`, or map fewer dims."
    )


def describe_call(wrapper: Any, call: Any) -> Plan:
    """A `Plan` for a fixed nest: its one candidate compiled, with no budget."""
    start = time.perf_counter()
    call, shard = _localize(wrapper, call)
    sizes = dict(call.check.sizes)
    compiler = _Compiler(call, wrapper._checkpoint)
    cand = _candidate(tuple(call.scan.items()), tuple(call.vmap), sizes, "given")
    if all(sizes[n] > 0 for n in call.mapped):
        cand = compiler.evaluate(cand, None)
    return Plan(
        fun_name=call.fun_name,
        auto=False,
        sizes=tuple(sizes.items()),
        dims=_dims_of(cand, sizes),
        chosen=cand,
        candidates=(cand,),
        budget_bytes=None,
        budget_source="",
        n_compiled=compiler.n_compiled,
        seconds=time.perf_counter() - start,
        shard=shard,
    )


def explain(fn: Callable, /, *args, **kwargs) -> Plan:
    """Plan a call of a `filter_multi_vmap` function without running it.

    **Arguments:**

    - `fn`: a function returned by [`eqx_multimap.filter_multi_vmap`][] (or a method
        defined with it, accessed on an instance).
    - `*args`, `**kwargs`: the arguments it would be called with. Arrays may be
        given as `jax.ShapeDtypeStruct`s; nothing is executed.

    **Returns:**

    A [`eqx_multimap.Plan`][]: per mapped dim its size, strategy, chunk and position
    in the nest, and each candidate nest with its compiled temporary memory,
    trip-count-corrected cost and whether it fit the budget. For `plan="auto"` this
    is the plan that a call with these arguments uses (and it is cached, so the call
    does not plan again); for a fixed nest, the one candidate is that nest.

    !!! example

        ```python
        f = filter_multi_vmap(body, in_dims="T B", plan="auto", memory_budget=2**20)
        print(eqx_multimap.explain(f, jax.ShapeDtypeStruct((4096, 64), jnp.float32)))
        ```
    """
    from ._multi_vmap import _MultiVmapWrapper

    wrapper = fn
    # Look through decorators applied outside (`jaxtyped`, `beartype`, `filter_jit`,
    # `functools.wraps`), which expose what they wrap as `__wrapped__`.
    for _ in range(32):
        if isinstance(wrapper, _MultiVmapWrapper) or (
            isinstance(wrapper, jtu.Partial)
            and isinstance(wrapper.func, _MultiVmapWrapper)
        ):
            break
        inner = getattr(wrapper, "__wrapped__", None)
        if inner is None:
            break
        wrapper = inner
    fn_given, fn = fn, wrapper
    wrapper = fn
    if isinstance(fn, jtu.Partial) and isinstance(fn.func, _MultiVmapWrapper):
        wrapper, args = fn.func, tuple(fn.args) + args
        kwargs = {**fn.keywords, **kwargs}
    if not isinstance(wrapper, _MultiVmapWrapper):
        raise SpecError(
            "`eqx_multimap.explain(fn, ...)`: `fn` must be a function returned by "
            f"`filter_multi_vmap`, but got {fn_given!r} of type "
            f"`{type(fn_given).__name__}`."
        )
    box: list[Plan] = []

    def resolve(args, kwargs):
        call = wrapper._resolve(args, kwargs)
        if wrapper._plan is None:
            box.append(describe_call(wrapper, call))
        else:
            box.append(plan_call(wrapper, call))

    eqx.filter_eval_shape(resolve, args, kwargs)
    return box[0]
