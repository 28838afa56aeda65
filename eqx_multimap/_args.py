"""Binding a call's arguments to dims specs, leaf by leaf, with user-facing paths."""

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.tree_util as jtu
import numpy as np
from jax._src import traceback_util
from jax._src.tree_util import prefix_errors

from ._dims import Dims, parse_dims
from ._errors import did_you_mean, ShapeError, SpecError
from ._text import describe, names_str, plural, wrap


traceback_util.register_exclusion(__file__)


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
    except (ValueError, TypeError) as caught:
        # The first mismatch, with its key path (as `tree_map` raises it since JAX
        # 0.10.2; before, its error named no key path); else `tree_map`'s own.
        errors = prefix_errors(spec, value, is_leaf=is_spec_leaf)
        e = errors[0]("tree_map tree") if errors else caught
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
    """One leaf of the arguments. `shown` is the value as the caller gave it, when
    `value` is a reshaped copy (see `_variadic`), and `shown_axes` the axis in
    `shown` of each token of the dims; errors describe that."""

    path: str
    value: Any
    spec: LeafSpec
    shown: Any = None
    shown_axes: tuple[int, ...] | None = None


@dataclasses.dataclass
class BoundCall:
    """A call split into leaves, with the means to rebuild it from new leaves."""

    treedef: Any
    leaves: list[InLeaf]

    def rebuild(self, values: list[Any]) -> tuple[tuple, dict]:
        return jtu.tree_unflatten(self.treedef, values)


_UNSET: Any = object()  # no spec given: from the annotation, else `None`


