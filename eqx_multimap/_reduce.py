"""Reductions over mapped dims, computed inside the nest: `reduce={"T": "sum"}`.

A reduced dim is mapped (the body runs once per element of it) but is absent from
the output: the elements' outputs are combined with the dim's op. The combination
happens where the dim is mapped, so the full `(T, ...)` output never exists:

- a vmap level of the dim reduces its output right after the level;
- a scan level accumulates in the loop carry (temporaries O(1) in the dim's size);
- a chunked scan reduces each chunk (the vmap inside) and accumulates the chunks in
    the carry, and the remainder is combined with the chunks' result (`_nest`);
- a sharded dim is reduced on each device, then across devices with one
    `psum`/`pmax`/`pmin` over its mesh axes (`_multi_vmap.run_call`).

[`parse_reduce`][] checks `reduce=` at decoration; [`make_reduction`][] builds one
call's [`Reduction`][] once the body's output is known (dtypes, identities, the
monoid's shape); `_nest` asks it to reduce, combine and finalise arrays.
"""

import dataclasses
import functools as ft
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from jax._src import traceback_util

from ._dims import parse_names
from ._errors import ShapeError, SpecError


traceback_util.register_exclusion(__file__)


@dataclasses.dataclass(frozen=True, eq=False)
class Monoid:
    """A user reduction for `filter_multi_vmap(..., reduce=...)`: an associative
    binary function and its identity.

    **Arguments:**

    - `op`: `op(a, b)` combines two outputs of one element (arrays of the same
        shape and dtype) into one of that shape and dtype. It must be associative;
        it need not be commutative over one dim: the elements are combined in their
        order along the dim. Over several dims at once, the order in which the dims
        are combined depends on the nest, so `op` should then be commutative too.
    - `identity`: the value `e` with `op(e, x) == x`, broadcast to the element's
        shape and cast to its dtype (e.g. `0.0`, `-jnp.inf`, `jnp.eye(2)`). A
        reduced dim of size 0 gives the identity.

    `op` is applied to each output array separately.

    !!! example

        ```python
        logsumexp = Monoid(jnp.logaddexp, -jnp.inf)
        matmul = Monoid(jnp.matmul, jnp.eye(2))  # a product of 2x2 matrices, in order
        ```
    """

    op: Any  # `Callable[[Array, Array], Array]`; checked with a clearer message
    identity: Any  # `ArrayLike`; checked with a clearer message

    def __post_init__(self):
        if not callable(self.op):
            raise SpecError(
                f"`eqx_multimap.Monoid(op, identity)`: `op` must be a function of two "
                f"arrays, but got {self.op!r} of type `{type(self.op).__name__}`."
            )
        try:
            np.shape(self.identity)
            jnp.asarray(self.identity)
        except Exception:
            raise SpecError(
                "`eqx_multimap.Monoid(op, identity)`: `identity` must be a number or "
                f"an array, but got {self.identity!r} of type "
                f"`{type(self.identity).__name__}`."
            ) from None

    def __repr__(self) -> str:
        name = getattr(self.op, "__name__", None) or repr(self.op)
        return f"Monoid({name}, {self.identity!r})"


ReduceOp = Literal["sum", "mean", "max", "min"] | Monoid
"""How to reduce a dim: `"sum"`, `"mean"`, `"max"`, `"min"`, or a [`Monoid`][]."""

ReduceSpec = Mapping[str, ReduceOp] | None
"""Dims to reduce over: `{"T": "sum"}`, `{"T F": "mean"}` (both dims), or `{"T":
"max", "F": "max"}`."""

OPS = ("sum", "mean", "max", "min")
_ALLOWED = "'sum', 'mean', 'max', 'min', or an `eqx_multimap.Monoid(op, identity)`"
_JNP = {"sum": jnp.sum, "mean": jnp.mean, "max": jnp.max, "min": jnp.min}
_PAIRWISE = {"sum": jnp.add, "max": jnp.maximum, "min": jnp.minimum}


def op_name(op: ReduceOp) -> str:
    return op if isinstance(op, str) else repr(op)


