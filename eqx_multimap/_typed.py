"""Dims from jaxtyping annotations: parameters, return values and typed containers.

An annotation such as `Float[Array, "T F"]` describes the *whole* (batched) shape
that the caller passes, exactly as a dims string does, plus a dtype constraint. A
typed container gives the dims of its children from its field annotations, at any
depth: an `eqx.Module`, a dataclass, a `NamedTuple` or a `TypedDict` (as parameters,
and in returns). Their core dims are scoped to the instance (`Dims.scope`), as
jaxtyping checks a dataclass's fields in its own `__init__`. `tuple[...]`,
`list[...]`, `dict[str, ...]` and `PyTree[...]` annotate their elements in the
function's scope.

[`fun_annotations`][] gives, for each parameter, a spec built from its annotation
*and* its value at call time ([`spec`][]), and for the return value an
[`OutAnnotation`][] that builds the `out_dims` from the body's output while it is
traced. A value whose fields cannot be read (a pytree class of another kind, or a
dataclass that is no pytree) but whose class annotates a mapped dim raises a
`SpecError` saying what to write instead; unannotated fields are passed whole. The
hints themselves are read by `_hints`.
"""

import dataclasses
import functools as ft
import types
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, get_args, get_origin

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
    no_array_in,
    pass_an_array,
)
from ._check import dtype_matches, fits_dims
from ._dims import Dims, parse_dims
from ._errors import ShapeError, SpecError
from ._hints import (
    checker_inside,
    class_hints,
    element_annotation,
    field_names,
    fits_type,
    fun_hints,
    has_fields,
    is_typeddict,
    strip,
    union_members,
    Unresolved,
)
from ._text import names_str


traceback_util.register_exclusion(__file__)


def _is_array_type(ann: Any) -> bool:
    return isinstance(ann, type) and issubclass(ann, AbstractArray)


def _is_pytree_type(ann: Any) -> bool:
    return isinstance(ann, type) and issubclass(ann, PyTree) and ann is not PyTree


#
# Dims strings of jaxtyping array types.
#


@ft.lru_cache(maxsize=1024)
def _translate(dim_str: str) -> Dims | str:
    """The `Dims` of a jaxtyping dim string (one syntax with dims strings), or the
    reason it is not supported."""
    try:
        return parse_dims(dim_str)
    except SpecError as e:
        reason = str(e).split(": ", 1)[-1].rstrip(".")
        return "its " + reason if reason.startswith("dim ") else reason


def _array_dims(array_types: list[Any]) -> Dims | list[Dims] | str:
    """The `Dims` (with dtypes) of one array type, or of a union of several: a list
    of each member's when they have different dims; or the reason they are not
    supported."""
    dim_strs = list(dict.fromkeys(t.dim_str for t in array_types))
    if len(dim_strs) > 1:
        out = []
        for dim_str in dim_strs:
            dims = _array_dims([t for t in array_types if t.dim_str == dim_str])
            if isinstance(dims, str):
                return dims
            assert isinstance(dims, Dims)
            out.append(dims)
        return out
    dims = _translate(dim_strs[0])
    if isinstance(dims, str):
        return dims
    # `Shaped` (any dtype), or a custom dtype given by a regex: not checked here (a
    # type checker around the call still checks a regex).
    if not all(
        isinstance(t.dtypes, (tuple, list))
        and all(isinstance(d, str) for d in t.dtypes)
        for t in array_types
    ):
        return dims
    dtypes = frozenset(d for t in array_types for d in t.dtypes)
    desc = " | ".join(dict.fromkeys(t.dtype.__name__ for t in array_types))
    return dims.with_dtypes(dtypes, desc)


def _type_name(ann: Any) -> str:
    if _is_array_type(ann):
        array = getattr(ann.array_type, "__name__", None) or repr(ann.array_type)
        array = array.rsplit(".", 1)[-1]  # `jax.Array.__name__` is "jaxlib._jax.Array"
        return f"{ann.dtype.__name__}[{array}, {ann.dim_str!r}]"
    return getattr(ann, "__name__", None) or repr(ann)


#
# Building spec trees.
#


