"""The body, traced once on one element.

[`trace_body`][] traces the mapped function with `jax.make_jaxpr` on
`ShapeDtypeStruct`s of one element (the argument leaves without their mapped axes).
Every array the body closes over (a closure's arrays, an `eqx.Module`'s fields,
tracers of an enclosing transform) becomes an explicit input of the [`Body`][]: the
nest is then a pure function of its inputs, which `jax.custom_jvp` and
`jax.shard_map` need, and the output's structure and shapes are known before any
nest is built.

[`inputs_to_isolate`][] reads the body's jaxpr to tell which scanned inputs XLA:CPU
runs best sliced apart from the body's kernels (see `_nest.isolate_slices`), and
[`collectives`][] which collectives it uses over which dims.

Every mapped dim is an axis name of the body (`lax.psum(x, "F")`): a vmapped dim's
level binds it. Inside `jax.shard_map` a sharded dim `F` is vmapped over each
device's block, so the body traced for inside rewrites its collectives over `F` to
span the mesh axes too (see `_Sharded`).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.extend.core
import jax.lax as lax
import numpy as np
from jax._src import traceback_util
from jax.experimental import checkify
from jax.sharding import NamedSharding, PartitionSpec

from ._args import BoundCall, is_array
from ._errors import SpecError
from ._shard import ShardPlan


traceback_util.register_exclusion(__file__)


def struct(x: Any, shape: tuple[int, ...] | None = None) -> jax.ShapeDtypeStruct:
    """`x` as a `ShapeDtypeStruct` (with its weak type), optionally reshaped."""
    weak = bool(getattr(jax.typeof(x), "weak_type", False))
    return jax.ShapeDtypeStruct(
        np.shape(x) if shape is None else shape, x.dtype, weak_type=weak
    )


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
        closed = self.jaxpr
        if not self.unchecked:
            return jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *leaves)

        def run(leaves: list[Any]) -> list[Any]:
            return jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *leaves)

        _, out = checkify.checkify(run, errors=checkify.user_checks)(leaves)
        return out

    @property
    def standalone(self) -> "Body":
        closed = self.jaxpr if self.standalone_jaxpr is None else self.standalone_jaxpr
        unchecked = _has_checks(closed.jaxpr)
        if self.standalone_jaxpr is None and not unchecked:
            return self
        return Body(closed, self.hoisted, self.n_args, unchecked=unchecked)


def _rebind(
    jaxpr: Any,
    consts: list[Any],
    args: list[Any],
    sharded: "_Sharded | None" = None,
) -> list[Any]:
    """`jaxpr` evaluated on `args`, its equations bound afresh in the current
    context. (`jax.core.eval_jaxpr` restores each equation's own context, such as
    the mesh it was traced under, which inside `shard_map` is the wrong one.)

    With `sharded`, collectives over sharded dims are rewritten to span the mesh."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jax.extend.core.Literal) else env[v]

    for eqn in jaxpr.eqns:
        invals = list(map(read, eqn.invars))
        if sharded is not None and sharded.touches(eqn):
            outs = sharded.bind(eqn, invals)
        else:
            params = eqn.primitive.get_bind_params(eqn.params)
            outs = eqn.primitive.bind(*invals, **params)
            if not eqn.primitive.multiple_results:
                outs = [outs]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


#
# Collectives.
#

# Primitives whose axis-name parameters are not collectives.
_NOT_COLLECTIVES = frozenset({"pvary", "pcast"})
# Calls that a sharded dim's collectives can be rewritten through (inlined).
_INLINE = frozenset({"jit", "pjit", "closed_call", "core_call", "call"})


def _is_axis_key(key: str) -> bool:
    """Whether a parameter names axes: `axes` (`psum`, `pmax`...), `axis_name`
    (`all_gather`, `ppermute`, `axis_index`...), and, for primitives we do not
    know, anything else called so (`axis_names`, `spmd_axis_name`...)."""
    return key == "axes" or "axis_name" in key


def _strings(value: Any) -> list[str]:
    """The strings in a parameter's value, through tuples, lists and sets."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, (tuple, list, set, frozenset)):
        return [s for v in value for s in _strings(v)]
    return []


def _axis_names(eqn: Any) -> tuple[str, ...]:
    """The axis names a collective equation uses. Every primitive but those known
    not to be collectives counts, so a collective we do not know is still one."""
    if eqn.primitive.name in _NOT_COLLECTIVES:
        return ()
    names: list[str] = []
    for key, value in eqn.params.items():
        if isinstance(key, str) and _is_axis_key(key):
            names.extend(_strings(value))
    return tuple(names)


def _jaxprs_in(value: Any) -> list[Any]:
    """The jaxprs in a parameter's value, through tuples, lists and dicts (`cond`'s
    branches, `custom_linear_solve`'s named tuple...)."""
    if isinstance(value, jax.extend.core.ClosedJaxpr):
        return [value.jaxpr]
    if isinstance(value, jax.extend.core.Jaxpr):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [j for v in value for j in _jaxprs_in(v)]
    return []


