"""The body, traced once on one element.

[`trace_body`][] traces the mapped function with `jax.make_jaxpr` on
`ShapeDtypeStruct`s of one element (the argument leaves without their mapped axes).
Every array the body closes over (a closure's arrays, an `eqx.Module`'s fields,
tracers of an enclosing transform) becomes an explicit input of the [`Body`][]: the
nest is then a pure function of its inputs, which `jax.custom_jvp` and
`jax.shard_map` need, and the output's structure and shapes are known before any
nest is built.

The body's jaxpr is read by `_jaxpr` (its collectives, its checks, which scanned
inputs to slice apart from its kernels), and evaluated afresh by `_jaxpr.rebind`.

Every mapped dim is an axis name of the body (`lax.psum(x, "F")`): a vmapped dim's
level binds it. Inside `jax.shard_map` a sharded dim `F` is vmapped over each
device's block, so the body traced for inside rewrites its collectives over `F` to
span the mesh axes too (see `_Sharded`).
"""

import dataclasses
import functools as ft
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.lax as lax
import numpy as np
from jax._src import traceback_util
from jax.experimental import checkify
from jax.sharding import NamedSharding, PartitionSpec

from ._args import BoundCall, is_array
from ._errors import SpecError
from ._jaxpr import (
    axis_names,
    bind_params,
    collectives,
    has_checks,
    inlined,
    rebind,
    sub_jaxprs,
)
from ._shard import ShardPlan


traceback_util.register_exclusion(__file__)


def struct(x: Any, shape: tuple[int, ...] | None = None) -> jax.ShapeDtypeStruct:
    """`x` as a `ShapeDtypeStruct` (with its weak type), optionally reshaped. Its
    dtype is the one JAX computes in (a NumPy `float64` is `float32` without x64)."""
    weak = bool(getattr(jax.typeof(x), "weak_type", False))
    dtype = jax.dtypes.canonicalize_dtype(x.dtype, allow_extended_dtype=True)
    shape = np.shape(x) if shape is None else shape
    return jax.ShapeDtypeStruct(shape, dtype, weak_type=weak)


@dataclasses.dataclass(frozen=True, eq=False)
class Body:
    """The body traced on one element: `jaxpr` (a `ClosedJaxpr`) over the array
    leaves of the arguments, then the arrays the body closed over (`hoisted`),
    which the nest passes in as unmapped inputs.

    With `shard=`, `jaxpr` was traced for inside `jax.shard_map` (the mesh's axes
    manual), and `standalone` is the body traced outside, from which the planner
    compiles one device's nest on its own. The planner compiles outside
    `checkify.checkify`: a standalone body that calls `checkify.check` computes
    its checks functionally (`unchecked`), and drops their error.
    """

    # Compared and hashed by identity (`eq=False`): JAX keys its caches on the
    # callables it transforms (`jax.checkpoint` of a scan level whose body is this),
    # and the hoisted arrays are not hashable.
    # Not in its repr: JAX takes the repr of a callable without `__code__` for its
    # debug info, once per transform, and a jaxpr's text takes a while to build.
    jaxpr: Any = dataclasses.field(repr=False)
    hoisted: tuple[Any, ...] = dataclasses.field(repr=False)
    n_args: int
    standalone_jaxpr: Any = dataclasses.field(default=None, repr=False)
    unchecked: bool = False

    def __call__(self, leaves: list[Any]) -> list[Any]:
        run = ft.partial(jax.core.eval_jaxpr, self.jaxpr.jaxpr, self.jaxpr.consts)
        if not self.unchecked:
            return run(*leaves)
        _, out = checkify.checkify(run, errors=checkify.user_checks)(*leaves)
        return out

    @property
    def standalone(self) -> "Body":
        closed = self.jaxpr if self.standalone_jaxpr is None else self.standalone_jaxpr
        unchecked = has_checks(closed)
        if self.standalone_jaxpr is None and not unchecked:
            return self
        return Body(closed, self.hoisted, self.n_args, unchecked=unchecked)


