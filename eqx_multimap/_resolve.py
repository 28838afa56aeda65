"""Resolving one call: from the arguments to everything the nest needs.

[`resolve`][] runs at call (trace) time, before any nest is built:

1. The mapped dims, by the one mapping rule: the named dims of the output's dims
   (`out_dims`, or the return annotation), except `core` ones, plus the reduced
   dims (`reduce=`), which the output does not name. Every strategy must name
   mapped dims only.
2. The arguments, bound to their dims leaf by leaf (`_args.bind_call`, annotations
   included), and their shapes checked (`_check.check_inputs`): the size of every
   named dim, and the axis of every mapped dim in every array leaf.
3. The body, traced once on one element (`jax.make_jaxpr` over `ShapeDtypeStruct`s
   without the mapped dims). Its outputs are checked against their dims here, so
   spec errors come before any `vmap` or `scan` is traced. Every array the body
   closes over (a closure's arrays, an `eqx.Module`'s fields, tracers of an
   enclosing transform) becomes an explicit, unmapped input of the nest: the nest
   is then a pure function of its inputs, which `jax.custom_jvp` and
   `jax.shard_map` need. An exception raised while the body is traced is the
   user's own, and is re-raised as it is, with a note (`_body_note`): the
   per-element shapes of the arguments, the mapped and core dims. A call that
   fails, there or by a check of ours, names any likely typo of a dim
   (`_errors.typo_hint`): where it was written and the dim probably meant.
4. From the body's jaxpr: the collectives it uses over mapped dims
   ([`Call.collective_dims`][]), which a scan cannot run; and the reductions'
   dtypes and identities (`_reduce.make_reduction`).

The result is a frozen [`Call`][].
"""

import contextlib
import dataclasses
import functools as ft
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.core
import jax.extend.core
import jax.tree_util as jtu
import jaxtyping
import numpy as np
from jax._src import traceback_util

from ._args import (
    bind_call,
    BoundCall,
    broadcast_spec,
    LeafSpec,
)
from ._blocks import NestSpec
from ._body import Body, struct, trace_body
from ._check import check_inputs, check_output, InputCheck
from ._dims import Dims, parse_dims
from ._errors import ShapeError, SpecError, typo_hint
from ._jaxpr import collectives, inputs_to_isolate
from ._nest import Axes, Problem
from ._options import (
    check_out_leaf,
    explicit_mapped,
    mapped_dims,
    Options,
    out_leaf_dims,
)
from ._reduce import check_reduce_sizes, make_reduction, Reduction
from ._shard import ShardPlan, split_dims
from ._text import describe, wrap
from ._typed import fun_annotations, FunAnnotations, OutAnnotation
from ._variadic import Expand, rewrite_inputs, rewrite_output


traceback_util.register_exclusion(__file__)


def fun_name_of(fun: Callable) -> str:
    name = getattr(fun, "__qualname__", None) or getattr(fun, "__name__", None)
    return f"filter_multi_vmap({name or type(fun).__name__})"


class _Dynamic:
    def __repr__(self) -> str:
        return "<dynamic>"


_DYNAMIC = _Dynamic()


@dataclasses.dataclass(frozen=True)
class OutLayout:
    """The body's output: its structure, its non-array leaves, and the dims of each
    array leaf (in the order of the nest's outputs)."""

    treedef: Any
    static: tuple[Any, ...]
    dims: tuple[Dims, ...]
    shapes: tuple[jax.ShapeDtypeStruct, ...]  # of one element
    # For each array output: how to reshape its flattened variadic dim back.
    expand: tuple[Expand | None, ...] = ()

    def combine(self, outs: Sequence[Any]) -> Any:
        if self.expand:
            outs = [o if e is None else e(o) for o, e in zip(outs, self.expand)]
        it_out = iter(outs)
        leaves = [next(it_out) if s is _DYNAMIC else s for s in self.static]
        return jtu.tree_unflatten(self.treedef, leaves)


