"""`filter_multi_vmap`: the decorator, its wrapper, and one call from end to end.

One call flows one way: the wrapper's options were parsed at decoration
(`_options`); `_resolve` binds and checks the arguments and traces the body once;
`_planner` chooses the nest (with `plan=`); `_nest` builds and runs it, inside
`jax.shard_map` with `shard=` (`_shard`); with `reduce=`, the partial results of
the devices are combined, and a mean divided (`_reduce`); the wrapper rebuilds the
output.
"""

import dataclasses
import functools as ft
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, overload, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax._src import traceback_util
from jaxtyping import PyTree

from ._args import check_in_dims_keys, is_array
from ._blocks import describe_nest, NestSpec
from ._body import struct
from ._errors import SpecError
from ._nest import Build, mapped_axes, mapped_function, Problem
from ._options import explicit_mapped, Options, parse_options, ScanSpec
from ._planner import Plan, plan_options, PlanMode, Planner
from ._progress_bar import make_meter
from ._reduce import op_name, ReduceSpec
from ._resolve import Call, fun_name_of, resolve
from ._shard import parse_shard, shard_repr, shardings_seen, ShardPlan, ShardSpec
from ._text import wrap_nest


traceback_util.register_exclusion(__file__)

_T = TypeVar("_T")

DimsSpec = str | None
"""A dims string such as `"T F B 2 2"`, or `None` for an unmapped value."""

InDims = PyTree[DimsSpec] | Mapping[str, PyTree[DimsSpec]]
"""Dims for the arguments: a dims string, a tuple (one entry per positional
argument) or a dict by parameter name; each entry a pytree prefix of its argument."""

OutDims = PyTree[DimsSpec]
"""Dims for the output: a pytree prefix of the output with dims strings at leaves."""


def run_call(call: Call) -> Any:
    """Choose the nest of a resolved call, build it, run it; the output pytree."""
    options = call.options
    spec = call.given_nest()
    build = Build(call.isolate, options.checkpoint, make_meter(call))
    diff = None
    forward: NestSpec | Callable[[], NestSpec] = spec
    if options.plan is not None:
        planner = options.plan.planner

        def forward_nest() -> NestSpec:
            # Planned only when the forward nest is traced: a differentiated call
            # runs `diff`'s nest alone.
            return planner.plan(call).spec

        forward = forward_nest
        if options.verbose:
            spec = forward = forward_nest()

        def diff() -> tuple[NestSpec, Build]:
            # Planned only when the call is differentiated.
            plan = planner.plan(call, backward=True)
            return plan.spec, dataclasses.replace(build, checkpoint=plan.checkpoint)

    reduction, shard = call.reduction, call.shard
    sizes = call.mapped_sizes
    if shard is not None:
        sizes = {name: shard.local_sizes[name] for name in call.mapped}
    if options.verbose:
        line = f"{call.fun_name}: {describe_nest(spec, sizes)}"
        line = line if shard is None else shard.describe(line)
        if reduction is not None:
            ops = ", ".join(f"{name!r}: {op_name(op)!r}" for name, op in reduction.ops)
            line += f"; reduce={{{ops}}}"
        print(wrap_nest(line))
    problem = call.problem(sizes)
    if shard is None:
        outs = mapped_function(problem, forward, build, diff)(list(call.values))
    else:
        values, leaf_axes = list(call.values), list(call.leaf_axes)
        padded = [n for n in shard.padded if reduction and n in reduction.dims]
        if padded:
            problem, values, leaf_axes = _mask_padding(problem, values, shard, padded)
        local = mapped_function(problem, forward, build, diff)
        ndims = [len(s.shape) + len(call.out_mapped) for s in call.out.shapes]
        outs = shard.run(
            values,
            leaf_axes,
            call.out.dims,
            ndims,
            _across_devices(call, local, ndims),
            prepadded=range(len(call.values), len(values)),
            in_dims=[x.spec.dims for x in call.bound.leaves if is_array(x.value)],
        )
    if reduction is not None:
        outs = [reduction.finalize(i, out) for i, out in enumerate(outs)]
    return call.out.combine(outs)


def _across_devices(call: Call, local: Callable, ndims: list[int]) -> Callable:
    """`local`, then, for the reduced sharded dims, its partial results combined
    across their mesh axes (one collective: `psum`, `pmax`, `pmin`)."""
    reduction, shard = call.reduction, call.shard
    assert shard is not None
    if reduction is None:
        return local
    mesh_axes = tuple(a for n, axes in shard.dims if n in reduction.dims for a in axes)
    if not mesh_axes:
        return local
    batch = [
        mapped_axes(dims, call.out_mapped, n) for dims, n in zip(call.out.dims, ndims)
    ]

    def combined(values: list) -> list:
        outs = local(values)
        return [
            reduction.across_devices(out, mesh_axes, axes)
            for out, axes in zip(outs, batch)
        ]

    return combined


