"""Dims from jaxtyping annotations: parameters, return values and `eqx.Module` fields.

An annotation such as `Float[Array, "T F B 2 2"]` describes the *whole* (batched)
shape that the caller passes, exactly as a dims string does, plus a dtype constraint.
This module turns the annotations of a function into the pytree-prefix specs that the
core understands:

- for each parameter, a spec built from its annotation *and* its value at call time
  (so that an `eqx.Module` argument gets a spec tree from its field annotations,
  recursively through nested modules, tuples and lists);
- for the return value, an [`OutAnnotation`][] that builds the `out_dims` from the
  body's actual output while it is traced (needed for `eqx.Module` return types).

The hints themselves are read by `_hints`, lazily at the first call (so that forward
references and `from __future__ import annotations` work).
"""

import dataclasses
import functools as ft
import types
import typing
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, get_args, get_origin

import equinox as eqx
import jax
import jax.tree_util as jtu
from jax._src import traceback_util
from jaxtyping import AbstractArray, PyTree

from ._args import (
    broadcast_spec,
    describe_value,
    holds_no_array,
    is_array,
    LeafSpec,
    names_str,
    no_array_in,
    pass_an_array,
)
from ._check import dtype_matches
from ._dims import Dims, parse_dims
from ._errors import ShapeError, SpecError
from ._hints import checker_inside, class_hints, fun_hints, Unresolved


traceback_util.register_exclusion(__file__)


_UNION_TYPES: tuple[Any, ...] = (typing.Union, types.UnionType)


def _is_array_type(ann: Any) -> bool:
    return isinstance(ann, type) and issubclass(ann, AbstractArray)


def _is_pytree_type(ann: Any) -> bool:
    return isinstance(ann, type) and issubclass(ann, PyTree) and ann is not PyTree


def _is_module_type(ann: Any) -> bool:
    return isinstance(ann, type) and issubclass(ann, eqx.Module)


def _strip(ann: Any) -> Any:
    """`Annotated[X, ...]` -> `X`."""
    while get_origin(ann) is typing.Annotated:
        ann = get_args(ann)[0]
    return ann


def _union_members(ann: Any) -> list[Any] | None:
    if get_origin(ann) in _UNION_TYPES:
        return [_strip(m) for m in get_args(ann) if m is not type(None)]
    return None


#
# Dims strings of jaxtyping array types.
#


def _translate_token(tok: str) -> str:
    """One jaxtyping dim token as a dims-string token; raises `ValueError(reason)`."""
    if tok == "...":
        return tok
    flags = set()
    rest = tok
    while rest:
        if rest[0] in "#*_?" and rest[0] not in flags:
            flags.add(rest[0])
            rest = rest[1:]
        elif rest.count("=") == 1:
            # jaxtyping's documentation syntax `rows=3` means just `3`.
            rest = rest.split("=")[1]
        else:
            break
    if "*" in flags:
        if "_" in flags:
            return "..."  # `*_` is jaxtyping's spelling of `...`
        raise ValueError(
            f"its dim {tok!r} is variadic (`*name`), which is not supported; use "
            "`...` for any number of unnamed axes"
        )
    if "#" in flags:
        raise ValueError(
            f"its dim {tok!r} is broadcastable (`#name`), which is not supported; "
            "name the dim and pass arrays of the full size"
        )
    if "?" in flags:
        raise ValueError(
            f"its dim {tok!r} depends on the pytree path (`?name`), which is not "
            "supported"
        )
    if "_" in flags:
        return "_" + rest
    if rest.isidentifier() or rest.isdigit():
        return rest
    raise ValueError(
        f"its dim {tok!r} is a symbolic expression, which is not supported; use a "
        "name or an integer"
    )


@ft.lru_cache(maxsize=1024)
def _translate(dim_str: str) -> Dims | str:
    """The `Dims` of a jaxtyping dim string, or the reason it is not supported."""
    try:
        tokens = [_translate_token(t) for t in dim_str.split()]
        return parse_dims(" ".join(tokens))
    except (ValueError, SpecError) as e:
        return str(e)


def _array_dims(array_types: list[Any]) -> Dims | str:
    """The `Dims` (with dtypes) of one array type, or of a union of several."""
    dim_strs = list(dict.fromkeys(t.dim_str for t in array_types))
    if len(dim_strs) > 1:
        return (
            "it is a union of array types with different dims "
            f"({', '.join(repr(s) for s in dim_strs)}), which cannot be mapped"
        )
    dims = _translate(dim_strs[0])
    if isinstance(dims, str):
        return dims
    dtypes: set[str] | None = set()
    for t in array_types:
        if not isinstance(t.dtypes, (tuple, list)) or not all(
            isinstance(d, str) for d in t.dtypes
        ):
            # `Shaped` (any dtype), or a custom dtype given by a regex: not checked
            # here (a type checker around the call still checks a regex).
            dtypes = None
            break
        dtypes.update(t.dtypes)
    if dtypes is None:
        return dims
    desc = " | ".join(dict.fromkeys(t.dtype.__name__ for t in array_types))
    return dims.with_dtypes(frozenset(dtypes), desc)