@dataclasses.dataclass(frozen=True)
class Call:
    """One resolved call of a mapped function.

    - `fun_name`: the function as errors name it.
    - `options`: the wrapper's options.
    - `mapped`: the mapped dims, in the order of the output's dims.
    - `sizes`: the size of every named dim (mapped and core).
    - `check`: where each size was bound, for errors.
    - `values`: the array leaves of the arguments, then the arrays the body closes
        over; `leaf_axes`: the axis of each mapped dim in each of them.
    - `body`: the body on one element; `out`: its output layout.
    - `bound`: the arguments, leaf by leaf.
    - `shard`: with `shard=`, the mesh and each sharded dim's local size; else
        `split`: the dims that inputs split over devices (`split_dims`), never scanned.
    - `reduction`: with `reduce=`, the reductions (dtypes, identities).
    """

    fun_name: str
    options: Options
    mapped: tuple[str, ...]
    sizes: dict[str, int]
    check: InputCheck
    values: tuple[Any, ...]
    leaf_axes: tuple[Axes, ...]
    body: Body
    out: OutLayout
    bound: BoundCall
    shard: ShardPlan | None
    reduction: Reduction | None = None
    split: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def collective_dims(self) -> frozenset[str]:
        """The mapped dims that the body uses as axis names of collectives
        (`lax.psum(x, "F")`, `all_gather`, `axis_index`...): they must be vmapped or
        sharded, never scanned."""
        jaxpr = self.body.standalone.jaxpr.jaxpr
        mapped = set(self.mapped)
        return frozenset(
            name for _, names in collectives(jaxpr) for name in names if name in mapped
        )

    @property
    def out_mapped(self) -> tuple[str, ...]:
        """The mapped dims that the output has: all but the reduced ones."""
        reduced = set(self.options.reduce_names)
        return tuple(n for n in self.mapped if n not in reduced)

    @property
    def isolate(self) -> frozenset[int]:
        """The input leaves that scans slice apart from the body's kernels."""
        return inputs_to_isolate(self.body.jaxpr)

    @property
    def mapped_sizes(self) -> dict[str, int]:
        return {name: self.sizes[name] for name in self.mapped}

    def problem(
        self, sizes: dict[str, int] | None = None, standalone: bool = False
    ) -> Problem:
        """The nest's problem; `sizes` overrides the mapped sizes (per device), and
        `standalone` gives the body for compiling one device's nest on its own."""
        return Problem(
            body=self.body.standalone if standalone else self.body,
            leaf_axes=self.leaf_axes,
            out_dims=self.out.dims,
            sizes=self.mapped_sizes if sizes is None else sizes,
            reduce=self.reduction,
        )

    def given_nest(self) -> NestSpec:
        """The nest the strategies give: scans in the order given, then the vmaps:
        sharded dims that are not scanned, those given by `vmap`, and every other
        mapped dim, in the order of the output's dims."""
        scan = self.options.scan
        named = {n for n, _ in scan}
        first = [n for n in self.options.shard_names if n not in named]
        given = [n for n in self.options.vmap if n not in first]
        rest = [n for n in self.mapped if n not in named | set(first) | set(given)]
        return NestSpec(scan=scan, vmap=tuple(first + given + rest))


#
# The output's dims.
#


@dataclasses.dataclass(frozen=True)
class _OutSpec:
    """Where the output's dims come from: `out_dims`, or the return annotation."""

    spec: Any  # the `out_dims` tree, or an `OutAnnotation`
    source: str  # "`out_dims`" or "the return annotation"
    written: dict[str, str]  # each named dim, as written: 'F', '*rest', '#B'


def _written(dims_list: Sequence[Dims]) -> dict[str, str]:
    """Each named dim of `dims_list`, as written: 'F', '*rest', '#B'."""
    return {t.name: str(t) for d in dims_list for t in d.tokens if hasattr(t, "name")}