def _mask_padding(
    problem: Problem, values: list, shard: ShardPlan, padded: list[str]
) -> tuple[Problem, list, list]:
    """With `pad=True`, a reduced sharded dim's padding must not take part: one more
    input leaf per such dim says which elements are real, and the body's outputs of
    the others are the op's identity."""
    reduction = problem.reduce
    assert reduction is not None
    n = len(values)
    masks = [jnp.arange(shard.padded[name]) < shard.sizes[name] for name in padded]
    body = problem.body

    def masked(leaves: list) -> list:
        outs = body(leaves[:n])
        valid = leaves[n]
        for v in leaves[n + 1 :]:
            valid = valid & v
        return [
            jnp.where(valid, y, reduction.identity(i, y.shape, y.dtype))
            for i, y in enumerate(outs)
        ]

    leaf_axes = list(problem.leaf_axes) + [{name: 0} for name in padded]
    problem = dataclasses.replace(problem, body=masked, leaf_axes=tuple(leaf_axes))
    return problem, values + masks, leaf_axes


def _has_tracer(tree: Any) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jtu.tree_leaves(tree))


def _static_hashable(tree: Any) -> bool:
    _, static = eqx.partition(tree, eqx.is_array)
    leaves, treedef = jtu.tree_flatten(static)
    try:
        hash((tuple(leaves), treedef))
    except TypeError:
        return False
    return True


class _Static(eqx.Module):
    """The non-array leaves of an eager call's output, carried out of `jax.jit`."""

    leaves: tuple = eqx.field(static=True)
    treedef: Any = eqx.field(static=True)

    @property
    def value(self) -> Any:
        return jtu.tree_unflatten(self.treedef, self.leaves)


class _EagerRunner:
    """The un-jitted calls of a function, each compiled once per call signature
    (arrays traced, everything else static, as `equinox.filter_jit` does), so that
    repeated calls neither re-trace nor re-compile.

    A callable compared by identity (a function, a partial, a jitted function) has
    a `jax.jit` of its own, which holds the callable weakly, in `_RUNNERS` under
    it: what it compiled is released with it, as `jax.jit(fun)`'s is. A callable
    compared by value (an `eqx.Module`, a bound method) goes through one shared
    runner, whose compile cache holds the static parts of the callable, as
    `equinox.filter_jit`'s does.
    """

    def __init__(self, fun: Callable | None):
        fun_ref = None if fun is None else weakref.ref(fun)
        self._own = fun_ref is not None

        def run(dynamic: tuple, static: tuple) -> tuple[Any, _Static]:
            dynamic_fun, dynamic_args = dynamic
            static_fun, options, leaves, treedef, seen = static
            if fun_ref is not None:
                static_fun = eqx.filter(fun_ref(), eqx.is_array, inverse=True)
            traced_fun = eqx.combine(dynamic_fun, static_fun)
            static_args = jtu.tree_unflatten(treedef, leaves)
            args, kwargs = eqx.combine(dynamic_args, static_args)
            with shardings_seen(jtu.tree_leaves(dynamic), seen):
                out = run_call(resolve(traced_fun, options, args, kwargs))
            dynamic_out, static_out = eqx.partition(out, eqx.is_array)
            out_leaves, out_treedef = jtu.tree_flatten(static_out)
            return dynamic_out, _Static(tuple(out_leaves), out_treedef)

        self._jitted = jax.jit(run, static_argnums=1)

    def __call__(self, fun: Callable, options: Options, args: tuple, kwargs: dict):
        # A callable with a runner of its own is not a static argument: the compile
        # cache would hold it, and so keep it alive in `_RUNNERS`.
        dynamic_fun, static_fun = eqx.partition(fun, eqx.is_array)
        dynamic_args, static_args = eqx.partition((args, kwargs), eqx.is_array)
        leaves, treedef = jtu.tree_flatten(static_args)
        dynamic = (dynamic_fun, dynamic_args)
        # With `shard=`, the arrays' shardings: a trace shows `Explicit` axes only.
        seen = options.shard.seen(jtu.tree_leaves(dynamic)) if options.shard else ()
        static = (None if self._own else static_fun, options, tuple(leaves), treedef)
        dynamic_out, static_out = self._jitted(dynamic, (*static, seen))
        return eqx.combine(dynamic_out, static_out.value)


