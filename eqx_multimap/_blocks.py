"""The block model of a nest: which scans and vmaps run, over which part of each dim.

A nest maps the body over its mapped dims with the scans outside (in the order given)
and the vmaps inside. A chunked scan `{"T": k}` over `n` elements is two levels: a
scan over the `n // k` chunks (level key `T`) and a vmap over the `k` elements of a
chunk (level key `T/k`), which joins the vmaps. When `k` does not divide `n`, the
`n % k` remaining elements form a second *block*, in which `T` is a plain vmap, so
no padding ever reaches the body. With several chunked dims the blocks are every
combination of their parts. `_nest` runs each remainder inside the iterations of
the scans outside its dim, and joins it to the chunks there.

A dim of symbolic size (`jax.export`) is cut the same way, for every size at once
([`split`][]): its remainder has a symbolic size (from 0 to `k - 1`) unless `k`
divides the size whatever it is.

[`blocks`][] enumerates the blocks of a nest once: they are the loop bodies that
`_nest` runs, and that `_planner.cost` costs.
"""

import dataclasses
import itertools as it
import math
from typing import Literal

import jax
from jax._src import traceback_util

from ._errors import SpecError
from ._text import plural


traceback_util.register_exclusion(__file__)


@dataclasses.dataclass(frozen=True)
class NestSpec:
    """How the mapped dims are mapped: the strategy of every mapped dim.

    - `scan`: `(dim, chunk)` pairs, outermost first; `chunk` is `None` for one
        element per iteration, or `k` for chunks of `k` elements vmapped inside.
    - `vmap`: the vmapped dims, outermost first.
    """

    scan: tuple[tuple[str, int | None], ...] = ()
    vmap: tuple[str, ...] = ()

    @property
    def dims(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.scan) + self.vmap

    @property
    def chunked(self) -> tuple[tuple[str, int], ...]:
        return tuple((n, c) for n, c in self.scan if c is not None)


@dataclasses.dataclass(frozen=True)
class Level:
    """One level of a block's nest: a scan or vmap of one dim's part.

    `key` names the level in the nest's output layout: the dim itself, or `T/k` for
    the elements inside a chunk of `T`. `named` is whether the level binds its dim
    as an axis name (it covers the whole dim), so that collectives can use it.
    """

    key: str
    dim: str
    kind: Literal["scan", "vmap"]
    size: int
    named: bool


@dataclasses.dataclass(frozen=True)
class Part:
    """The part of one chunked dim that a block covers: elements `[start, stop)`.

    The main part is `chunks` whole chunks of `chunk` elements (reshaped to
    `(chunks, chunk)`); the remainder has `chunks=None`.
    """

    dim: str
    start: int
    stop: int
    chunks: int | None
    chunk: int

    @property
    def is_main(self) -> bool:
        return self.chunks is not None


@dataclasses.dataclass(frozen=True)
class Block:
    """One block of a nest: the parts of the chunked dims it covers, and its levels
    (outermost first: the scans, then the vmaps)."""

    parts: tuple[Part, ...]
    levels: tuple[Level, ...]

    @property
    def scans(self) -> tuple[Level, ...]:
        return tuple(lv for lv in self.levels if lv.kind == "scan")

    @property
    def vmaps(self) -> tuple[Level, ...]:
        return tuple(lv for lv in self.levels if lv.kind == "vmap")

    @property
    def trips(self) -> int:
        """The number of iterations of the loop body (the vmaps inside the scans)."""
        return math.prod(lv.size for lv in self.scans)

    @property
    def elements(self) -> int:
        """The number of body calls that one iteration runs (its vmapped size)."""
        return math.prod(lv.size for lv in self.vmaps)

    def keys_of(self, dim: str) -> tuple[str, ...]:
        """The level keys that a dim's axis splits into, major first."""
        keys = [lv.key for lv in self.levels if lv.dim == dim]
        return tuple(sorted(keys, key=lambda k: k != dim))


def chunk_key(dim: str) -> str:
    """The level key of the elements inside a chunk of `dim`."""
    return dim + "/k"


def known(size: int) -> bool:
    """Whether a size is concrete: not symbolic (`jax.export`)."""
    return not jax.export.is_symbolic_dim(size)