def _out_spec(
    options: Options, annotations: FunAnnotations, fun_name: str
) -> tuple[_OutSpec, tuple[str, ...]]:
    """The output's dims and the mapped dims, checked before the body is traced."""
    mapped = explicit_mapped(options, fun_name)
    if mapped is not None:
        written = _written([d for _, d in out_leaf_dims(options.out_dims.value)])
        return _OutSpec(options.out_dims.value, "`out_dims`", written), mapped
    if not annotations.has_return:
        raise SpecError(
            f"`{fun_name}` has no `out_dims` and no return annotation, so which dims "
            "are mapped is unknown: the mapped dims are the named dims of the "
            "output. Give `out_dims`, e.g. `out_dims='T F ...'` (the output's dims, "
            "mapped dims first here), or a jaxtyping return annotation."
        )
    leaves = annotations.out_leaf_dims(fun_name)
    if not any(dims.names for _, dims, _ in leaves) and not options.reduce:
        raise SpecError(
            f"`{fun_name}` has no `out_dims`, and its return annotation names no "
            "dims, so which dims are mapped is unknown: the mapped dims are the "
            "named dims of the output. Give `out_dims`, e.g. `out_dims='T F ...'`, "
            "or annotate the return value with its dims, e.g. "
            "`-> Float[Array, 'T F']`."
        )
    source = "the return annotation"
    mapped = mapped_dims(options, fun_name, source, leaves)
    spec = annotations.out_dims(fun_name, mapped)
    written = _written([dims for _, dims, _ in leaves])
    return _OutSpec(spec, source, written), mapped


def _out_dims(
    fun_name: str,
    out_spec: _OutSpec,
    out: Any,
    mapped: tuple[str, ...],
    check: InputCheck,
    reduced: tuple[str, ...] = (),
    variadic: dict[Any, tuple[int, ...]] | None = None,
) -> OutLayout:
    """Check the body's output (of one element, as `ShapeDtypeStruct`s) against its
    dims; the layout of the output. `mapped` are the mapped dims of the output (all
    but the `reduced` ones)."""
    default = parse_dims(" ".join(mapped) + " ...")
    spec = out_spec.spec
    if isinstance(spec, OutAnnotation):
        spec = spec.resolve(out, default)
    where = f"`{fun_name}`: {out_spec.source}"
    leaf_specs = broadcast_spec(spec, out, where, "output")
    sizes = dict(check.sizes)
    seen = {k: list(v) for k, v in check.seen.items()}
    dims_list: list[Dims] = []
    expand: list[Expand | None] = []
    shapes: list[jax.ShapeDtypeStruct] = []
    static: list[Any] = []
    paths_and_leaves, treedef = jtu.tree_flatten_with_path(out)
    for (path, leaf), leaf_spec in zip(paths_and_leaves, leaf_specs):
        where_leaf = "output" + jtu.keystr(path)
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            static.append(leaf)
            continue
        if leaf_spec.dims is None:
            raise SpecError(
                f"`{fun_name}`: {out_spec.source} gives `None` for `{where_leaf}`, "
                f"which is an array; every output array is mapped over "
                f"{', '.join(mapped)}, so give it dims that name them."
            )
        source = out_spec.source
        if leaf_spec.dims is default:
            source = "the default dims of unannotated outputs"
        flat, how = rewrite_output(leaf_spec.dims, mapped, variadic or {})
        leaf_spec = LeafSpec(flat, leaf_spec.direct)
        for name in reduced:
            if name in leaf_spec.dims.names:
                raise SpecError(
                    f"`{fun_name}`: `reduce` names dim '{name}', which {source} "
                    f"{leaf_spec.dims.source!r} for `{where_leaf}` also names. A "
                    f"reduced dim is combined away: the output has no '{name}' axis."
                )
        check_out_leaf(fun_name, source, where_leaf, leaf_spec.dims, mapped)
        check_output(
            fun_name,
            where_leaf,
            leaf.shape,
            leaf_spec.dims,
            mapped,
            sizes,
            seen,
            source,
        )
        dims_list.append(leaf_spec.dims)
        expand.append(how)
        shapes.append(leaf)
        static.append(_DYNAMIC)
    expanded = tuple(expand) if any(e is not None for e in expand) else ()
    return OutLayout(treedef, tuple(static), tuple(dims_list), tuple(shapes), expanded)