_RUNNERS: "weakref.WeakKeyDictionary[Callable, _EagerRunner]" = (
    weakref.WeakKeyDictionary()
)
"""The runner of each callable compared by identity, released with it."""

_SHARED_RUNNER = _EagerRunner(None)
"""The runner of every other callable."""


def _eager_runner(fun: Callable) -> _EagerRunner:
    if type(fun).__hash__ is not object.__hash__:
        return _SHARED_RUNNER
    try:
        runner = _RUNNERS.get(fun)
        if runner is None:
            # Two threads may both build one: the one kept is as good as the other.
            runner = _RUNNERS.setdefault(fun, _EagerRunner(fun))
    except TypeError:  # not weakly referenceable
        return _SHARED_RUNNER
    return runner


class Wrapper(eqx.Module):
    """A function wrapping `_fun`, which binds as a method when a class holds it."""

    _fun: Callable

    @property
    def __wrapped__(self):
        return self._fun

    def __get__(self, instance, owner):
        del owner
        if instance is None:
            return self
        return jtu.Partial(self, instance)


class _MultiVmapWrapper(Wrapper):
    _options: Options = eqx.field(static=True)

    @property
    def __globals__(self) -> dict[str, Any]:
        # Read by `jaxtyping.jaxtyped` (and `typing.get_type_hints`) to resolve string
        # annotations, so that `@jaxtyped` can go outside `@filter_multi_vmap`.
        return getattr(self._fun, "__globals__", {})

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "__no_type_check__":
            # `typing.no_type_check(wrapper)`: the function's annotations are not
            # type hints to a type checker; they still give the dims.
            try:
                setattr(self._fun, name, value)
            except (AttributeError, TypeError):  # a builtin, say
                pass
            return
        super().__setattr__(name, value)

    @traceback_util.api_boundary
    def __call__(self, /, *args, **kwargs):
        # An un-jitted call runs the nest compiled once (see `_EagerRunner`).
        eager = (
            not jax.config.jax_disable_jit
            and not _has_tracer((self._fun, args, kwargs))
            and _static_hashable((self, args, kwargs))
        )
        if eager:
            plan = self._options.plan
            if plan is not None and plan.planner.measure is True:
                _tune_once(self, plan.planner, args, kwargs)
            return _eager_runner(self._fun)(self._fun, self._options, args, kwargs)
        return run_call(resolve(self._fun, self._options, args, kwargs))

    def __repr__(self) -> str:
        return _describe_wrapper(self._fun, self._options)


def _describe_wrapper(fun: Callable, options: Options) -> str:
    parts = [fun_name_of(fun)[len("filter_multi_vmap(") : -1]]
    if options.in_dims.value is not None:
        parts.append(f"in_dims={options.in_dims.value!r}")
    if options.out_dims.value is not None:
        parts.append(f"out_dims={options.out_dims.value!r}")
    if options.core:
        parts.append(f"core={' '.join(options.core)!r}")
    if options.scan:
        if all(c is None for _, c in options.scan):
            parts.append(f"scan={' '.join(options.scan_names)!r}")
        else:
            parts.append(f"scan={dict(options.scan)!r}")
    if options.vmap:
        parts.append(f"vmap={' '.join(options.vmap)!r}")
    if options.reduce:
        ops = ", ".join(f"{n!r}: {op_name(op)!r}" for n, op in options.reduce)
        parts.append(f"reduce={{{ops}}}")
    if options.shard is not None:
        parts.append(f"shard={shard_repr(options.shard.dims)}")
        if (mesh := options.shard.mesh) is not None:
            axes = ", ".join(f"{name!r}: {size}" for name, size in mesh.shape.items())
            parts.append(f"mesh=Mesh({axes})")
        if options.shard.pad:
            parts.append("pad=True")
    if options.plan is not None:
        parts.append(f"plan={options.plan.mode}")
        if options.plan.memory_budget is not None:
            parts.append(f"memory_budget={options.plan.memory_budget!r}")
    if options.checkpoint:
        parts.append("checkpoint=True")
    parts += [f"progress={options.progress!r}"] if options.progress else []
    return f"filter_multi_vmap({', '.join(parts)})"


@overload
def filter_multi_vmap(
    *,
    in_dims: InDims = None,
    out_dims: OutDims = None,
    core: str | Sequence[str] | None = None,
    vmap: str | Sequence[str] | None = None,
    scan: ScanSpec = None,
    reduce: ReduceSpec = None,
    shard: ShardSpec = None,
    mesh: jax.sharding.Mesh | None = None,
    pad: bool = False,
    plan: PlanMode | Planner | None = None,
    memory_budget: int | float | None = None,
    checkpoint: bool = False,
    verbose: bool = False,
    progress: bool | Literal["tqdm", "text"] = False,
) -> Callable[[Callable[..., _T]], Callable[..., _T]]: ...