def _sub_jaxprs(eqn: Any) -> list[Any]:
    """Every jaxpr in an equation's parameters (calls, branches, loop bodies).

    Not the jaxprs that Python callables in them would trace to: `custom_jvp`'s JVP
    rule, `custom_vjp`'s forward and backward rules run only under differentiation,
    and a collective that only they use is not seen here (JAX then reports the
    unbound axis name)."""
    return [j for value in eqn.params.values() for j in _jaxprs_in(value)]


def _has_checks(jaxpr: Any) -> bool:
    """Whether `jaxpr` (or a jaxpr in it) calls `checkify.check`."""
    return any(
        eqn.primitive.name == "check" or any(map(_has_checks, _sub_jaxprs(eqn)))
        for eqn in jaxpr.eqns
    )


# Primitives whose cost depends on the values they run on.
_DATA_DEPENDENT = {"while": "a while loop", "cond": "a `lax.cond`"}


def data_dependent(jaxpr: Any) -> str | None:
    """What in `jaxpr` (or a jaxpr in it) makes its run time depend on its data
    (`"a while loop"`), or `None`. Total: a jaxpr it cannot read is data-dependent."""
    try:
        for eqn in jaxpr.eqns:
            found = [_DATA_DEPENDENT.get(eqn.primitive.name)]
            found += [data_dependent(sub) for sub in _sub_jaxprs(eqn)]
            what = next((w for w in found if w is not None), None)
            if what is not None:
                return what
    except Exception:  # an unfamiliar jaxpr: the conservative answer
        return "a body the planner cannot read"
    return None


def collectives(jaxpr: Any) -> list[tuple[str, tuple[str, ...]]]:
    """The collectives in `jaxpr` and its sub-jaxprs: `(primitive, axis names)`,
    e.g. `("psum", ("F",))`, `("axis_index", ("F",))`."""
    out = []
    for eqn in jaxpr.eqns:
        names = _axis_names(eqn)
        if names:
            out.append((eqn.primitive.name, names))
        for sub in _sub_jaxprs(eqn):
            out.extend(collectives(sub))
    return out


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
        if self._named(_axis_names(eqn)):
            return True
        return any(
            self._named(names)
            for sub in _sub_jaxprs(eqn)
            for _, names in collectives(sub)
        )

    def _error(self, prim: str, name: str, why: str) -> SpecError:
        return SpecError(
            f"`{self.plan.fun_name}`: the body uses the collective `{prim}` over dim "
            f"'{name}', which `shard` splits over mesh axes {self.dims[name]!r}: "
            f"{why} Supported over a sharded dim: `psum`, `pmean`, `pmax`, `pmin`, "
            "`all_gather` and `axis_index`; or use `reduce=` to combine over it."
        )

    def bind(self, eqn: Any, invals: list[Any]) -> list[Any]:
        prim = eqn.primitive
        names = _axis_names(eqn)
        if not names:  # a call with such collectives inside
            if prim.name in _INLINE:
                sub = eqn.params[_CALLS[prim.name]]
                consts = list(getattr(sub, "consts", ()))
                return _rebind(getattr(sub, "jaxpr", sub), consts, invals, self)
            inner, name = next(
                (p, n)
                for sub in _sub_jaxprs(eqn)
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
        params = prim.get_bind_params(eqn.params)
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
        return _rebind(closed.jaxpr, consts, dyn)

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
        return _rebind(closed.jaxpr, consts, dyn, sharded)

    manual_env = [(a, manual.shape[a]) for a in shard.manual]
    with jax.sharding.use_abstract_mesh(manual):
        inside = jax.make_jaxpr(inside_shard_map, axis_env=[*axis_env, *manual_env])(
            specs(element_specs), specs(hoisted_specs)
        )
    return Body(inside, hoisted, len(element_specs), jaxpr), out


#
# Which scanned inputs to slice apart from the body's kernels.
#

# Primitives that XLA fuses into one loop with their operands (and their slices).
_ELEMENTWISE = frozenset(
    """abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp clz conj
    convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2
    expm1 floor ge gt imag integer_pow is_finite le lgamma log log1p logistic lt max
    min mul ne neg nextafter not or population_count pow real reduce_precision rem
    round rsqrt select_n shift_left shift_right_arithmetic shift_right_logical sign
    sin sinh sqrt square stop_gradient sub tan tanh xor""".split()
)
# Primitives that read their operand through an index map, fused with it.
_INDEX_MAPS = frozenset(
    """broadcast_in_dim concatenate dynamic_slice expand_dims gather pad reshape rev
    slice squeeze transpose""".split()
)
# Calls, whose jaxpr's inputs and outputs are the equation's own, followed into.
# Every other equation with jaxprs is a kernel of its own: control flow (`cond`,
# `while`, `scan`: a scan's outputs are stacked, a loop's carried), `shard_map`
# (its jaxpr sees blocks), and primitives we do not know.
_CALLS = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "call": "call_jaxpr",
    "checkpoint": "jaxpr",
    "remat": "jaxpr",
    "remat2": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
}