@dataclasses.dataclass(frozen=True)
class _Params:
    """The parameters of the mapped function, as far as its signature tells."""

    signature: inspect.Signature | None
    positional: tuple[str, ...]  # positional-only and positional-or-keyword
    named: tuple[str, ...]  # every parameter but `*args` and `**kwargs`
    var_pos: str | None
    var_kw: str | None

    @classmethod
    def of(cls, fun: Callable) -> "_Params":
        try:
            sig = inspect.signature(fun)
        except (TypeError, ValueError):
            return cls(None, (), (), None, None)
        ps = list(sig.parameters.values())
        return cls(
            sig,
            tuple(
                p.name
                for p in ps
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            ),
            tuple(
                p.name for p in ps if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            ),
            next((p.name for p in ps if p.kind is p.VAR_POSITIONAL), None),
            next((p.name for p in ps if p.kind is p.VAR_KEYWORD), None),
        )

    def check_call(self, fun_name: str, args: tuple, kwargs: dict) -> None:
        if self.signature is None:
            return
        try:
            self.signature.bind(*args, **kwargs)
        except TypeError as e:
            why = str(e)
            unknown = []
            if self.var_kw is None:
                unknown = [k for k in kwargs if k not in self.named]
            if unknown:
                # Python names a missing argument first; the typo is the cause.
                why = f"unexpected keyword arguments {tuple(unknown)}"
            message = (
                f"`{fun_name}` was called with bad arguments:\n{why}. The parameters "
                f"are {tuple(self.signature.parameters)}."
                + did_you_mean(unknown, self.named)
            )
            raise TypeError(wrap(message, len("TypeError: "))) from None

    def in_order(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The call as the signature binds it, a positional parameter given by keyword
        passed by position: both spellings give the same leaves, body and plan."""
        if self.signature is None or not kwargs:
            return args, kwargs
        bound = self.signature.bind(*args, **kwargs)
        return bound.args, bound.kwargs

    def check_keys(self, in_dims: Any, fun_name: str) -> None:
        """Every key of a dict `in_dims` names a parameter (unless the function
        takes `**kwargs`, or has no signature to tell)."""
        if (
            not isinstance(in_dims, dict)
            or self.signature is None
            or self.var_kw is not None
        ):
            return
        unknown = [k for k in in_dims if k not in self.named and k != self.var_pos]
        if unknown:
            raise SpecError(
                f"`{fun_name}`: the following `in_dims` keys did not correspond to "
                f"any parameter: {tuple(unknown)}. The parameters are "
                f"{tuple(self.signature.parameters)}."
                + did_you_mean(unknown, tuple(self.signature.parameters))
            )

    def arg_param(self, i: int) -> str | None:
        """The parameter that positional argument `i` binds to."""
        return self.positional[i] if i < len(self.positional) else self.var_pos

    def kwarg_param(self, k: str) -> str | None:
        return k if k in self.named else self.var_kw

    def arg_path(self, i: int) -> str:
        """Positional argument `i` as errors name it: `x`, `xs[0]`, `args[2]`."""
        if i < len(self.positional):
            return self.positional[i]
        if self.var_pos is not None:
            return f"{self.var_pos}[{i - len(self.positional)}]"
        return f"args[{i}]"

    def kwarg_path(self, k: str) -> str:
        return k if k in self.named else f"{self.var_kw or 'kwargs'}[{k!r}]"


def check_in_dims_keys(fun: Callable, fun_name: str, in_dims: Any) -> None:
    """At decoration: the keys of a dict `in_dims` against `fun`'s signature."""
    _Params.of(fun).check_keys(in_dims, fun_name)


def _specs_from_dict(
    in_dims: dict, params: _Params, args: tuple, kwargs: dict, fun_name: str
) -> tuple[list[Any], dict[str, Any]]:
    """One spec per argument from `in_dims` by parameter name (`*args` and
    `**kwargs` by their names too)."""
    arg_specs = [_UNSET] * len(args)
    kw_specs = {k: _UNSET for k in kwargs}
    params.check_keys(in_dims, fun_name)
    for i in range(min(len(args), len(params.positional))):
        name = params.positional[i]
        if name in in_dims:
            arg_specs[i] = in_dims[name]
    # `*args` by its name: one spec for every extra positional argument, or a
    # tuple/list with one entry per extra positional argument.
    var_pos = params.var_pos
    if var_pos is not None and var_pos in in_dims:
        n_extra = len(args) - len(params.positional)
        spec = in_dims[var_pos]
        if isinstance(spec, (tuple, list)):
            if len(spec) != n_extra:
                raise SpecError(
                    f"`{fun_name}`: `in_dims[{var_pos!r}]` has {len(spec)} entries, "
                    f"one per argument of `*{var_pos}`, but the function was called "
                    f"with {n_extra}."
                )
            extra = list(spec)
        else:
            extra = [spec] * n_extra
        arg_specs[len(params.positional) :] = extra
    var_kw = params.var_kw
    var_kw_spec = _UNSET if var_kw is None else in_dims.get(var_kw, _UNSET)
    for k in kwargs:
        if k in in_dims:
            kw_specs[k] = in_dims[k]
        elif k not in params.named and var_kw_spec is not _UNSET:
            if not isinstance(var_kw_spec, dict):
                kw_specs[k] = var_kw_spec
            elif k in var_kw_spec:
                kw_specs[k] = var_kw_spec[k]
    return arg_specs, kw_specs


def _specs(
    in_dims: Any, params: _Params, args: tuple, kwargs: dict, fun_name: str
) -> tuple[list[Any], dict[str, Any]]:
    """One spec per positional and keyword argument (`_UNSET` where `in_dims` says
    nothing)."""
    if in_dims is None:
        return [_UNSET] * len(args), {k: _UNSET for k in kwargs}
    if isinstance(in_dims, (str, Dims)):
        return [in_dims] * len(args), {k: in_dims for k in kwargs}
    if isinstance(in_dims, (tuple, list)):
        if len(in_dims) != len(args):
            raise SpecError(
                f"`{fun_name}`: `in_dims` has {len(in_dims)} entries, one per "
                f"positional argument, but the function was called with {len(args)} "
                "positional arguments. Use a dict of `in_dims` by parameter name to "
                "give dims for keyword arguments."
            )
        return list(in_dims), {k: _UNSET for k in kwargs}
    if isinstance(in_dims, dict):
        return _specs_from_dict(in_dims, params, args, kwargs, fun_name)
    raise SpecError(
        f"`{fun_name}`: `in_dims` must be `None`, a dims string, a tuple with one "
        "entry per positional argument, or a dict by parameter name; but got "
        f"{in_dims!r} of type `{type(in_dims).__name__}`."
    )


def describe_value(value: Any) -> str:
    """A pytree as errors describe it: `a list of 4 floats ([0.0, ...])`."""
    leaves = jtu.tree_leaves(value)
    counts: dict[str, int] = {}
    for leaf in leaves:
        kind = f"{describe(leaf)} array" if is_array(leaf) else type(leaf).__name__
        counts[kind] = counts.get(kind, 0) + 1
    what = " and ".join(plural(n, kind) for kind, n in counts.items())
    treedef = jtu.tree_structure(value)
    flat = all(jtu.treedef_is_leaf(c) for c in treedef.children())
    type_name = type(value).__name__
    article = "an" if type_name[:1].lower() in "aeiou" else "a"
    out = f"{article} {type_name} {'of' if flat else 'holding'} {what}"
    if not any(is_array(x) for x in leaves):
        text = repr(value)
        out += f" ({text[:56] + ' ...' if len(text) > 60 else text})"
    return out


def pass_an_array(value: Any, path: str) -> str:
    """How to turn `value` into an array, for errors."""
    if isinstance(value, (list, tuple)):
        return f"Pass an array, `jnp.asarray({path})`"
    return "Pass arrays in it"


def no_array_in(value: Any) -> str:
    """`with no array in it`, or, if it holds rank-0 arrays (as a list of numbers
    does under `jax.jit`), `with no array of rank 1 or more in it`."""
    if any(is_array(x) for x in jtu.tree_leaves(value)):
        return "with no array of rank 1 or more in it"
    return "with no array in it"


def holds_no_array(value: Any) -> bool:
    """Whether `value` is a pytree (not a single leaf) with leaves but no array of
    rank one or more: dims that name a dim would describe nothing in it. (Under
    `jax.jit`, a list of numbers arrives as a list of rank-0 arrays.)"""
    if jtu.treedef_is_leaf(jtu.tree_structure(value)):
        return False
    leaves = jtu.tree_leaves(value)
    return bool(leaves) and all(not is_array(x) or np.ndim(x) == 0 for x in leaves)


def _check_some_array(fun_name: str, path: str, value: Any, spec: Any) -> None:
    """A subtree given a dims string with named dims must hold an array: a list of
    numbers would otherwise pass through unmapped, and the body fail on it."""

    def check(key_path: Any, s: Any, sub: Any) -> None:
        dims = to_leaf_spec(s, "").dims
        if dims is None or not dims.names or not holds_no_array(sub):
            return
        where = path + jtu.keystr(key_path)
        raise ShapeError(
            f"`{fun_name}`: argument `{where}` is {describe_value(sub)}, "
            f"{no_array_in(sub)}, but its dims {dims.source!r} name "
            f"{names_str(dims.names)}. Only array leaves are mapped and checked (other "
            "leaves pass through whole), so these dims would describe nothing. "
            f"{pass_an_array(sub, where)}, or give it `None` dims to pass it "
            "through unchanged."
        )

    jtu.tree_map_with_path(check, spec, value, is_leaf=is_spec_leaf)


def _leaves(fun_name: str, path: str, value: Any, spec: Any) -> list[InLeaf]:
    """The leaves of one argument, each with its spec and its path."""
    where = f"`{fun_name}`: `in_dims` for argument `{path}`"
    specs = broadcast_spec(spec, value, where, path)
    _check_some_array(fun_name, path, value, spec)
    paths_and_leaves = jtu.tree_flatten_with_path(value)[0]
    assert len(specs) == len(paths_and_leaves)
    return [
        InLeaf(path + jtu.keystr(p), leaf, leaf_spec)
        for (p, leaf), leaf_spec in zip(paths_and_leaves, specs)
    ]


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
    annotations; that of `*args` or `**kwargs` is that of each of their entries);
    `path` is the argument as errors name it (`kwargs['nu']`).
    """
    params = _Params.of(fun)
    params.check_call(fun_name, args, kwargs)
    arg_specs, kw_specs = _specs(in_dims, params, args, kwargs, fun_name)
    # Specs as spelt (a tuple `in_dims` is by position); leaves in signature order.
    args, kwargs = params.in_order(args, kwargs)
    moved = range(len(arg_specs), len(args))
    arg_specs += [kw_specs.pop(params.positional[i]) for i in moved]

    def spec_of(param: str | None, value: Any, spec: Any, path: str) -> Any:
        if spec is not _UNSET:
            return spec
        if default_dims is None or param is None:
            return None
        return default_dims(param, value, path)

    leaves: list[InLeaf] = []
    for i, (value, spec) in enumerate(zip(args, arg_specs)):
        path = params.arg_path(i)
        spec = spec_of(params.arg_param(i), value, spec, path)
        leaves.extend(_leaves(fun_name, path, value, spec))
    for k in sorted(kwargs):  # the order in which `jax.tree_util` flattens a dict
        path = params.kwarg_path(k)
        spec = spec_of(params.kwarg_param(k), kwargs[k], kw_specs[k], path)
        leaves.extend(_leaves(fun_name, path, kwargs[k], spec))
    return BoundCall(jtu.tree_structure((args, kwargs)), leaves)


def is_array(x: Any) -> bool:
    return eqx.is_array(x)