@overload
def filter_multi_vmap(
    fun: Callable[..., _T],
    *,
    in_dims: InDims = None,
    out_dims: OutDims = None,
    core: str | Sequence[str] | None = None,
    vmap: str | Sequence[str] | None = None,
    scan: ScanSpec = None,
    reduce: ReduceSpec = None,
    shard: ShardSpec = None,
    mesh: jax.sharding.Mesh | None = None,
    pad: bool = False,
    plan: PlanMode | Planner | None = None,
    memory_budget: int | float | None = None,
    checkpoint: bool = False,
    verbose: bool = False,
    progress: bool | Literal["tqdm", "text"] = False,
) -> Callable[..., _T]: ...


@traceback_util.api_boundary
def filter_multi_vmap(
    fun=None,
    *,
    in_dims: InDims = None,
    out_dims: OutDims = None,
    core: str | Sequence[str] | None = None,
    vmap: str | Sequence[str] | None = None,
    scan: ScanSpec = None,
    reduce: ReduceSpec = None,
    shard: ShardSpec = None,
    mesh: jax.sharding.Mesh | None = None,
    pad: bool = False,
    plan: Any = None,  # `PlanMode | Planner | None`; checked with a clearer message
    memory_budget: int | float | None = None,
    checkpoint: bool = False,
    verbose: bool = False,
    progress: Any = False,  # `bool | Literal["tqdm", "text"]`; checked likewise
):
    """Map a function over several named dims at once: `shard_map` outermost, then
    `scan`, then `vmap`.

    The dims of each argument and of the output are dims strings in the notation of
    jaxtyping (`"T F B 2 2"`), or jaxtyping annotations, describing the *whole*
    shapes that the caller passes. **The mapped dims are the named dims of the
    output**; a dim named only by the inputs is a core dim, checked but not mapped.
    The function body is called on one element, without the mapped dims, and the
    results are stacked in the order of the output's dims. Strategies choose *how*
    each mapped dim is mapped, never *whether*: every choice gives the same values.

    **Arguments:**

    - `fun`: the function to map. Its arguments and output may be any pytrees;
        array leaves are mapped, every other leaf passes through unchanged.
    - `in_dims`: the dims of the arguments: a dims string for every argument, a
        tuple (one entry per positional argument) or a dict by parameter name. Each
        entry is a dims string, `None` (passed whole), or a pytree prefix of the
        argument. Defaults to the jaxtyping annotations; unannotated arguments are
        not mapped. See [Dims notation](../dims.md).
    - `out_dims`: the dims of the output, as a dims string or a pytree prefix of the
        output. Each output array names every mapped dim once. Defaults to the
        return annotation; one of the two is needed.
    - `core`: dims of the output that are *not* mapped: the body sees them whole
        (and makes them, if no argument has them).
    - `vmap`: mapped dims to `jax.vmap` over, in this order (outermost first). A
        mapped dim that no strategy names is vmapped.
    - `scan`: mapped dims to `jax.lax.scan` over, outermost first, as `"T"`, or
        `{"T": k}` to scan over chunks of `k` elements with a vmap inside each
        (as `jax.lax.map(..., batch_size=k)`; a remainder is vmapped apart, never
        padded).
    - `reduce`: mapped dims to combine away, inside the nest, as `{"T": "sum"}`
        (`"sum"`, `"mean"`, `"max"`, `"min"` or an [`eqx_multimap.Monoid`][]); the
        output does not name them. See [Reductions](../reductions.md).
    - `shard`: mapped dims to split over a device mesh with `jax.shard_map`, as
        `{"F": "freq"}` (dim to mesh axis). `mesh` is the `jax.sharding.Mesh`
        (default: the ambient one of `jax.set_mesh`); `pad=True` pads a dim that
        the mesh does not divide. See [Sharding](../sharding.md).
    - `plan`: `"auto"` lets the planner choose, per call signature, how to map the
        mapped dims that no strategy names (the scans, their order and chunk
        sizes), within `memory_budget` (bytes, or a fraction of device memory),
        for the forward and the backward pass; dims named by `scan=`, `vmap=` or
        `shard=` keep the strategy given. An [`eqx_multimap.Planner`][] instead
        of `"auto"` gives the wrapper a planner of its own (e.g.
        `Planner(measure=True)`, which times the best candidates). See
        [The planner](../planner.md).
    - `memory_budget`: with `plan`, the temporary memory that the chosen nest may
        use: bytes as an `int` (`2**30`), or a fraction of the device's memory as
        a `float` in `(0, 1]`. The default, `None`, is `0.5`: half of the
        device's memory (of physical RAM on a CPU, which reports none).
    - `checkpoint`: wrap each scan body in `jax.checkpoint`, so that reverse-mode
        autodiff stores only each iteration's inputs.
    - `verbose`: print the nest whenever the function is traced.
    - `progress`: `True` (`tqdm` if installed, else text), `"tqdm"` or `"text"`: a bar
        over the outermost scan's iterations, one per call, forward pass only; about
        5 to 10 ms a call; off, none. See
        [Progress on long scans](../strategies.md#progress-on-long-scans).

    **Returns:**

    A function with the same signature as `fun`, taking the full (mapped) arrays.
    Bad dims or strategies raise [`eqx_multimap.SpecError`][], at decoration where
    possible; arrays that do not fit their dims raise [`eqx_multimap.ShapeError`][]
    at call time, before the body is traced, naming the argument path, the dim and
    every size seen.

    !!! example

        ```python
        import jax.numpy as jnp
        from eqx_multimap import filter_multi_vmap

        @filter_multi_vmap(
            in_dims={"vis": "T F B 2 2", "nu": "F"},
            out_dims="F T B 2 2",
            scan="T",
        )
        def scale(vis, nu):
            return vis * nu  # vis: (2, 2), nu: ()

        out = scale(jnp.ones((10, 4, 5, 2, 2)), jnp.arange(4.0))
        # out.shape == (4, 10, 5, 2, 2)
        ```
    """
    if fun is None:
        return ft.partial(
            filter_multi_vmap,
            in_dims=in_dims,
            out_dims=out_dims,
            core=core,
            vmap=vmap,
            scan=scan,
            reduce=reduce,
            shard=shard,
            mesh=mesh,
            pad=pad,
            plan=plan,
            memory_budget=memory_budget,
            checkpoint=checkpoint,
            verbose=verbose,
            progress=progress,
        )
    if not callable(fun):
        raise SpecError(
            f"`filter_multi_vmap` must wrap a callable, but got {fun!r} of type "
            f"`{type(fun).__name__}`. Options such as `in_dims` are keyword-only."
        )
    options = parse_options(
        in_dims=in_dims,
        out_dims=out_dims,
        scan=scan,
        vmap=vmap,
        core=core,
        reduce=reduce,
        shard=parse_shard(shard, mesh, pad),
        plan=plan_options(plan, memory_budget),
        checkpoint=checkpoint,
        verbose=verbose,
        progress=progress,
    )
    explicit_mapped(options, fun_name_of(fun))
    check_in_dims_keys(fun, fun_name_of(fun), options.in_dims.value)
    return eqx.module_update_wrapper(_MultiVmapWrapper(fun, options))


