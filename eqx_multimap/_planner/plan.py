"""What a plan is, and how it reads: `Plan`, its candidates and dims, and its text.

A [`Plan`][] is what [`eqx_multimap.explain`][] returns and `verbose=True` prints:
the nest chosen for one call signature, every candidate considered (compiled or
not) with its numbers and the reason it was or was not chosen, and where the plan
came from. The search that fills it in is `search`; this module only holds and
prints it.
"""

import dataclasses
from typing import Literal

from .._blocks import describe_nest, NestSpec, plural
from .._shard import axes_str, describe_split
from .._timing import fmt_bytes, fmt_seconds
from .model import TimeModel


ScanNest = tuple[tuple[str, int | None], ...]

# How many candidates besides the chosen one `str(plan)` shows.
RUNNERS_UP = 5


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
    not, chosen. `predicted` is whether `temp_bytes` was predicted from full vmap's
    instead of compiled: for a block chosen below the fresh threshold, far within
    the budget.
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
    predicted: bool = False

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
    `str(plan)` (that is, `plan.describe()`) opens with `summary` and the chosen nest,
    then shows the compiled runners-up with their reasons; `plan.describe(full=True)`
    adds every candidate and the time model, and `plan.table(all=True)` is the table
    of every candidate alone.

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
    - `measured`: whether candidates were timed (`Planner(measure=True)`), and
        `basis` what the choice rests on: `"arguments"` (timed on the call's own
        arguments), `"inputs"` (timed on made-up inputs) or `"model"`.
    - `given`: the mapped dims whose strategy was given (`scan=`, `vmap=`,
        `shard=`), which the planner kept; `collective`: the dims the body uses in
        collectives, which it never scans.
    - `cache`: where the plan came from: planned now (and written to the disk
        cache, or not), from this process's cache (planned, or read from disk, by
        an earlier call), or from the disk cache; `cache_path`: its file in the
        disk cache, if it has one.
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
    basis: str = "model"
    given: tuple[str, ...] = ()
    collective: tuple[str, ...] = ()
    # Where a plan came from is not part of what it is.
    cache: str = dataclasses.field(default="", compare=False)
    cache_path: str | None = dataclasses.field(default=None, compare=False)

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
        return self.describe()

    def describe(self, full: bool = False, gradient: bool | None = None) -> str:
        """The plan as text; `str(plan)` is `plan.describe()`.

        **Arguments:**

        - `full`: `False` (the default) gives the summary, the chosen nest, the
            compiled runners-up (at most five) with their reasons, and one line
            counting the rest. `True` adds the table of the mapped dims, every
            candidate (as `plan.table(all=True)`) and the time model.
        - `gradient`: whether to describe `plan.gradient` (the plan of the nest run
            under differentiation) in full. `None` (the default): only when its nest
            differs from this plan's (or no nest fits it), or with `full`;
            otherwise one line says it is the same nest.
        """
        lines = self._head()
        if full:
            lines.append("")
            lines.extend(self._dims_table())
        lines.append("")
        lines.append(self.table(all=full))
        if self.backward and self.checkpoint:
            lines.append(
                "scan bodies checkpointed: the backward pass recomputes each block"
            )
        if full and self.auto and self.time_model is not None:
            lines.append("")
            lines.append(self.time_model.describe())
        g = self.gradient
        if g is None:
            return "\n".join(lines)
        differs = isinstance(g, str) or g.spec != self.spec
        if gradient or (gradient is None and (differs or full)):
            lines.append("")
            lines.append(g if isinstance(g, str) else g.describe(full))
        else:
            ckpt = ", its scan bodies checkpointed" if g.checkpoint else ""
            lines.append(
                f"under differentiation: the same nest{ckpt} "
                "(`plan.describe(gradient=True)` shows its candidates)"
            )
        return "\n".join(lines)

    def _head(self) -> list[str]:
        """The title, the summary, the budget, the nest, and where it came from."""
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
        nest = self.chosen.nest(dict(self.sizes))
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
            lines.append(f"this plan: {self.cache}")
        return lines

    def _dims_table(self) -> list[str]:
        """One row per mapped dim: size, strategy, chunk, order (and its shards)."""
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
        return _table(rows)

    def table(self, all: bool = False) -> str:
        """The candidates as a table, each with its numbers and reason.

        With `all=False` (as `str(plan)` shows), the chosen candidate and the best
        five others that were compiled (those that fit, fastest first, then those
        over budget), and a line counting the rest; with `all=True`, every
        candidate considered, compiled or not, in the order of their blocks.
        """
        n_cand = sum(
            c.temp_bytes is not None and not c.predicted for c in self.candidates
        )
        n_timed = sum(c.measured is not None for c in self.candidates)
        timed = f", {n_timed} measured" if self.measured else ""
        lines = [
            f"candidates: {self.n_candidates} considered, {n_cand} compiled{timed} "
            f"({plural(self.n_compiled, 'compile')}, "
            f"{self.seconds:.2f} s)"
        ]
        shown = list(self.candidates) if all else self._runners_up()
        lines.extend(self._rows(shown))
        rest = [c for c in self.candidates if c not in shown]
        if rest:
            compiled = sum(c.temp_bytes is not None and not c.predicted for c in rest)
            lines.append(
                f"... and {plural(len(rest), 'more candidate')} ({compiled} "
                f"compiled, {len(rest) - compiled} not): "
                "`print(plan.table(all=True))` lists them all"
            )
        return "\n".join(lines)

    def _runners_up(self, n: int = RUNNERS_UP) -> list[PlanCandidate]:
        """The chosen candidate, then the best `n` others compiled."""

        def rank(c: PlanCandidate) -> tuple:
            time = c.measured if c.measured is not None else c.seconds
            if c.fits is not False and time is not None:
                return (0, time)
            return (1, c.temp_bytes or 0)

        others = [
            c for c in self.candidates if c != self.chosen and c.temp_bytes is not None
        ]
        return [self.chosen, *sorted(others, key=rank)[:n]]

    def _rows(self, cands: list[PlanCandidate]) -> list[str]:
        """One row per candidate, the chosen one marked `*`."""
        sizes = dict(self.sizes)
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
        for c in cands:
            mark = "*" if c == self.chosen else ""
            fits = "-" if c.fits is None else ("yes" if c.fits else "no")
            row = (
                mark,
                c.nest(sizes),
                "-"
                if c.temp_bytes is None
                else ("~" if c.predicted else "") + fmt_bytes(c.temp_bytes),
                _fmt_num(c.flops),
                _fmt_num(c.bytes_accessed),
                "-" if c.working_set is None else fmt_bytes(c.working_set),
                "-" if c.fresh_bytes is None else fmt_bytes(c.fresh_bytes),
                "-" if c.seconds is None else fmt_seconds(c.seconds),
            )
            if self.measured:
                row += ("-" if c.measured is None else fmt_seconds(c.measured),)
            rows.append(row + (fits, c.reason))
        return _table(rows)


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



def dims_of(cand: PlanCandidate, sizes: dict[str, int]) -> tuple[PlanDim, ...]:
    """One `PlanDim` per mapped dim of a candidate, in nest order."""
    dims = [
        PlanDim(name, sizes[name], "scan", chunk, i)
        for i, (name, chunk) in enumerate(cand.scan)
    ]
    dims.extend(
        PlanDim(name, sizes[name], "vmap", None, len(cand.scan) + i)
        for i, name in enumerate(cand.vmap)
    )
    return tuple(dims)