#
# Resolving a call.
#


def resolve(fun: Callable, options: Options, args: tuple, kwargs: dict) -> Call:
    """Bind, check and trace one call, up to (not including) the nest."""
    fun_name = fun_name_of(fun)
    annotations = fun_annotations(fun)
    out_spec, mapped = _out_spec(options, annotations, fun_name)
    if not mapped:
        raise SpecError(
            f"`{fun_name}` maps no dims: its output's dims name none (the mapped "
            "dims are the named dims of the output, except `core` ones)."
        )
    bound = bind_call(
        fun,
        fun_name,
        args,
        kwargs,
        options.in_dims.value,
        annotations.in_dims_hook(fun_name, mapped),
    )
    # Where each dim is written, as the user wrote it: for errors that name a typo.
    typos = ft.partial(_typos, bound, out_spec, options)
    sharded = options.shard is not None
    bound, variadic = rewrite_inputs(fun_name, bound, mapped, sharded)
    check = check_inputs(fun_name, bound.leaves, mapped, variadic)
    reduced = options.reduce_names
    with _naming_typos(typos):
        _check_sizes_known(fun_name, options, out_spec, mapped, check)
    dyn_index = [i for i, a in enumerate(check.axes) if a is not None]
    values = [bound.leaves[i].value for i in dyn_index]
    leaf_axes = [a for a in check.axes if a is not None]
    element_specs = [_element_spec(v, a) for v, a in zip(values, leaf_axes)]
    shard = None if options.shard is None else options.shard.plan(fun_name, check)
    split = {} if sharded else split_dims(bound.leaves, check.axes)
    _check_split(fun_name, options, split)
    axis_env = [(name, check.sizes[name]) for name in mapped]
    try:
        body, out = trace_body(fun, bound, dyn_index, element_specs, axis_env, shard)
    except Exception as e:
        # The user's own exception, kept as it is, with what the body was given.
        notes = getattr(e, "__notes__", ())
        if not any(_NOTE_MARK in " ".join(n.split()) for n in notes):
            note = _body_note(
                fun_name,
                options,
                out_spec.source,
                mapped,
                bound,
                check,
                dict(zip(dyn_index, element_specs)),
                variadic,
            )
            note += typos() + _checked_class_note(e)
            e.add_note(wrap(note))
        raise
    with _naming_typos(typos):
        _check_collectives(fun_name, body, options, mapped)
        out_mapped = tuple(n for n in mapped if n not in reduced)
        layout = _out_dims(
            fun_name, out_spec, out, out_mapped, check, reduced, variadic
        )
        reduction = make_reduction(fun_name, options.reduce, layout.shapes, check.sizes)
    return Call(
        fun_name=fun_name,
        options=options,
        mapped=mapped,
        sizes=dict(check.sizes),
        check=check,
        values=tuple(values) + body.hoisted,
        leaf_axes=tuple(leaf_axes) + tuple({} for _ in body.hoisted),
        body=body,
        out=layout,
        bound=bound,
        shard=shard,
        reduction=reduction,
        split=split,
    )


def _typos(bound: BoundCall, out_spec: _OutSpec, options: Options) -> str:
    """For a call that failed: the likely typos of its dims (`typo_hint`), from
    where each dim is written, the output first."""
    places = {name: [out_spec.source] for name in out_spec.written}
    for name in options.reduce_names:
        places.setdefault(name, []).append("`reduce`")
    for leaf in bound.leaves:
        dims = leaf.spec.dims
        for name in dict.fromkeys(() if dims is None else dims.names):
            places.setdefault(name, []).append(f"`{leaf.path}` ({dims.source!r})")
    return typo_hint(places, options.core)