def _kind(op: ReduceOp) -> Any:
    """Ops of one kind combine in any order: sum and mean (a sum, then a division)."""
    return "sum" if op in ("sum", "mean") else op


def parse_reduce(reduce: Any) -> tuple[tuple[str, ReduceOp], ...]:
    """Validate `reduce=` at decoration: `(dim, op)` pairs, in the order given."""
    if reduce is None:
        return ()
    if not isinstance(reduce, Mapping):
        raise SpecError(
            "`filter_multi_vmap(..., reduce=...)` must be a dict from dim name to "
            f"op, e.g. `{{'T': 'sum'}}`, but got {reduce!r} of type "
            f"`{type(reduce).__name__}`."
        )
    out: list[tuple[str, ReduceOp]] = []
    for key, op in reduce.items():
        if not isinstance(key, str):
            raise SpecError(
                f"`filter_multi_vmap(..., reduce=...)` has key {key!r}, which is not a "
                "dim name: the keys are dim names such as 'T' (or 'T F' for several "
                "dims with one op)."
            )
        names = parse_names(key, "reduce")
        where = f"`filter_multi_vmap(..., reduce={{{key!r}: {op!r}}})`"
        if isinstance(op, str):
            if op not in OPS:
                raise SpecError(
                    f"{where}: unknown op {op!r} for dim '{names[0]}'. The allowed "
                    f"ops are {_ALLOWED}."
                )
        elif not isinstance(op, Monoid):
            hint = ""
            if isinstance(op, tuple) and len(op) == 2 and callable(op[0]):
                hint = (
                    " For `(op, identity)`, write `eqx_multimap.Monoid(op, identity)`."
                )
            raise SpecError(
                f"{where}: the op for dim '{names[0]}' must be {_ALLOWED}, but got "
                f"{op!r} of type `{type(op).__name__}`.{hint}"
            )
        for name in names:
            if any(name == n for n, _ in out):
                raise SpecError(
                    f"`filter_multi_vmap(..., reduce=...)` names dim '{name}' twice; "
                    "each dim is reduced by one op."
                )
            out.append((name, op))
    kinds = {_kind(op): (name, op) for name, op in out}
    if len(kinds) > 1:
        (n1, o1), (n2, o2) = list(kinds.values())[:2]
        raise SpecError(
            f"`filter_multi_vmap(..., reduce=...)` reduces dim '{n1}' with "
            f"{op_name(o1)!r} and dim '{n2}' with {op_name(o2)!r}: their result would "
            "depend on which dim the nest reduces first. Give every reduced dim the "
            "same op ('sum' and 'mean' may mix), or reduce the second dim in a "
            "second call."
        )
    return tuple(out)


def check_reduce_sizes(
    fun_name: str,
    ops: Sequence[tuple[str, ReduceOp]],
    sizes: Mapping[str, int],
    seen: Mapping[str, Sequence[Any]],
) -> None:
    """`mean`, `max` and `min` over a dim of size 0 raise, as numpy's max does."""
    for name, op in ops:
        if op in ("mean", "max", "min") and sizes.get(name) == 0:
            where = "; ".join(s.where for s in seen.get(name, [])) or "no argument"
            raise ShapeError(
                f"`{fun_name}`: `reduce={{{name!r}: {op!r}}}` over dim '{name}' of "
                f"size 0 (bound by {where}): {op!r} of no elements is undefined (numpy "
                f"{'returns nan with a warning' if op == 'mean' else 'raises'}). Use "
                "'sum', or a `Monoid` with an identity, if an empty dim is expected."
            )


