"""Reading jaxprs: the one module that reads a jaxpr's equations and their
parameters (one iterator over them, the tables of the primitives we care about, and
every question asked of a body's jaxpr), so that what a JAX upgrade changes is
written once.

Every reading handles any jaxpr JAX makes (`Literal`s and `DropVar`s anywhere, the
jaxprs of calls, control flow and custom rules). Where it cannot know, it takes the
safe side: a primitive it does not know that names a dim in an axis-name parameter is
a collective over it, and the planner's readings give their cautious answer.
"""

from collections.abc import Iterator
from typing import Any

import jax
import jax.extend.core


#
# The tables.
#

# Primitives whose axis-name parameters are not collectives.
_NOT_COLLECTIVES = frozenset({"pvary", "pcast"})
# Primitives whose cost depends on the values they run on: loops and branches.
_DATA_DEPENDENT = {"while": "a while loop", "cond": "a `lax.cond`"}
# Primitives of `checkify.check`.
_CHECKS = frozenset({"check"})
# Primitives that call back into Python (and any named `*callback*`).
_CALLBACKS = frozenset({"debug_print"})
# Calls, with the parameter that holds their jaxpr, whose inputs and outputs are the
# equation's own. Every other equation with jaxprs is a kernel of its own: control
# flow (`cond`, `while`, `scan`: a scan's outputs are stacked, a loop's carried),
# `shard_map` (its jaxpr sees blocks), and primitives we do not know.
_CALLS = {
    **dict.fromkeys("jit pjit checkpoint remat remat2".split(), "jaxpr"),
    **dict.fromkeys("closed_call core_call call".split(), "call_jaxpr"),
    **dict.fromkeys(["custom_jvp_call", "custom_vjp_call"], "call_jaxpr"),
    "custom_vjp_call_jaxpr": "fun_jaxpr",
}
# Of those, the calls that can be inlined (a sharded dim's collectives are rewritten
# through them).
_INLINE = frozenset({"jit", "pjit", "closed_call", "core_call", "call"})
# Ops that move data, which XLA fuses into the ops that compute.
_MOVES = frozenset(
    "slice squeeze reshape broadcast_in_dim expand_dims transpose dynamic_slice "
    "dynamic_update_slice gather concatenate copy copy_p convert_element_type iota "
    "select_n pad rev".split()
)
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


#
# Equations.
#


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


def sub_jaxprs(eqn: Any) -> list[Any]:
    """Every jaxpr in an equation's parameters (calls, branches, loop bodies).

    Not the jaxprs that Python callables in them would trace to: `custom_jvp`'s JVP
    rule, `custom_vjp`'s forward and backward rules run only under differentiation,
    and a collective that only they use is not seen here (JAX then reports the
    unbound axis name)."""
    return [j for value in eqn.params.values() for j in _jaxprs_in(value)]


