"""`multi_vmap`: a migration shim with the semantics of DSA2000-Cal's `multi_vmap`."""

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import equinox as eqx
import jax.tree_util as jtu
from jax._src import traceback_util

from ._args import _Params
from ._dims import is_dim_name
from ._errors import SpecError
from ._multi_vmap import filter_multi_vmap, Wrapper
from ._text import plural


traceback_util.register_exclusion(__file__)


_C = TypeVar("_C", bound=Callable)

_GROUP = re.compile(r"\[([^\[\]]*)\]")
_NUMBER = re.compile(r"^[0-9]+$")

Groups = tuple[tuple[str, ...], ...]
"""A parsed mapping: one tuple of labels per bracketed group, as written."""

# The options of DSA2000-Cal's `auto_multi_vmap`, which our planner has no use for.
_DSA_AUTO_KWARGS = {
    "scan_dims": "the planner considers every mapped dim",
    "compute_bound": "the planner estimates time from both flops and bytes",
    "max_scan_dims": "the planner considers scanning any number of the mapped dims",
}


def _is_number(label: str) -> bool:
    return bool(_NUMBER.match(label))


def _parse(mapping: Any, argname: str) -> tuple[str, Groups]:
    """`"[T,F,B],[F],[]"` -> the mapping as one string, and its groups of labels."""
    if isinstance(mapping, (list, tuple)) and all(isinstance(m, str) for m in mapping):
        mapping = ",".join(mapping)
    if not isinstance(mapping, str):
        raise SpecError(
            f"`multi_vmap(..., {argname}=...)` must be a string such as "
            f"'[T,F,B],[F]' (or a list of such strings), but got {mapping!r}."
        )
    text = mapping.strip()
    groups = _GROUP.findall(text)
    leftover = _GROUP.sub("", text).replace(",", "").strip()
    one = "argument" if argname == "in_mapping" else "output"
    if leftover or not groups:
        raise SpecError(
            f"`multi_vmap(..., {argname}={mapping!r})`: expected comma-separated "
            f"bracketed groups of dims, one per {one}, e.g. '[T,F,B],[F],[]'."
        )
    out = []
    for g in groups:
        labels = tuple(t.strip() for t in g.split(",") if t.strip())
        for t in labels:
            name = t[1:] if t.startswith("~") else t
            if t != "..." and not (is_dim_name(name) or _is_number(name)):
                raise SpecError(
                    f"`multi_vmap(..., {argname}={mapping!r})`: {t!r} is not a dim "
                    "label; use names such as 'T' or \"D'\" (an identifier, "
                    "optionally primed), numbers such as '3' (in `in_mapping`), "
                    "'~X' (an unmapped output axis) or '...'."
                )
            if argname == "out_mapping" and _is_number(t):
                raise SpecError(
                    f"`multi_vmap(..., out_mapping={mapping!r})`: the number {t!r} "
                    "would be a mapped dim (every label in `out_mapping` without `~` "
                    "is mapped), but numbers are only labels. Name the dim, e.g. "
                    f"'C' in both mappings, to map it; or write '~{t}' for an "
                    "unmapped axis of the function's output."
                )
        if labels.count("...") > 1:
            raise SpecError(
                f"`multi_vmap(..., {argname}={mapping!r})`: group [{g}] has '...' "
                "more than once; '...' must be unique in a group, as it stands for "
                "all the remaining axes."
            )
        out.append(labels)
    return text, tuple(out)


def _mapped_dims(outs: Groups, out_text: str) -> tuple[str, ...]:
    """The mapped dims: the labels of `out_mapping` without `~`, in order."""
    mapped: list[str] = []
    for group in outs:
        for t in group:
            if group.count(t) > 1:
                raise SpecError(
                    f"`multi_vmap(..., out_mapping={out_text!r})`: {t!r} appears "
                    f"twice in output [{','.join(group)}]; each dim must be unique "
                    "in output dims."
                )
            if t != "..." and not t.startswith("~") and t not in mapped:
                mapped.append(t)
    return tuple(mapped)