def split(dim: str, n: int, chunk: int) -> tuple[int, int]:
    """`divmod(n, chunk)`: the whole chunks of `dim`'s `n` elements and the
    remainder. For a symbolic size (`jax.export`), the remainder is
    `n - chunk * (n // chunk)`, which is `0` where `chunk` divides every size (`n` is
    `4*t`, `chunk` is 2). A chunked scan needs a whole chunk: a `SpecError` names
    the dim when a symbolic size may be smaller than its chunk."""
    if known(n):
        return divmod(n, chunk)
    n_full = n // chunk
    rest = n - chunk * n_full
    if not known(rest):
        try:
            enough = bool(n >= chunk)
        except Exception:  # inconclusive: JAX cannot tell for every size
            enough = False
        if not enough:
            raise SpecError(
                f"`scan={{{dim!r}: {chunk}}}`: dim {dim!r} has symbolic size {n} (as "
                f"`jax.export` gives it), which may be smaller than a chunk of "
                f"{chunk}: a chunked scan needs at least one whole chunk. Constrain "
                f"the size (`jax.export.symbolic_shape(..., constraints=[...])`, "
                f"e.g. '{n} >= {chunk}'), give one that {chunk} divides (e.g. "
                f"`{chunk}*t`), or scan {dim!r} one element at a time "
                f"(`scan={dim!r}`)."
            )
    return n_full, rest


def runs_on_slice(
    later: tuple[tuple[str, int | None], ...], sizes: dict[str, int]
) -> bool:
    """Whether the body runs on a scan's slice as it is, the scans `later` inside it
    looping no more over it: each has one whole chunk or none (a loop of one trip,
    which XLA inlines) until one leaves a remainder, cut from that slice. A symbolic
    size (`jax.export`) may loop."""
    for name, chunk in later:
        if not known(sizes[name]):
            return False
        trips, rest = divmod(sizes[name], chunk or 1)
        if rest:
            return True
        if trips > 1:
            return False
    return True


def parts(dim: str, n: int, chunk: int) -> list[Part]:
    """The parts of a dim of `n` elements chunked by `chunk`: its whole chunks (if
    any, or if `n` is 0), then its remainder (if any). `_Nest.level` runs them, and
    `blocks` combines them."""
    n_full, rest = split(dim, n, chunk)
    parts = []
    if n_full != 0 or n == 0:
        parts.append(Part(dim, 0, n_full * chunk, n_full, chunk))
    if rest != 0:  # for a symbolic size, unless it is 0 for every size
        parts.append(Part(dim, n - rest, n, None, chunk))
    return parts


def blocks(spec: NestSpec, sizes: dict[str, int]) -> tuple[Block, ...]:
    """The blocks of the nest `spec` over dims of the given sizes.

    For every combination of the parts of the chunked dims (main chunks, and the
    remainder when the chunk does not divide the size), one `Block`, in the order
    that `itertools.product` gives (main before remainder, first chunked dim major).
    """
    choices = [parts(name, sizes[name], chunk) for name, chunk in spec.chunked]
    out = []
    for combo in it.product(*choices):
        by_dim = {p.dim: p for p in combo}
        scans: list[Level] = []
        vmaps: list[Level] = []
        for name, chunk in spec.scan:
            part = by_dim.get(name)
            if part is None:
                scans.append(Level(name, name, "scan", sizes[name], False))
            elif part.chunks is not None:
                scans.append(Level(name, name, "scan", part.chunks, False))
                vmaps.append(Level(chunk_key(name), name, "vmap", chunk, False))
            else:
                vmaps.append(Level(name, name, "vmap", part.stop - part.start, False))
        vmaps.extend(Level(name, name, "vmap", sizes[name], True) for name in spec.vmap)
        out.append(Block(tuple(combo), tuple(scans + vmaps)))
    return tuple(out)


def describe_nest(spec: NestSpec, sizes: dict[str, int]) -> str:
    """The nest as text, e.g. `scan(T=10) -> vmap(F=4) -> body`."""
    parts = []
    for name, chunk in spec.scan:
        if chunk is None:
            parts.append(f"scan({name}={sizes[name]})")
        else:
            n_full, rest = split(name, sizes[name], chunk)
            extra = f" + vmap({name} remainder={rest})" if rest != 0 else ""
            parts.append(f"scan({name}: {plural(n_full, 'chunk')} of {chunk}){extra}")
    parts.extend(f"vmap({name}={sizes[name]})" for name in spec.vmap)
    return " -> ".join(parts + ["body"])
