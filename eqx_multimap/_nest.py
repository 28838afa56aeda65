"""Building and running the `scan(vmap(...))` nest of one call, block by block.

The nest works on flat lists of array leaves. [`Problem`][] is what every nest of one
call computes: the body on one element, the axis of each mapped dim in each input
leaf, and the dims of each output leaf. [`run`][] maps the body over the blocks of a
[`NestSpec`][] (see `_blocks`): it slices each input leaf to the block's part of every
chunked dim, builds the block's levels (scans outside, vmaps inside), puts each
output's axes in the order of its dims, and concatenates the blocks.

Each level puts its dim at axis 0 of every output (`vmap(out_axes=0)`, and `scan`
stacks at 0), so a block's outputs are laid out as `[level keys..., core axes...]`,
then transposed once (only if needed) into the order of their dims.

A level of a reduced dim (`Problem.reduce`, see `_reduce`) leaves no axis: a vmap
level reduces its output right after the level, a scan level accumulates in its
carry, and the blocks of a chunked reduced dim are merged with the op.

[`mapped_function`][] is the function a call runs: the nest, and under
differentiation the nest that differentiates best (see there).
"""

import dataclasses
import functools as ft
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.lax as lax
import jax.numpy as jnp
from jax._src import traceback_util
from jax.custom_derivatives import SymbolicZero

from ._blocks import Block, blocks, chunk_key, Level, NestSpec, Part
from ._dims import axes_of, Dims, EllipsisDim, NamedDim
from ._progress_bar import BlockReport, per_block
from ._reduce import Reduction


traceback_util.register_exclusion(__file__)


Leaves = list[Any]
Axes = dict[str, int]


@dataclasses.dataclass(frozen=True)
class Problem:
    """What every nest of one call computes.

    - `body`: the function on one element, from all input leaves (at per-element
        shapes) to the output leaves.
    - `leaf_axes`: for each input leaf, the axis of each mapped dim it has (`{}` for
        a leaf that is broadcast: closed over by scans, `in_axes=None` for vmaps).
    - `out_dims`: the dims of each output leaf (the whole, mapped shape).
    - `sizes`: the size of every mapped dim (the local sizes, inside `shard_map`).
    - `reduce`: the reductions over mapped dims that the outputs do not have
        (`reduce=`), or `None`. The nest leaves the outputs in their accumulation
        dtypes, and a mean undivided: `Reduction.finalize` finishes them.
    """

    body: Callable[[Leaves], Leaves]
    leaf_axes: tuple[Axes, ...]
    out_dims: tuple[Dims, ...]
    sizes: dict[str, int]
    reduce: Reduction | None = None


@dataclasses.dataclass(frozen=True)
class Build:
    """How to build a nest.

    - `isolate`: the input leaves (by index) that the innermost scan of each block
        slices apart from the body's kernels on CPU (see `isolate_slices`).
    - `checkpoint`: wrap each scan body in `jax.checkpoint`.
    - `progress`: `progress=`'s bar (`_progress_bar.Meter`), or, once `run` has
        given it to a block (`per_block`), the block's report from its outermost
        scan.
    """

    isolate: frozenset[int] = frozenset()
    checkpoint: bool = False
    progress: Any = None


#
# Levels.
#


def drop_axis(axes: Axes, key: str) -> Axes:
    """`axes` without `key`, the axes after it moved down by one."""
    if key not in axes:
        return axes
    removed = axes[key]
    return {k: (a - 1 if a > removed else a) for k, a in axes.items() if k != key}


def _isolated(xs: Leaves, index: Any, length: int) -> Leaves:
    # `index < length` always holds; the branches differ so that XLA cannot fold
    # the conditional away, and it keeps the slices out of the body's kernels.
    zeros = lambda xs: [jnp.zeros_like(x) for x in xs]  # noqa: E731
    return lax.cond(index < length, lambda xs: list(xs), zeros, xs)


def isolate_slices(xs: Leaves, index: Any, length: int) -> Leaves:
    """This iteration's slices of scanned leaves, kept apart from the loop body's
    kernels on CPU.

    XLA:CPU fuses a scan's slice of its `xs` into the first kernels of the loop body;
    when a kernel reads that slice through two index maps (`outer(x, x)`,
    `x[::-1] * x`), it reloads the slice index in its innermost loop and LLVM does
    not vectorise it: `tanh(outer(x, x)) @ x` ran 4-9x slower per trip. Passing the
    slices through a conditional makes each its own small copy. The slices are the
    scan's own, so the gradient stacks their cotangents as `lax.scan` does. Other
    platforms, and inputs that `inputs_to_isolate` does not name, are sliced as
    `lax.scan` slices them.
    """
    return lax.platform_dependent(
        xs,
        index,
        cpu=ft.partial(_isolated, length=length),
        default=lambda xs, _: list(xs),
    )


