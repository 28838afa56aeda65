import dataclasses
import functools as ft
from collections.abc import Callable, Mapping, Sequence
from typing import Any, overload, TypeVar

import equinox as eqx
import jax
import jax.tree_util as jtu
from jaxtyping import PyTree

from ._annotations import fun_annotations, OutAnnotation
from ._args import bind_call, BoundCall, broadcast_spec, is_array
from ._check import check_inputs, check_output, InputCheck
from ._dims import Dims, parse_dims, parse_names
from ._errors import SpecError
from ._nest import describe_nest, OutLayout, run_blocks
from ._planner import check_plan_options, MemoryBudget, plan_call, PlanMode
from ._shard import parse_shard, ShardOptions, ShardSpec


_T = TypeVar("_T")

DimsSpec = str | None
"""A dims string such as `"T F B 2 2"`, or `None` for an unmapped value."""

InDims = PyTree[DimsSpec] | Mapping[str, PyTree[DimsSpec]]
"""Dims for the arguments: a dims string, a tuple (one entry per positional
argument) or a dict by parameter name; each entry a pytree prefix of its argument."""

OutDims = PyTree[DimsSpec]
"""Dims for the output: a pytree prefix of the output with dims strings at leaves."""

ScanSpec = str | Sequence[str] | Mapping[str, int | None] | None
"""Dims to scan over: `"T F"`, `("T", "F")`, or `{"T": 64, "F": None}` (chunk sizes,
`None` for an unchunked scan)."""


class _Frozen:
    """A hashable, immutable holder for a user's spec tree (dicts, lists, strings).

    Not a pytree, so it lives in a static field and keeps the wrapper hashable (and so
    usable with `jax.jit(wrapper)`).
    """

    __slots__ = ("value", "_key")

    def __init__(self, value: Any):
        self.value = value
        self._key = _freeze_key(value)

    def __hash__(self) -> int:
        try:
            return hash(self._key)
        except TypeError:
            return id(self.value)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Frozen):
            return NotImplemented
        if self.value is other.value:
            return True
        try:
            return bool(self._key == other._key)
        except Exception:
            return False

    def __repr__(self) -> str:
        return repr(self.value)


def _freeze_key(x: Any) -> Any:
    if isinstance(x, Mapping):
        return (
            "dict",
            tuple(sorted(((repr(k), _freeze_key(v)) for k, v in x.items()))),
        )
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_freeze_key(v) for v in x))
    return x


def _parse_scan(scan: ScanSpec) -> tuple[tuple[str, int | None], ...]:
    if isinstance(scan, Mapping):
        names = parse_names(tuple(scan.keys()), "scan")
        out = []
        for name in names:
            chunk = scan[name]
            if chunk is not None and (
                isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1
            ):
                raise SpecError(
                    f"`filter_multi_vmap(..., scan={{{name!r}: {chunk!r}}})`: a chunk "
                    "size must be a positive `int` (scan over chunks of that many "
                    "elements, vmapped inside), or `None` (scan one at a time)."
                )
            out.append((name, chunk))
        return tuple(out)
    return tuple((name, None) for name in parse_names(scan, "scan"))


def _validate_tree(spec: Any, where: str) -> None:
    """Parse every dims string in a spec tree now, so typos fail at decoration."""
    for leaf in jtu.tree_leaves(spec, is_leaf=lambda x: x is None):
        if leaf is not None and not isinstance(leaf, Dims):
            if not isinstance(leaf, str):
                raise SpecError(
                    f"{where} must contain dims strings such as 'T F B' or `None`, "
                    f"but contains {leaf!r} of type `{type(leaf).__name__}`."
                )
            parse_dims(leaf)


def _names_in(spec: Any) -> list[str]:
    names: list[str] = []
    for leaf in jtu.tree_leaves(spec, is_leaf=lambda x: x is None):
        if isinstance(leaf, str):
            leaf = parse_dims(leaf)
        if isinstance(leaf, Dims):
            names.extend(n for n in leaf.names if n not in names)
    return names


def _fun_name(fun: Callable) -> str:
    name = getattr(fun, "__qualname__", None) or getattr(fun, "__name__", None)
    return f"filter_multi_vmap({name or type(fun).__name__})"


