"""Reading the type hints of a function or a class, for `_typed`.

Hints are read with `typing.get_type_hints(..., include_extras=True)` (lazily, at the
first call, so that forward references and `from __future__ import annotations`
work), falling back to evaluating each string annotation on its own, in the
function's globals and closure or the class's module and namespace. A string that
cannot be evaluated becomes an `Unresolved`, which `_typed` reports only if
the parameter or field it annotates is mapped.

It also tells typed containers apart (`eqx.Module`s, dataclasses, `NamedTuple`s,
`TypedDict`s), whose fields' annotations give the dims of their children, and reads
typing forms: `Annotated[X, ...]`, unions, and the annotation of each element of a
`tuple[...]`, `list[...]` or `dict[str, ...]`.
"""

import dataclasses
import functools as ft
import inspect
import sys
import types
import typing
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, get_args, get_origin

from jax._src import traceback_util


traceback_util.register_exclusion(__file__)


@dataclasses.dataclass(frozen=True)
class Unresolved:
    """A string annotation that could not be evaluated."""

    text: str
    error: str


def _closure_ns(fun: Any) -> dict[str, Any]:
    code = getattr(fun, "__code__", None)
    cells = getattr(fun, "__closure__", None) or ()
    out = {}
    if code is not None:
        for name, cell in zip(code.co_freevars, cells):
            try:
                out[name] = cell.cell_contents
            except ValueError:  # an empty cell
                pass
    return out


def _eval_each(raw: Mapping[str, Any], globalns: dict, localns: dict) -> dict:
    out = {}
    for name, ann in raw.items():
        if isinstance(ann, str):
            try:
                ann = eval(ann, globalns, localns)
            except Exception as e:
                ann = Unresolved(ann, f"{type(e).__name__}: {e}")
        out[name] = ann
    return out


def _hint_target(fun: Any) -> Any:
    """The function whose annotations describe the parameters of `fun`."""
    if isinstance(fun, ft.partial):
        return _hint_target(fun.func)
    try:
        unwrapped = inspect.unwrap(fun)
    except ValueError:  # a `__wrapped__` cycle
        unwrapped = fun
    if inspect.isroutine(fun) or inspect.isroutine(unwrapped):
        return fun
    if isinstance(fun, type):
        return fun.__init__
    call = getattr(type(fun), "__call__", None)
    return fun if call is None else call


def fun_hints(fun: Any) -> tuple[dict[str, Any], bool]:
    """The resolved hints of `fun`, and whether all of them could be resolved."""
    target = _hint_target(fun)
    no_type_check = getattr(inspect.unwrap(target), "__no_type_check__", False)
    try:
        # `typing.get_type_hints` returns `{}` under `@typing.no_type_check`, which
        # opts out of type *checking* (the jaxtyping import hook's), not of dims.
        if not no_type_check:
            return typing.get_type_hints(target, include_extras=True), True
    except Exception:
        pass
    raw = getattr(target, "__annotations__", None)
    if not isinstance(raw, Mapping):
        return {}, True
    inner = inspect.unwrap(target)
    globalns = getattr(inner, "__globals__", {})
    hints = _eval_each(raw, globalns, _closure_ns(inner))
    return hints, not any(isinstance(h, Unresolved) for h in hints.values())


_class_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def class_hints(cls: type) -> dict[str, Any]:
    """The resolved field annotations of a class, through its MRO."""
    if cls in _class_cache:
        return _class_cache[cls]
    complete = True
    try:
        hints = typing.get_type_hints(cls, include_extras=True)
    except Exception:
        hints = {}
        for base in reversed(cls.__mro__):
            raw = base.__dict__.get("__annotations__", {})
            module = sys.modules.get(base.__module__)
            globalns = dict(vars(module)) if module is not None else {}
            hints.update(_eval_each(raw, globalns, dict(vars(base))))
        complete = not any(isinstance(h, Unresolved) for h in hints.values())
    if complete:
        _class_cache[cls] = hints
    return hints


def checker_inside(fun: Any) -> str | None:
    """The runtime type checker that `fun` is already wrapped in, if any."""
    seen = 0
    f = fun
    while f is not None and seen < 100:
        try:
            globals_name = getattr(f, "__globals__", {}).get("__name__")
        except Exception:
            globals_name = None
        if globals_name == "jaxtyping._decorator":
            return "jaxtyped"
        if getattr(f, "__beartype_wrapper", False):
            return "beartype"
        f = getattr(f, "__wrapped__", None)
        seen += 1
    return None


#
# The fields of typed containers.
#


def is_typeddict(ann: Any) -> bool:
    return isinstance(ann, type) and typing.is_typeddict(ann)


def is_namedtuple_type(ann: Any) -> bool:
    return (
        isinstance(ann, type)
        and issubclass(ann, tuple)
        and isinstance(getattr(ann, "_fields", None), tuple)
    )


def has_fields(cls: Any) -> bool:
    """Whether instances of `cls` are typed containers whose children are fields
    named by attribute: an `eqx.Module`, a dataclass or a `NamedTuple`."""
    return isinstance(cls, type) and (
        dataclasses.is_dataclass(cls) or is_namedtuple_type(cls)
    )


def field_names(cls: type) -> list[str]:
    """The fields of a typed container class that hold data (not static ones)."""
    if is_namedtuple_type(cls):
        return list(cls._fields)
    if is_typeddict(cls):
        return list(class_hints(cls))
    return [
        f.name for f in dataclasses.fields(cls) if not f.metadata.get("static", False)
    ]


#
# Typing forms.
#

_UNION_TYPES: tuple[Any, ...] = (typing.Union, types.UnionType)


def strip(ann: Any) -> Any:
    """`Annotated[X, ...]` -> `X`."""
    while get_origin(ann) is typing.Annotated:
        ann = get_args(ann)[0]
    return ann


def union_members(ann: Any) -> list[Any] | None:
    """The members of a union but `None`, or `None` if `ann` is not a union."""
    if get_origin(ann) in _UNION_TYPES:
        return [strip(m) for m in get_args(ann) if m is not type(None)]
    return None


def fits_type(ann: Any, value: Any) -> bool:
    """Whether `value` is an instance of `ann` (of its origin, if generic)."""
    if is_typeddict(ann):
        return isinstance(value, dict)
    origin = get_origin(ann) or ann
    return isinstance(origin, type) and isinstance(value, origin)


def element_annotation(ann: Any, value: Any) -> Callable[[Any], Any]:
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