def _tune_once(
    wrapper: "_MultiVmapWrapper", planner: Planner, args: tuple, kwargs: dict
) -> None:
    """An un-jitted call whose planner measures: its forward nest timed on these
    arguments, once per call signature (the eager runner's, without the values)."""
    dynamic, static = eqx.partition((wrapper, args, kwargs), eqx.is_array)
    leaves, treedef = jtu.tree_flatten(static)
    shapes = tuple(str(struct(x)) for x in jtu.tree_leaves(dynamic))
    if planner.first_time((tuple(leaves), treedef, shapes)):
        _tune(wrapper, (), args, kwargs)


def _tune(
    wrapper: "_MultiVmapWrapper", bound: tuple, args: tuple, kwargs: dict, again=False
) -> Plan:
    """Plan a call by timing candidates on its arguments; with `again`
    (`eqx_multimap.tune`), even if a plan so timed is cached, which it replaces,
    and its derivative's nest too (the plan's `gradient`). The forward plan."""
    call = resolve(wrapper._fun, wrapper._options, bound + args, kwargs)
    assert call.options.plan is not None
    planner = call.options.plan.planner
    plan = planner.plan(call, tune=True, again=again)
    if again:
        gradient = gradient_plan(planner, call, tune=True, again=True)
        plan = dataclasses.replace(plan, gradient=gradient)
    return plan


def gradient_plan(planner: Planner, call: Call, **kwargs) -> Plan | str:
    """The plan of differentiating `call` (`planner.plan`'s `kwargs`), or why there
    is none: `Plan.gradient`."""
    try:
        return planner.plan(call, backward=True, **kwargs)
    except SpecError as e:  # only differentiating the map would raise it
        return str(e)
    except Exception as e:  # a body JAX cannot differentiate (a while loop)
        return f"Not differentiable: {type(e).__name__}: {e}"