def _one_level(value: Any) -> tuple[list[tuple[Any, Any]], Any]:
    children, treedef = jtu.tree_flatten_with_path(
        value, is_leaf=lambda y: y is not value
    )
    return [(path[0], child) for path, child in children], treedef


def spec_names(spec: Any) -> list[str]:
    """The dim names in a spec tree, in order."""
    names: list[str] = []
    for leaf in jtu.tree_leaves(spec, is_leaf=lambda x: isinstance(x, Dims)):
        if isinstance(leaf, Dims):
            names.extend(n for n in leaf.names if n not in names)
    return names


def is_arrayish(x: Any) -> bool:
    """An array, or (in the body's traced output) a `ShapeDtypeStruct`."""
    return is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


@dataclasses.dataclass(frozen=True)
class Context:
    """Where a spec is being built, for error messages.

    `mapped` are the mapped dims; `output` is whether the value is the body's
    output on one element (its arrays `ShapeDtypeStruct`s without the mapped dims).
    """

    fun_name: str
    override: str  # e.g. "`in_dims={'vis': ...}`"
    top_label: str  # e.g. "parameter `vis`" or "the return value"
    top_path: str
    mapped: tuple[str, ...] = ()
    output: bool = False

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
            f"annotation is not met, and its {names_str(dims.names)} would describe "
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


def spec(
    ann: Any, value: Any, path: str, ctx: Context, scope: str | None = None
) -> Any:
    """A pytree-prefix spec for `value` from its annotation `ann` (or `None`).

    `scope` is the path of the innermost typed container around `value`, whose
    core dims are checked within it (`Dims.scope`).
    """
    if value is None:
        return None
    ann = strip(ann)
    if isinstance(ann, Unresolved):
        raise ctx.unresolved(ann, path)
    members = union_members(ann)
    if members is not None:
        arrays = [m for m in members if _is_array_type(m)]
        others = [m for m in members if not _is_array_type(m)]
        if arrays and (is_arrayish(value) or not others):
            return _value_dims(arrays, ann, value, path, ctx, scope)
        fitting = [m for m in others if fits_type(m, value)]
        ann = fitting[0] if fitting else None
    if _is_array_type(ann):
        return _value_dims([ann], ann, value, path, ctx, scope)
    if _is_pytree_type(ann):
        leaf = strip(getattr(ann, "leaftype", None))
        leaf_members = union_members(leaf)
        if leaf_members is None:
            leaf_members = [leaf]
        arrays = [m for m in leaf_members if _is_array_type(m)]
        if arrays and len(arrays) == len(leaf_members):
            return _value_dims(arrays, ann, value, path, ctx, scope)
        ann = None
    fields = _field_annotation(ann, value)
    if fields is not None:
        return _children_spec(value, fields, path, ctx, path)
    if isinstance(value, (tuple, list, dict)):
        elements = element_annotation(ann, value)
        return _children_spec(value, elements, path, ctx, scope)
    _check_readable(value, path, ctx)
    return None


def _field_annotation(ann: Any, value: Any) -> Callable[[Any], Any] | None:
    """The annotation of each field of a typed container, by its key; `None` if
    `value` is not one (a tuple annotated `tuple[...]` is read as a tuple)."""
    if is_typeddict(ann) and isinstance(value, dict):
        hints = class_hints(ann)
        return lambda key: hints.get(getattr(key, "key", None))
    if not has_fields(type(value)) or _is_leaf(value):
        return None
    if isinstance(value, tuple) and get_origin(ann) is tuple and get_args(ann):
        return None
    children, _ = _one_level(value)
    if not all(isinstance(key, jtu.GetAttrKey) for key, _ in children):
        return None  # flattened without field names: `_check_readable` decides
    hints = class_hints(type(value))
    return lambda key: hints.get(key.name) if isinstance(key, jtu.GetAttrKey) else None


def _is_leaf(value: Any) -> bool:
    return jtu.treedef_is_leaf(jtu.tree_structure(value))


def _children_spec(
    value: Any,
    annotation_of: Callable[[Any], Any],
    path: str,
    ctx: Context,
    scope: str | None,
) -> Any:
    children, treedef = _one_level(value)
    specs = [
        spec(annotation_of(key), child, path + jtu.keystr((key,)), ctx, scope)
        for key, child in children
    ]
    if all(s is None for s in specs):
        return None
    return jtu.tree_unflatten(treedef, specs)