@contextlib.contextmanager
def _naming_typos(typos: Callable[[], str]):
    """Our own error, raised by a check of this call, names the likely typos."""
    try:
        yield
    except (ShapeError, SpecError) as e:
        hint = typos()
        if hint and len(e.args) == 1 and isinstance(e.args[0], str):
            e.args = (e.args[0] + hint,)
        raise


def _check_sizes_known(
    fun_name: str,
    options: Options,
    out_spec: _OutSpec,
    mapped: tuple[str, ...],
    check: InputCheck,
) -> None:
    """Every reduced and every mapped dim is named by some array argument (so its
    size is known), and the reduced dims' sizes suit their reductions."""
    reduced = options.reduce_names
    for name in reduced:
        if name not in check.sizes:
            known = ", ".join(check.sizes) or "none"
            raise SpecError(
                f"`{fun_name}`: `reduce` names dim '{name}', which no array "
                "argument's dims name. A reduced dim is mapped over the inputs that "
                f"have it, then combined away. The named dims of the arguments are: "
                f"{known}."
            )
    check_reduce_sizes(fun_name, options.reduce, check.sizes, check.seen)
    for name in mapped:
        if name in check.sizes:
            continue
        known = ", ".join(check.sizes) or "none"
        written = out_spec.written.get(name, name)
        if written.startswith("*"):
            raise SpecError(
                f"`{fun_name}`: {out_spec.source} names the variadic dim "
                f"'{written}', which no array argument's dims name. A variadic dim "
                "of the output must come from an argument, which gives its shape: "
                f"name '{written}' in an argument's dims too, or write the output's "
                f"axes out. The named dims of the arguments are: {known}."
            )
        raise SpecError(
            f"`{fun_name}`: {out_spec.source} names dim '{name}', so it is "
            "mapped, but no array argument's dims name it, so its size is "
            f"unknown. The named dims of the arguments are: {known}. If the "
            f"body makes '{name}' itself, declare it `core='{name}'`."
        )


def _element_spec(value: Any, axes: Axes) -> jax.ShapeDtypeStruct:
    """One element of a mapped argument: `value` without its mapped axes."""
    drop = set(axes.values())
    shape = tuple(s for i, s in enumerate(np.shape(value)) if i not in drop)
    return struct(value, shape)


# jaxtyping names the check `Cls.__init__`; before 0.3, `Cls` alone, whose value of
# `self` then shows as `Cls(...)`.
_CHECKED_INIT = re.compile(r"checking the parameters of (\S+?)(\.__init__)?\.?$", re.M)


def _checked_class_note(e: Exception) -> str:
    """For a class checked by `@jaxtyped` when the body builds it: the fix."""
    found = _CHECKED_INIT.search(str(e))
    if found is None or not isinstance(e, jaxtyping.TypeCheckError):
        return ""
    cls = found.group(1).rsplit(".", 1)[-1]
    if found.group(2) is None and f"'self': {cls}(" not in str(e):
        return ""  # a function's parameters, not a class's
    return (
        f"\n`{cls}` checks its fields when it is built (it is decorated "
        "`@jaxtyped`), against annotations that describe the whole, batched value, "
        f"while the body builds `{cls}` from one element. Build it outside: return "
        f"its fields (say as a `NamedTuple` with the same annotations) and call "
        f"`{cls}(...)` on the mapped result; or drop `@jaxtyped` from `{cls}`: "
        f"with the return annotation `-> {cls}`, `filter_multi_vmap` checks the "
        "dims of its fields itself."
    )


_NOTE_MARK = "raised this while tracing its body on one element"
_NOTE_MAX_ARGS = 12