def _type_name(ann: Any) -> str:
    if _is_array_type(ann):
        return f"{ann.dtype.__name__}[{_short_array_name(ann)}, {ann.dim_str!r}]"
    return getattr(ann, "__name__", None) or repr(ann)


def _short_array_name(ann: Any) -> str:
    name = getattr(ann.array_type, "__name__", None) or repr(ann.array_type)
    return name.rsplit(".", 1)[-1]  # `jax.Array.__name__` is "jaxlib._jax.Array"


#
# Building spec trees.
#


def _one_level(value: Any) -> tuple[list[tuple[Any, Any]], Any]:
    children, treedef = jtu.tree_flatten_with_path(
        value, is_leaf=lambda y: y is not value
    )
    return [(path[0], child) for path, child in children], treedef


def _spec_names(spec: Any) -> list[str]:
    names: list[str] = []
    for leaf in jtu.tree_leaves(spec, is_leaf=lambda x: isinstance(x, Dims)):
        if isinstance(leaf, Dims):
            names.extend(n for n in leaf.names if n not in names)
    return names


@dataclasses.dataclass(frozen=True)
class _Context:
    """Where a spec is being built, for error messages."""

    fun_name: str
    override: str  # e.g. "`in_dims={'vis': ...}`"
    top_label: str  # e.g. "parameter `vis`" or "the return value"
    top_path: str

    def label(self, path: str) -> str:
        return self.top_label if path == self.top_path else f"`{path}`"

    def unsupported(self, ann: Any, path: str, reason: str) -> SpecError:
        return SpecError(
            f"`{self.fun_name}`: {self.label(path)} is annotated `{_type_name(ann)}`, "
            f"but {reason}. Change the annotation, or override it with "
            f"{self.override}."
        )

    def not_an_array(self, ann: Any, dims: Dims, value: Any, path: str) -> ShapeError:
        return ShapeError(
            f"`{self.fun_name}`: {self.label(path)} is annotated `{_type_name(ann)}`, "
            f"but was given {describe_value(value)}, {no_array_in(value)}: the "
            f"annotation is not met, and its {names_str(dims)} would describe "
            f"nothing (only array leaves are mapped). {pass_an_array(value, path)}; "
            "or override the annotation with "
            f"{self.override} (`None` passes it through unchanged)."
        )

    def unresolved(self, ann: Unresolved, path: str) -> SpecError:
        return SpecError(
            f"`{self.fun_name}`: cannot resolve the annotation {ann.text!r} of "
            f"{self.label(path)} ({ann.error}). Define the names it uses at module "
            f"level, or override it with {self.override}."
        )


def _spec(ann: Any, value: Any, path: str, ctx: _Context) -> Any:
    """A pytree-prefix spec for `value` from its annotation `ann` (or `None`)."""
    if value is None:
        return None
    ann = _strip(ann)
    if isinstance(ann, Unresolved):
        raise ctx.unresolved(ann, path)
    members = _union_members(ann)
    if members is not None:
        arrays = [m for m in members if _is_array_type(m)]
        others = [m for m in members if not _is_array_type(m)]
        if arrays and (is_array(value) or not others):
            return _value_dims(arrays, ann, value, path, ctx)
        fitting = [m for m in others if _fits(m, value)]
        ann = fitting[0] if fitting else None
    if _is_array_type(ann):
        return _value_dims([ann], ann, value, path, ctx)
    if _is_pytree_type(ann):
        leaf = _strip(getattr(ann, "leaftype", None))
        leaf_members = _union_members(leaf)
        if leaf_members is None:
            leaf_members = [leaf]
        arrays = [m for m in leaf_members if _is_array_type(m)]
        if arrays and len(arrays) == len(leaf_members):
            return _value_dims(arrays, ann, value, path, ctx)
        ann = None
    if isinstance(value, eqx.Module):
        hints = class_hints(type(value))

        def field_annotation(key: Any) -> Any:
            return hints.get(key.name) if isinstance(key, jtu.GetAttrKey) else None

        return _children_spec(value, field_annotation, path, ctx)
    if isinstance(value, (tuple, list, dict)):
        return _children_spec(value, _element_annotation(ann, value), path, ctx)
    return None