def _check_readable(value: Any, path: str, ctx: Context) -> None:
    """A value that is passed whole, although its class annotates a mapped dim:
    a pytree of a kind whose fields cannot be read, or a dataclass (or another
    annotated class) that is not a pytree, whose arrays `jax` cannot see."""
    if is_arrayish(value) or isinstance(value, (str, bytes, int, float, complex)):
        return
    cls = type(value)
    try:
        hints = class_hints(cls)
    except Exception:
        return
    named = [
        (field, name)
        for field, ann in hints.items()
        for _, dims, _ in _safe_annotation_dims(ann)
        for name in dims.names
        if name in ctx.mapped
    ]
    if not named:
        return
    field, name = named[0]
    if _is_leaf(value):
        why = (
            "is not a pytree, so JAX cannot see its arrays. Register it "
            "(`jax.tree_util.register_dataclass`) or make it an `eqx.Module`"
        )
    else:
        why = (
            "is a pytree whose children cannot be matched to its fields. Make it "
            "an `eqx.Module`, a dataclass or a `NamedTuple`"
        )
    raise SpecError(
        f"`{ctx.fun_name}`: {ctx.label(path)} is a `{cls.__name__}`, whose field "
        f"`{field}` is annotated with the mapped dim '{name}', but `{cls.__name__}` "
        f"{why}; or give its dims with {ctx.override}."
    )


def _safe_annotation_dims(ann: Any) -> list[tuple[str, Dims, bool]]:
    try:
        return annotation_dims(ann, Context("", "", "", ""), "")
    except SpecError:
        return []


def _dims_or_raise(
    array_types: list[Any], ann: Any, path: str, ctx: Context
) -> Dims | list[Dims]:
    dims = _array_dims(array_types)
    if isinstance(dims, str):
        raise ctx.unsupported(ann, path, dims)
    return dims


def _value_dims(
    array_types: list[Any],
    ann: Any,
    value: Any,
    path: str,
    ctx: Context,
    scope: str | None,
) -> Dims:
    """The dims of a value annotated as an array, given `value`: a pytree with no
    array in it (a list of numbers) does not meet the annotation. Of a union of
    array types with different dims, those of the member that `value` meets."""
    dims = _dims_or_raise(array_types, ann, path, ctx)
    if isinstance(dims, list):
        dims = _pick_member(dims, ann, value, path, ctx)
    if dims.names and not ctx.output and holds_no_array(value):
        raise ctx.not_an_array(ann, dims, value, path)
    return dims.scoped(scope)


def _pick_member(
    candidates: list[Dims], ann: Any, value: Any, path: str, ctx: Context
) -> Dims:
    """Of a union's array types with different dims, the member that `value` (an
    array) meets, as jaxtyping reads a union: `PRNGKeyArray` is a typed key of
    shape `()` or a `uint32` key of shape `(2,)`."""
    if not is_arrayish(value):
        sources = ", ".join(repr(d.source) for d in candidates)
        raise ctx.unsupported(
            ann,
            path,
            f"it is a union of array types with different dims ({sources}), and "
            f"was given {describe_value(value)}, which is not one array",
        )
    met = [
        d
        for d in candidates
        if fits_dims(value, d, sum(n in ctx.mapped for n in d.names) * ctx.output)
    ]
    named = {d.names for d in met}
    if len(named) > 1:
        sources = ", ".join(repr(d.source) for d in met)
        raise ctx.unsupported(
            ann,
            path,
            f"the value meets several of its members, with different dims "
            f"({sources}), so which dims are mapped is ambiguous",
        )
    return met[0] if met else candidates[0]