def _scan_level(
    inner: Callable[[Leaves], Leaves],
    level: Level,
    in_axes: list,
    build: Build,
    innermost: bool,
    accumulate: "_Accumulate | None" = None,
) -> Callable[[Leaves], Leaves]:
    """A scan over `level`; with `accumulate`, the level's dim is reduced: the
    outputs are combined in the carry instead of stacked."""
    mapped = [i for i, a in enumerate(in_axes) if a is not None]
    body = jax.checkpoint(inner) if build.checkpoint else inner
    isolated = [j for j, i in enumerate(mapped) if innermost and i in build.isolate]

    def scanned(leaves: Leaves) -> Leaves:
        xs = [jnp.moveaxis(leaves[i], in_axes[i], 0) for i in mapped]

        def run(x: Leaves) -> Leaves:
            current = list(leaves)
            for i, xi in zip(mapped, x):
                current[i] = xi
            return body(current)

        def step(carry: tuple[Any, Any], x: Leaves) -> tuple[Any, Any]:
            index, acc = carry
            if isolated:
                x = list(x)
                kept = isolate_slices([x[j] for j in isolated], index, level.size)
                for j, xj in zip(isolated, kept):
                    x[j] = xj
                index = index + 1
            ys = run(x)
            if accumulate is None:
                return (index, acc), ys
            return (index, accumulate.combine(acc, ys)), None

        index = jnp.int32(0) if isolated else None
        init = None if accumulate is None else accumulate.init()
        (_, acc), ys = lax.scan(step, (index, init), xs, length=level.size)
        return ys if accumulate is None else acc

    return scanned


@dataclasses.dataclass(frozen=True)
class _Accumulate:
    """A reduced scan level's carry: every output leaf, one element of each of the
    `batch` (non-reduced) levels inside."""

    reduce: Reduction
    batch: tuple[int, ...]

    def init(self) -> Leaves:
        return [
            self.reduce.identity(i, self.batch + e.shape)
            for i, e in enumerate(self.reduce.elements)
        ]

    def combine(self, acc: Leaves, ys: Leaves) -> Leaves:
        axes = range(len(self.batch))
        return [self.reduce.combine(a, y, axes) for a, y in zip(acc, ys)]


def build_levels(
    core: Callable[[Leaves], Leaves],
    levels: Sequence[Level],
    leaf_axes: Sequence[Axes],
    build: Build = Build(),
    reduce: Reduction | None = None,
) -> Callable[[Leaves], Leaves]:
    """`core` mapped over `levels` (outermost first).

    `leaf_axes[i]` gives the axis of each level key in input leaf `i`; leaves without
    a key are broadcast. With `reduce`, the levels of reduced dims leave no axis in
    the outputs (see `Reduction`).
    """
    if not levels:
        return core
    level, rest = levels[0], levels[1:]
    report, build = build.progress, dataclasses.replace(build, progress=None)
    inner = build_levels(
        core, rest, [drop_axis(a, level.key) for a in leaf_axes], build, reduce
    )
    in_axes = [a.get(level.key) for a in leaf_axes]
    reduced = reduce is not None and level.dim in reduce.dims
    # The levels inside whose axes the outputs keep.
    batch = tuple(lv.size for lv in rest if reduce is None or lv.dim not in reduce.dims)
    if level.kind == "vmap":
        mapped = jax.vmap(
            inner,
            in_axes=(in_axes,),
            out_axes=0,
            axis_size=level.size,
            axis_name=level.dim if level.named else None,
        )
        if not reduced:
            return mapped
        assert reduce is not None

        def vmapped_and_reduced(leaves: Leaves) -> Leaves:
            return [
                reduce.reduce_leading(i, y, len(batch))
                for i, y in enumerate(mapped(leaves))
            ]

        return vmapped_and_reduced
    elif level.kind == "scan":
        innermost = all(lv.kind != "scan" for lv in rest)
        accumulate = _Accumulate(reduce, batch) if reduced and reduce else None
        make = ft.partial(
            _scan_level, level=level, innermost=innermost, accumulate=accumulate
        )
        if isinstance(report, BlockReport):  # the block's outermost scan reports
            return report.scan(make, inner, in_axes, build)
        return make(inner, in_axes=in_axes, build=build)
    else:
        raise ValueError(f"Unrecognised level kind '{level.kind}'.")


#
# Blocks.
#


def _split_axis(x: Any, axis: int, sizes: tuple[int, int]) -> Any:
    return jnp.reshape(x, x.shape[:axis] + sizes + x.shape[axis + 1 :])