def _body_note(
    fun_name: str,
    options: Options,
    out_source: str,
    mapped: tuple[str, ...],
    bound: BoundCall,
    check: InputCheck,
    element_specs: dict[int, jax.ShapeDtypeStruct],
    variadic: dict[Any, tuple[int, ...]] | None = None,
) -> str:
    """The note added to an exception raised while the body is traced: what each
    argument is on one element, which dims are mapped, which core and why."""
    lines = [
        f"`{fun_name}` {_NOTE_MARK},\nwhich it calls with each argument without its "
        "mapped dims:"
    ]
    for i, leaf in enumerate(bound.leaves):
        if len(lines) > _NOTE_MAX_ARGS:
            lines.append(f"  ... and {len(bound.leaves) - i} more leaves")
            break
        dims = leaf.spec.dims
        if check.axes[i] is None:
            lines.append(
                f"  {leaf.path}: `{type(leaf.value).__name__}`, not an array: "
                "passed as it is"
            )
        elif i not in element_specs or not check.axes[i]:
            how = "`None` dims: not mapped" if dims is None else f"dims {dims.source!r}"
            lines.append(f"  {leaf.path}: {describe(leaf.value)} whole ({how})")
        else:
            given = describe(leaf.value if leaf.shown is None else leaf.shown)
            assert dims is not None
            lines.append(
                f"  {leaf.path}: {describe(element_specs[i])} per element (given "
                f"{given}, dims {dims.source!r})"
            )
    reduced = options.reduce_names
    out_mapped = [n for n in mapped if n not in reduced]
    variadic = variadic or {}
    sized = ", ".join(
        f"*{n}={variadic[n]}" if n in variadic else f"{n}={check.sizes[n]}"
        for n in out_mapped
    )
    mapped_line = f"Mapped dims (named by {out_source}): {sized}"
    if reduced:
        mapped_line += "; reduced by `reduce`: " + ", ".join(
            f"{n}={check.sizes[n]}" for n in reduced
        )
    lines.append(mapped_line + ".")
    core = [n for n in check.sizes if n not in mapped]
    if core:
        why = [
            "declared `core`" if n in options.core else "named by no output"
            for n in core
        ]
        lines.append(
            "Core dims, which the body sees whole: "
            + ", ".join(f"{n}={check.sizes[n]} ({w})" for n, w in zip(core, why))
            + "."
        )
    return "\n".join(lines)


def _check_split(fun_name: str, options: Options, split: dict[str, str]) -> None:
    """No scan over a dim that inputs split over devices (JAX refuses it)."""
    for name in (n for n in options.scan_names if n in split):
        raise SpecError(
            f"`{fun_name}`: `scan` names dim '{name}', but {split[name]} (an "
            "`Explicit` axis), and a scan needs its inputs whole along its dim. Vmap "
            f"'{name}' (drop it from `scan`), shard it (`shard={{{name!r}: ...}}`), "
            f"or give that input a sharding that does not split '{name}'."
        )


def _check_collectives(
    fun_name: str, body: Body, options: Options, mapped: tuple[str, ...]
) -> None:
    """A scanned (or chunked) dim runs one element per iteration, so no collective
    can see its other elements."""
    scanned = dict(options.scan)
    for prim, names in collectives(body.standalone.jaxpr.jaxpr):
        for name in names:
            if name not in mapped or name not in scanned:
                continue
            how = "scanned" if scanned[name] is None else "scanned in chunks"
            raise SpecError(
                f"`{fun_name}`: the body uses the collective `{prim}` over dim "
                f"'{name}', which `scan` names: a {how} dim is a loop, and one "
                "iteration cannot see the other elements. Vmap it (drop it from "
                f"`scan`), shard it (`shard={{{name!r}: ...}}`), or, to sum or "
                f"otherwise combine over '{name}', use `reduce={{{name!r}: 'sum'}}` "
                "instead of the collective."
            )