def _scan_dims(
    scan_dims: Iterable[str] | str | None, mapped: tuple[str, ...], auto: bool
) -> list[str]:
    if scan_dims is None:
        return []
    names = scan_dims.split() if isinstance(scan_dims, str) else list(scan_dims)
    if names and auto:
        raise SpecError(
            f"`multi_vmap(..., auto=True, scan_dims={scan_dims!r})`: with "
            "`auto=True` the planner chooses which dims to scan, so `scan_dims` is "
            "not used (DSA2000-Cal ignores it silently). Drop `scan_dims`, or drop "
            "`auto=True` to scan exactly those dims."
        )
    unknown = sorted(set(names).difference(mapped), key=str)
    if unknown:
        raise SpecError(
            f"`multi_vmap(..., scan_dims=...)` names {unknown}, which are not mapped "
            f"dims; the mapped dims are {list(mapped)} (the labels of `out_mapping` "
            "without `~`)."
        )
    return [m for m in mapped if m in names]


def _memory_budget(auto: bool, auto_kwargs: Mapping[str, Any] | None) -> Any:
    """The `memory_budget` for the planner, from DSA2000-Cal's `auto_kwargs`."""
    if auto_kwargs is None:
        return None
    if not isinstance(auto_kwargs, Mapping):
        raise SpecError(
            "`multi_vmap(..., auto_kwargs=...)` must be a dict or `None`, but got "
            f"{auto_kwargs!r} of type `{type(auto_kwargs).__name__}`."
        )
    for key in auto_kwargs:
        if key == "memory_budget":
            continue
        why = _DSA_AUTO_KWARGS.get(key)
        what = (
            f"DSA2000-Cal's {key!r} has no counterpart here: {why}"
            if why is not None
            else f"{key!r} is not an option"
        )
        raise SpecError(
            f"`multi_vmap(..., auto_kwargs={dict(auto_kwargs)!r})`: {what}. The one "
            "key allowed is 'memory_budget', the temporary memory that the planner "
            "may use (as `filter_multi_vmap(..., memory_budget=...)`)."
        )
    if auto_kwargs and not auto:
        raise SpecError(
            f"`multi_vmap(..., auto_kwargs={dict(auto_kwargs)!r})` is only used with "
            "`auto=True`: pass `auto=True` too, or drop `auto_kwargs`."
        )
    return auto_kwargs.get("memory_budget")


def _parameters(f: Callable, ins: Groups, fun_name: str) -> tuple[str, ...] | None:
    """The names of the parameters that the groups of `in_mapping` describe, in
    order; `None` if `f` has no signature, so that arguments go by position only."""
    params = _Params.of(f)
    positional = params.positional
    if params.signature is None:
        return None
    if len(positional) >= len(ins):
        return positional[: len(ins)]
    if params.var_pos is not None:
        return None
    raise SpecError(
        f"`{fun_name}`: `in_mapping` has {plural(len(ins), 'group')}, one per "
        f"positional argument, but `f` takes {len(positional)} positional parameters "
        f"{positional}."
    )


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def _describe_missing(value: Any, given: bool) -> str:
    if not given:
        return "was not passed"
    if value is None:
        return "is None"
    return "has no leaves"


class _Outputs(eqx.Module):
    """`f`, returning one output per group of `out_mapping`, counted as DSA2000-Cal
    counts them: the elements of a returned tuple; anything else (a namedtuple
    included) is one output. A 1-tuple is unpacked, as DSA2000-Cal does."""

    _fun: Callable
    _n_out: int = eqx.field(static=True)
    _out_mapping: str = eqx.field(static=True)
    _shim_name: str = eqx.field(static=True)

    @property
    def __wrapped__(self):
        return self._fun

    def __call__(self, *args, **kwargs):
        out = self._fun(*args, **kwargs)
        is_tuple = isinstance(out, tuple) and not _is_namedtuple(out)
        n = len(out) if is_tuple else 1
        if n != self._n_out:
            what = f"a tuple of {n}" if is_tuple else "one output (not a tuple)"
            raise SpecError(
                f"`{self._shim_name}`: the function returned {what}, but "
                f"`out_mapping={self._out_mapping!r}` has "
                f"{plural(self._n_out, 'group')}; the number of outputs must match "
                "output mapping, one group per element of the returned tuple."
            )
        return out[0] if is_tuple and n == 1 else out


