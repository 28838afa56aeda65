"""Runtime shape checks, run at trace time before the mapped body is traced.

Checks *return* reason strings or collect bindings; the caller raises one error with
the full context (the argument path, the dim, every size seen and where).
"""

import dataclasses
from typing import Any

import numpy as np
from jax._src import traceback_util

from ._args import InLeaf, is_array
from ._dims import AnonDim, axes_of, Dims, EllipsisDim, FixedDim, NamedDim
from ._errors import ShapeError, SpecError
from ._text import describe


traceback_util.register_exclusion(__file__)


def dtype_matches(x: Any, dims: Dims) -> bool:
    if dims.dtypes is None:
        return True
    dtype = x.dtype
    name = getattr(dtype, "name", str(dtype))
    if name in dims.dtypes:
        return True
    # JAX names PRNG key dtypes `key<impl>`; jaxtyping's `Key` asks for `prng_key`.
    return name.startswith("key<") and any(
        d.startswith("key") or d == "prng_key" for d in dims.dtypes
    )


def fits_dims(x: Any, dims: Dims, n_dropped: int = 0) -> bool:
    """Whether array `x` meets `dims`: its rank, fixed sizes and dtype. With
    `n_dropped`, `x` is one element, without that many mapped axes (and only its
    rank and dtype are checked)."""
    if not dtype_matches(x, dims):
        return False
    shape = np.shape(x)
    if n_dropped:
        return isinstance(axes_of(dims, len(shape) + n_dropped), tuple)
    token_axes = axes_of(dims, len(shape))
    if isinstance(token_axes, str):
        return False
    return all(
        shape[ax] == tok.size
        for tok, ax in zip(dims.tokens, token_axes)
        if isinstance(tok, FixedDim)
    )


@dataclasses.dataclass(frozen=True)
class Seen:
    size: int
    where: str


@dataclasses.dataclass
class InputCheck:
    sizes: dict[str, int]
    seen: dict[str, list[Seen]]
    # For each input leaf that is an array: the axis of each mapped dim it has.
    axes: list[dict[str, int] | None]


def bindings_str(sizes: dict[str, Any]) -> str:
    if not sizes:
        return "No dim sizes were bound."
    body = ", ".join(f"{k}={v}" for k, v in sizes.items())
    return f"The dim sizes bound so far are: {body}."


def _inconsistent(
    fun_name: str, name: str, seen: list[Seen], sizes: dict, scope: str | None = None
) -> ShapeError:
    by_size: dict[int, list[str]] = {}
    for s in seen:
        by_size.setdefault(s.size, []).append(s.where)
    if scope is None:
        lines = [f"`{fun_name}` got inconsistent sizes for dim '{name}':"]
    else:
        lines = [
            f"`{fun_name}` got inconsistent sizes for dim '{name}' within `{scope}` "
            "(a core dim of a Module's or typed container's fields is checked "
            "within each instance, as jaxtyping checks its fields):"
        ]
    for size, wheres in by_size.items():
        lines.append(f"  * size {size}: " + "; ".join(wheres))
    others = {k: v for k, v in sizes.items() if k != name and isinstance(k, str)}
    lines.append(bindings_str(others))
    return ShapeError("\n".join(lines))


def _check_non_array(fun_name: str, leaf: InLeaf, dims: Dims, mapped: set[str]) -> None:
    value = leaf.value
    if isinstance(value, (bool, int, float, complex)):
        # A Python scalar has shape (); check it as `jax.jit` would see it, so that
        # eager and jitted calls agree.
        reason = axes_of(dims, 0)
        if isinstance(reason, str):
            raise ShapeError(
                f"`{fun_name}`: argument `{leaf.path}` is the Python "
                f"`{type(value).__name__}` {value!r}, which {reason}."
            )
    names = [n for n in dims.names if n in mapped]
    if names:
        raise ShapeError(
            f"`{fun_name}`: argument `{leaf.path}` is `{type(value).__name__}` "
            f"({value!r}), not an array, but its dims {dims.source!r} name the "
            f"mapped dim '{names[0]}'. Pass an array, or give it `None` dims."
        )