def _fits(ann: Any, value: Any) -> bool:
    origin = get_origin(ann) or ann
    return isinstance(origin, type) and isinstance(value, origin)


def _element_annotation(ann: Any, value: Any) -> Callable[[Any], Any]:
    """The annotation of each child of a tuple, list or dict, by its key."""
    origin = get_origin(ann)
    args = get_args(ann)
    if isinstance(value, tuple) and origin is tuple and args:
        if len(args) == 2 and args[1] is Ellipsis:
            return lambda key: args[0]
        if len(args) == len(value):
            return lambda key: args[key.idx]
    elif isinstance(value, (tuple, list)) and origin in (list, Sequence):
        if len(args) == 1:
            return lambda key: args[0]
    elif isinstance(value, dict) and origin in (dict, Mapping) and len(args) == 2:
        return lambda key: args[1]
    return lambda key: None


def _children_spec(
    value: Any, annotation_of: Callable[[Any], Any], path: str, ctx: _Context
) -> Any:
    children, treedef = _one_level(value)
    specs = [
        _spec(annotation_of(key), child, path + jtu.keystr((key,)), ctx)
        for key, child in children
    ]
    if all(s is None for s in specs):
        return None
    return jtu.tree_unflatten(treedef, specs)


def _dims_or_raise(array_types: list[Any], ann: Any, path: str, ctx: _Context) -> Dims:
    dims = _array_dims(array_types)
    if isinstance(dims, str):
        raise ctx.unsupported(ann, path, dims)
    return dims


def _value_dims(
    array_types: list[Any], ann: Any, value: Any, path: str, ctx: _Context
) -> Dims:
    """The dims of a parameter annotated as an array, given `value`: a pytree with
    no array in it (a list of numbers) does not meet the annotation."""
    dims = _dims_or_raise(array_types, ann, path, ctx)
    if dims.names and holds_no_array(value):
        raise ctx.not_an_array(ann, dims, value, path)
    return dims


def _annotation_dims(
    ann: Any, ctx: _Context, path: str, depth: int = 0
) -> list[tuple[str, Dims, bool]]:
    """The dims of every array type in a (return) annotation, without a value:
    `(path, dims, certain)`, where `certain` is `False` for a member of a union
    (which may not be the type of the value)."""
    ann = _strip(ann)
    if depth > 20:
        return []
    if isinstance(ann, Unresolved):
        raise ctx.unresolved(ann, path)
    members = _union_members(ann)
    if members is not None:
        return [
            (p, d, False)
            for m in members
            for p, d, _ in _annotation_dims(m, ctx, path, depth + 1)
        ]
    if _is_array_type(ann):
        return [(path, _dims_or_raise([ann], ann, path, ctx), True)]
    if _is_pytree_type(ann):
        return _annotation_dims(getattr(ann, "leaftype", None), ctx, path, depth)
    if _is_module_type(ann):
        hints = class_hints(ann)
        return [
            found
            for f in dataclasses.fields(ann)
            if not f.metadata.get("static", False)
            for found in _annotation_dims(
                hints.get(f.name), ctx, f"{path}.{f.name}", depth + 1
            )
        ]
    if get_origin(ann) in (tuple, list, Sequence):
        return [
            found
            for i, a in enumerate(get_args(ann))
            if a is not Ellipsis
            for found in _annotation_dims(a, ctx, f"{path}[{i}]", depth + 1)
        ]
    return []


#
# The annotations of one function.
#