def _is_low_float(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32


@dataclasses.dataclass(frozen=True)
class Reduction:
    """One call's reductions.

    - `ops`: `(dim, op)` for every reduced dim (all of one kind: see
        `parse_reduce`).
    - `elements`: for each output leaf, one element's shape, in the dtype it is
        accumulated in (float32 for a sum of float16, as `jnp.sum` computes it; the
        floating dtype of a mean of integers).
    - `dtypes`: the final dtype of each output leaf, as `jnp.sum`, `jnp.mean`,
        `jnp.max` or `jnp.min` give it (a sum of `int8` is `int32`, as in
        `jnp.sum`); a monoid keeps the dtype.
    - `count`: what a mean divides by: the product of the (global) sizes of the
        dims reduced by `"mean"`.
    """

    ops: tuple[tuple[str, ReduceOp], ...]
    elements: tuple[jax.ShapeDtypeStruct, ...]
    dtypes: tuple[Any, ...]
    count: int

    @property
    def dims(self) -> frozenset[str]:
        return frozenset(name for name, _ in self.ops)

    @property
    def kind(self) -> Any:
        return _kind(self.ops[0][1])

    def prepare(self, outs: Sequence[Any]) -> list[Any]:
        """The body's outputs in their accumulation dtypes."""
        return [
            y if y.dtype == e.dtype else y.astype(e.dtype)
            for y, e in zip(outs, self.elements)
        ]

    def identity(self, i: int, shape: tuple[int, ...], dtype: Any = None) -> Any:
        """The identity of output leaf `i`, broadcast to `shape`."""
        dtype = self.elements[i].dtype if dtype is None else dtype
        kind = self.kind
        if kind == "sum":
            return jnp.zeros(shape, dtype)
        if isinstance(kind, Monoid):
            e = jnp.asarray(kind.identity).astype(dtype)
            return jnp.broadcast_to(e, shape)
        if jnp.issubdtype(dtype, jnp.bool_):
            value: Any = kind == "min"
        elif jnp.issubdtype(dtype, jnp.integer):
            info = jnp.iinfo(dtype)
            value = info.min if kind == "max" else info.max
        else:
            value = -np.inf if kind == "max" else np.inf
        return jnp.full(shape, value, dtype)

    def reduce_leading(self, i: int, x: Any, n_batch: int) -> Any:
        """Reduce axis 0 of output leaf `i`, laid out as `[dim, batch..., element]`
        with `n_batch` batch axes (the levels inside)."""
        kind = self.kind
        if kind == "sum":
            return jnp.sum(x, axis=0, dtype=x.dtype)
        if kind in ("max", "min"):
            return _JNP[kind](x, axis=0)
        if x.shape[0] == 0:
            return self.identity(i, x.shape[1:])
        return _tree(_batched(kind.op, tuple(range(n_batch))), x)

    def combine(self, a: Any, b: Any, batch_axes: Sequence[int]) -> Any:
        """`op(a, b)` of two partial results, applied per element: `batch_axes` are
        the axes of the mapped dims (the rest is one element)."""
        kind = self.kind
        if isinstance(kind, str):
            return _PAIRWISE[kind](a, b)
        return _batched(kind.op, tuple(batch_axes))(a, b)

    def across_devices(
        self, x: Any, mesh_axes: tuple[str, ...], batch_axes: Sequence[int]
    ) -> Any:
        """Inside `shard_map`: combine every device's partial result along
        `mesh_axes` (one collective)."""
        kind = self.kind
        if kind == "sum":
            return lax.psum(x, mesh_axes)
        if kind in ("max", "min"):
            return _pextremum(x, mesh_axes, kind)
        # A monoid: gather the partial results, in mesh order, and combine in order.
        parts = lax.all_gather(x, mesh_axes, axis=0, tiled=False)
        return _tree(_batched(kind.op, tuple(batch_axes)), parts)

    def finalize(self, i: int, x: Any) -> Any:
        """The mean's division, and the final dtype."""
        if any(op == "mean" for _, op in self.ops):
            x = x / jnp.asarray(self.count, x.dtype)
        dtype = self.dtypes[i]
        return x if x.dtype == dtype else x.astype(dtype)


@ft.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _pextremum(x: Any, axes: tuple[str, ...], kind: str) -> Any:
    """`lax.pmax` or `lax.pmin`, differentiable (JAX has no rule for them): the
    tangent is that of the device holding the extremum, shared equally between ties
    (as `jnp.max` shares it between equal elements)."""
    return lax.pmax(x, axes) if kind == "max" else lax.pmin(x, axes)


@_pextremum.defjvp
def _pextremum_jvp(axes: tuple[str, ...], kind: str, primals: tuple, tangents: tuple):
    (x,), (dx,) = primals, tangents
    y = _pextremum(x, axes, kind)
    at = x == y
    count = lax.psum(at.astype(x.dtype), axes)
    dy = lax.psum(jnp.where(at, dx, jnp.zeros_like(dx)), axes) / count
    return y, dy


def _batched(op: Callable, batch_axes: tuple[int, ...]) -> Callable:
    """`op` of one element, mapped over the `batch_axes` of both arguments."""
    if not batch_axes:
        return op
    inner = op
    for _ in batch_axes:
        inner = jax.vmap(inner)
    front = tuple(range(len(batch_axes)))

    def batched(a: Any, b: Any) -> Any:
        out = inner(
            jnp.moveaxis(a, batch_axes, front), jnp.moveaxis(b, batch_axes, front)
        )
        return jnp.moveaxis(out, front, batch_axes)

    return batched


def _tree(op: Callable, x: Any) -> Any:
    """Combine the elements of `x` along axis 0 (at least one) with `op`, in order:
    a balanced tree of `log2(n)` vmapped steps."""
    pairwise = jax.vmap(op)
    while x.shape[0] > 1:
        n = x.shape[0]
        even = n - n % 2
        paired = pairwise(x[0:even:2], x[1:even:2])
        x = jnp.concatenate([paired, x[even:]]) if n % 2 else paired
    return x[0]


def make_reduction(
    fun_name: str,
    ops: tuple[tuple[str, ReduceOp], ...],
    shapes: Sequence[jax.ShapeDtypeStruct],
    sizes: Mapping[str, int],
) -> Reduction | None:
    """The reductions of one call, from the body's output (one element of each
    leaf); checks a monoid against every output leaf."""
    if not ops:
        return None
    kind = _kind(ops[0][1])
    elements, dtypes = [], []
    for i, s in enumerate(shapes):
        if isinstance(kind, Monoid):
            _check_monoid(fun_name, ops, kind, s, i)
            elements.append(jax.ShapeDtypeStruct(s.shape, s.dtype))
            dtypes.append(s.dtype)
            continue
        final = jax.ShapeDtypeStruct(s.shape, s.dtype)
        for _, op in ops:
            fn = ft.partial(_JNP[op], axis=0)  # type: ignore[index]
            final = jax.eval_shape(
                fn, jax.ShapeDtypeStruct((1,) + s.shape, final.dtype)
            )
        acc = final.dtype
        if kind == "sum" and _is_low_float(acc):
            acc = jnp.dtype(jnp.float32)
        elements.append(jax.ShapeDtypeStruct(s.shape, acc))
        dtypes.append(final.dtype)
    count = math.prod(sizes[name] for name, op in ops if op == "mean")
    return Reduction(ops, tuple(elements), tuple(dtypes), count)


def _check_monoid(
    fun_name: str,
    ops: Sequence[tuple[str, ReduceOp]],
    monoid: Monoid,
    s: jax.ShapeDtypeStruct,
    i: int,
) -> None:
    dims = ", ".join(f"'{name}'" for name, _ in ops)
    where = f"`{fun_name}`: `reduce` over dim{'s' if len(ops) > 1 else ''} {dims}"
    elem = f"{s.dtype.name}{list(s.shape)}"
    out = jax.eval_shape(monoid.op, s, s)
    is_array = isinstance(out, jax.ShapeDtypeStruct)
    if not is_array or (out.shape, out.dtype) != (s.shape, s.dtype):
        got = f"{out.dtype.name}{list(out.shape)}" if is_array else type(out).__name__
        raise SpecError(
            f"{where} with {monoid!r}: `op` must return an array of the shape and "
            f"dtype of its arguments (one element's output {i}, {elem}), but returned "
            f"{got}."
        )
    identity = jnp.asarray(monoid.identity)
    try:
        fits = np.broadcast_shapes(identity.shape, s.shape) == s.shape
    except ValueError:
        fits = False
    if not fits:
        raise SpecError(
            f"{where} with {monoid!r}: the identity of shape {list(identity.shape)} "
            f"does not broadcast to one element's output {i}, {elem}."
        )