class _MultiVmapShim(Wrapper):
    """The function returned by `multi_vmap`: binds arguments to the groups of
    `in_mapping` (by position or parameter name), then calls the mapped function
    (`_fun`: the `filter_multi_vmap` wrapper; `_Outputs` if nothing is mapped)."""

    _shim_name: str = eqx.field(static=True)
    _params: tuple[str, ...] | None = eqx.field(static=True)
    _in_groups: Groups = eqx.field(static=True)
    _in_mapping: str = eqx.field(static=True)
    _mapped: tuple[str, ...] = eqx.field(static=True)

    def _arg_name(self, i: int) -> str:
        return self._params[i] if self._params is not None else f"args[{i}]"

    def _bind(self, args: tuple, kwargs: dict) -> dict[int, Any]:
        """The argument for each group of `in_mapping`, by group index."""
        n = len(self._in_groups)
        if self._params is None:
            if kwargs:
                raise SpecError(
                    f"`{self._shim_name}`: the function has no named parameters "
                    "for the groups of `in_mapping` (it takes `*args`, or has no "
                    "signature), so its arguments are matched to the groups by "
                    "position only; but it was called with keyword arguments "
                    f"{tuple(kwargs)}."
                )
            if len(args) != n:
                raise SpecError(
                    f"`{self._shim_name}` was called with "
                    f"{plural(len(args), 'positional argument')}, but "
                    f"`in_mapping={self._in_mapping!r}` has {plural(n, 'group')}, "
                    "one per argument (`[]` for one that is not mapped)."
                )
            return dict(enumerate(args))
        values = dict(enumerate(args[:n]))
        extra = [f"{len(args)} positional arguments"] if len(args) > n else []
        index = {name: i for i, name in enumerate(self._params)}
        for key, value in kwargs.items():
            if key not in index:
                extra.append(f"`{key}`")
            elif index[key] in values:
                raise TypeError(
                    f"`{self._shim_name}` got multiple values for argument `{key}`."
                )
            else:
                values[index[key]] = value
        if extra:
            raise SpecError(
                f"`{self._shim_name}` was called with {' and '.join(extra)}, but "
                f"`in_mapping={self._in_mapping!r}` has {plural(n, 'group')}, for the "
                f"parameters {self._params} in order. Give every argument a group "
                "(`[]` for one that is not mapped)."
            )
        return values

    def _check_sizes_known(self, values: dict[int, Any]) -> None:
        """Each mapped dim needs an argument with array leaves to take its size from;
        a `None` argument passes through unmapped."""
        for dim in self._mapped:
            carriers = [i for i, g in enumerate(self._in_groups) if dim in g]
            if any(jtu.tree_leaves(values.get(i)) for i in carriers):
                continue
            which = ", ".join(f"`{self._arg_name(i)}`" for i in carriers)
            how = "; ".join(
                f"`{self._arg_name(i)}` {_describe_missing(values.get(i), i in values)}"
                for i in carriers
            )
            raise SpecError(
                f"`{self._shim_name}`: the size of mapped dim {dim!r} is unknown: "
                f"only the `in_mapping` group of {which} names it, and {how}. A "
                "`None` argument passes through unmapped, so it cannot give a "
                f"mapped dim its size. Pass an array there, or drop {dim!r} from "
                "`out_mapping`."
            )

    @traceback_util.api_boundary
    def __call__(self, *args, **kwargs):
        values = self._bind(args, kwargs)
        self._check_sizes_known(values)
        return self._fun(*args, **kwargs)


def _signature_line(ins: Groups, outs: Groups, mapped: tuple[str, ...]) -> str:
    """DSA2000-Cal's "implied function signature": the labels left per element."""

    def core(group: tuple[str, ...]) -> str:
        labels = [t for t in group if t not in mapped]
        if "..." not in labels:
            labels.append("...")
        return "(" + ",".join(labels) + ")"

    return (
        f"Implied function signature :: {','.join(core(g) for g in ins)} -> "
        f"{','.join(core(g) for g in outs)}"
    )


