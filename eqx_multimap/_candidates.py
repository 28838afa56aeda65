"""The planner's search space: the candidate nests of one call.

A candidate scans a prefix of the planned dims (in one of a few orders: `dim_orders`)
and vmaps the rest; the scanned prefix's outer dims go one element at a time and its
last dim in chunks from a small geometric set (`chunk_options`). One order gives one
*ladder* of candidates, sorted by the number of elements of one loop iteration (the
block), which memory grows with. The dims whose strategy is given (`scan=`, `vmap=`,
`shard=`) or that the body uses in collectives are never planned, and with `shard=`
the sizes are those of one device's block (`localize`).
"""

import math

from ._plan import PlanCandidate, ScanNest, ShardDim
from ._resolve import Call


def chunk_options(n: int) -> list[int | None]:
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


def block_and_trips(
    scan: ScanNest, vmap: tuple[str, ...], sizes: dict[str, int]
) -> tuple[int, int]:
    """The elements of one loop iteration, and the number of iterations."""
    block = math.prod(sizes[n] for n in vmap)
    trips = 1
    for name, chunk in scan:
        if chunk is None:
            trips *= sizes[name]
        else:
            block *= chunk
            trips *= max(1, sizes[name] // chunk)
    return block, trips


def candidate(
    scan: ScanNest, vmap: tuple[str, ...], sizes: dict[str, int], source: str
) -> PlanCandidate:
    """The candidate of a nest, with its block and trips."""
    block, trips = block_and_trips(scan, vmap, sizes)
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
        for chunk in chunk_options(sizes[inner]):
            scan = fixed + tuple((n, None) for n in outer) + ((inner, chunk),)
            out.append(candidate(scan, vmap, sizes, "ladder"))
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


def localize(call: Call) -> tuple[dict[str, int], tuple[ShardDim, ...]]:
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


def given_dims(call: Call) -> tuple[str, ...]:
    """The mapped dims whose strategy the user gave, in nest order."""
    named = set(call.options.scan_names) | set(call.options.vmap)
    named |= set(call.options.shard_names)
    return tuple(n for n in call.given_nest().dims if n in named)


def collective_dims(call: Call) -> tuple[str, ...]:
    """The mapped dims the body uses in collectives: never scanned."""
    used = call.collective_dims
    return tuple(n for n in call.mapped if n in used)