def block_axes(leaf_axes: Sequence[Axes], block: Block) -> list[Axes]:
    """The axis of each level key in each input leaf once cut to the block's parts
    (see `block_inputs`): a main part's `(chunks, k)` axes are keys `T` and `T/k`."""
    out = [dict(a) for a in leaf_axes]
    for part in block.parts:
        if not part.is_main:
            continue
        for i, axes in enumerate(out):
            if part.dim in axes:
                ax = axes[part.dim]
                shifted = {d: (a + 1 if a > ax else a) for d, a in axes.items()}
                shifted[chunk_key(part.dim)] = ax + 1
                out[i] = shifted
    return out


def block_inputs(values: Leaves, leaf_axes: Sequence[Axes], block: Block) -> Leaves:
    """Each input leaf cut to the block's parts of the chunked dims: a main part is
    sliced to its whole chunks and split into `(chunks, k)` axes, a remainder is
    sliced to its elements."""
    values = list(values)
    for part in block.parts:
        for i, axes in enumerate(leaf_axes):
            if part.dim not in axes:
                continue
            # The axes before `part.dim` in this leaf were not split by earlier parts
            # if their dims come later; count the splits before it.
            ax = axes[part.dim] + sum(
                1
                for p in block.parts
                if p.is_main
                and p.dim in axes
                and axes[p.dim] < axes[part.dim]
                and block.parts.index(p) < block.parts.index(part)
            )
            x = values[i]
            if (part.start, part.stop) != (0, x.shape[ax]):
                x = lax.slice_in_dim(x, part.start, part.stop, axis=ax)
            if part.is_main:
                x = _split_axis(x, ax, (part.chunks or 0, part.chunk))
            values[i] = x
    return values


def loop_body_inputs(
    specs: Sequence[jax.ShapeDtypeStruct], leaf_axes: Sequence[Axes], block: Block
) -> tuple[list[jax.ShapeDtypeStruct], list[Axes]]:
    """The input leaves of one iteration of the block's loop (inside its scans), as
    `ShapeDtypeStruct`s, and the axis of each of the block's vmap keys in them."""
    cut = jax.eval_shape(lambda v: block_inputs(v, leaf_axes, block), list(specs))
    axes = block_axes(leaf_axes, block)
    out_specs, out_axes = [], []
    for s, a in zip(cut, axes):
        shape = list(s.shape)
        for lv in reversed(block.scans):
            if lv.key in a:
                del shape[a[lv.key]]
                a = drop_axis(a, lv.key)
        out_specs.append(
            jax.ShapeDtypeStruct(tuple(shape), s.dtype, weak_type=s.weak_type)
        )
        out_axes.append(a)
    return out_specs, out_axes


def _target_perm(
    dims: Dims, block: Block, mapped: set[str], ndim: int
) -> tuple[list[int], list[int]]:
    """The permutation from a block's output layout `[level keys..., core axes...]`
    to the order of `dims`, and the positions (after it) of each chunked dim's
    `(chunks, k)` pair of axes, to merge."""
    level_keys = [lv.key for lv in block.levels]
    n_levels = len(level_keys)
    core_tokens = [
        t for t in dims.tokens if not (isinstance(t, NamedDim) and t.name in mapped)
    ]
    n_ellipsis = (
        ndim - n_levels - sum(not isinstance(t, EllipsisDim) for t in core_tokens)
    )
    perm: list[int] = []
    pairs: list[int] = []
    core_axis = n_levels
    for t in dims.tokens:
        if isinstance(t, NamedDim) and t.name in mapped:
            keys = block.keys_of(t.name)
            if len(keys) == 2:
                pairs.append(len(perm))
            perm.extend(level_keys.index(k) for k in keys)
        elif isinstance(t, EllipsisDim):
            perm.extend(range(core_axis, core_axis + n_ellipsis))
            core_axis += n_ellipsis
        else:
            perm.append(core_axis)
            core_axis += 1
    return perm, pairs


def _to_dims_order(out: Any, dims: Dims, block: Block, mapped: set[str]) -> Any:
    perm, pairs = _target_perm(dims, block, mapped, out.ndim)
    if perm != list(range(out.ndim)):
        out = jnp.transpose(out, perm)
    for ax in sorted(pairs, reverse=True):  # merge each (chunks, k) pair
        merged = out.shape[ax] * out.shape[ax + 1]
        out = jnp.reshape(out, out.shape[:ax] + (merged,) + out.shape[ax + 2 :])
    return out


def final_axis(dims: Dims, name: str, ndim: int) -> int:
    """The axis of the named dim `name` in an array of rank `ndim` with `dims`."""
    token_axes = axes_of(dims, ndim)
    assert not isinstance(token_axes, str)
    for t, ax in zip(dims.tokens, token_axes):
        if isinstance(t, NamedDim) and t.name == name:
            return ax
    raise AssertionError(name)


def mapped_axes(dims: Dims, names: Sequence[str], ndim: int) -> list[int]:
    """The axes of the named dims `names` (those `dims` has) in an array of rank
    `ndim` with `dims`, in increasing order."""
    return sorted(final_axis(dims, n, ndim) for n in names if n in dims.names)