@traceback_util.api_boundary
def multi_vmap(
    f: _C,
    in_mapping: str | list[str],
    out_mapping: str | list[str],
    scan_dims: Iterable[str] | None = None,
    verbose: bool = False,
    auto: bool = False,
    auto_kwargs: dict[str, Any] | None = None,
) -> _C:
    """Map `f` according to a DSA2000-Cal-style signature; a migration shim.

    This has the signature and semantics of `multi_vmap` from DSA2000-Cal's
    `jax_utils`, and is implemented with [`eqx_multimap.filter_multi_vmap`][]. The
    migration guide lists the differences.

    **Arguments:**

    - `f`: the function to map.
    - `in_mapping`: one bracketed group per positional argument of `f`, e.g.
        `"[T,F,B],[F],[]"`, labelling its leading axes; a `...` is implied at the end
        of each group if absent, and `[]` is an argument that is not mapped. A
        label is a name (`T`, `n1`, or primed, `D'`), a number (`3`: one axis, only
        a label) or `...`. A name that is not mapped must have one size across the
        arguments.
    - `out_mapping`: one bracketed group per output, e.g. `"[F,T,B,...]"`. Every
        name in it is a mapped dim, and must appear in some group of `in_mapping`;
        `~X` is one unmapped axis of the function's own output, `...` its remaining
        axes (implied at the end if absent). Several groups mean that `f` returns
        a tuple with one element per group.
    - `scan_dims`: the mapped dims to scan over instead of vmap.
    - `verbose`: print the implied per-element signature, and the nest when traced.
    - `auto`: choose the nest with the planner: `filter_multi_vmap(...,
        plan="auto")`. `scan_dims` must then be empty.
    - `auto_kwargs`: with `auto=True`, `{"memory_budget": ...}`, as
        `filter_multi_vmap(..., memory_budget=...)`.

    **Returns:**

    The mapped function. Its arguments may be given by position or by the names of
    the parameters of `f` (each group of `in_mapping` goes with one parameter, in
    order); a `None` argument passes through unmapped. Unlike DSA2000-Cal, scans
    are always placed outside vmaps (`scan(vmap(f))`): the values are the same, and
    this order is faster.

    !!! example

        ```python
        f = multi_vmap(
            lambda x, y: x + y,
            in_mapping="[n1,n2,n3],[n1,n2,n3,2,2]",
            out_mapping="[...,n1,n2]",
        )
        # x, y: (3, 4, 5, 2, 2) -> (5, 2, 2, 3, 4)
        ```
    """
    in_text, ins = _parse(in_mapping, "in_mapping")
    out_text, outs = _parse(out_mapping, "out_mapping")
    mapped = _mapped_dims(outs, out_text)
    for group in outs:
        missing = [m for m in mapped if m not in group]
        if missing:
            raise SpecError(
                f"`multi_vmap(..., out_mapping={out_text!r})`: output "
                f"[{','.join(group)}] must contain all mapped dims {list(mapped)}; "
                f"it lacks {missing}. Every output is mapped over every mapped dim "
                "(the labels of `out_mapping` without `~`)."
            )
    for m in mapped:
        if not any(m in g for g in ins):
            raise SpecError(
                f"`multi_vmap(..., out_mapping={out_text!r})`: mapped dim {m!r} must "
                f"be in some input dims, but no group of `in_mapping={in_text!r}` "
                f"names it. Name it where an argument has it, or write '~{m}' for "
                "an unmapped axis of the function's output."
            )
    scan = _scan_dims(scan_dims, mapped, auto)
    memory_budget = _memory_budget(auto, auto_kwargs)
    shim_name = f"multi_vmap({getattr(f, '__name__', None) or type(f).__name__})"
    params = _parameters(f, ins, shim_name)
    if verbose:
        print(f"=== {shim_name} ===\n{_signature_line(ins, outs, mapped)}")

    body = eqx.module_update_wrapper(_Outputs(f, len(outs), out_text, shim_name))
    if mapped:

        def to_dims(group: tuple[str, ...]) -> str:
            # `~X` and numbers are one axis each, unchecked: `_`.
            dims = ["_" if t.startswith("~") or _is_number(t) else t for t in group]
            if "..." not in dims:
                dims.append("...")
            return " ".join(dims)

        in_dims = [None if not g else to_dims(g) for g in ins]
        out_strings = tuple(to_dims(g) for g in outs)
        fun = filter_multi_vmap(
            body,
            in_dims=tuple(in_dims) if params is None else dict(zip(params, in_dims)),
            out_dims=out_strings[0] if len(outs) == 1 else out_strings,
            scan=scan,
            # With `auto`, no strategy is given: the planner plans every dim.
            vmap=None if auto else [m for m in mapped if m not in scan],
            verbose=verbose,
            plan="auto" if auto else None,
            memory_budget=memory_budget,
        )
    else:
        # Nothing is mapped (e.g. `out_mapping="[~B]"`): DSA2000-Cal calls `f`.
        fun = body
    shim = _MultiVmapShim(fun, shim_name, params, ins, in_text, mapped)
    return eqx.module_update_wrapper(shim)  # pyright: ignore[reportReturnType]