class _MultiVmapWrapper(eqx.Module):
    _fun: Callable
    _in_dims: _Frozen = eqx.field(static=True)
    _out_dims: _Frozen = eqx.field(static=True)
    _scan: tuple[tuple[str, int | None], ...] = eqx.field(static=True)
    _vmap: tuple[str, ...] = eqx.field(static=True)
    _checkpoint: bool = eqx.field(static=True)
    _verbose: bool = eqx.field(static=True)
    _shard: ShardOptions | None = eqx.field(static=True, default=None)
    _plan: PlanMode | None = eqx.field(static=True, default=None)
    _memory_budget: MemoryBudget = eqx.field(static=True, default=None)

    @property
    def __wrapped__(self):
        return self._fun

    @property
    def __globals__(self) -> dict[str, Any]:
        # Read by `jaxtyping.jaxtyped` (and `typing.get_type_hints`) to resolve string
        # annotations, so that `@jaxtyped` can go outside `@filter_multi_vmap`.
        return getattr(self._fun, "__globals__", {})

    def _mapped(self) -> tuple[str, ...]:
        scan = tuple(name for name, _ in self._scan)
        if scan or self._vmap:
            mapped = scan + self._vmap
        elif self._out_dims.value is None:
            # No strategy: every named dim of the return annotation is vmapped.
            mapped = fun_annotations(self._fun).out_names(_fun_name(self._fun))
        else:
            # No strategy: every named dim of `out_dims` is vmapped.
            mapped = tuple(_names_in(self._out_dims.value))
        # A sharded dim in neither `scan` nor `vmap` is vmapped (outermost) locally.
        shard = self._shard.names if self._shard is not None else ()
        local = tuple(name for name in shard if name not in mapped)
        return mapped[: len(scan)] + local + mapped[len(scan) :]

    def __call__(self, /, *args, **kwargs):
        call = self._resolve(args, kwargs)
        if self._plan is not None:
            plan = plan_call(self, call)
            call.scan, call.vmap = plan.scan, plan.vmap
        if self._shard is not None:
            plan = self._shard.plan(call.fun_name, call.check)
            if self._verbose:
                nest = _describe_nest(
                    call.fun_name, call.scan, call.vmap, plan.local_sizes
                )
                print(plan.describe(nest))
            make_core, values, axes = call.with_fun_arrays_as_inputs()
            outs, layout = plan.run(
                make_core, values, axes, call.scan, call.vmap, self._checkpoint
            )
            return call.combine(outs, layout)
        if self._verbose:
            print(_describe_nest(call.fun_name, call.scan, call.vmap, call.check.sizes))
        outs, layout = run_blocks(
            call.make_core,
            call.values,
            call.axes,
            call.check.sizes,
            call.scan,
            call.vmap,
            self._checkpoint,
        )
        return call.combine(outs, layout)

    def _resolve(self, args: tuple, kwargs: dict) -> "_Call":
        """Bind and check a call: everything up to (not including) the nest."""
        fun_name = _fun_name(self._fun)
        mapped = self._mapped()
        if not mapped:
            raise SpecError(
                f"`{fun_name}` maps no dims: name them with `vmap=` or `scan=`, or "
                "give `out_dims` (whose named dims are then all vmapped)."
            )
        scan = dict(self._scan)
        vmap = [name for name in mapped if name not in scan]
        annotations = fun_annotations(self._fun)
        bound = bind_call(
            self._fun,
            fun_name,
            args,
            kwargs,
            self._in_dims.value,
            annotations.in_dims_hook(fun_name, mapped),
        )
        check = check_inputs(fun_name, bound.leaves, mapped)
        for name in mapped:
            if name not in check.sizes:
                strategy = "scan" if name in scan else "vmap"
                if self._shard is not None and name in self._shard.names:
                    strategy = "shard"
                known = ", ".join(check.sizes) or "none"
                raise SpecError(
                    f"`{fun_name}`: `{strategy}` names dim '{name}', but no array "
                    f"argument's dims contain it, so its size is unknown. The dims "
                    f"of the arguments are: {known}."
                )
        first_seen = [n for n in check.seen if n in mapped]
        default_out = parse_dims(" ".join(first_seen) + " ...")
        dyn_index = [i for i, a in enumerate(check.axes) if a is not None]
        return _Call(
            fun=self._fun,
            fun_name=fun_name,
            bound=bound,
            check=check,
            mapped=mapped,
            scan=scan,
            vmap=tuple(vmap),
            out_dims=(
                annotations.out_dims(fun_name, mapped)
                if self._out_dims.value is None
                else self._out_dims.value
            ),
            default_out=default_out,
            dyn_index=dyn_index,
        )

    def __get__(self, instance, owner):
        del owner
        if instance is None:
            return self
        return jtu.Partial(self, instance)


