"""Dims from jaxtyping annotations: parameters, return values and typed containers.

An annotation such as `Float[Array, "T F B 2 2"]` describes the *whole* (batched)
shape that the caller passes, exactly as a dims string does, plus a dtype constraint.
This module turns the annotations of a function into the pytree-prefix specs that the
core understands:

- for each parameter, a spec built from its annotation *and* its value at call time
  (`_typed.spec`: an `eqx.Module`, dataclass, `NamedTuple` or `TypedDict` argument
  gets a spec tree from its field annotations, at any depth);
- for the return value, an [`OutAnnotation`][] that builds the `out_dims` from the
  body's actual output while it is traced (needed for typed container returns).

The hints themselves are read by `_hints`, lazily at the first call (so that forward
references and `from __future__ import annotations` work).
"""

import dataclasses
import types
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.tree_util as jtu
from jax._src import traceback_util

from ._args import broadcast_spec, is_array, LeafSpec
from ._check import dtype_matches
from ._dims import Dims
from ._errors import ShapeError, SpecError
from ._hints import checker_inside, fun_hints
from ._typed import annotation_dims, Context, spec, spec_names


traceback_util.register_exclusion(__file__)


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

    def _in_ctx(
        self, fun_name: str, name: str, path: str, mapped: tuple[str, ...]
    ) -> Context:
        label = f"parameter `{name}`" if path == name else f"`{path}`"
        override = f"`in_dims={{{name!r}: ...}}`"
        return Context(fun_name, override, label, path, mapped)

    def _out_ctx(self, fun_name: str, mapped: tuple[str, ...] = ()) -> Context:
        return Context(
            fun_name, "`out_dims=...`", "the return value", "output", mapped, True
        )

    def in_dims_hook(
        self, fun_name: str, mapped: tuple[str, ...]
    ) -> Callable[[str, Any, str], Any]:
        """The `default_dims(param_name, value, path)` hook of `bind_call`."""

        def default_dims(name: str, value: Any, path: str) -> Any:
            ctx = self._in_ctx(fun_name, name, path, mapped)
            out = spec(self.hints.get(name), value, path, ctx)
            self._check_no_checker_inside(fun_name, ctx.top_label, out, mapped)
            return out

        return default_dims

    def out_leaf_dims(self, fun_name: str) -> list[tuple[str, Dims, bool]]:
        """The dims of every array type in the return annotation, by output path
        (see `_annotation_dims`)."""
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
        if self.checker is not None and set(names).intersection(mapped):
            self._raise_checker_inside(fun_name, "the return value", names, mapped)
        ctx = self._out_ctx(fun_name, mapped)
        return OutAnnotation(self.hints["return"], ctx, mapped)

    def _check_no_checker_inside(
        self, fun_name: str, label: str, tree: Any, mapped: tuple[str, ...]
    ) -> None:
        if self.checker is None:
            return
        names = spec_names(tree)
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
    ctx: Context
    mapped: tuple[str, ...]

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
