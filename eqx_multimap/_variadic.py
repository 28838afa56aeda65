"""Variadic (`*batch`) and broadcast (`#B`) dims, rewritten into plain dims.

At resolve time, before the inputs are checked, every array argument whose dims
have a variadic or broadcast token is rewritten, so that the rest of the pipeline
(checks, planner, nest) only sees plain named dims:

- a mapped `*batch` (named by the output) is **flattened** into one axis, a plain dim
  named `batch` whose size is the product of its shape; every argument naming it
  must have the same shape there. The output's `batch` axis is reshaped back by
  [`Expand`][] when the results are combined. A core `*batch` is `...`, with the
  same agreement checked.
- an axis `#B` of size 1, where `B` is mapped with another size, is **squeezed**:
  the argument is then broadcast (not mapped) along `B`. A `#B` (or `#3`) of size 1
  along a core dim binds no size, as in jaxtyping. Otherwise `#B` is `B`.

The names stay the user's: the flattened dim is `batch`, in errors and in `explain`.
"""

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax._src import traceback_util
from jax.sharding import NamedSharding, PartitionSpec as P

from ._args import BoundCall, InLeaf, is_array, LeafSpec
from ._check import check_leaf_shape
from ._dims import (
    AnonDim,
    axes_of,
    Dims,
    EllipsisDim,
    final_axis,
    FixedDim,
    NamedDim,
    Token,
    variadic_axes,
    VariadicDim,
)
from ._errors import ShapeError
from ._shard import explicit_sharding
from ._text import describe


traceback_util.register_exclusion(__file__)


def _needs_rewrite(dims: Dims | None) -> bool:
    return dims is not None and any(
        isinstance(t, VariadicDim) or getattr(t, "broadcast", False)
        for t in dims.tokens
    )


def _variadic_shapes(
    fun_name: str, leaves: list[InLeaf], mapped: set[str]
) -> dict[Any, tuple[int, ...]]:
    """The shape of each variadic dim (by size key), checked to agree across the
    arguments that name it."""
    seen: dict[Any, list[tuple[tuple[int, ...], str]]] = {}
    for leaf in leaves:
        dims = leaf.spec.dims
        if dims is None or dims.variadic is None or not is_array(leaf.value):
            continue
        shape = np.shape(leaf.value)
        if isinstance(axes_of(dims, len(shape)), str):
            continue  # the rank is wrong: `check_inputs` says so
        start, n = variadic_axes(dims, len(shape))
        axes = f"axis {start}" if n == 1 else f"axes {start}-{start + n - 1}"
        if n == 0:
            axes = f"no axes (before axis {start})"
        where = f"`{leaf.path}` {axes} ({describe(leaf.value)}, dims {dims.source!r})"
        key = dims.size_key(dims.variadic.name, mapped)
        seen.setdefault(key, []).append((tuple(shape[start : start + n]), where))
    out = {}
    for key, found in seen.items():
        shapes = list(dict.fromkeys(s for s, _ in found))
        if len(shapes) > 1:
            name = key if isinstance(key, str) else key[1]
            lines = [
                f"`{fun_name}` got inconsistent shapes for the variadic dim "
                f"'*{name}' (every array that names it has the same shape there):"
            ]
            for shape in shapes:
                wheres = "; ".join(w for s, w in found if s == shape)
                lines.append(f"  * shape {shape}: {wheres}")
            raise ShapeError("\n".join(lines))
        out[key] = shapes[0]
    return out


def _full_sizes(leaves: list[InLeaf]) -> dict[str, set[int]]:
    """The sizes each named dim has where it is not a broadcast size 1."""
    out: dict[str, set[int]] = {}
    for leaf in leaves:
        dims = leaf.spec.dims
        if dims is None or not is_array(leaf.value):
            continue
        shape = np.shape(leaf.value)
        token_axes = axes_of(dims, len(shape))
        if isinstance(token_axes, str):
            continue
        for tok, ax in zip(dims.tokens, token_axes):
            if isinstance(tok, NamedDim) and not (tok.broadcast and shape[ax] == 1):
                out.setdefault(tok.name, set()).add(shape[ax])
    return out


def _rewrite(
    fun_name: str,
    leaf: InLeaf,
    mapped: set[str],
    full: dict[str, set[int]],
    sharded: bool,
) -> InLeaf:
    """One argument with its mapped variadic dim flattened and its broadcast axes
    of size 1 squeezed (see the module's docstring)."""
    dims = leaf.spec.dims
    assert dims is not None
    shape, token_axes = check_leaf_shape(fun_name, leaf, dims)
    tokens: list[Token] = []
    new_shape: list[int] = []
    shown_axes: list[int] = []
    for tok, ax in zip(dims.tokens, token_axes):
        if isinstance(tok, VariadicDim):
            start, n = variadic_axes(dims, len(shape))
            span = shape[start : start + n]
            shown_axes.append(start)
            if tok.name in mapped:
                tokens.append(NamedDim(tok.name))
                new_shape.append(math.prod(span))
            else:
                tokens.append(EllipsisDim())
                new_shape.extend(span)
            continue
        size = shape[ax]
        if getattr(tok, "broadcast", False) and size == 1:
            if isinstance(tok, NamedDim) and tok.name in mapped:
                if full.get(tok.name, {1}) != {1}:
                    continue  # squeezed: broadcast along a mapped dim
                tok = NamedDim(tok.name)
            else:
                tok = AnonDim("_")  # size 1 of a core dim binds no size
        elif isinstance(tok, NamedDim):
            tok = NamedDim(tok.name)
        elif isinstance(tok, FixedDim):
            tok = FixedDim(tok.size)
        tokens.append(tok)
        new_shape.append(size)
        shown_axes.append(ax)
    spec = LeafSpec(dataclasses.replace(dims, tokens=tuple(tokens)), leaf.spec.direct)
    if tuple(new_shape) == tuple(shape):
        return InLeaf(leaf.path, leaf.value, spec)
    if sharded:
        value = _sharded_reshape(leaf.value, tuple(new_shape))
    else:
        value = leaf.value.reshape(tuple(new_shape))
    return InLeaf(leaf.path, value, spec, leaf.value, tuple(shown_axes))