def _assemble(
    parts_outs: dict[tuple[Part, ...], Leaves],
    all_blocks: Sequence[Block],
    out_dims: Sequence[Dims],
    reduce: Reduction | None = None,
    mapped: Sequence[str] = (),
) -> Leaves:
    """Concatenate the blocks' outputs along each chunked dim, last dim first; or,
    for a reduced dim, combine them with its op (main part first)."""
    outs = dict(parts_outs)
    n_chunked = len(all_blocks[0].parts)
    for j in reversed(range(n_chunked)):
        merged: dict[tuple[Part, ...], Leaves] = {}
        for parts, leaves in outs.items():
            merged.setdefault(parts[:j], []).append(leaves)
        outs = {}
        for prefix, groups in merged.items():
            if len(groups) == 1:
                outs[prefix] = groups[0]
                continue
            dim = all_blocks[0].parts[j].dim
            if reduce is not None and dim in reduce.dims:
                outs[prefix] = [
                    ft.reduce(
                        ft.partial(
                            reduce.combine,
                            batch_axes=mapped_axes(out_dims[i], mapped, leaves[0].ndim),
                        ),
                        leaves,
                    )
                    for i, leaves in enumerate(zip(*groups))
                ]
                continue
            outs[prefix] = [
                jnp.concatenate(
                    leaves, axis=final_axis(out_dims[i], dim, leaves[0].ndim)
                )
                for i, leaves in enumerate(zip(*groups))
            ]
    return outs[()]


def run(problem: Problem, spec: NestSpec, build: Build, values: Leaves) -> Leaves:
    """The nest `spec` of `problem` on the input leaves `values`: every output leaf,
    in the order of its dims."""
    mapped = set(spec.dims)
    reduce = problem.reduce
    core = problem.body
    if reduce is not None:

        def core(leaves: Leaves) -> Leaves:
            return reduce.prepare(problem.body(leaves))

    all_blocks = blocks(spec, problem.sizes)
    outs: dict[tuple[Part, ...], Leaves] = {}
    for block, block_build in zip(all_blocks, per_block(build, all_blocks)):
        block_values = block_inputs(values, problem.leaf_axes, block)
        axes = block_axes(problem.leaf_axes, block)
        nest = build_levels(core, block.levels, axes, block_build, reduce)
        if reduce is not None:  # the layout of the levels that leave an axis
            kept = tuple(lv for lv in block.levels if lv.dim not in reduce.dims)
            block = dataclasses.replace(block, levels=kept)
        outs[block.parts] = [
            _to_dims_order(out, dims, block, mapped)
            for out, dims in zip(nest(block_values), problem.out_dims)
        ]
    out_mapped = [n for n in spec.dims if reduce is None or n not in reduce.dims]
    return _assemble(outs, all_blocks, problem.out_dims, reduce, out_mapped)


#
# The mapped function, and its derivative.
#


def mapped_function(
    problem: Problem,
    spec: NestSpec | Callable[[], NestSpec],
    build: Build,
    diff: Callable[[], tuple[NestSpec, Build]] | None = None,
) -> Callable[[Leaves], Leaves]:
    """The nest `spec` of `problem`, as a function of the input leaves.

    With `diff` (the planner's nest for differentiation: its blocks sized so that
    the backward pass fits the memory budget, its scan bodies checkpointed),
    differentiating the function (`jax.jvp`, and so `jax.grad` and every transform
    built on it) runs that nest instead: a `jax.custom_jvp` whose primal is the
    forward nest and whose tangent rule is the JVP of the nest `diff()` gives, which
    is planned only when the function is differentiated. `spec` may then be a
    function giving the forward nest, called only when the primal is traced: a
    differentiated call does not plan the forward nest at all.
    """
    if diff is None:
        assert isinstance(spec, NestSpec)
        return ft.partial(run, problem, spec, build)

    def primal(values: Leaves) -> Leaves:
        nest = spec if isinstance(spec, NestSpec) else spec()
        return run(problem, nest, build, values)

    @jax.custom_jvp
    def f(values: Leaves) -> Leaves:
        return primal(values)

    def f_jvp(primals: tuple, tangents: tuple) -> tuple:
        (values,), (dvalues,) = primals, tangents
        differentiable = ft.partial(run, problem, *diff())
        live = [i for i, t in enumerate(dvalues) if not isinstance(t, SymbolicZero)]

        def of_live(*xs: Any) -> Leaves:
            full = list(values)
            for i, x in zip(live, xs):
                full[i] = x
            return differentiable(full)

        return jax.jvp(of_live, [values[i] for i in live], [dvalues[i] for i in live])

    f.defjvp(f_jvp, symbolic_zeros=True)
    return f