@dataclasses.dataclass
class _Call:
    """One resolved call: its leaves, the checked dim sizes and the strategies.

    `values[i]` is the `i`-th array leaf and `axes[i]` the axis of each mapped dim in
    it. `make_core()` gives the innermost (per-element) function over those leaves;
    `combine` rebuilds the output pytree from the nest's outputs.
    """

    fun: Callable
    fun_name: str
    bound: BoundCall
    check: InputCheck
    mapped: tuple[str, ...]
    scan: dict[str, int | None]
    vmap: tuple[str, ...]
    out_dims: Any
    default_out: Dims
    dyn_index: list[int]

    @property
    def values(self) -> list[Any]:
        return [self.bound.leaves[i].value for i in self.dyn_index]

    @property
    def axes(self) -> list[dict[str, int]]:
        axes = [self.check.axes[i] for i in self.dyn_index]
        assert all(a is not None for a in axes)
        return axes  # pyright: ignore[reportReturnType]

    def make_core(self, rebuild_fun: Callable[[list[Any]], Callable] | None = None):
        """The innermost (per-element) function over the array leaves, and a getter
        for the output layout it records while traced.

        With `rebuild_fun`, the leaves after the call's own rebuild `fun` (see
        `with_fun_arrays_as_inputs`).
        """
        box: list[OutLayout] = []
        n = len(self.dyn_index)

        def core(dyn):
            fun = self.fun if rebuild_fun is None else rebuild_fun(dyn[n:])
            out, layout = _call_body(
                fun,
                self.fun_name,
                self.bound,
                self.dyn_index,
                dyn[:n],
                self.out_dims,
                self.default_out,
                self.mapped,
                self.check,
            )
            box.append(layout)
            return out

        def get_layout() -> OutLayout:
            assert box, "the mapped body was not traced"
            return box[-1]

        return core, get_layout

    def with_fun_arrays_as_inputs(self):
        """`make_core`, `values`, `axes` with the array leaves of `fun` (a callable
        `equinox.Module`, say) appended as unmapped inputs.

        `jax.shard_map` cannot close over arrays sharded on an explicit mesh, so the
        sharded path passes them in (replicated) instead.
        """
        fun_arrays, fun_static = eqx.partition(self.fun, eqx.is_array)
        fun_leaves, fun_def = jtu.tree_flatten(fun_arrays)
        if not fun_leaves:
            return self.make_core, self.values, self.axes

        def rebuild_fun(leaves: list[Any]) -> Callable:
            return eqx.combine(jtu.tree_unflatten(fun_def, leaves), fun_static)

        axes = self.axes + [{} for _ in fun_leaves]
        make_core = ft.partial(self.make_core, rebuild_fun)
        return make_core, self.values + fun_leaves, axes

    def combine(self, outs: list[Any], layout: OutLayout) -> Any:
        treedef, static_leaves = layout.data
        it_out = iter(outs)
        leaves = [next(it_out) if s is _DYNAMIC else s for s in static_leaves]
        return jtu.tree_unflatten(treedef, leaves)


class _Dynamic:
    def __repr__(self) -> str:
        return "<dynamic>"


_DYNAMIC = _Dynamic()


def _call_body(
    fun: Callable,
    fun_name: str,
    bound: BoundCall,
    dyn_index: list[int],
    dyn: list[Any],
    out_dims: Any,
    default_out: Dims,
    mapped: tuple[str, ...],
    check: InputCheck,
) -> tuple[list[Any], OutLayout]:
    """Call the user's function on one element; check and split its output."""
    values = [leaf.value for leaf in bound.leaves]
    for i, v in zip(dyn_index, dyn):
        values[i] = v
    args, kwargs = bound.rebuild(values)
    out = fun(*args, **kwargs)
    spec = default_out if out_dims is None else out_dims
    if isinstance(spec, OutAnnotation):
        spec = spec.resolve(out, default_out)
    leaf_specs = broadcast_spec(spec, out, f"`{fun_name}`: `out_dims`", "output")
    sizes = dict(check.sizes)
    seen = {k: list(v) for k, v in check.seen.items()}
    dyn_out: list[Any] = []
    dims_list: list[Dims] = []
    static: list[Any] = []
    paths_and_leaves, treedef = jtu.tree_flatten_with_path(out)
    for (path, leaf), leaf_spec in zip(paths_and_leaves, leaf_specs):
        where = "output" + jtu.keystr(path)
        if not is_array(leaf):
            static.append(leaf)
            continue
        if leaf_spec.dims is None:
            raise SpecError(
                f"`{fun_name}`: `out_dims` gives `None` for `{where}`, which is an "
                f"array; every output array is mapped over {', '.join(mapped)}, so "
                "give it a dims string that names them."
            )
        # Where the dims came from, for errors.
        if out_dims is not None and not isinstance(out_dims, OutAnnotation):
            source = "`out_dims`"
        elif leaf_spec.dims is default_out:
            source = "the default `out_dims`"
        else:
            source = "the return annotation"
        check_output(
            fun_name, where, leaf.shape, leaf_spec.dims, mapped, sizes, seen, source
        )
        dyn_out.append(leaf)
        dims_list.append(leaf_spec.dims)
        static.append(_DYNAMIC)
    return dyn_out, OutLayout(dims_list, (treedef, static))


