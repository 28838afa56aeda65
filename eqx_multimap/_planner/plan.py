"""What a plan is, and how it reads: `Plan`, its candidates and dims, and its text."""

import dataclasses
import math
from typing import Literal

from .._blocks import describe_nest, NestSpec
from .._resolve import Call
from .._shard import _names, axes_str, describe_split
from .._text import describe, fill, fmt_bytes, fmt_seconds, plural, wrap_nest
from .model import TimeModel


ScanNest = tuple[tuple[str, int | None], ...]

RUNNERS_UP = 5  # how many candidates besides the chosen one `str(plan)` shows
WIDTH = 100  # the widest line of a plan's text: a docs page's code block at 1,280 px
PROSE = 88  # where prose wraps

_LEGEND = (
    "temp: temporary memory (~: predicted); bytes: bytes accessed; work set: of one "
    "loop iteration; est.: the time model's estimate over the chosen nest's, a rank "
    "(not a time)"
)


@dataclasses.dataclass(frozen=True)
class PlanDim:
    """One mapped dim: its `name`, `size`, `strategy` (`"scan"` or `"vmap"`), `chunk`
    when scanned (`None`: one at a time) and `order` in the nest (`0` outermost)."""

    name: str
    size: int
    strategy: Literal["scan", "vmap"]
    chunk: int | None
    order: int


@dataclasses.dataclass(frozen=True)
class ShardDim:
    """A dim split over a mesh by `shard=`, outside the planned nest: its global
    `size`, its `mesh_axes`, the number of `shards` and one shard's `local_size`."""

    name: str
    size: int
    mesh_axes: tuple[str, ...]
    shards: int
    local_size: int


@dataclasses.dataclass(frozen=True)
class LocalArg:
    """An input leaf split into `shards` pieces over `mesh_axes` that `shard=` leaves to
    the compiler: one piece counts in bytes and work sets, the whole in temporaries."""

    path: str
    shards: int
    mesh_axes: tuple[str, ...]

    def __str__(self) -> str:
        which = "axis" if len(self.mesh_axes) == 1 else "axes"
        axes = f"mesh {which} {axes_str(self.mesh_axes)}"
        return f"`{self.path}` counted at 1/{self.shards}, split over {axes}"


def split_leaves(call: Call) -> tuple[tuple[int, ...], tuple[LocalArg, ...]]:
    """Per input leaf of `call`, the pieces its known sharding splits it into over mesh
    axes `shard=` leaves to the compiler (`1`: none or unknown), and those split."""
    if (sp := call.shard) is None:
        return (1,) * len(call.values), ()
    bound = [x for x, a in zip(call.bound.leaves, call.check.axes) if a is not None]
    leaves = [(x.path, x.value if x.shown is None else x.shown) for x in bound]
    hoisted = call.values[len(bound) :]
    leaves += [(f"an array the body closes over, {describe(v)}", v) for v in hoisted]
    args = []
    for path, x in leaves:
        names = (a for e in sp.known_spec(x) or [] for a in _names(e))
        axes = tuple(a for a in names if a not in sp.manual)
        args.append(LocalArg(path, math.prod(sp.mesh.shape[a] for a in axes), axes))
    return tuple(a.shards for a in args), tuple(a for a in args if a.mesh_axes)