@dataclasses.dataclass
class FunAnnotations:
    """The resolved annotations of a mapped function."""

    hints: dict[str, Any]
    checker: str | None

    @property
    def has_return(self) -> bool:
        return "return" in self.hints

    def _in_ctx(self, fun_name: str, name: str, path: str) -> _Context:
        label = f"parameter `{name}`" if path == name else f"`{path}`"
        return _Context(fun_name, f"`in_dims={{{name!r}: ...}}`", label, path)

    def _out_ctx(self, fun_name: str) -> _Context:
        return _Context(fun_name, "`out_dims=...`", "the return value", "output")

    def in_dims_hook(
        self, fun_name: str, mapped: tuple[str, ...]
    ) -> Callable[[str, Any, str], Any]:
        """The `default_dims(param_name, value, path)` hook of `bind_call`."""

        def default_dims(name: str, value: Any, path: str) -> Any:
            ctx = self._in_ctx(fun_name, name, path)
            spec = _spec(self.hints.get(name), value, path, ctx)
            self._check_no_checker_inside(fun_name, ctx.top_label, spec, mapped)
            return spec

        return default_dims

    def out_leaf_dims(self, fun_name: str) -> list[tuple[str, Dims, bool]]:
        """The dims of every array type in the return annotation, by output path
        (see `_annotation_dims`)."""
        if not self.has_return:
            return []
        return _annotation_dims(self.hints["return"], self._out_ctx(fun_name), "output")

    def out_names(self, fun_name: str) -> tuple[str, ...]:
        """The dim names of the return annotation, in order."""
        names = (n for _, dims, _ in self.out_leaf_dims(fun_name) for n in dims.names)
        return tuple(dict.fromkeys(names))

    def out_dims(
        self, fun_name: str, mapped: tuple[str, ...]
    ) -> "OutAnnotation | None":
        """The `out_dims` from the return annotation, if there is one."""
        if not self.has_return:
            return None
        names = self.out_names(fun_name)
        if self.checker is not None and set(names).intersection(mapped):
            self._raise_checker_inside(fun_name, "the return value", names, mapped)
        return OutAnnotation(self.hints["return"], self._out_ctx(fun_name), mapped)

    def _check_no_checker_inside(
        self, fun_name: str, label: str, spec: Any, mapped: tuple[str, ...]
    ) -> None:
        if self.checker is None:
            return
        names = _spec_names(spec)
        if set(names).intersection(mapped):
            self._raise_checker_inside(fun_name, label, names, mapped)

    def _raise_checker_inside(
        self, fun_name: str, label: str, names: Any, mapped: tuple[str, ...]
    ) -> None:
        dropped = [n for n in mapped if n in names]
        what = "dim" if len(dropped) == 1 else "dims"
        raise SpecError(
            MSG_CHECKER_INSIDE.format(
                fun_name=fun_name,
                checker=self.checker,
                label=label,
                dropped=f"{what} " + ", ".join(repr(n) for n in dropped),
            )
        )


MSG_CHECKER_INSIDE = """`{fun_name}`: the function is wrapped in `@{checker}` inside \
`@filter_multi_vmap`, but the annotation of {label} names the mapped \
{dropped}. Annotations describe the full, batched shapes that the caller passes, \
while the function body only sees one element, without the mapped dims, so the type \
checker would reject every call. Put the type checker outside (above) \
`@filter_multi_vmap`:

    @jaxtyped(typechecker=beartype)
    @filter_multi_vmap(...)
    def f(...): ...

or, to check per-element annotations inside, give every mapped argument and the \
output explicit `in_dims` and `out_dims`."""


@dataclasses.dataclass(frozen=True)
class OutAnnotation:
    """`out_dims` from a return annotation, built from the body's output when traced.

    Array outputs that the annotation gives no dims get the default `out_dims` (the
    mapped dims, then `...`).
    """

    hint: Any
    ctx: _Context
    mapped: tuple[str, ...]

    def resolve(self, out: Any, default_out: Dims) -> Any:
        """A spec tree (of `LeafSpec`s) for the body's per-element output `out`."""
        ctx = self.ctx
        spec = _spec(self.hint, out, "output", ctx)
        leaf_specs = broadcast_spec(
            spec, out, f"`{ctx.fun_name}`: the return annotation"
        )
        paths_and_leaves, treedef = jtu.tree_flatten_with_path(out)
        full = []
        for (path, leaf), leaf_spec in zip(paths_and_leaves, leaf_specs):
            dims = leaf_spec.dims
            if is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct):
                where = "output" + jtu.keystr(path)
                if dims is None:
                    leaf_spec = LeafSpec(default_out)
                else:
                    self._check_leaf(where, leaf, dims)
            full.append(leaf_spec)
        return jtu.tree_unflatten(treedef, full)

    def _check_leaf(self, where: str, leaf: Any, dims: Dims) -> None:
        if not dtype_matches(leaf, dims):
            raise ShapeError(
                f"`{self.ctx.fun_name}`: the function body returned `{where}` with "
                f"dtype {leaf.dtype}, but the return annotation asks for "
                f"{dims.dtype_desc}[..., {dims.source!r}]."
            )


_fun_cache: "weakref.WeakKeyDictionary[Any, FunAnnotations]" = (
    weakref.WeakKeyDictionary()
)


def fun_annotations(fun: Callable) -> FunAnnotations:
    """The annotations of `fun`, resolved at the first call.

    Cached for plain functions, which hash by identity. (A callable `eqx.Module` hashes
    by its fields, which may be unhashable or traced, so it is not cached.)
    """
    cacheable = isinstance(fun, types.FunctionType)
    if cacheable and fun in _fun_cache:
        return _fun_cache[fun]
    hints, complete = fun_hints(fun)
    out = FunAnnotations(hints, checker_inside(fun))
    if cacheable and complete:
        _fun_cache[fun] = out
    return out