def _describe_nest(
    fun_name: str, scan: dict[str, int | None], vmap: Sequence[str], sizes: dict
) -> str:
    return f"{fun_name}: {describe_nest(scan, vmap, sizes)}"


@overload
def filter_multi_vmap(
    *,
    in_dims: InDims = None,
    out_dims: OutDims = None,
    vmap: str | Sequence[str] | None = None,
    scan: ScanSpec = None,
    checkpoint: bool = False,
    verbose: bool = False,
    shard: ShardSpec = None,
    mesh: jax.sharding.Mesh | None = None,
    pad: bool = False,
    plan: PlanMode | None = None,
    memory_budget: MemoryBudget = None,
) -> Callable[[Callable[..., _T]], Callable[..., _T]]: ...


@overload
def filter_multi_vmap(
    fun: Callable[..., _T],
    *,
    in_dims: InDims = None,
    out_dims: OutDims = None,
    vmap: str | Sequence[str] | None = None,
    scan: ScanSpec = None,
    checkpoint: bool = False,
    verbose: bool = False,
    shard: ShardSpec = None,
    mesh: jax.sharding.Mesh | None = None,
    pad: bool = False,
    plan: PlanMode | None = None,
    memory_budget: MemoryBudget = None,
) -> Callable[..., _T]: ...


