"""The options of `filter_multi_vmap`, parsed and checked once, at decoration.

[`Options`][] is frozen and hashable: the wrapper keeps it in a static field, and the
planner keys its cache on it. Everything that can be checked without the arguments
is checked here, so that a bad spec fails where it is written:

- dims strings parse (`_dims.parse_dims`);
- with explicit `out_dims`, the mapped dims are known (the one mapping rule,
    [`mapped_dims`][]): every output names each of them once (but the reduced
    ones, which no output names), and every strategy names only mapped dims;
- `reduce=` names each dim once, with a known op (`_reduce.parse_reduce`).
"""

import dataclasses
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, SupportsIndex

import jax.tree_util as jtu
from jax._src import traceback_util

from ._dims import Dims, parse_dims, parse_names
from ._errors import SpecError
from ._progress_bar import Kind, parse_progress
from ._reduce import parse_reduce, ReduceOp
from ._shard import ShardOptions


traceback_util.register_exclusion(__file__)


ScanSpec = str | Sequence[str] | Mapping[str, SupportsIndex | None] | None
"""Dims to scan over: `"T F"`, `("T", "F")`, or `{"T": 64, "F": None}` (chunk sizes,
`None` for an unchunked scan)."""


class Frozen:
    """A hashable, immutable holder for a user's spec tree (dicts, lists, strings).

    Not a pytree, so it lives in a static field and keeps the wrapper hashable (and so
    usable with `jax.jit(wrapper)`).
    """

    __slots__ = ("value", "_key")

    def __init__(self, value: Any):
        self.value = value
        self._key = _freeze_key(value)

    def __hash__(self) -> int:
        try:
            return hash(self._key)
        except TypeError:
            return id(self.value)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Frozen):
            return NotImplemented
        if self.value is other.value:
            return True
        try:
            return bool(self._key == other._key)
        except Exception:
            return False

    def __repr__(self) -> str:
        return repr(self.value)


def _freeze_key(x: Any) -> Any:
    if isinstance(x, Mapping):
        return (
            "dict",
            tuple(sorted(((repr(k), _freeze_key(v)) for k, v in x.items()))),
        )
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_freeze_key(v) for v in x))
    return x


@dataclasses.dataclass(frozen=True)
class Options:
    """The parsed options of one `filter_multi_vmap` wrapper.

    - `in_dims`, `out_dims`: the user's spec trees (`None` where not given).
    - `scan`: `(dim, chunk)` pairs in the order given; `vmap`: dims in the order
        given; `core`: dims of the output that are not mapped.
    - `reduce`: `(dim, op)` pairs, in the order given.
    - `shard`: the parsed `shard=`/`mesh=`/`pad=`, or `None`.
    - `plan`: `None` for the nest given by the strategies, else the planner's
        options (see `_planner`).
    - `checkpoint`, `verbose`: as given.
    - `progress`: the kind of bar `progress=` asks for (`"tqdm"` or `"text"`), or
        `None` (see `_progress_bar`).
    """

    in_dims: Frozen
    out_dims: Frozen
    scan: tuple[tuple[str, int | None], ...]
    vmap: tuple[str, ...]
    core: tuple[str, ...]
    reduce: tuple[tuple[str, ReduceOp], ...]
    shard: ShardOptions | None
    plan: Any
    checkpoint: bool
    verbose: bool
    progress: Kind | None = None

    @property
    def scan_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.scan)

    @property
    def reduce_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.reduce)

    @property
    def shard_names(self) -> tuple[str, ...]:
        return () if self.shard is None else self.shard.names


def parse_chunk(name: str, chunk: Any) -> int | None:
    if chunk is None:
        return None
    if (
        isinstance(chunk, bool)
        or not isinstance(chunk, numbers.Integral)
        or int(chunk) < 1
    ):
        raise SpecError(
            f"`filter_multi_vmap(..., scan={{{name!r}: {chunk!r}}})`: a chunk size "
            "must be a positive integer (scan over chunks of that many elements, "
            "vmapped inside), or `None` (scan one at a time)."
        )
    return int(chunk)


def parse_scan(scan: ScanSpec) -> tuple[tuple[str, int | None], ...]:
    if isinstance(scan, Mapping):
        keys = tuple(scan.keys())
        names = parse_names(keys, "scan")
        return tuple((n, parse_chunk(n, scan[k])) for n, k in zip(names, keys))
    return tuple((name, None) for name in parse_names(scan, "scan"))


def validate_tree(spec: Any, where: str) -> None:
    """Parse every dims string in a spec tree now, so typos fail at decoration."""
    for leaf in jtu.tree_leaves(spec, is_leaf=lambda x: x is None):
        if leaf is not None and not isinstance(leaf, Dims):
            if not isinstance(leaf, str):
                raise SpecError(
                    f"{where} must contain dims strings such as 'T F B' or `None`, "
                    f"but contains {leaf!r} of type `{type(leaf).__name__}`."
                )
            parse_dims(leaf)


def out_leaf_dims(out_dims: Any) -> list[tuple[str, Dims]]:
    """The dims strings of an `out_dims` tree, parsed, with their key paths."""
    out = []
    leaves = jtu.tree_flatten_with_path(
        out_dims, is_leaf=lambda x: x is None or isinstance(x, (str, Dims))
    )[0]
    for path, leaf in leaves:
        if isinstance(leaf, str):
            leaf = parse_dims(leaf)
        if isinstance(leaf, Dims):
            out.append(("output" + jtu.keystr(path), leaf))
    return out


