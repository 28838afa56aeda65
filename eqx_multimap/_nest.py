"""Building and running the scan(vmap(...)) nest over flat lists of array leaves.

Every level maps one dim. Scans are outermost (in the order given), vmaps innermost.
A chunked scan over `T` with chunk `k` is two levels: a scan over `T // k` chunks
(key `T`), and a vmap over the `k` elements of a chunk (key `T/k`) that joins the
vmap group. The `T % k` remaining elements form a separate block in which `T` is a
plain vmap, so no padding ever reaches the function. The blocks are concatenated.

Each level puts its dim at axis 0 of every output (`vmap(out_axes=0)`, and `scan`
stacks at 0), so the nest's outputs are laid out as `[level keys..., core axes...]`,
then transposed once (only if needed) into the order of `out_dims`.
"""

import dataclasses
import functools as ft
import itertools as it
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np

from ._dims import axes_of, Dims, EllipsisDim, NamedDim


LevelKind = Literal["scan", "vmap"]


@dataclasses.dataclass(frozen=True)
class Level:
    key: str
    kind: LevelKind
    size: int


Leaves = list[Any]
AxesList = list[dict[str, int]]


def _drop_axis(axes: dict[str, int], key: str) -> dict[str, int]:
    if key not in axes:
        return axes
    removed = axes[key]
    return {k: (a - 1 if a > removed else a) for k, a in axes.items() if k != key}


def build_nest(
    core: Callable[[Leaves], Leaves],
    levels: Sequence[Level],
    leaf_axes: AxesList,
    checkpoint: bool = False,
) -> Callable[[Leaves], Leaves]:
    """The function mapping `core` over `levels` (outermost first).

    `leaf_axes[i]` gives the axis of each level key in input leaf `i`; leaves without
    a key are broadcast (closed over by scans, `in_axes=None` for vmaps).
    """
    if not levels:
        return core
    level, rest = levels[0], levels[1:]
    key = level.key
    inner = build_nest(core, rest, [_drop_axis(a, key) for a in leaf_axes], checkpoint)
    in_axes = [a.get(key) for a in leaf_axes]
    if level.kind == "vmap":
        return jax.vmap(inner, in_axes=(in_axes,), out_axes=0, axis_size=level.size)
    elif level.kind == "scan":
        mapped = [i for i, a in enumerate(in_axes) if a is not None]
        body_fn = jax.checkpoint(inner) if checkpoint else inner

        def scanned(leaves: Leaves) -> Leaves:
            xs = [jnp.moveaxis(leaves[i], in_axes[i], 0) for i in mapped]

            def run(x: Leaves) -> Leaves:
                current = list(leaves)
                for i, xi in zip(mapped, x):
                    current[i] = xi
                return body_fn(current)

            if xs and level.size > 0 and ISOLATE_SLICES_ON_CPU:
                # Slice each iteration's elements with `take` (see there).
                def body(index, _):
                    return index + 1, run(take(xs, index, level.size))

                _, ys = lax.scan(body, jnp.int32(0), None, length=level.size)
            else:
                _, ys = lax.scan(lambda c, x: (c, run(x)), None, xs, length=level.size)
            return ys

        return scanned
    else:
        raise ValueError(f"Unrecognised level kind '{level.kind}'.")


# Read at trace time by `take`; `benchmarks/overhead.py` turns it off to compare
# with a hand-written `lax.scan`.
ISOLATE_SLICES_ON_CPU = True


def _index(xs: Leaves, index: Any) -> Leaves:
    return [lax.dynamic_index_in_dim(x, index, 0, keepdims=False) for x in xs]


def _index_isolated(xs: Leaves, index: Any, length: int) -> Leaves:
    # `index < length` always holds; the conditional only keeps XLA from fusing the
    # slices into the loop body's kernels.
    return lax.cond(index < length, _index, lambda xs, _: _index(xs, 0), xs, index)