def eqns(jaxpr: Any) -> Iterator[Any]:
    """The equations of `jaxpr` (a `Jaxpr` or a `ClosedJaxpr`) and, after each, those
    of its sub-jaxprs."""
    if isinstance(jaxpr, jax.extend.core.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in sub_jaxprs(eqn):
            yield from eqns(sub)


def bind_params(eqn: Any) -> dict[str, Any]:
    """The parameters to bind `eqn`'s primitive with."""
    return eqn.primitive.get_bind_params(eqn.params)


def inlined(eqn: Any) -> tuple[Any, list[Any]] | None:
    """The jaxpr and consts of a call that can be inlined (`jit`, `closed_call`...),
    or `None`."""
    if eqn.primitive.name not in _INLINE:
        return None
    sub = eqn.params[_CALLS[eqn.primitive.name]]
    return getattr(sub, "jaxpr", sub), list(getattr(sub, "consts", ()))


def rebind(
    jaxpr: Any, consts: list[Any], args: list[Any], rewrite: Any = None
) -> list[Any]:
    """`jaxpr` evaluated on `args`, its equations bound afresh in the current
    context. (`jax.core.eval_jaxpr` restores each equation's own context, such as
    the mesh it was traced under, which inside `shard_map` is the wrong one.)

    With `rewrite` (a `_body._Sharded`), the equations it `touches` are bound by
    its `bind`."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jax.extend.core.Literal) else env[v]

    for eqn in jaxpr.eqns:
        invals = list(map(read, eqn.invars))
        if rewrite is not None and rewrite.touches(eqn):
            outs = rewrite.bind(eqn, invals)
        else:
            outs = eqn.primitive.bind(*invals, **bind_params(eqn))
            if not eqn.primitive.multiple_results:
                outs = [outs]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


#
# Collectives and checks.
#


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


def axis_names(eqn: Any) -> tuple[str, ...]:
    """The axis names a collective equation uses. Every primitive but those known
    not to be collectives counts, so a collective we do not know is still one."""
    if eqn.primitive.name in _NOT_COLLECTIVES:
        return ()
    names: list[str] = []
    for key, value in eqn.params.items():
        if isinstance(key, str) and _is_axis_key(key):
            names.extend(_strings(value))
    return tuple(names)


def collectives(jaxpr: Any) -> list[tuple[str, tuple[str, ...]]]:
    """The collectives in `jaxpr` and its sub-jaxprs: `(primitive, axis names)`,
    e.g. `("psum", ("F",))`, `("axis_index", ("F",))`."""
    found = ((eqn.primitive.name, axis_names(eqn)) for eqn in eqns(jaxpr))
    return [(name, names) for name, names in found if names]


def has_checks(jaxpr: Any) -> bool:
    """Whether `jaxpr` (or a jaxpr in it) calls `checkify.check`."""
    return any(eqn.primitive.name in _CHECKS for eqn in eqns(jaxpr))


#
# Does the cost depend on the data.
#


def _first(jaxpr: Any, names: Any) -> str | None:
    """The first primitive in `jaxpr` (or a jaxpr in it) whose name is in `names`
    (or `names(name)`), or `None`; `"?"` for a jaxpr it cannot read (total)."""
    try:
        return next((n for e in eqns(jaxpr) if names(n := e.primitive.name)), None)
    except Exception:  # an unfamiliar jaxpr: the conservative answer
        return "?"


def data_dependent(jaxpr: Any) -> str | None:
    """What in `jaxpr` (or a jaxpr in it) makes its run time depend on its data
    (`"a while loop"`), or `None`. A jaxpr it cannot read is data-dependent."""
    name = _first(jaxpr, _DATA_DEPENDENT.__contains__)
    return name and _DATA_DEPENDENT.get(name, "a body the planner cannot read")


def calls_back(jaxpr: Any) -> bool:
    """Whether `jaxpr` (or a jaxpr in it) calls back into Python (`jax.debug.print`,
    `jax.pure_callback`...), as each timed run would. A jaxpr it cannot read does."""
    return _first(jaxpr, lambda n: n in _CALLBACKS or "callback" in n) is not None


def lockstep(jaxpr: Any) -> bool:
    """Whether a vmapped program runs a while loop in lockstep: its predicate is
    batched (as is, or reduced by equinox's `unvmap_any`), so each block loops as
    long as its slowest element. A jaxpr it cannot read is taken to."""
    try:
        for eqn in eqns(jaxpr):
            if eqn.primitive.name == "while":
                cond = eqn.params["cond_jaxpr"].jaxpr
                if cond.outvars[0].aval.shape or any(map(_unvmapped, eqns(cond))):
                    return True
    except Exception:  # an unfamiliar jaxpr: the cautious answer
        return True
    return False


def _unvmapped(eqn: Any) -> bool:
    unvmap = eqn.primitive.name in ("unvmap_any", "unvmap_all")
    return unvmap and bool(eqn.invars[0].aval.shape)


def op_bytes(jaxpr: Any) -> list[int]:
    """The bytes each op of `jaxpr` reads (the ops of its sub-jaxprs, not the calls
    of them); none if it cannot be read, or if it runs a while loop in lockstep:
    the waste of a larger block, which the model cannot see, outweighs its threads."""
    try:
        if lockstep(jaxpr):
            return []
        ops = (e for e in eqns(jaxpr) if e.primitive.name not in _MOVES)
        reads = [_bytes_read(e) for e in ops if not sub_jaxprs(e)]
        return [n for n in reads if n]
    except Exception:  # an unfamiliar jaxpr: no op is taken to be small
        return []


def _bytes_read(eqn: Any) -> int:
    avals = [v.aval for v in eqn.invars]
    return int(sum(a.size * a.dtype.itemsize for a in avals if hasattr(a, "size")))


#
# Which scanned inputs to slice apart from the body's kernels.
#


def _call_jaxpr(eqn: Any) -> Any:
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
        elif (sub := _call_jaxpr(eqn)) is not None:
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


def inputs_to_isolate(closed: Any) -> frozenset[int]:
    """The inputs of the body `closed` (a `ClosedJaxpr`) that XLA:CPU runs best
    sliced apart from its kernels.

    Measured over 26 bodies (scan over rows, vmap inside): slicing inside a
    conditional pays only where one fused kernel reads the same slice through two
    or more index maps (`outer(x, x)`: 8-10x faster; `x[::-1] * x`, `roll(x) * x`:
    1.4-2x); elsewhere the copy costs up to 1.6x (`2 * x + 1`), and a single index
    map or two different inputs gain nothing. So an input is isolated exactly when
    the body reads it through two index maps within one fusion.

    Only a matter of speed: should the analysis meet a jaxpr it cannot read, no
    input is isolated (the default slicing), rather than the call failing.
    """
    jaxpr = closed.jaxpr
    try:
        return frozenset(
            i for i, v in enumerate(jaxpr.invars) if _reads(jaxpr, {v: frozenset({()})})
        )
    except Exception:  # a last resort: every equation above is handled
        return frozenset()
