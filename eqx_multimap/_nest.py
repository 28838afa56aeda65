"""Building and running the `scan(vmap(...))` nest of one call.

The nest works on flat lists of array leaves. [`Problem`][] is what every nest of one
call computes: the body on one element, the axis of each mapped dim in each input
leaf, and the dims of each output leaf. [`run`][] maps the body over the nest of a
[`NestSpec`][], the program one writes by hand with `lax.map` and `jax.vmap`: each
scan, outermost first, slices its dim inside its own iteration (the outermost, of a
chunked dim, with `lax.dynamic_slice` where the scan's `xs` would copy the input), the
vmaps run innermost, and each scan stacks its outputs at its dim's axis. A chunked dim's
remainder (`_blocks`: `n % k` elements, vmapped) runs inside the iterations of the
scans outside it, and is joined to its chunks there, so that no level copies more
than its own part of the inputs or outputs. A symbolic size (`jax.export`) is
scanned and chunked alike (`_blocks.split`).

A level of a reduced dim (`Problem.reduce`) leaves no axis: `_reduce` says how.

The blocks of `_blocks` (every combination of main chunks and remainders) are the
nest's loop bodies: the planner costs them ([`loop_body_inputs`][],
[`build_levels`][]).

[`mapped_function`][] is the function a call runs: the nest, and under
differentiation the nest that differentiates best (see there).
"""

import dataclasses
import functools as ft
import math
from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax
import jax.lax as lax
import jax.numpy as jnp
from jax._src import traceback_util
from jax.custom_derivatives import SymbolicZero

