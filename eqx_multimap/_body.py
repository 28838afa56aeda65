"""The body, traced once on one element.

[`trace_body`][] traces the mapped function with `jax.make_jaxpr` on
`ShapeDtypeStruct`s of one element (the argument leaves without their mapped axes).
Every array the body closes over (a closure's arrays, an `eqx.Module`'s fields,
tracers of an enclosing transform) becomes an explicit input of the [`Body`][]: the
nest is then a pure function of its inputs, which `jax.custom_jvp` and
`jax.shard_map` need, and the output's structure and shapes are known before any
nest is built.

[`inputs_to_isolate`][] reads the body's jaxpr to tell which scanned inputs XLA:CPU
runs best sliced apart from the body's kernels (see `_nest.isolate_slices`).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.extend.core
import numpy as np
from jax._src import traceback_util
from jax.sharding import AxisType, Mesh

from ._args import BoundCall, is_array
from ._shard import ShardPlan


traceback_util.register_exclusion(__file__)


def struct(x: Any, shape: tuple[int, ...] | None = None) -> jax.ShapeDtypeStruct:
    """`x` as a `ShapeDtypeStruct` (with its weak type), optionally reshaped."""
    weak = bool(getattr(jax.typeof(x), "weak_type", False))
    return jax.ShapeDtypeStruct(
        np.shape(x) if shape is None else shape, x.dtype, weak_type=weak
    )


@dataclasses.dataclass(frozen=True)
class Body:
    """The body traced on one element: `jaxpr` (a `ClosedJaxpr`) over the array
    leaves of the arguments, then the arrays the body closed over (`hoisted`),
    which the nest passes in as unmapped inputs.

    With `shard=`, `jaxpr` was traced for inside `jax.shard_map` (the mesh's axes
    manual), and `standalone` is the body traced outside, from which the planner
    compiles one device's nest on its own.
    """

    jaxpr: Any
    hoisted: tuple[Any, ...]
    n_args: int
    standalone_jaxpr: Any = None

    def __call__(self, leaves: list[Any]) -> list[Any]:
        return jax.core.eval_jaxpr(self.jaxpr.jaxpr, self.jaxpr.consts, *leaves)

    @property
    def standalone(self) -> "Body":
        if self.standalone_jaxpr is None:
            return self
        return Body(self.standalone_jaxpr, self.hoisted, self.n_args)


def _rebind(jaxpr: Any, consts: list[Any], args: list[Any]) -> list[Any]:
    """`jaxpr` evaluated on `args`, its equations bound afresh in the current
    context. (`jax.core.eval_jaxpr` restores each equation's own context, such as
    the mesh it was traced under, which inside `shard_map` is the wrong one.)"""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jax.extend.core.Literal) else env[v]

    for eqn in jaxpr.eqns:
        params = eqn.primitive.get_bind_params(eqn.params)
        outs = eqn.primitive.bind(*map(read, eqn.invars), **params)
        if not eqn.primitive.multiple_results:
            outs = [outs]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


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

    closed, shapes = jax.make_jaxpr(element, axis_env=axis_env, return_shape=True)(
        element_specs
    )
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
    # As `jax.shard_map` traces its function: with the mesh's axes manual.
    mesh = shard.mesh.abstract_mesh if isinstance(shard.mesh, Mesh) else shard.mesh
    manual = mesh.update_axis_types({a: AxisType.Manual for a in mesh.axis_names})
    with jax.sharding.use_abstract_mesh(manual):
        inside = jax.make_jaxpr(
            with_hoisted, axis_env=[*axis_env, *mesh.shape.items()]
        )(element_specs, hoisted_specs)
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
_SUB_JAXPRS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def _sub_jaxpr(eqn: Any) -> Any:
    """The jaxpr of a call (`jit`, `checkpoint`, `custom_jvp_call`...), if any."""
    for key in _SUB_JAXPRS:
        sub = eqn.params.get(key)
        if sub is not None and not isinstance(sub, (tuple, list)):
            return getattr(sub, "jaxpr", sub)
    return None


def _index_map(eqn: Any, position: int) -> tuple:
    params = tuple(
        sorted((k, repr(v)) for k, v in eqn.params.items() if k != "sharding")
    )
    return (eqn.primitive.name, position, params)


def _reads(jaxpr: Any, maps: dict[Any, frozenset]) -> bool:
    """Whether some value of `jaxpr` combines reads of the tracked input through two
    or more index maps, within the ops that XLA fuses with its slice.

    `maps` gives, for each variable, the index maps through which it reads the
    input; elementwise ops join them, index ops extend them, calls are followed, and
    every other op (a reduction, `dot_general`, control flow) is a kernel of its own.
    """
    for eqn in jaxpr.eqns:
        ins = [
            (i, maps[v])
            for i, v in enumerate(eqn.invars)
            if not isinstance(v, jax.extend.core.Literal) and v in maps
        ]
        if not ins:
            continue
        name = eqn.primitive.name
        sub = _sub_jaxpr(eqn)
        if name in _ELEMENTWISE:
            out = frozenset().union(*(m for _, m in ins))
        elif name in _INDEX_MAPS:
            out = frozenset(p + (_index_map(eqn, i),) for i, m in ins for p in m)
        elif sub is not None and len(sub.invars) == len(eqn.invars):
            inner = {
                sv: maps[v]
                for sv, v in zip(sub.invars, eqn.invars)
                if not isinstance(v, jax.extend.core.Literal) and v in maps
            }
            if _reads(sub, inner):
                return True
            for ov, sv in zip(eqn.outvars, sub.outvars):
                if sv in inner:
                    maps[ov] = inner[sv]
            continue
        else:
            continue
        if len(out) >= 2:
            return True
        for ov in eqn.outvars:
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
    """
    jaxpr = body.jaxpr.jaxpr
    return frozenset(
        i for i, v in enumerate(jaxpr.invars) if _reads(jaxpr, {v: frozenset({()})})
    )