def take(xs: Leaves, index: Any, length: int) -> Leaves:
    """Element `index` of each scanned leaf (along axis 0), for one loop iteration.

    On CPU the slices are taken inside a conditional, so that each is its own small
    copy rather than fused into the first kernels of the loop body. XLA:CPU does fuse
    it there (as `lax.scan` slices its `xs`), and the kernel then reloads the slice
    index in its innermost loop, so LLVM does not vectorise it: for a body with
    transcendentals and a materialised intermediate (`tanh(outer(x, x)) @ x`) a loop of
    3 or more trips ran 4-9x slower per trip than a loop of 2. The copy costs about
    5% on a purely elementwise body (see `benchmarks/overhead.py`). Other platforms
    slice as `lax.scan` does.
    """
    return lax.platform_dependent(
        xs, index, cpu=ft.partial(_index_isolated, length=length), default=_index
    )


def _split_axis(x: Any, axis: int, sizes: tuple[int, int]) -> Any:
    return jnp.reshape(x, x.shape[:axis] + sizes + x.shape[axis + 1 :])


@dataclasses.dataclass(frozen=True)
class OutLayout:
    """What the body returned, recorded while tracing the innermost function."""

    dims: list[Dims]
    data: Any


def _target_perm(
    dims: Dims, keys_of: dict[str, tuple[str, ...]], level_keys: list[str], ndim: int
) -> list[int]:
    """Permutation from nest layout `[level keys..., core]` to the order of `dims`."""
    n_levels = len(level_keys)
    core_ndim = ndim - n_levels
    mapped = set(keys_of)
    core_tokens = [
        t for t in dims.tokens if not (isinstance(t, NamedDim) and t.name in mapped)
    ]
    n_ellipsis = core_ndim - sum(not isinstance(t, EllipsisDim) for t in core_tokens)
    perm: list[int] = []
    core_axis = n_levels
    for t in dims.tokens:
        if isinstance(t, NamedDim) and t.name in mapped:
            perm.extend(level_keys.index(k) for k in keys_of[t.name])
        elif isinstance(t, EllipsisDim):
            perm.extend(range(core_axis, core_axis + n_ellipsis))
            core_axis += n_ellipsis
        else:
            perm.append(core_axis)
            core_axis += 1
    return perm