from ._blocks import Block, chunk_key, known, Level, NestSpec, parts, runs_on_slice
from ._dims import Dims, EllipsisDim, final_axis, NamedDim
from ._errors import SpecError
from ._progress_bar import Meter, Report, report_for
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

    - `isolate`: the input leaves (by index) that each scan whose slices the body's
        kernels read (`_blocks.runs_on_slice`) slices apart from them on CPU (see
        `isolate_slices`).
    - `checkpoint`: wrap each scan body in `jax.checkpoint`.
    - `progress`: `progress=`'s bar (`_progress_bar.Meter`), reported from the
        nest's outermost scan, or `None`.
    """

    isolate: frozenset[int] = frozenset()
    checkpoint: bool = False
    progress: Meter | None = None


#
# Levels.
#


def drop_axis(axes: Axes, key: str) -> Axes:
    """`axes` without `key`, the axes after it moved down by one."""
    if key not in axes:
        return axes
    removed = axes[key]
    return {k: (a - 1 if a > removed else a) for k, a in axes.items() if k != key}


@jax.custom_jvp
def _isolated(xs: Leaves, index: Any) -> Leaves:
    # Both branches forward the slices (`index >= 0` holds anyway). `lax.cond` would
    # drop a conditional whose branches both forward an input bare; XLA drops the
    # barrier before it fuses, so neither branch compiles a kernel, while XLA keeps
    # the conditional (tests check the optimised HLO for it).
    barrier = lambda xs: list(lax.optimization_barrier(xs))  # noqa: E731
    return lax.cond(index >= 0, list, barrier, xs)


_isolated.defjvp(lambda p, t: (_isolated(*p), list(t[0])), symbolic_zeros=True)


def isolate_slices(xs: Leaves, index: Any) -> Leaves:
    """This iteration's slices of scanned leaves, kept apart from the loop body's
    kernels on CPU.

    XLA:CPU fuses a scan's slice of its `xs` into the first kernels of the loop body;
    when a kernel reads that slice through two index maps (`outer(x, x)`,
    `x[::-1] * x`), it reloads the slice index in its innermost loop and LLVM does
    not vectorise it: `tanh(outer(x, x)) @ x` ran 4-9x slower per trip. Passing the
    slices through a conditional makes each its own small copy. Its JVP is the
    identity (`jax.custom_jvp`): the backward pass has no conditional. The slices
    are the scan's own, so the gradient stacks their cotangents as `lax.scan` does.
    Other platforms, and inputs that `inputs_to_isolate` does not name, are sliced
    as `lax.scan` slices them.

    The cost is compile time, about half of it LLVM's on the kernel it now vectorises
    (`docs/strategies.md`): `benchmarks/run.py`'s heavy body under `scan(vmap)`
    compiles in about 1.3x the hand-written nest's time and runs in 0.2x (0.65x under
    `jax.grad`).
    """
    return lax.platform_dependent(
        list(xs), index, cpu=_isolated, default=lambda xs, _: list(xs)
    )


def build_levels(
    core: Callable[[Leaves], Leaves],
    levels: Sequence[Level],
    leaf_axes: Sequence[Axes],
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
    if level.kind != "vmap":
        raise ValueError(f"`build_levels` builds vmaps; got a '{level.kind}' level.")
    inner = build_levels(
        core, rest, [drop_axis(a, level.key) for a in leaf_axes], reduce
    )
    mapped = jax.vmap(
        inner,
        in_axes=([a.get(level.key) for a in leaf_axes],),
        out_axes=0,
        axis_size=level.size,
        axis_name=level.dim if level.named else None,
    )
    if reduce is None or level.dim not in reduce.dims:
        return mapped
    # The levels inside whose axes the outputs keep.
    n_batch = sum(lv.dim not in reduce.dims for lv in rest)

    def vmapped_and_reduced(leaves: Leaves) -> Leaves:
        outs = mapped(leaves)
        return [reduce.reduce_leading(i, y, n_batch) for i, y in enumerate(outs)]

    return vmapped_and_reduced


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


def mapped_axes(dims: Dims, names: Sequence[str], ndim: int) -> list[int]:
    """The axes of the named dims `names` (those `dims` has) in an array of rank
    `ndim` with `dims`, in increasing order."""
    return sorted(final_axis(dims, n, ndim) for n in names if n in dims.names)


def present_axes(dims: Dims, absent: Collection[str], ndim: int) -> dict[str, int]:
    """The axis of each named dim of `dims` in an array of rank `ndim` that has the
    axes of `dims` in their order, but those of the named dims `absent`."""
    is_absent = lambda t: isinstance(t, NamedDim) and t.name in absent  # noqa: E731
    kept = [t for t in dims.tokens if not is_absent(t)]
    n_ellipsis = ndim - sum(not isinstance(t, EllipsisDim) for t in kept)
    out, axis = {}, 0
    for t in kept:
        if isinstance(t, NamedDim):
            out[t.name] = axis
        axis += n_ellipsis if isinstance(t, EllipsisDim) else 1
    return out


def _move_axis(x: Any, source: int, destination: int) -> Any:
    """`jnp.moveaxis`, as a reshape when the axes it moves past have size 1 (a
    transpose there may take a layout that XLA copies `x` to)."""
    lo, hi = sorted((source, destination))
    others = x.shape[lo : hi + 1]
    if math.prod(others) == x.shape[source]:
        order = list(range(x.ndim))
        order.insert(destination, order.pop(source))
        return jnp.reshape(x, [x.shape[a] for a in order])
    return jnp.moveaxis(x, source, destination)


def _rename(axes: Axes, key: str, new: str) -> Axes:
    return {(new if k == key else k): a for k, a in axes.items()}


@dataclasses.dataclass(frozen=True)
class _Nest:
    """The nest `spec` of `problem`, built level by level as it is traced.

    `level(j, values, axes, pending)` maps over the scans `spec.scan[j:]` and the
    vmaps inside them. The scans outside have cut the input leaves `values` to one
    iteration: `axes` gives the axis of each level key left in each leaf, and
    `pending` are the vmaps of the chunked dims outside (a chunk's elements, or the
    remainder), which join the vmaps innermost. Its outputs have the axes of their
    dims in order, but those of the dims scanned outside (not `pending`) and of the
    reduced dims (`absent`), so that no output is transposed whole.
    """

    problem: Problem
    spec: NestSpec
    build: Build
    core: Callable[[Leaves], Leaves]
    report: Report | None = None  # `progress=`: the outermost scan's iterations

    def absent(self, j: int, pending: tuple[Level, ...]) -> set[str]:
        """The dims that the outputs of `level(j, ..., pending)` have no axis for."""
        outside = {name for name, _ in self.spec.scan[:j]} - {lv.dim for lv in pending}
        reduce = self.problem.reduce
        return outside | set(reduce.dims if reduce else ())

    def batch_axes(self, y: Any, dims: Dims, absent: set[str]) -> list[int]:
        axes = present_axes(dims, absent, y.ndim)
        return sorted(axes[n] for n in self.spec.dims if n in axes and n not in absent)

    def level(self, j: int, values: Leaves, axes: list[Axes], pending: tuple) -> Leaves:
        if j == len(self.spec.scan):
            return self.vmaps(values, axes, pending)
        name, chunk = self.spec.scan[j]
        n = self.problem.sizes[name]
        if chunk in (None, 1):  # chunks of 1 are the elements: the plain scan
            ys = self.loop(j, values, axes, pending, None)
            return self.placed(j, pending, ys, chunked=False)
        main = rem = None
        for part in parts(name, n, chunk):
            if part.is_main:
                ys = self.loop(j, values, axes, pending, chunk)
                main = self.placed(j, pending, ys, chunked=True)
                continue
            # The remainder: `name` vmapped inside, over its last elements.
            cut = [
                lax.slice_in_dim(x, part.start, part.stop, axis=a[name])
                if name in a
                else x
                for x, a in zip(values, axes)
            ]
            vmapped = Level(name, name, "vmap", part.stop - part.start, False)
            rem = self.level(j + 1, cut, axes, pending + (vmapped,))
        return self.join(j, pending, main, rem)

    def vmaps(self, values: Leaves, axes: list[Axes], pending: tuple) -> Leaves:
        """The innermost levels: the vmaps, then each output in its dims' order."""
        sizes, reduce = self.problem.sizes, self.problem.reduce
        levels = pending + tuple(
            Level(name, name, "vmap", sizes[name], True) for name in self.spec.vmap
        )
        outs = build_levels(self.core, levels, axes, reduce)(values)
        kept = tuple(lv for lv in levels if reduce is None or lv.dim not in reduce.dims)
        block, mapped = Block((), kept), set(self.spec.dims)
        return [
            _to_dims_order(out, dims, block, mapped)
            for out, dims in zip(outs, self.problem.out_dims)
        ]

    def loop(
        self, j: int, values: Leaves, axes: list[Axes], pending: tuple, k: int | None
    ) -> Leaves:
        """The scan of level `j`, over its dim's elements (`k` is `None`) or its whole
        chunks of `k`: the iterations' outputs stacked at axis 0, or for a reduced
        dim, combined in the carry. Each leaf is scanned as the scan's `xs`, or for
        a chunked dim, sliced in each iteration where that saves a whole copy."""
        name, build = self.spec.scan[j][0], self.build
        length = self.problem.sizes[name] // (k or 1)
        mapped = [i for i, a in enumerate(axes) if name in a]
        if k is None:
            xs = {i: jnp.moveaxis(values[i], axes[i][name], 0) for i in mapped}
            inner_axes, inner_pending = [drop_axis(a, name) for a in axes], pending
        else:
            # The outermost scan slices a leaf in each iteration where its `xs`
            # would copy the whole input first (a remainder, or an axis not
            # leading); a scan inside another scans `xs` as `lax.map` does (a copy
            # of its part of the iteration outside, or one XLA hoists out of it).
            # A symbolic length (`jax.export`) is given by the `xs`: no slicing.
            # Each chunk keeps its place in the leaf, so that an iteration's block
            # needs no transpose: the chunks' axis alone is moved to the front.
            xs = {}
            for i in mapped:
                x, ax = values[i], axes[i][name]
                if length and j == 0 and known(length):
                    if ax != 0 or x.shape[0] != length * k:
                        continue
                if length and x.shape[ax] != length * k:
                    x = lax.slice_in_dim(x, 0, length * k, axis=ax)
                xs[i] = _move_axis(_split_axis(x, ax, (length, k)), ax, 0)
            inner_axes = [_rename(a, name, chunk_key(name)) for a in axes]
            inner_pending = pending + (Level(chunk_key(name), name, "vmap", k, False),)
        sliced = [i for i in mapped if i not in xs]
        read = runs_on_slice(self.spec.scan[j + 1 :], self.problem.sizes)
        isolated = [i for i in mapped if read and i in build.isolate]
        inner = ft.partial(self.level, j + 1, axes=inner_axes, pending=inner_pending)
        body = jax.checkpoint(inner) if build.checkpoint else inner

        def take(index: Any, x: Leaves) -> Leaves:
            current = list(values)
            for i, xi in zip(xs, x):
                current[i] = xi
            for i in sliced:
                ax = axes[i][name]
                current[i] = lax.dynamic_slice_in_dim(values[i], index * k, k, ax)
            if isolated:
                kept = isolate_slices([current[i] for i in isolated], index)
                for i, xi in zip(isolated, kept):
                    current[i] = xi
            return current

        acc, combine = None, []
        if self.problem.reduce is not None and name in self.problem.reduce.dims:
            specs = [jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in xs.values()]
            shapes = jax.eval_shape(lambda x: body(take(jnp.int32(0), x)), specs)
            acc, combine = self.accumulator(shapes, self.absent(j + 1, inner_pending))

        # The bar's report takes the index (loop-variant, or `jax.grad` would hoist
        # it out of the loop), outside `jax.checkpoint` (or the backward pass would
        # report again).
        report = self.report if j == 0 else None

        def step(carry: tuple[Any, Any], x: Leaves) -> tuple[Any, Any]:
            index, acc = carry
            if report is not None:
                report(index)
            ys = body(take(index, x))
            index = None if index is None else index + 1
            if acc is None:
                return (index, None), ys
            return (index, [f(a, y) for f, a, y in zip(combine, acc, ys)]), None

        index = jnp.int32(0) if sliced or isolated or report else None
        # `lax.scan` needs an `int` length: a symbolic one is that of the `xs`.
        trips = length if known(length) else None
        carry, ys = lax.scan(step, (index, acc), list(xs.values()), length=trips)
        return ys if acc is None else carry[1]

    def accumulator(self, shapes: list, absent: set[str]) -> tuple[Leaves, list]:
        """A reduced scan's carry: the identity of each output, shaped as one
        iteration's, and the op that combines one iteration's outputs into it."""
        reduce, dims = self.problem.reduce, self.problem.out_dims
        assert reduce is not None
        init = [reduce.identity(i, s.shape) for i, s in enumerate(shapes)]
        combine = [
            ft.partial(reduce.combine, batch_axes=self.batch_axes(s, d, absent))
            for s, d in zip(shapes, dims)
        ]
        return init, combine

    def placed(self, j: int, pending: tuple, ys: Leaves, chunked: bool) -> Leaves:
        """The stacked outputs of level `j`'s scan with their dim at its axis (merged
        with a chunk's elements); a reduced dim's are as they are."""
        name, reduce = self.spec.scan[j][0], self.problem.reduce
        if reduce is not None and name in reduce.dims:
            return ys
        absent = self.absent(j, pending)
        out = []
        for y, dims in zip(ys, self.problem.out_dims):
            ax = present_axes(dims, absent, y.ndim - chunked)[name]
            y = jnp.moveaxis(y, 0, ax)
            if chunked:
                merged = (y.shape[ax] * y.shape[ax + 1],)
                y = jnp.reshape(y, y.shape[:ax] + merged + y.shape[ax + 2 :])
            out.append(y)
        return out

    def join(self, j: int, pending: tuple, main: Any, rem: Any) -> Leaves:
        """A chunked dim's chunks and remainder, concatenated along its axis, or for a
        reduced dim, combined with its op (chunks first)."""
        if main is None or rem is None:
            return main if rem is None else rem
        name, reduce = self.spec.scan[j][0], self.problem.reduce
        absent = self.absent(j, pending)
        out = []
        for a, b, dims in zip(main, rem, self.problem.out_dims):
            if reduce is not None and name in reduce.dims:
                out.append(reduce.combine(a, b, self.batch_axes(a, dims, absent)))
            else:
                ax = present_axes(dims, absent, a.ndim)[name]
                out.append(jnp.concatenate([a, b], axis=ax))
        return out


def run(problem: Problem, spec: NestSpec, build: Build, values: Leaves) -> Leaves:
    """The nest `spec` of `problem` on the input leaves `values`: every output leaf,
    in the order of its dims."""
    reduce = problem.reduce
    core = problem.body
    if reduce is not None:

        def core(leaves: Leaves) -> Leaves:
            return reduce.prepare(problem.body(leaves))

    report = None
    if build.progress is not None and spec.scan:
        name, chunk = spec.scan[0]
        if not known(size := problem.sizes[name]):
            raise SpecError(
                f"`progress=` needs the number of iterations of the outermost scan, "
                f"over dim {name!r}, whose size {size} is symbolic (`jax.export`); "
                "nor can `jax.export` serialise its callback. Drop `progress=`."
            )
        report = report_for(build.progress, size // (chunk or 1))
    nest = _Nest(problem, spec, build, core, report)
    return nest.level(0, list(values), list(problem.leaf_axes), ())


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