def filter_multi_vmap(
    fun=None,
    *,
    in_dims: InDims = None,
    out_dims: OutDims = None,
    vmap: str | Sequence[str] | None = None,
    scan: ScanSpec = None,
    checkpoint: bool = False,
    verbose: bool = False,
    shard: ShardSpec = None,
    mesh: jax.sharding.Mesh | None = None,
    pad: bool = False,
    plan: str | None = None,  # `PlanMode | None`; checked with a clearer message
    memory_budget: MemoryBudget = None,
):
    """Map a function over several named dims at once: `scan` outside, `vmap` inside.

    The dims of each argument and of the output are written as dims strings in the
    notation of jaxtyping (`"T F B 2 2"`), describing the *whole* shape that the
    caller passes. Each dim is given a strategy; the function body is called on one
    element, with every mapped dim removed, and the results are stacked back in the
    order of `out_dims`.

    **Arguments:**

    - `fun`: the function to map. Its arguments and output may be any pytrees;
        array leaves (`equinox.is_array`) are mapped, every other leaf (Python
        scalars, strings, callables, `None`, static fields) passes through
        unchanged, in and out.
    - `in_dims`: the dims of the arguments. One of:
        - a dims string, used for every argument;
        - a tuple, one entry per positional argument (keyword arguments are then
          unmapped);
        - a dict by parameter name; keyword-only parameters and the keys of
          `**kwargs` may be named too.

        Each entry is a dims string, `None` (not mapped: passed whole), or a pytree
        prefix of the argument with dims strings at its leaves. A dims string has
        names (checked to have one size across all arguments), integers (a fixed
        size), `_` (one axis of any size) and at most one `...` (any number of
        axes). Arguments that `in_dims` does not mention take their dims from their
        jaxtyping annotations (see "Dims from annotations" below); unannotated ones
        are not mapped.

    - `out_dims`: the dims of the output, as a dims string or a pytree prefix of the
        output. Each output array must name every mapped dim once; the output's axes
        come back in this order (a transpose is only made when the order differs
        from the nest's). Defaults to the return annotation, if there is one; else
        to the mapped dims, in the order in which they first appear in the
        arguments, followed by `...`.
    - `vmap`: the dims to `jax.vmap` over, as `"B F"` or `("B", "F")`.
    - `scan`: the dims to `jax.lax.scan` over, as `"T"`, `("T",)`, or a dict
        `{"T": k}` to scan over chunks of `k` elements with a vmap inside each chunk
        (as `jax.lax.map(..., batch_size=k)`); the remainder, when `k` does not
        divide the size, is vmapped separately, so no padding ever reaches `fun`.
        `{"T": None}` is an unchunked scan.

        The nest is always `scan(scan(... vmap(vmap(fun))))`: the scans outermost in
        the order given, the vmaps inside them in the order given. If neither
        `vmap` nor `scan` is given, every named dim in `out_dims` (or, without
        `out_dims`, in the return annotation) is vmapped.

    - `checkpoint`: if `True`, wrap each scan body in `jax.checkpoint`, so that
        reverse-mode autodiff stores only the scan's inputs, not every intermediate.
    - `shard`: dims to shard over a device mesh with `jax.shard_map`, as a dict from
        dim name to mesh axis name, `{"F": "freq"}`, or to a tuple of mesh axis
        names, `{"F": ("x", "y")}`. Each sharded dim is split into contiguous
        blocks, one per device along those axes; arrays without a sharded dim are
        replicated, and the outputs come back sharded (`NamedSharding`) along the
        same axes. Inside each shard a sharded dim is scanned if it is also in
        `scan` (chunked scans then chunk each local block) and vmapped otherwise,
        so the nest is `shard_map(scan(... vmap(fun)))`. A pure map compiles to no
        collectives. See the README section "Sharding".
    - `mesh`: the `jax.sharding.Mesh` for `shard`. Defaults to the ambient mesh set
        with `jax.set_mesh(mesh)`, looked up at trace time.
    - `pad`: what to do when a sharded dim's size is not a multiple of the number of
        devices along its mesh axes. If `False` (the default), raise
        [`eqx_multimap.ShapeError`][]. If `True`, pad the dim with copies of its
        last element (real data, so the padded calls cannot produce NaNs), and trim
        the outputs back exactly; a JAX array cannot be sharded unevenly, so the
        outputs are then gathered (replicated) along that dim.
    - `verbose`: if `True`, print the nest each time the function is traced (and,
        with `plan="auto"`, the plan table whenever a new signature is planned).
    - `plan`: `None` (default) runs the nest given by `vmap`/`scan`. `"auto"` lets
        the planner choose it per call signature: the mapped dims are those named by
        `vmap` and `scan` (or by `out_dims`), and for them it chooses which to scan,
        in which order and with which chunk sizes. Candidate nests are compiled
        (never run) and scored by XLA's memory and cost analyses: full vmap when its
        temporary memory fits `memory_budget`; else, for each of a few orders of
        the dims, the scan with the largest per-iteration block that fits (the
        closest to full vmap), and of those the one with the lowest estimated time
        (flops and bytes, with scan bodies counted once per iteration, plus loop
        overhead). On CPU, temporaries above 32 MiB are allocated, and
        page-faulted in, afresh on every call, which the estimate charges; so when
        the choice's are, the largest block below that is costed too, and the
        cheaper wins. With `shard=`, the local nest of one device is
        planned, the budget being per device. Plans are cached per signature; see
        [`eqx_multimap.explain`][] to inspect one. Planning respects `checkpoint`
        but budgets the forward pass only.
    - `memory_budget`: with `plan="auto"`, the temporary memory the mapped
        computation may use (excluding its inputs and outputs): an `int` in bytes,
        or a `float` in `(0, 1]` as a fraction of the memory of the first local
        device. Where the backend reports no device memory (CPU), the fraction is
        of physical RAM (`os.sysconf`); `explain` says which was used. Defaults to
        `0.5`.

    **Returns:**

    A function with the same signature as `fun`, taking the full (mapped) arrays.
    Bad dims strings raise [`eqx_multimap.SpecError`][] at decoration time; arrays
    whose shapes do not fit their dims raise [`eqx_multimap.ShapeError`][] at call
    (trace) time, naming the argument path, the dim and every size seen.

    !!! example

        ```python
        import jax.numpy as jnp
        from eqx_multimap import filter_multi_vmap

        @filter_multi_vmap(
            in_dims={"vis": "T F B 2 2", "nu": "F"},
            out_dims="F T B 2 2",
            scan="T",
            vmap="F B",
        )
        def scale(vis, nu):
            return vis * nu  # vis: (2, 2), nu: ()

        out = scale(jnp.ones((10, 4, 5, 2, 2)), jnp.arange(4.0))
        # out.shape == (4, 10, 5, 2, 2)
        ```

    !!! info "Dims from annotations"

        Jaxtyping annotations give the dims, and the dtypes, without repeating them:
        like dims strings they describe the *whole* (batched) shapes that the caller
        passes, and the return annotation gives the output's dims and order.

        ```python
        class SkyModel(eqx.Module):
            flux: Float[Array, "S F"]
            lmn: Float[Array, "S 3"]

        @filter_multi_vmap(scan="T", vmap="B")
        def predict(
            sky: SkyModel, vis: Float[Array, "T F B 2 2"], nu: Float[Array, "F"]
        ) -> Float[Array, "F T B 2 2"]:
            ...  # vis: (F, 2, 2); sky.flux: (S, F), checked against nu's F
        ```

        - Array annotations (`Float[Array, ...]`, `Int[...]`, `Shaped[...]`,
          `Key[...]`, `Float[np.ndarray, ...]`, `PyTree[Float[...]]`, and `X | None`)
          give a dims string with a dtype check (a mismatch raises
          [`eqx_multimap.ShapeError`][]). Variadic (`*batch`), broadcastable
          (`#B`), `?`-dims and symbolic dims are not supported and raise
          [`eqx_multimap.SpecError`][]; `*_` is `...`.
        - An `eqx.Module` argument (annotated as one, or just passed) gets its dims
          from its field annotations, recursively through nested modules and
          annotated tuples and lists of them; static and unannotated fields are not
          mapped. A return annotation can be a `Module` type, or a tuple.
        - Explicit `in_dims` (per argument) and `out_dims` override annotations.
        - The annotation of `*args` or `**kwargs` gives the dims of each of their
          entries, as in Python (`**kw: Float[Array, "F"]`).
        - Annotations are read with `typing.get_type_hints` at the first call, so
          `from __future__ import annotations` and forward references work.

        A runtime type checker goes *outside*, so that it checks the batched shapes
        that the annotations describe:

        ```python
        @jaxtyped(typechecker=beartype)
        @filter_multi_vmap(scan="T", vmap="B")
        def predict(...): ...
        ```

        Inside `@filter_multi_vmap` it would see one element, without the mapped
        dims; that order raises a `SpecError` (unless every mapped argument and the
        output have explicit `in_dims`/`out_dims`, in which case the annotations are
        per-element and checked as such).

    !!! tip

        `filter_multi_vmap` does not itself `jit`; compose it with `jax.jit` or
        `equinox.filter_jit`. The shape checks then run once, at trace time.
    """
    if fun is None:
        return ft.partial(
            filter_multi_vmap,
            in_dims=in_dims,
            out_dims=out_dims,
            vmap=vmap,
            scan=scan,
            checkpoint=checkpoint,
            verbose=verbose,
            shard=shard,
            mesh=mesh,
            pad=pad,
            plan=plan,
            memory_budget=memory_budget,
        )
    if not callable(fun):
        raise SpecError(
            f"`filter_multi_vmap` must wrap a callable, but got {fun!r} of type "
            f"`{type(fun).__name__}`. Options such as `in_dims` are keyword-only."
        )
    check_plan_options(plan, memory_budget)
    scan_parsed = _parse_scan(scan)
    vmap_parsed = parse_names(vmap, "vmap")
    both = set(vmap_parsed).intersection(name for name, _ in scan_parsed)
    if both:
        raise SpecError(
            f"`filter_multi_vmap`: dim '{sorted(both)[0]}' is given both `vmap` and "
            "`scan`; each dim gets one strategy."
        )
    if isinstance(in_dims, Mapping):
        for key, value in in_dims.items():
            _validate_tree(value, f"`filter_multi_vmap(..., in_dims={{{key!r}: ...}})`")
    else:
        _validate_tree(in_dims, "`filter_multi_vmap(..., in_dims=...)`")
    _validate_tree(out_dims, "`filter_multi_vmap(..., out_dims=...)`")
    shard_parsed = parse_shard(shard, mesh, pad)
    wrapper = _MultiVmapWrapper(
        _fun=fun,
        _in_dims=_Frozen(in_dims),
        _out_dims=_Frozen(out_dims),
        _scan=scan_parsed,
        _vmap=vmap_parsed,
        _checkpoint=bool(checkpoint),
        _verbose=bool(verbose),
        _shard=shard_parsed,
        _plan=plan,
        _memory_budget=memory_budget,
    )
    return eqx.module_update_wrapper(wrapper)