def _sharded_reshape(x: Any, shape: tuple[int, ...]) -> Any:
    """`x.reshape(shape)`, whose cotangent, sharded by `shard_map` over an
    explicitly sharded mesh, is reshaped back with `x`'s own sharding (JAX cannot
    tell the sharding of the reshape of a sharded axis). Reverse mode only."""
    old = np.shape(x)
    primal = explicit_sharding(x)
    spec = P() if primal is None else primal.spec

    @jax.custom_vjp
    def reshape(x):
        return x.reshape(shape)

    def fwd(x):
        return reshape(x), None

    def bwd(_, ct):
        sharding = explicit_sharding(ct)
        if sharding is None:
            return (ct.reshape(old),)
        out = NamedSharding(sharding.mesh, spec)
        return (jax.lax.reshape(ct, old, out_sharding=out),)

    reshape.defvjp(fwd, bwd)
    return reshape(x)


def rewrite_inputs(
    fun_name: str, bound: BoundCall, mapped: tuple[str, ...], sharded: bool = False
) -> tuple[BoundCall, dict[Any, tuple[int, ...]]]:
    """The arguments with plain dims only, and the shape of each variadic dim.
    `sharded`: the call is sharded (`shard=`)."""
    leaves = bound.leaves
    if not any(_needs_rewrite(leaf.spec.dims) for leaf in leaves):
        return bound, {}
    mapped_set = set(mapped)
    shapes = _variadic_shapes(fun_name, leaves, mapped_set)
    full = _full_sizes(leaves)
    new = [
        _rewrite(fun_name, leaf, mapped_set, full, sharded)
        if is_array(leaf.value) and _needs_rewrite(leaf.spec.dims)
        else leaf
        for leaf in leaves
    ]
    return BoundCall(bound.treedef, new), shapes


@dataclasses.dataclass(frozen=True)
class Expand:
    """How to reshape one output back: its flattened variadic dim `name` (a plain
    dim of `dims`) into `shape`."""

    dims: Dims
    name: str
    shape: tuple[int, ...]

    def __call__(self, out: Any) -> Any:
        ax = final_axis(self.dims, self.name, np.ndim(out))
        shape = np.shape(out)
        new_shape = shape[:ax] + self.shape + shape[ax + 1 :]
        sharding = explicit_sharding(out)
        if sharding is None:
            return out.reshape(new_shape)
        spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
        expanded = _expanded_spec(spec, ax, self.shape, sharding.mesh)
        return jax.lax.reshape(
            out, new_shape, out_sharding=NamedSharding(sharding.mesh, expanded)
        )


def _expanded_spec(spec: tuple, ax: int, shape: tuple[int, ...], mesh: Any) -> P:
    """The spec of a sharded flattened axis `ax` once expanded into `shape`: the
    same layout if its first axis splits evenly, else those axes replicated."""
    entry = spec[ax]
    new: list[Any] = [None] * len(shape)
    if entry is not None and shape:
        names = entry if isinstance(entry, tuple) else (entry,)
        n = math.prod(mesh.shape[name] for name in names)
        if shape[0] % n == 0:
            new[0] = entry
    return P(*spec[:ax], *new, *spec[ax + 1 :])


def rewrite_output(
    dims: Dims, mapped: tuple[str, ...], shapes: dict[Any, tuple[int, ...]]
) -> tuple[Dims, Expand | None]:
    """An output's dims with plain dims only (a mapped `*batch` as the dim `batch`,
    a core one as `...`, `#B` as `B`), and how to reshape the output back."""
    if not _needs_rewrite(dims):
        return dims, None
    tokens: list[Token] = []
    expand_name = None
    for tok in dims.tokens:
        if isinstance(tok, VariadicDim):
            if tok.name in mapped:
                tokens.append(NamedDim(tok.name))
                expand_name = tok.name
            else:
                tokens.append(EllipsisDim())
        elif isinstance(tok, NamedDim):
            tokens.append(NamedDim(tok.name))
        elif isinstance(tok, FixedDim):
            tokens.append(FixedDim(tok.size))
        else:
            tokens.append(tok)
    flat = dataclasses.replace(dims, tokens=tuple(tokens))
    if expand_name is None or expand_name not in shapes:
        return flat, None
    return flat, Expand(flat, expand_name, shapes[expand_name])