def _sub_jaxpr(eqn: Any) -> Any:
    """The jaxpr of a call (`jit`, `checkpoint`, `custom_jvp_call`...) whose inputs
    and outputs are those of the equation, or `None`."""
    key = _CALLS.get(eqn.primitive.name)
    sub = None if key is None else eqn.params.get(key)
    sub = getattr(sub, "jaxpr", sub)
    if not isinstance(sub, jax.extend.core.Jaxpr):
        return None
    if len(sub.invars) != len(eqn.invars) or len(sub.outvars) != len(eqn.outvars):
        return None
    return sub


def _index_map(eqn: Any, position: int) -> tuple:
    params = tuple(
        sorted((k, repr(v)) for k, v in eqn.params.items() if k != "sharding")
    )
    return (eqn.primitive.name, position, params)


def _is_var(v: Any) -> bool:
    """Whether `v` is a variable that can carry a read: not a `Literal` (which is
    not hashable), nor a `DropVar` (an unused output)."""
    core = jax.extend.core
    return isinstance(v, core.Var) and not isinstance(v, core.DropVar)


def _reads(jaxpr: Any, maps: dict[Any, frozenset]) -> bool:
    """Whether some value of `jaxpr` combines reads of the tracked input through two
    or more index maps, within the ops that XLA fuses with its slice.

    `maps` gives, for each variable, the index maps through which it reads the
    input; elementwise ops join them, index ops extend them, calls are followed, and
    every other op (a reduction, `dot_general`, control flow, a primitive we do not
    know) is a kernel of its own, whose outputs read nothing.
    """
    for eqn in jaxpr.eqns:
        ins = [
            (i, maps[v]) for i, v in enumerate(eqn.invars) if _is_var(v) and v in maps
        ]
        if not ins:
            continue
        name = eqn.primitive.name
        if name in _ELEMENTWISE:
            out = frozenset().union(*(m for _, m in ins))
        elif name in _INDEX_MAPS:
            out = frozenset(p + (_index_map(eqn, i),) for i, m in ins for p in m)
        elif (sub := _sub_jaxpr(eqn)) is not None:
            inner = {
                sv: maps[v]
                for sv, v in zip(sub.invars, eqn.invars)
                if _is_var(v) and v in maps
            }
            if _reads(sub, inner):
                return True
            for ov, sv in zip(eqn.outvars, sub.outvars):
                if _is_var(ov) and _is_var(sv) and sv in inner:
                    maps[ov] = inner[sv]
            continue
        else:
            continue
        if len(out) >= 2:
            return True
        for ov in eqn.outvars:
            if _is_var(ov):
                maps[ov] = out
    return False


def inputs_to_isolate(body: Body) -> frozenset[int]:
    """The input leaves that XLA:CPU runs best sliced apart from the body's kernels.

    Measured over 26 bodies (scan over rows, vmap inside): slicing inside a
    conditional pays only where one fused kernel reads the same slice through two
    or more index maps (`outer(x, x)`: 8-10x faster; `x[::-1] * x`, `roll(x) * x`:
    1.4-2x); elsewhere the copy costs up to 1.6x (`2 * x + 1`), and a single index
    map or two different inputs gain nothing. So an input is isolated exactly when
    the body reads it through two index maps within one fusion.

    Only a matter of speed: should the analysis meet a jaxpr it cannot read, no
    input is isolated (the default slicing), rather than the call failing.
    """
    jaxpr = body.jaxpr.jaxpr
    try:
        return frozenset(
            i for i, v in enumerate(jaxpr.invars) if _reads(jaxpr, {v: frozenset({()})})
        )
    except Exception:  # a last resort: every equation above is handled
        return frozenset()