#
# Collectives over a sharded dim.
#


@dataclasses.dataclass(frozen=True)
class _Sharded:
    """Rewrites a body's collectives over sharded dims for inside `shard_map`, where
    each sharded dim `F` over mesh axes `axes` is vmapped over a device's block of
    `local` elements (device `d` holding elements `[d * local, (d + 1) * local)`):

    - `psum`, `pmax`, `pmin` over `F`: over the local vmap axis, then the mesh axes;
    - `all_gather` over `F`: the local block, then the blocks of the mesh axes
        (tiled), so the elements come in their global order;
    - `axis_index("F")`: the global index, `mesh index * local + local index`.
    """

    plan: ShardPlan

    @property
    def dims(self) -> dict[str, tuple[str, ...]]:
        return dict(self.plan.dims)

    def _named(self, names: tuple[str, ...]) -> list[str]:
        return [n for n in names if n in self.dims]

    def touches(self, eqn: Any) -> bool:
        inner = (names for sub in sub_jaxprs(eqn) for _, names in collectives(sub))
        return any(map(self._named, [axis_names(eqn), *inner]))

    def _error(self, prim: str, name: str, why: str) -> SpecError:
        return SpecError(
            f"`{self.plan.fun_name}`: the body uses the collective `{prim}` over dim "
            f"'{name}', which `shard` splits over mesh axes {self.dims[name]!r}: "
            f"{why} Supported over a sharded dim: `psum`, `pmean`, `pmax`, `pmin`, "
            "`all_gather` and `axis_index`; or use `reduce=` to combine over it."
        )

    def bind(self, eqn: Any, invals: list[Any]) -> list[Any]:
        prim = eqn.primitive
        names = axis_names(eqn)
        if not names:  # a call with such collectives inside
            if (call := inlined(eqn)) is not None:
                return rebind(*call, invals, self)
            inner, name = next(
                (p, n)
                for sub in sub_jaxprs(eqn)
                for p, ns in collectives(sub)
                for n in self._named(ns)
            )
            raise self._error(
                inner,
                name,
                f"it is inside `{prim.name}`, which cannot be rewritten to span the "
                "mesh.",
            )
        sharded = self._named(names)
        for name in sharded:
            if name in self.plan.padded:
                raise self._error(
                    prim.name,
                    name,
                    f"with `pad=True` it is padded (to {self.plan.padded[name]}), and "
                    "the padding would take part.",
                )
        params = bind_params(eqn)
        mesh_axes = tuple(a for name in sharded for a in self.dims[name])
        if prim.name in ("psum", "pmax", "pmin"):
            outs = prim.bind(*invals, **params)
            outs = outs if prim.multiple_results else [outs]
            outs = prim.bind(*outs, **dict(params, axes=mesh_axes))
            return outs if prim.multiple_results else [outs]
        if prim.name == "all_gather" and names == tuple(sharded) and len(names) == 1:
            name = names[0]
            local = self.plan.local_sizes[name]
            out = prim.bind(*invals, **dict(params, axis_size=local))
            shards = int(np.prod([self.plan.mesh.shape[a] for a in mesh_axes]))
            out = prim.bind(
                out, **dict(params, axis_name=mesh_axes, axis_size=shards, tiled=True)
            )
            return [out]
        if prim.name == "axis_index" and len(names) == 1:
            name = names[0]
            index = 0
            for a in mesh_axes:
                index = index * self.plan.mesh.shape[a] + lax.axis_index(a)
            return [index * self.plan.local_sizes[name] + prim.bind(**params)]
        if prim.name == "all_gather":
            why = "over several dims at once, that is not supported."
        else:
            why = "it cannot be rewritten to span the mesh."
        raise self._error(prim.name, sharded[0], why)