def mapped_dims(
    options: Options,
    fun_name: str,
    where: str,
    leaves: Sequence[tuple[str, Dims, bool]],
) -> tuple[str, ...]:
    """The one mapping rule: the mapped dims are the named dims of the output (of
    its dims `leaves`, `(path, dims, certain)`, from `where`), in their first order,
    except those declared `core`, then the reduced dims (which the output does not
    name). Checked: every certain leaf names each of them once (but the reduced
    ones), and every strategy names mapped dims only."""
    names = [n for _, dims, _ in leaves for n in dims.names]
    core, reduce = options.core, options.reduce_names
    for name in core:
        if name not in names:
            raise SpecError(
                f"`{fun_name}`: `core` names dim '{name}', which {where} does not "
                "name. `core` declares output dims that the body sees whole; a dim "
                "named only by the inputs is core already."
            )
    for name in reduce:
        if name in names:
            raise SpecError(
                f"`{fun_name}`: `reduce` names dim '{name}', which {where} also "
                f"names. A reduced dim is combined away: the output has no '{name}' "
                f"axis. Drop '{name}' from {where}, or from `reduce`."
            )
    out_mapped = tuple(n for n in dict.fromkeys(names) if n not in core)
    for path, dims, certain in leaves:
        if certain:
            check_out_leaf(fun_name, where, path, dims, out_mapped)
    check_strategies(options, out_mapped + reduce, where, fun_name)
    return out_mapped + reduce


def check_strategies(
    options: Options, mapped: Sequence[str], where: str, fun_name: str
) -> None:
    """Every dim that a strategy names is mapped."""
    for keyword, names in (
        ("scan", options.scan_names),
        ("vmap", options.vmap),
        ("shard", options.shard_names),
    ):
        for name in names:
            if name in mapped:
                continue
            core = name in options.core
            why = "it is declared `core`" if core else f"{where} does not name it"
            reduced = options.reduce_names
            listed = ", ".join(repr(n) for n in mapped if n not in reduced) or "none"
            if reduced:
                listed += ", and the reduced " + ", ".join(repr(n) for n in reduced)
            raise SpecError(
                f"`{fun_name}`: `{keyword}` names dim '{name}', which is not mapped: "
                f"{why}. The mapped dims are the named dims of the output (here "
                f"{listed}); a strategy only chooses how a mapped dim is mapped. A "
                "dim named only by the inputs is a core dim: the body sees it whole "
                "(unless `reduce=` names it)."
            )


def check_out_leaf(
    fun_name: str, source: str, where: str, dims: Dims, mapped: Sequence[str]
) -> None:
    """An output's dims name every mapped dim exactly once."""
    for name in mapped:
        count = dims.names.count(name)
        if count == 1:
            continue
        how = "does not name" if count == 0 else "names more than once"
        fix = ""
        if source == "the return annotation":
            fix = " Fix the return annotation, or override it with `out_dims=...`."
        raise SpecError(
            f"`{fun_name}`: {source} {dims.source!r} for `{where}` {how} the mapped "
            f"dim '{name}'. Every output array is mapped over each of "
            f"{', '.join(mapped)} exactly once (the mapped dims are the named dims "
            f"of the outputs, except `core` ones).{fix}"
        )


def explicit_mapped(options: Options, fun_name: str) -> tuple[str, ...] | None:
    """With explicit `out_dims`, the mapped dims (the reduced ones last), checked;
    else `None`."""
    if options.out_dims.value is None:
        return None
    leaves = [(where, d, True) for where, d in out_leaf_dims(options.out_dims.value)]
    return mapped_dims(options, fun_name, "`out_dims`", leaves)


def parse_options(
    *,
    in_dims: Any,
    out_dims: Any,
    scan: ScanSpec,
    vmap: Any,
    core: Any,
    reduce: Any,
    shard: ShardOptions | None,
    plan: Any,
    checkpoint: bool,
    verbose: bool,
    progress: Any = False,
) -> Options:
    scan_parsed = parse_scan(scan)
    vmap_parsed = parse_names(vmap, "vmap")
    core_parsed = parse_names(core, "core")
    both = set(vmap_parsed).intersection(name for name, _ in scan_parsed)
    if both:
        raise SpecError(
            f"`filter_multi_vmap`: dim '{sorted(both)[0]}' is given both `vmap` and "
            "`scan`; each dim gets one strategy."
        )
    if isinstance(in_dims, Mapping):
        for key, value in in_dims.items():
            validate_tree(value, f"`filter_multi_vmap(..., in_dims={{{key!r}: ...}})`")
    else:
        validate_tree(in_dims, "`filter_multi_vmap(..., in_dims=...)`")
    validate_tree(out_dims, "`filter_multi_vmap(..., out_dims=...)`")
    return Options(
        in_dims=Frozen(in_dims),
        out_dims=Frozen(out_dims),
        scan=scan_parsed,
        vmap=vmap_parsed,
        core=core_parsed,
        reduce=parse_reduce(reduce),
        shard=shard,
        plan=plan,
        checkpoint=bool(checkpoint),
        verbose=bool(verbose),
        progress=parse_progress(progress),
    )