@dataclasses.dataclass(frozen=True)
class PlanCandidate:
    """A nest the planner considered (`scan`, `vmap`; `block`, elements per iteration;
    `trips`; `source`): its `temp_bytes` (`predicted`: not compiled), `flops`,
    `transcendentals`, `bytes_accessed`, `working_set`, estimated `seconds` (`None`: not
    costed), whether it `fits` (`None`: no budget), `measured` time per call if run,
    and the `reason` it was, or was not, chosen."""

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
    """The nest chosen for one call signature, and how it was chosen: what
    [`eqx_multimap.explain`][] returns, and `verbose=True` prints when planning.

    Its fields: `fun_name`; `auto` (planned, or a fixed nest); `summary` (what was
    chosen, and why); `sizes`; `dims` (`PlanDim`s, outermost first); `chosen` and all
    `candidates` (`PlanCandidate`s); `budget_bytes`, `budget_source`; `n_compiled` and
    `seconds` (planning's cost here: `0` compiles if read from disk); `measured`
    (candidates were timed); `basis`: `"arguments"` (timed on the call's own),
    `"inputs"` (on made-up ones), `"short"` (a short list on made-up ones) or `"model"`;
    `searched` (the model searched beyond full vmap); never scanned: `given` (dims whose
    strategy was given), `collective` (dims used in collectives), `split` (dims inputs
    split over devices); `cache`, `cache_path` (where the plan came from, not part of
    what it is); `shard` (`ShardDim`s: sizes and budget are then per device); `local`
    (`LocalArg`s: input leaves split over other mesh axes); `backward`, `checkpoint`
    (the plan under differentiation); from `explain`, `gradient` (that plan, or the
    error differentiating would raise); `time_model`. `spec`: the chosen nest; `scan`
    and `vmap`, its strategies as `filter_multi_vmap` takes them."""

    fun_name: str
    auto: bool
    sizes: tuple[tuple[str, int], ...]
    chosen: PlanCandidate
    candidates: tuple[PlanCandidate, ...]
    budget_bytes: int | None
    budget_source: str
    n_compiled: int
    seconds: float
    shard: tuple[ShardDim, ...] = ()
    local: tuple[LocalArg, ...] = ()
    backward: bool = False
    checkpoint: bool = False
    gradient: "Plan | str | None" = None
    time_model: TimeModel | None = None
    summary: str = ""
    measured: bool = False
    basis: str = "model"
    searched: bool = False
    given: tuple[str, ...] = ()
    collective: tuple[str, ...] = ()
    split: tuple[str, ...] = ()
    cache: str = dataclasses.field(default="", compare=False)
    cache_path: str | None = dataclasses.field(default=None, compare=False)

    @property
    def spec(self) -> NestSpec:
        return self.chosen.spec

    @property
    def scan(self) -> dict[str, int | None]:
        return dict(self.chosen.scan)

    @property
    def vmap(self) -> tuple[str, ...]:
        return self.chosen.vmap

    @property
    def dims(self) -> tuple[PlanDim, ...]:
        c, sizes = self.chosen, dict(self.sizes)
        nest = [(n, "scan", k) for n, k in c.scan] + [(n, "vmap", None) for n in c.vmap]
        return tuple(PlanDim(n, sizes[n], s, k, i) for i, (n, s, k) in enumerate(nest))

    def describe(self, full: bool = False, gradient: bool | None = None) -> str:
        """The plan as text, each line at most 100 columns: the summary, the nest,
        and the compiled runners-up (at most five) with their reasons. `full=True`
        adds every candidate and the time model. `gradient`: show `plan.gradient`
        in full (`None`: when its nest differs, or with `full`)."""
        auto = "plan='auto'" + (", measured" if self.measured else "")
        back = ", under differentiation (reverse mode)" if self.backward else ""
        head = f"{self.fun_name}: {auto if self.auto else 'fixed nest'}{back}"
        lines = [fill(head, WIDTH), fill(self.summary, PROSE)]
        if self.budget_bytes is not None:
            what = "of the derivative" if self.backward else "of temporary memory"
            budget = f"{fmt_bytes(self.budget_bytes)} {what} ({self.budget_source})"
            lines.append(fill(f"memory budget: {budget}", PROSE))
        nest = self.chosen.nest(dict(self.sizes))
        if self.shard:
            split = (describe_split(*dataclasses.astuple(d)) for d in self.shard)
            nest = f"shard_map({'; '.join(split)}) -> {nest}"
            lines.append("sharded: sizes, candidates and the budget are per device")
        if local := "; ".join(map(str, self.local)):
            lines.append(fill(f"per device, in bytes and work set: {local}", PROSE))
        lines.append(wrap_nest(f"nest: {nest}", WIDTH))
        if self.auto and self.given:
            planned = ", ".join(d.name for d in self.dims if d.name not in self.given)
            kept = f"strategies given, kept: {', '.join(self.given)}"
            lines.append(f"{kept}; planned: {planned or 'none'}")
        never = ("used in collectives", "split over devices by inputs")
        for why, dims in zip(never, (self.collective, self.split)):
            lines += [f"{why}, never scanned: {', '.join(dims)}"] if dims else []
        lines += [fill(f"this plan: {self.cache}", PROSE)] if self.cache else []
        lines += ["", self.table(all=full)]
        ckpt = "scan bodies checkpointed: the backward pass recomputes each block"
        lines += [ckpt] if self.backward and self.checkpoint else []
        if full and self.auto and self.time_model is not None:
            lines += ["", fill(self.time_model.describe(), PROSE)]
        if isinstance(g := self.gradient, str):
            lines += ["", fill(g, PROSE)]  # the error differentiating would raise
        elif g and (gradient or gradient is None and (g.spec != self.spec or full)):
            lines += ["", g.describe(full)]
        elif g:
            ckpt = ", its scan bodies checkpointed" if g.checkpoint else ""
            same = f"the same nest{ckpt} (`plan.describe(gradient=True)` shows it)"
            lines.append(fill(f"under differentiation: {same}", PROSE))
        return "\n".join(lines)

    __str__ = describe

    def table(self, all: bool = False) -> str:
        """The candidates, each with its numbers and its reason: the chosen one and
        the best five others compiled (those that fit, fastest first), or `all`."""

        def rank(c: PlanCandidate) -> tuple:
            time = c.seconds if c.measured is None else c.measured
            fast = c.fits is not False and time is not None
            return (0, time) if fast else (1, c.temp_bytes or 0)

        cands = self.candidates
        compiled = [c for c in cands if c.temp_bytes is not None and not c.predicted]
        others = [c for c in cands if c.temp_bytes is not None and c != self.chosen]
        best = sorted(others, key=rank)[:RUNNERS_UP]
        shown = list(cands) if all else [self.chosen, *best]
        n_timed = sum(c.measured is not None for c in cands)
        timed = f", {n_timed} measured" if self.measured else ""
        lines = [
            f"candidates: {len(cands)} considered, {len(compiled)} compiled{timed} "
            f"({plural(self.n_compiled, 'compile')}, {self.seconds:.2f} s)",
            *fill(_LEGEND, PROSE, "  ").splitlines(),
        ]
        head = ("", "temp", "flops", "bytes", "work set", "est.", "measured", "fits")
        rows = [tuple(h for h in head if self.measured or h != "measured")]
        chosen = self.chosen.seconds
        relative = lambda t: f"{t / chosen:.2f}x" if chosen else "-"
        show = lambda x, fmt: "-" if x is None else fmt(x)
        for c in shown:
            row = (
                "*" if c == self.chosen else "",
                ("~" if c.predicted else "") + show(c.temp_bytes, fmt_bytes),
                show(c.flops, "{:.3g}".format),
                show(c.bytes_accessed, "{:.3g}".format),
                show(c.working_set, fmt_bytes),
                show(c.seconds, relative),
            )
            if self.measured:
                row += (show(c.measured, fmt_seconds),)
            rows.append(row + ("-" if c.fits is None else "yes" if c.fits else "no",))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        numbers = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
        lines.append(numbers[0] + "  nest")
        for c, line in zip(shown, numbers[1:]):
            nest = c.nest(dict(self.sizes))
            if len(line) + 2 + len(nest.split(" -> ")[0]) > WIDTH:
                lines.append(line.rstrip())  # the nest goes under the numbers
                line = "     "
            lines += wrap_nest(f"{line}  {nest}", WIDTH, "      ").splitlines()
            lines += fill(c.reason, PROSE, "      ").splitlines()
        if rest := [c for c in cands if c not in shown]:
            n = sum(c in compiled for c in rest)
            lines.append(
                f"... and {plural(len(rest), 'more candidate')} ({n} compiled, "
                f"{len(rest) - n} not): `print(plan.table(all=True))` lists them all"
            )
        return "\n".join(lines)
