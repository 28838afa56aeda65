"""Binding a call's arguments to dims specs, leaf by leaf, with user-facing paths."""

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.tree_util as jtu

from ._dims import Dims, parse_dims
from ._errors import SpecError


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """A dims spec placed at one leaf; not a pytree, so it survives `tree_map`.

    `direct` is whether the spec was given for this very leaf, rather than as a
    prefix of a pytree around it (whose non-array leaves then pass through).
    """

    dims: Dims | None
    direct: bool = True


def is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, (str, Dims, LeafSpec))


def to_leaf_spec(spec: Any, where: str) -> LeafSpec:
    if isinstance(spec, LeafSpec):
        return spec
    if spec is None:
        return LeafSpec(None)
    if isinstance(spec, Dims):
        return LeafSpec(spec)
    if isinstance(spec, str):
        return LeafSpec(parse_dims(spec))
    raise SpecError(
        f"{where} must be a dims string such as 'T F B', or `None`, but got {spec!r} "
        f"of type `{type(spec).__name__}`."
    )


def broadcast_spec(
    spec: Any, value: Any, where: str, name: str = "value"
) -> list[LeafSpec]:
    """One `LeafSpec` per leaf of `value`, from a spec that is a prefix of `value`.

    `name` is how `value` is called in errors (`x`, `output`): JAX's prefix error
    names the mismatching key path relative to it.
    """

    def _fill(s, sub):
        leaf_spec = to_leaf_spec(s, where)
        if not jtu.treedef_is_leaf(jtu.tree_structure(sub)):
            leaf_spec = dataclasses.replace(leaf_spec, direct=False)
        return jtu.tree_map(lambda _: leaf_spec, sub)

    try:
        full = jtu.tree_map(_fill, spec, value, is_leaf=is_spec_leaf)
    except SpecError:
        raise
    except (ValueError, TypeError) as e:
        # JAX calls the root of the key path "tree_map tree"; use the user's name.
        detail = str(e).replace("the prefix pytree tree_map tree", "the spec")
        detail = detail.replace("the full pytree", f"`{name}`")
        detail = detail.replace("tree_map tree", name)
        detail = detail.replace("pytree structure error: ", "").strip()
        hint = ""
        if "different types" in detail and isinstance(spec, dict):
            hint = (
                " A dict spec only fits a dict; for the fields of another pytree "
                "(such as an `equinox.Module`) give a spec of the same type, or one "
                "dims string (or `None`) for the whole value."
            )
        raise SpecError(
            f"{where} must be a dims string, `None`, or a pytree prefix of `{name}` "
            f"(with dims strings at its leaves); but the spec {spec!r} does not fit "
            f"its structure {jtu.tree_structure(value)}: {detail}{hint}"
        ) from None
    return jtu.tree_leaves(full, is_leaf=lambda x: isinstance(x, LeafSpec))


@dataclasses.dataclass(frozen=True)
class InLeaf:
    path: str
    value: Any
    spec: LeafSpec


@dataclasses.dataclass
class BoundCall:
    """A call split into leaves, with the means to rebuild it from new leaves."""

    treedef: Any
    leaves: list[InLeaf]

    def rebuild(self, values: list[Any]) -> tuple[tuple, dict]:
        args, kwargs = jtu.tree_unflatten(self.treedef, values)
        return args, kwargs


