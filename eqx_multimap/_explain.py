"""`explain` and `tune`: the plan of a call of a `filter_multi_vmap` function, by the
time model (nothing runs) or by timing candidate nests on real arguments."""

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
from jax._src import traceback_util

from ._errors import SpecError
from ._multi_vmap import _has_tracer, _MultiVmapWrapper, _tune, gradient_plan
from ._planner import Plan, TimeModel
from ._planner.cost import Compiler
from ._planner.search import candidate, localize, plan_for
from ._resolve import Call, fun_name_of, resolve
from ._shard import shardings_seen


def describe_fixed(call: Call) -> Plan:
    """A `Plan` for a fixed nest: its one candidate compiled, with no budget."""
    start, (sizes, shard) = time.perf_counter(), localize(call)
    compiler = Compiler(call, sizes, TimeModel.for_backend(jax.default_backend()))
    given = call.given_nest()
    cand = candidate(given.scan, given.vmap, sizes, "given")
    if all(sizes[n] > 0 for n in call.mapped):
        cand = compiler.evaluate(cand, None)
    cand = dataclasses.replace(cand, reason="the nest the strategies give")
    why = "the strategies given (`scan=`, `vmap=`, `shard=`), not planned"
    summary = f"Fixed nest {cand.nest(sizes)}: {why}."
    fields: dict[str, Any] = dict(auto=False, budget_bytes=None, budget_source="")
    fields.update(n_compiled=compiler.n_compiled, seconds=time.perf_counter() - start)
    return plan_for(call, sizes, cand, (cand,), shard=shard, summary=summary, **fields)


def _unwrap(fn: Callable, caller: str) -> tuple[_MultiVmapWrapper, tuple]:
    """The wrapper behind `fn` (through decorators applied outside and bound
    methods), and the arguments a bound method adds."""
    wrapper: Any = fn
    # Decorators applied outside (`jaxtyped`, `beartype`, `filter_jit`,
    # `functools.wraps`) expose what they wrap as `__wrapped__`: `fn` and up to 32
    # of them are looked through.
    for _ in range(33):
        if isinstance(wrapper, _MultiVmapWrapper):
            return wrapper, ()
        if isinstance(wrapper, jtu.Partial) and isinstance(
            wrapper.func, _MultiVmapWrapper
        ):
            return wrapper.func, tuple(wrapper.args)
        wrapper = getattr(wrapper, "__wrapped__", None)
        if wrapper is None:
            break
    raise SpecError(
        f"`eqx_multimap.{caller}(fn, ...)`: `fn` must be a function returned by "
        f"`filter_multi_vmap`, but got {fn!r} of type `{type(fn).__name__}`."
    )


@traceback_util.api_boundary
def explain(fn: Callable, /, *args, **kwargs) -> Plan:
    """Plan a call of a `filter_multi_vmap` function, without calling it.

    **Arguments:**

    - `fn`: a function returned by [`eqx_multimap.filter_multi_vmap`][] (or a method
        defined with it, accessed on an instance).
    - `*args`, `**kwargs`: the arguments it would be called with. Arrays may be
        given as `jax.ShapeDtypeStruct`s; they are not run on (see `Planner`).

    **Returns:**

    A [`eqx_multimap.Plan`][]: the chosen nest and every candidate considered, with
    its compiled memory, estimated cost and why it was or was not chosen. For
    `plan="auto"` this is the plan that a call with these arguments uses (and it is
    cached, so the call does not plan again); for a fixed nest, the one candidate
    is that nest.

    !!! example

        ```python
        f = filter_multi_vmap(body, in_dims="T B", out_dims="T B", plan="auto")
        print(eqx_multimap.explain(f, jax.ShapeDtypeStruct((4096, 64), jnp.float32)))
        ```
    """
    wrapper, bound_args = _unwrap(fn, "explain")
    shard = wrapper._options.shard  # the arrays' shardings, as a call sees them
    seen = shard.seen(jtu.tree_leaves((bound_args + args, kwargs))) if shard else ()

    def resolve_and_plan(args: tuple, kwargs: dict) -> Plan:
        with shardings_seen(jtu.tree_leaves((args, kwargs)), seen):
            call = resolve(wrapper._fun, wrapper._options, args, kwargs)
            if call.options.plan is None:
                return describe_fixed(call)
            planner = call.options.plan.planner
            plan = planner.plan(call)
            gradient = gradient_plan(planner, call)
        return dataclasses.replace(plan, gradient=gradient)

    # A `Plan` is not an array: `filter_eval_shape` returns it as it is.
    return eqx.filter_eval_shape(resolve_and_plan, bound_args + args, kwargs)


@traceback_util.api_boundary
def tune(fn: Callable, /, *args, **kwargs) -> Plan:
    """Plan a call of a `filter_multi_vmap` function by timing candidate nests on
    these arguments, and keep the plan for the calls that follow.

    **Arguments:**

    - `fn`: a function returned by [`eqx_multimap.filter_multi_vmap`][] with
        `plan="auto"` or `plan=Planner(...)`.
    - `*args`, `**kwargs`: real arguments (arrays, not tracers or
        `jax.ShapeDtypeStruct`s): a body whose run time depends on its data (a
        `while` loop, say) is timed on what it will run on.

    **Returns:**

    The [`eqx_multimap.Plan`][] chosen, as [`eqx_multimap.explain`][] gives it. It
    is kept in the plan cache of `fn`'s planner, in memory and on disk, replacing
    any plan cached for the signature: later calls of `fn` with arguments of the
    same shapes, in this process or another, use it without planning again (if its
    nest differs, `jax.clear_caches()` drops the programs traced with the old one).
    The nest that differentiating `fn` runs is timed too, on these arguments (the
    cotangents made up), and kept as `plan.gradient` is. Timing runs the body many
    times (thousands, for a quick one): a callback in it runs as often.

    !!! example

        ```python
        f = filter_multi_vmap(solve, in_dims="T F", out_dims="T F", plan="auto")
        print(eqx_multimap.tune(f, data))  # once: times the candidates on `data`
        f(data)  # uses the plan, as does every later process
        ```
    """
    wrapper, bound_args = _unwrap(fn, "tune")
    if wrapper._options.plan is None:
        raise SpecError(
            f"`eqx_multimap.tune(fn, ...)`: `{fun_name_of(wrapper._fun)}` has a fixed "
            "nest; pass `plan='auto'` (or `plan=Planner(...)`) to "
            "`filter_multi_vmap` to plan it."
        )
    if _has_tracer((args, kwargs)) or any(
        isinstance(x, jax.ShapeDtypeStruct) for x in jtu.tree_leaves((args, kwargs))
    ):
        raise SpecError(
            "`eqx_multimap.tune(fn, ...)` times the nests on the arguments, so they "
            "must be arrays, not tracers or `jax.ShapeDtypeStruct`s: call it "
            "outside `jax.jit`, or use `eqx_multimap.explain` to plan by the model."
        )
    return _tune(wrapper, bound_args, args, kwargs, again=True)