def trace_body(
    fun: Callable,
    bound: BoundCall,
    dyn_index: list[int],
    element_specs: list[jax.ShapeDtypeStruct],
    axis_env: list[tuple[str, int]],
    shard: ShardPlan | None,
) -> tuple[Body, Any]:
    """The body on one element as a jaxpr, and its output as `ShapeDtypeStruct`s
    (non-array leaves as they are).

    With `shard`, the body is traced as `jax.shard_map` traces its function: with
    the mesh's axes manual (the jaxpr then runs inside the `shard_map`)."""
    static_out: list[Any] = []

    def element(dyn: list[Any]) -> Any:
        values = [leaf.value for leaf in bound.leaves]
        for i, v in zip(dyn_index, dyn):
            values[i] = v
        args, kwargs = bound.rebuild(values)
        out = fun(*args, **kwargs)
        arrays, others = eqx.partition(out, is_array)
        static_out.append(others)
        return arrays

    # Mesh axes that `shard=` leaves to the compiler are bound too, to be named in
    # an error.
    others = [] if shard is None else shard.unbound_axes(axis_env)
    closed, shapes = jax.make_jaxpr(
        element, axis_env=[*axis_env, *others], return_shape=True
    )(element_specs)
    if shard is not None:
        shard.check_collectives(collectives(closed.jaxpr))
    # The arrays the body closed over become inputs: trace the jaxpr once more,
    # with them as arguments.
    hoisted = tuple(closed.consts)

    def with_hoisted(dyn: list[Any], consts: list[Any]) -> Any:
        return rebind(closed.jaxpr, consts, dyn)

    hoisted_specs = [struct(c) for c in hoisted]
    jaxpr = jax.make_jaxpr(with_hoisted, axis_env=axis_env)(
        element_specs, hoisted_specs
    )
    out = eqx.combine(shapes, static_out[-1])
    if shard is None:
        return Body(jaxpr, hoisted, len(element_specs)), out
    # As `jax.shard_map` traces its function: with the mesh's axes manual, and
    # every value on that mesh. Traced afresh rather than `closed` rebound, so that
    # the jaxprs nested in calls, loops and custom rules are on that mesh too (`grad`
    # of the `shard_map` rejects a cotangent whose mesh is not its primal's).
    manual = shard.inside_mesh
    replicated = NamedSharding(manual, PartitionSpec())

    def on_mesh(specs: list[jax.ShapeDtypeStruct]) -> list[jax.ShapeDtypeStruct]:
        return [
            jax.ShapeDtypeStruct(
                s.shape, s.dtype, weak_type=s.weak_type, sharding=replicated
            )
            for s in specs
        ]

    try:
        with jax.sharding.use_abstract_mesh(manual):
            traced = jax.make_jaxpr(element, axis_env=axis_env)(on_mesh(element_specs))
    except Exception:
        # Some bodies trace outside `shard_map` but not on its manual mesh (in JAX
        # 0.10, diffrax's and lineax's solves, which compare structures that carry
        # the mesh). Their values are right with `closed` rebound; their `grad`s may
        # fail, as in a plain `jax.shard_map`.
        traced = None
    if traced is not None and [struct(c) for c in traced.consts] == hoisted_specs:
        closed, specs = traced, on_mesh
    else:  # (or it closed over other arrays this time, made as it was traced)
        specs = list
    sharded = _Sharded(shard)

    def inside_shard_map(dyn: list[Any], consts: list[Any]) -> Any:
        return rebind(closed.jaxpr, consts, dyn, sharded)

    manual_env = [(a, manual.shape[a]) for a in shard.manual]
    with jax.sharding.use_abstract_mesh(manual):
        inside = jax.make_jaxpr(inside_shard_map, axis_env=[*axis_env, *manual_env])(
            specs(element_specs), specs(hoisted_specs)
        )
    return Body(inside, hoisted, len(element_specs), jaxpr), out