def run_blocks(
    make_core: Callable[[], tuple[Callable[[Leaves], Leaves], Callable[[], OutLayout]]],
    values: Leaves,
    leaf_axes: AxesList,
    sizes: dict[str, int],
    scan: dict[str, int | None],
    vmap: Sequence[str],
    checkpoint: bool = False,
) -> tuple[Leaves, OutLayout]:
    """Run the whole nest, block by block for chunked scans, in `out_dims` order.

    `make_core()` returns a fresh innermost function and a getter for the layout it
    recorded while being traced.
    """
    chunked = [(name, chunk) for name, chunk in scan.items() if chunk is not None]
    choices = []
    for name, chunk in chunked:
        n = sizes[name]
        n_full, rest = divmod(n, chunk)
        opts = []
        if n_full > 0 or n == 0:
            opts.append(("main", n_full))
        if rest > 0:
            opts.append(("rest", rest))
        choices.append(opts)

    block_outs: dict[tuple[str, ...], Leaves] = {}
    layout: OutLayout | None = None
    for combo in it.product(*choices):
        block_values = list(values)
        block_axes = [dict(a) for a in leaf_axes]
        which = {}
        for (name, chunk), (kind, count) in zip(chunked, combo):
            which[name] = (kind, count, chunk)
            start = 0 if kind == "main" else sizes[name] - count
            stop = count * chunk if kind == "main" else sizes[name]
            for i, axes in enumerate(block_axes):
                if name not in axes:
                    continue
                ax = axes[name]
                x = block_values[i]
                if (start, stop) != (0, x.shape[ax]):
                    x = lax.slice_in_dim(x, start, stop, axis=ax)
                if kind == "main":
                    x = _split_axis(x, ax, (count, chunk))
                    block_axes[i] = {
                        k: (a + 1 if a > ax else a) for k, a in axes.items()
                    }
                    block_axes[i][name + "/k"] = ax + 1
                block_values[i] = x
        scan_levels: list[Level] = []
        vmap_levels: list[Level] = []
        keys_of: dict[str, tuple[str, ...]] = {}
        for name, chunk in scan.items():
            if chunk is None:
                scan_levels.append(Level(name, "scan", sizes[name]))
                keys_of[name] = (name,)
            else:
                kind, count, chunk = which[name]
                if kind == "main":
                    scan_levels.append(Level(name, "scan", count))
                    vmap_levels.append(Level(name + "/k", "vmap", chunk))
                    keys_of[name] = (name, name + "/k")
                else:
                    vmap_levels.append(Level(name, "vmap", count))
                    keys_of[name] = (name,)
        for name in vmap:
            vmap_levels.append(Level(name, "vmap", sizes[name]))
            keys_of[name] = (name,)
        levels = scan_levels + vmap_levels
        level_keys = [lv.key for lv in levels]

        core, get_layout = make_core()
        outs = build_nest(core, levels, block_axes, checkpoint)(block_values)
        block_layout = get_layout()
        if layout is None:
            layout = block_layout
        final = []
        for out, dims in zip(outs, block_layout.dims):
            perm = _target_perm(dims, keys_of, level_keys, out.ndim)
            if perm != list(range(out.ndim)):
                out = jnp.transpose(out, perm)
            # Merge each chunked (chunks, k) pair of adjacent axes, rightmost first.
            pairs = sorted(
                (
                    perm.index(level_keys.index(name))
                    for name, _ in chunked
                    if which[name][0] == "main"
                ),
                reverse=True,
            )
            for ax in pairs:
                merged_size = out.shape[ax] * out.shape[ax + 1]
                out = jnp.reshape(
                    out, out.shape[:ax] + (merged_size,) + out.shape[ax + 2 :]
                )
            final.append(out)
        block_outs[tuple(kind for kind, _ in combo)] = final
    assert layout is not None

    # Concatenate blocks along each chunked dim, last chunked dim first.
    def assemble(prefix: tuple[str, ...], j: int) -> Leaves:
        if j == len(chunked):
            return block_outs[prefix]
        parts = [assemble(prefix + (kind,), j + 1) for kind, _ in choices[j]]
        if len(parts) == 1:
            return parts[0]
        name = chunked[j][0]
        merged = []
        for leaves_ in zip(*parts):
            dims = layout.dims[len(merged)]
            ax = _final_axis(dims, name, leaves_[0].ndim)
            merged.append(jnp.concatenate(leaves_, axis=ax))
        return merged

    return assemble((), 0), layout


def _final_axis(dims: Dims, name: str, ndim: int) -> int:
    token_axes = axes_of(dims, ndim)
    assert not isinstance(token_axes, str)
    for t, ax in zip(dims.tokens, token_axes):
        if isinstance(t, NamedDim) and t.name == name:
            return ax
    raise AssertionError(name)


def nbytes(x: Any) -> int:
    return int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize


def plural(n: int, word: str) -> str:
    """`"1 chunk"`, `"3 chunks"`."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def describe_nest(
    scan: dict[str, int | None], vmap: Sequence[str], sizes: dict[str, int]
) -> str:
    """The nest as text, e.g. `scan(T=10) -> vmap(F=4) -> body`."""
    parts = []
    for name, chunk in scan.items():
        if chunk is None:
            parts.append(f"scan({name}={sizes[name]})")
        else:
            n_full, rest = divmod(sizes[name], chunk)
            extra = f" + vmap({name} remainder={rest})" if rest else ""
            parts.append(f"scan({name}: {plural(n_full, 'chunk')} of {chunk}){extra}")
    parts.extend(f"vmap({name}={sizes[name]})" for name in vmap)
    return " -> ".join(parts + ["body"])