def annotation_dims(
    ann: Any, ctx: Context, path: str, depth: int = 0
) -> list[tuple[str, Dims, bool]]:
    """The dims of every array type in a (return) annotation, without a value:
    `(path, dims, certain)`, where `certain` is `False` for a member of a union
    (which may not be the type of the value)."""
    ann = strip(ann)
    if depth > 20:
        return []
    if isinstance(ann, Unresolved):
        raise ctx.unresolved(ann, path)
    members = union_members(ann)
    if members is not None:
        return [
            (p, d, False)
            for m in members
            for p, d, _ in annotation_dims(m, ctx, path, depth + 1)
        ]
    if _is_array_type(ann):
        dims = _dims_or_raise([ann], ann, path, ctx)
        assert isinstance(dims, Dims)
        return [(path, dims, True)]
    if _is_pytree_type(ann):
        return annotation_dims(getattr(ann, "leaftype", None), ctx, path, depth)
    if is_typeddict(ann) or has_fields(ann):
        hints = class_hints(ann)
        typed_dict = is_typeddict(ann)
        return [
            found
            for name in field_names(ann)
            for found in annotation_dims(
                hints.get(name),
                ctx,
                f"{path}[{name!r}]" if typed_dict else f"{path}.{name}",
                depth + 1,
            )
        ]
    origin, args = get_origin(ann), get_args(ann)
    if origin in (dict, Mapping) and len(args) == 2:
        return annotation_dims(args[1], ctx, f"{path}[...]", depth + 1)
    if origin in (tuple, list, Sequence):
        return [
            found
            for i, a in enumerate(args)
            if a is not Ellipsis
            for found in annotation_dims(a, ctx, f"{path}[{i}]", depth + 1)
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

    def _out_ctx(self, fun_name: str, mapped: tuple[str, ...] = ()) -> Context:
        return Context(
            fun_name, "`out_dims=...`", "the return value", "output", mapped, True
        )

    def in_dims_hook(
        self, fun_name: str, mapped: tuple[str, ...]
    ) -> Callable[[str, Any, str], Any]:
        """The `default_dims(param_name, value, path)` hook of `bind_call`."""

        def default_dims(name: str, value: Any, path: str) -> Any:
            label = f"parameter `{name}`" if path == name else f"`{path}`"
            override = f"`in_dims={{{name!r}: ...}}`"
            ctx = Context(fun_name, override, label, path, mapped)
            out = spec(self.hints.get(name), value, path, ctx)
            self._no_checker_inside(fun_name, label, spec_names(out), mapped)
            return out

        return default_dims

    def out_leaf_dims(self, fun_name: str) -> list[tuple[str, Dims, bool]]:
        """The dims of every array type in the return annotation, by output path
        (see `annotation_dims`)."""
        if not self.has_return:
            return []
        return annotation_dims(self.hints["return"], self._out_ctx(fun_name), "output")

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
        self._no_checker_inside(fun_name, "the return value", names, mapped)
        ctx = self._out_ctx(fun_name, mapped)
        return OutAnnotation(self.hints["return"], ctx)

    def _no_checker_inside(
        self, fun_name: str, label: str, names: Any, mapped: tuple[str, ...]
    ) -> None:
        """A type checker inside would check batched annotations on one element."""
        dropped = [n for n in mapped if n in names]
        if self.checker is None or not dropped:
            return
        raise SpecError(
            MSG_CHECKER_INSIDE.format(
                fun_name=fun_name,
                checker=self.checker,
                label=label,
                dropped=names_str(dropped),
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
    ctx: Context

    def resolve(self, out: Any, default_out: Dims) -> Any:
        """A spec tree (of `LeafSpec`s) for the body's per-element output `out`."""
        ctx = self.ctx
        tree = spec(self.hint, out, "output", ctx)
        leaf_specs = broadcast_spec(
            tree, out, f"`{ctx.fun_name}`: the return annotation"
        )
        paths_and_leaves, treedef = jtu.tree_flatten_with_path(out)
        full = []
        for (path, leaf), leaf_spec in zip(paths_and_leaves, leaf_specs):
            if is_arrayish(leaf):
                dims = leaf_spec.dims
                if dims is None:
                    leaf_spec = LeafSpec(default_out)
                elif not dtype_matches(leaf, dims):
                    raise ShapeError(
                        f"`{ctx.fun_name}`: the function body returned "
                        f"`output{jtu.keystr(path)}` with dtype {leaf.dtype}, but "
                        "the return annotation asks for "
                        f"{dims.dtype_desc}[..., {dims.source!r}]."
                    )
            full.append(leaf_spec)
        return jtu.tree_unflatten(treedef, full)


_fun_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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