def check_leaf_shape(
    fun_name: str, leaf: InLeaf, dims: Dims
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """An array argument's rank, dtype and fixed sizes against its dims; its shape
    and the axis of each token."""
    shape = np.shape(leaf.value)
    desc = describe(leaf.value)
    token_axes = axes_of(dims, len(shape))
    if isinstance(token_axes, str):
        raise ShapeError(
            f"`{fun_name}`: argument `{leaf.path}` of type {desc} {token_axes}."
        )
    if not dtype_matches(leaf.value, dims):
        raise ShapeError(
            f"`{fun_name}`: argument `{leaf.path}` has dtype "
            f"{leaf.value.dtype}, but its annotation asks for "
            f"{dims.dtype_desc}[..., {dims.source!r}]."
        )
    for tok, ax in zip(dims.tokens, token_axes):
        if not isinstance(tok, FixedDim) or shape[ax] == tok.size:
            continue
        if tok.broadcast and shape[ax] == 1:
            continue
        raise ShapeError(
            f"`{fun_name}`: argument `{leaf.path}` of type {desc} has size "
            f"{shape[ax]} at axis {ax}, but its dims {dims.source!r} fix that axis "
            f"to {tok.size}{' (or 1)' if tok.broadcast else ''}."
        )
    return shape, token_axes


def check_inputs(
    fun_name: str,
    leaves: list[InLeaf],
    mapped: tuple[str, ...],
    variadic: dict[Any, tuple[int, ...]] | None = None,
) -> InputCheck:
    """The size of every named dim, checked to agree, and the axis of every mapped
    dim in every array leaf. `variadic`: the shape of each flattened variadic dim,
    for errors."""
    mapped_set = set(mapped)
    seen: dict[str, list[Seen]] = {}
    scoped: dict[tuple[str, str], list[Seen]] = {}  # core dims of a Module's fields
    axes: list[dict[str, int] | None] = []
    for leaf in leaves:
        dims = leaf.spec.dims
        if not is_array(leaf.value):
            # As in `eqx.filter_vmap`, non-array leaves under a pytree's dims pass
            # through; a non-array given dims of its own is checked as a value.
            if leaf.spec.direct and dims is not None:
                _check_non_array(fun_name, leaf, dims, mapped_set)
            axes.append(None)
            continue
        if dims is None:
            axes.append({})
            continue
        shape, token_axes = check_leaf_shape(fun_name, leaf, dims)
        desc = describe(leaf.value if leaf.shown is None else leaf.shown)
        leaf_axes: dict[str, int] = {}
        for i, (tok, ax) in enumerate(zip(dims.tokens, token_axes)):
            if isinstance(tok, NamedDim):
                at = ax if leaf.shown_axes is None else leaf.shown_axes[i]
                where = f"`{leaf.path}` axis {at} ({desc}, dims {dims.source!r})"
                key = dims.size_key(tok.name, mapped_set)
                seen_in = seen if isinstance(key, str) else scoped
                seen_in.setdefault(key, []).append(Seen(shape[ax], where))
                if tok.name in mapped_set:
                    if tok.name in leaf_axes:
                        raise SpecError(
                            f"`{fun_name}`: the dims {dims.source!r} of argument "
                            f"`{leaf.path}` name the mapped dim '{tok.name}' twice; "
                            "a mapped dim may appear at most once per array."
                        )
                    leaf_axes[tok.name] = ax
        axes.append(leaf_axes)
    sizes = {name: ss[0].size for name, ss in seen.items()}
    shown: dict[str, Any] = {
        (f"*{k}" if k in (variadic or {}) else k): (variadic or {}).get(k, v)
        for k, v in sizes.items()
    }
    for key, ss in [*seen.items(), *scoped.items()]:
        if any(s.size != ss[0].size for s in ss):
            scope, name = (None, key) if isinstance(key, str) else key
            raise _inconsistent(fun_name, name, ss, shown, scope)
    return InputCheck(sizes, seen, axes)


def _core_hint(dims: Dims, mapped: tuple[str, ...], seen: dict) -> str:
    """For an output of the wrong rank: the core dims that exactly one input names
    (a misspelled mapped dim, say)."""
    lines = []
    for name, ss in seen.items():
        if not isinstance(name, str) or name in mapped or name in dims.names:
            continue
        args = {s.where.split("`")[1] for s in ss}
        if len(args) == 1:
            lines.append(
                f" `{args.pop()}` names dim '{name}' (size {ss[0].size}), which the "
                f"output does not name, so '{name}' is a core dim: the body sees it "
                "whole."
            )
    return "".join(lines)


def check_output(
    fun_name: str,
    path: str,
    core_shape: tuple[int, ...],
    dims: Dims,
    mapped: tuple[str, ...],
    sizes: dict[str, int],
    seen: dict[str, list[Seen]],
    source: str = "`out_dims`",
) -> None:
    """Check one output array of the body (shape without mapped dims) against dims,
    which name every mapped dim once (`_options.check_out_leaf`).

    `source` says where `dims` came from, for errors (`` `out_dims` ``, "the return
    annotation"). Updates `sizes`/`seen` with core dims that only the outputs bind.
    """
    mapped_set = set(mapped)
    core_tokens = [
        t for t in dims.tokens if not (isinstance(t, NamedDim) and t.name in mapped_set)
    ]
    core = Dims(tuple(core_tokens), " ".join(str(t) for t in core_tokens))
    shape_desc = str(tuple(core_shape))
    token_axes = axes_of(core, len(core_shape))
    if isinstance(token_axes, str):
        raise ShapeError(
            f"`{fun_name}`: the function body returned `{path}` with per-element "
            f"shape {shape_desc}: that shape {token_axes} ({source} "
            f"{dims.source!r} without the mapped dims {' '.join(mapped)})."
            + _core_hint(dims, mapped, seen)
        )
    for tok, ax in zip(core.tokens, token_axes):
        if isinstance(tok, (AnonDim, EllipsisDim)):
            continue
        size = core_shape[ax]
        if isinstance(tok, FixedDim):
            if size != tok.size:
                raise ShapeError(
                    f"`{fun_name}`: the function body returned `{path}` with "
                    f"per-element shape {shape_desc}, but {source} {dims.source!r} "
                    f"{'fix' if source == '`out_dims`' else 'fixes'} the axis at {ax} "
                    f"to {tok.size}."
                )
            continue
        where = f"`{path}` (body output of shape {shape_desc}) axis {ax}"
        key = dims.size_key(tok.name, mapped_set)
        if key in sizes and sizes[key] != size:
            ss = seen.get(key, []) + [Seen(size, where)]
            raise _inconsistent(fun_name, tok.name, ss, sizes, dims.scope)
        sizes.setdefault(key, size)
        seen.setdefault(key, []).append(Seen(size, where))