def _signature(fun: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(fun)
    except (TypeError, ValueError):
        return None


def bind_call(
    fun: Callable,
    fun_name: str,
    args: tuple,
    kwargs: dict,
    in_dims: Any,
    default_dims: Callable[[str, Any, str], Any] | None = None,
) -> BoundCall:
    """Split `fun(*args, **kwargs)` into leaves with the dims spec of each.

    `in_dims` is `None`, a dims string (for every argument), a tuple or list (one
    entry per positional argument) or a dict by parameter name (keyword-only and
    `**kwargs` entries included). `default_dims(param_name, value, path)`, if
    given, supplies a spec for arguments that `in_dims` does not mention (used for
    annotations); `path` is the argument as errors name it (`kwargs['nu']`).
    """
    sig = _signature(fun)
    var_pos = var_kw = None
    param_names: list[str] = []
    if sig is not None:
        for p in sig.parameters.values():
            if p.kind is p.VAR_POSITIONAL:
                var_pos = p.name
            elif p.kind is p.VAR_KEYWORD:
                var_kw = p.name
            else:
                param_names.append(p.name)
        try:
            sig.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(
                f"`{fun_name}` was called with bad arguments: {e}"
            ) from None
        positional = [
            p.name
            for p in sig.parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    else:
        positional = []

    def arg_name(i: int) -> str:
        if i < len(positional):
            return positional[i]
        if var_pos is not None:
            return f"{var_pos}[{i - len(positional)}]"
        return f"args[{i}]"

    def kwarg_name(k: str) -> tuple[str, bool]:
        if k in param_names:
            return k, True
        return f"{var_kw or 'kwargs'}[{k!r}]", False

    # One spec per argument.
    unset = object()
    arg_specs: list[Any] = [unset] * len(args)
    kw_specs: dict[str, Any] = {k: unset for k in kwargs}
    if in_dims is None:
        pass
    elif isinstance(in_dims, (str, Dims)):
        arg_specs = [in_dims] * len(args)
        kw_specs = {k: in_dims for k in kwargs}
    elif isinstance(in_dims, (tuple, list)):
        if len(in_dims) != len(args):
            raise SpecError(
                f"`{fun_name}`: `in_dims` has {len(in_dims)} entries, one per "
                f"positional argument, but the function was called with {len(args)} "
                "positional arguments. Use a dict of `in_dims` by parameter name to "
                "give dims for keyword arguments."
            )
        arg_specs = list(in_dims)
    elif isinstance(in_dims, dict):
        used = set()
        for i in range(len(args)):
            name = positional[i] if i < len(positional) else None
            if name is not None and name in in_dims:
                arg_specs[i] = in_dims[name]
                used.add(name)
        # `*args` by its name: one spec for every extra positional argument, or a
        # tuple/list with one entry per extra positional argument.
        var_pos_spec = in_dims.get(var_pos, unset) if var_pos is not None else unset
        n_extra = len(args) - len(positional)
        if var_pos_spec is not unset:
            used.add(var_pos)
            if isinstance(var_pos_spec, (tuple, list)):
                if len(var_pos_spec) != n_extra:
                    raise SpecError(
                        f"`{fun_name}`: `in_dims[{var_pos!r}]` has "
                        f"{len(var_pos_spec)} entries, one per argument of "
                        f"`*{var_pos}`, but the function was called with {n_extra}."
                    )
                extra = list(var_pos_spec)
            else:
                extra = [var_pos_spec] * n_extra
            for j, s in enumerate(extra):
                arg_specs[len(positional) + j] = s
        var_kw_spec = in_dims.get(var_kw, unset) if var_kw is not None else unset
        if var_kw_spec is not unset:
            used.add(var_kw)
        for k in kwargs:
            if k in in_dims:
                kw_specs[k] = in_dims[k]
                used.add(k)
            elif k not in param_names and var_kw_spec is not unset:
                if isinstance(var_kw_spec, dict):
                    if k in var_kw_spec:
                        kw_specs[k] = var_kw_spec[k]
                else:
                    kw_specs[k] = var_kw_spec
        known = set(param_names) | {n for n in (var_pos, var_kw) if n is not None}
        unknown = [k for k in in_dims if k not in used and k not in known]
        if sig is not None and var_kw is None and unknown:
            all_params = tuple(sig.parameters)
            raise SpecError(
                f"`{fun_name}`: the following `in_dims` keys did not correspond to any "
                f"parameter: {tuple(unknown)}. The parameters are {all_params}."
            )
    else:
        raise SpecError(
            f"`{fun_name}`: `in_dims` must be `None`, a dims string, a tuple with one "
            "entry per positional argument, or a dict by parameter name; but got "
            f"{in_dims!r} of type `{type(in_dims).__name__}`."
        )

    names = [arg_name(i) for i in range(len(args))]
    kw_names = {k: kwarg_name(k)[0] for k in kwargs}
    pieces: list[tuple[str, Any, Any]] = []
    # An annotation of `*args` or `**kwargs` is that of each of their entries.
    for i, (a, s) in enumerate(zip(args, arg_specs)):
        if s is unset:
            pname = positional[i] if i < len(positional) else var_pos
            if default_dims is not None and pname is not None:
                s = default_dims(pname, a, names[i])
            else:
                s = None
        pieces.append((names[i], a, s))
    for k in sorted(kwargs):  # the order in which `jax.tree_util` flattens a dict
        v = kwargs[k]
        s = kw_specs[k]
        if s is unset:
            pname = k if k in param_names else var_kw
            if default_dims is not None and pname is not None:
                s = default_dims(pname, v, kw_names[k])
            else:
                s = None
        pieces.append((kw_names[k], v, s))

    leaves: list[InLeaf] = []
    for name, value, spec in pieces:
        where = f"`{fun_name}`: `in_dims` for argument `{name}`"
        specs = broadcast_spec(spec, value, where, name)
        paths_and_leaves = jtu.tree_flatten_with_path(value)[0]
        assert len(specs) == len(paths_and_leaves)
        for (path, leaf), leaf_spec in zip(paths_and_leaves, specs):
            leaves.append(InLeaf(name + jtu.keystr(path), leaf, leaf_spec))
    treedef = jtu.tree_structure((args, kwargs))
    return BoundCall(treedef, leaves)


def is_array(x: Any) -> bool:
    return eqx.is_array(x)
