"""Sharding the nest over a device mesh, with JAX's own SPMD (`jax.shard_map`).

`shard={"F": "freq"}` partitions dim `F` contiguously over the mesh axis `freq`: each
device gets one contiguous block of `F`, and runs the ordinary nest on it (see
`_nest.run`) with the *local* sizes. The full nest is therefore
`shard_map(scan(vmap(... fun)))`. A sharded dim is scanned inside each shard if it is
also in `scan` (so chunked scans split each local block into chunks and an exact
remainder), and vmapped otherwise.

Nothing here moves data itself: inputs get `PartitionSpec`s built from their dims
(an input without a sharded dim is replicated), outputs get `PartitionSpec`s built
from `out_dims`, and JAX/XLA do the rest. A pure map therefore compiles with no
collectives at all. Only the mesh axes that `shard=` names are manual; the others
stay with the compiler, so an array split over them stays split (docs/sharding.md).

`shard_map` needs its `out_specs` before it traces the body: the output layout (the
dims of each output array) is known by then, since the body was traced once, on
*one element*, when the call was resolved (`_body.trace_body`).
"""

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from jax._src import traceback_util
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from ._check import InputCheck, Seen
from ._dims import Dims, unstarred
from ._errors import ShapeError, SpecError
from ._nest import present_axes
from ._text import describe, plural


traceback_util.register_exclusion(__file__)


ShardSpec = Mapping[str, str | tuple[str, ...]] | None
"""Dims to shard over a device mesh: `{"F": "freq"}` (dim `F` over the mesh axis
`freq`), or `{"F": ("x", "y")}` (dim `F` over both axes, `x` major)."""


def _entry(axes: tuple[str, ...]) -> str | tuple[str, ...]:
    return axes[0] if len(axes) == 1 else axes


def axes_str(axes: tuple[str, ...]) -> str:
    """The mesh axes of a sharded dim as descriptions show them: `'x'`, `('x', 'y')`."""
    return repr(_entry(axes))


def describe_split(
    name: str,
    size: int,
    axes: tuple[str, ...],
    shards: int,
    local_size: int,
    padded: int | None = None,
) -> str:
    """One sharded dim as descriptions show it: `F=12 over 'y': 4 shards of 3`."""
    pad = "" if padded is None else f", padded to {padded}"
    return (
        f"{name}={size} over {axes_str(axes)}: {plural(shards, 'shard')} of "
        f"{local_size}{pad}"
    )


AnyMesh = Mesh | AbstractMesh
Leaves = list[Any]
AxesEnv = list[tuple[str, int]]
# The shardings of the tracers of one call, as seen before its trace (`shardings_seen`).
_SEEN = contextvars.ContextVar[dict[int, NamedSharding]]("_SEEN", default={})


def shard_repr(dims: Sequence[tuple[str, tuple[str, ...]]]) -> str:
    return "{" + ", ".join(f"{name!r}: {axes_str(axes)}" for name, axes in dims) + "}"


def _axes_desc(axes: tuple[str, ...], mesh: AnyMesh) -> str:
    """`mesh axis 'freq' (size 4)` or `mesh axes ('x', 'y') (sizes 2 x 4 = 8)`."""
    if len(axes) == 1:
        return f"mesh axis {axes[0]!r} (size {mesh.shape[axes[0]]})"
    sizes = [mesh.shape[a] for a in axes]
    prod = " x ".join(str(s) for s in sizes)
    return f"mesh axes {axes!r} (sizes {prod} = {math.prod(sizes)})"


def _mesh_desc(mesh: AnyMesh) -> str:
    return ", ".join(f"{name!r} (size {size})" for name, size in mesh.shape.items())


@dataclasses.dataclass(frozen=True)
class ShardOptions:
    """The parsed `shard=`, `mesh=` and `pad=` of one wrapper. Not a pytree."""

    dims: tuple[tuple[str, tuple[str, ...]], ...]
    mesh: Mesh | None
    pad: bool

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.dims)

    def seen(self, leaves: Sequence[Any]) -> tuple[NamedSharding | None, ...]:
        """Each array's `NamedSharding` (`None` if none): a trace shows `Explicit` axes
        only. (`leaves`: arrays, `ShapeDtypeStruct`s, others; not tracers.)"""
        shardings = [getattr(x, "sharding", None) for x in leaves]
        return tuple(s if isinstance(s, NamedSharding) else None for s in shardings)

    def plan(self, fun_name: str, check: InputCheck) -> "ShardPlan":
        """Resolve the mesh and the local sizes for one call (at trace time)."""
        where = f"`{fun_name}`: `shard={shard_repr(self.dims)}`"
        ambient = jax.sharding.get_abstract_mesh()
        if self.mesh is not None:
            mesh: AnyMesh = self.mesh
            if not ambient.empty and ambient != mesh.abstract_mesh:
                raise SpecError(
                    f"{where}: the `mesh` given to `filter_multi_vmap` (axes "
                    f"{_mesh_desc(mesh)}) differs from the ambient mesh set with "
                    f"`jax.set_mesh` (axes {_mesh_desc(ambient)}), and "
                    "`jax.shard_map` needs them to match. Drop `mesh=` to use the "
                    "ambient mesh, or call outside that `jax.set_mesh`."
                )
        else:
            mesh = ambient
            if mesh.empty:
                raise SpecError(
                    f"{where} needs a device mesh, but none was given and there is "
                    "no ambient mesh. Pass `filter_multi_vmap(..., mesh=mesh)`, or "
                    "call the function inside `with jax.set_mesh(mesh):`."
                )
            check_axes(self.dims, mesh, f"{where} (with the ambient mesh)")
        local = dict(check.sizes)
        padded: dict[str, int] = {}
        for name, axes in self.dims:
            n = check.sizes[name]
            count = math.prod(mesh.shape[a] for a in axes)
            n_local = -(-n // count)
            if n % count:  # for a symbolic size, unless `count` divides every size
                if not self.pad:
                    desc = _axes_desc(axes, mesh)
                    size, to, eg = f"size {n}", n_local * count, ""
                    if jax.export.is_symbolic_dim(n):
                        size = f"symbolic size {n} (as `jax.export` gives it)"
                        to, eg = f"a multiple of {count}", f" (e.g. `{count}*t`)"
                    raise ShapeError(
                        f"{where}: dim '{name}' has {size}, which the {desc} does "
                        "not divide: every device must get the same number of "
                        f"elements. The size of '{name}' was bound by "
                        f"{_seen_desc(check.seen.get(name, []))}. Pass `pad=True` "
                        f"to pad '{name}' to {to} with copies of its last element "
                        f"(the outputs are trimmed back to {n}), or use a size that "
                        f"is a multiple of {count}{eg}."
                    )
                padded[name] = n_local * count
            local[name] = n_local
        return ShardPlan(fun_name, mesh, self.dims, dict(check.sizes), local, padded)


def _seen_desc(seen: list[Seen]) -> str:
    return "; ".join(s.where for s in seen) or "no argument"


def check_axes(
    dims: Sequence[tuple[str, tuple[str, ...]]], mesh: AnyMesh, where: str
) -> None:
    for name, axes in dims:
        for axis in axes:
            if axis not in mesh.axis_names:
                raise SpecError(
                    f"{where}: dim '{name}' is sharded over mesh axis {axis!r}, but "
                    f"the mesh has no such axis. Its axes are: {_mesh_desc(mesh)}."
                )


def parse_shard(shard: Any, mesh: Any, pad: Any) -> ShardOptions | None:
    """Validate `shard=`, `mesh=` and `pad=` at decoration time."""
    if not isinstance(pad, bool):
        raise SpecError(
            f"`filter_multi_vmap(..., pad=...)` must be `True` or `False`, but got "
            f"{pad!r} of type `{type(pad).__name__}`."
        )
    if mesh is not None and not isinstance(mesh, Mesh):
        raise SpecError(
            "`filter_multi_vmap(..., mesh=...)` must be a `jax.sharding.Mesh` (e.g. "
            "from `jax.make_mesh`) or `None` (use the ambient mesh of "
            f"`jax.set_mesh`), but got {mesh!r} of type `{type(mesh).__name__}`."
        )
    if shard is None:
        if mesh is not None or pad:
            given = "mesh" if mesh is not None else "pad"
            raise SpecError(
                f"`filter_multi_vmap(..., {given}=...)` is only used with `shard=`, "
                "which was not given; name the dims to shard, e.g. "
                "`shard={'F': 'freq'}`."
            )
        return None
    if not isinstance(shard, Mapping):
        raise SpecError(
            "`filter_multi_vmap(..., shard=...)` must be a dict from dim name to mesh "
            "axis name (or a tuple of mesh axis names), e.g. `{'F': 'freq'}`, but got "
            f"{shard!r} of type `{type(shard).__name__}`."
        )
    dims: list[tuple[str, tuple[str, ...]]] = []
    owner: dict[Any, str] = {}
    for name, value in shard.items():
        name = unstarred(name)  # `{"*batch": ...}`: the dim `batch`
        if not isinstance(name, str) or not name.isidentifier() or name[0] == "_":
            raise SpecError(
                f"`filter_multi_vmap(..., shard=...)` has key {name!r}, which is not a "
                "dim name. Dim names are Python identifiers not starting with `_`, "
                "e.g. 'F'."
            )
        axes = (value,) if isinstance(value, str) else value
        if (
            not isinstance(axes, (tuple, list))
            or not axes
            or not all(isinstance(a, str) for a in axes)
        ):
            raise SpecError(
                f"`filter_multi_vmap(..., shard={{{name!r}: {value!r}}})`: the value "
                "must be a mesh axis name such as 'freq', or a non-empty tuple of "
                "mesh axis names such as ('x', 'y')."
            )
        for axis in axes:
            if axis in owner:
                other = owner[axis]
                which = "twice for dim" if other == name else "for both dims"
                dims_ = f"'{name}'" if other == name else f"'{other}' and '{name}'"
                raise SpecError(
                    f"`filter_multi_vmap(..., shard=...)` uses mesh axis {axis!r} "
                    f"{which} {dims_}; each mesh axis can shard only one dim. To "
                    "shard one dim over several mesh axes, give a tuple, e.g. "
                    "`{'F': ('x', 'y')}`."
                )
            owner[axis] = name
        dims.append((name, tuple(axes)))
    if mesh is not None:
        check_axes(dims, mesh, f"`filter_multi_vmap(..., shard={shard_repr(dims)})`")
    return ShardOptions(tuple(dims), mesh, pad)


def _spec(dim_axes: Mapping[str, int], dims: dict, ndim: int) -> PartitionSpec:
    """The `PartitionSpec` of an array whose dim `name` is at `dim_axes[name]`."""
    entries: list[Any] = [None] * ndim
    for name, axes in dims.items():
        used = {a for e in entries for a in _names(e)}  # a mesh axis splits one dim
        if name in dim_axes and not used & set(axes):
            entries[dim_axes[name]] = _entry(axes)
    return PartitionSpec(*entries)


def split_dims(leaves: Sequence[Any], axes: Sequence[Any]) -> dict[str, str]:
    """The dims that arrays split over `Explicit` mesh axes (`axes`: each leaf's
    dims, or `None`), each with where: "`x` splits it over the mesh axis 'f'". Outside
    `shard_map`, no scan can loop over one: JAX needs a scan's inputs whole along it."""
    split: dict[str, str] = {}
    for leaf, dims in zip(leaves, axes):
        sharding = explicit_sharding(leaf.value) if dims else None
        if sharding is not None:
            spec = _padded_spec(sharding.spec, np.ndim(leaf.value))
            explicit = _explicit(sharding.mesh)
            for name, ax in dims.items():
                over = [a for a in _names(spec[ax]) if a in explicit]
                if over:
                    where = f"`{leaf.path}` splits it over the mesh axis {over[0]!r}"
                    split.setdefault(name, where)
    return split


def explicit_sharding(x: Any) -> Any:
    """The sharding of `x` under an explicitly sharded mesh, else `None`."""
    try:
        sharding = jax.typeof(x).sharding
        return sharding if _explicit(sharding.mesh) else None
    except Exception:
        return None


def _explicit(mesh: AnyMesh) -> tuple[str, ...]:
    kinds = zip(mesh.axis_names, mesh.axis_types)
    return tuple(a for a, kind in kinds if kind == AxisType.Explicit)


def _names(entry: Any) -> tuple[str, ...]:
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def _padded_spec(spec: PartitionSpec, ndim: int) -> list[Any]:
    return list(spec) + [None] * (ndim - len(spec))


def _reshard(
    x: Any, spec: PartitionSpec, mesh: AnyMesh, manual: Sequence[str], clear=()
) -> Any:
    """Give `x` the sharding `spec` on the manual axes of the mesh's `Explicit` ones
    (`shard_map` demands that its inputs' explicit shardings equal `in_specs`),
    keeping its sharding on the others, but on its axes numbered in `clear`. On
    `Auto` axes `shard_map` inserts the resharding itself."""
    explicit = _explicit(mesh)
    if not explicit:
        return x
    have = _padded_spec(jax.typeof(x).sharding.spec, np.ndim(x))
    entries = []
    for i, (h, w) in enumerate(zip(have, _padded_spec(spec, np.ndim(x)))):
        kept = () if i in clear else tuple(a for a in _names(h) if a not in manual)
        names = tuple(a for a in _names(w) + kept if a in explicit)
        entries.append(_entry(names) if names else None)
    return jax.sharding.reshard(x, NamedSharding(mesh, PartitionSpec(*entries)))


@contextlib.contextmanager
def shardings_seen(tracers: Sequence[Any], seen: Sequence[Any]) -> Iterator[None]:
    """While tracing `tracers`: their shardings as `ShardOptions.seen` saw them."""
    token = _SEEN.set({id(t): s for t, s in zip(tracers, seen) if s is not None})
    try:
        yield
    finally:
        _SEEN.reset(token)


def _retyped(mesh: AnyMesh, types: dict[str, AxisType]) -> AnyMesh:
    """`mesh` with the axis types `types` on its axes named there."""
    if not types or isinstance(mesh, AbstractMesh):
        return mesh.update_axis_types(types) if types else mesh
    kinds = tuple(types.get(a, t) for a, t in zip(mesh.axis_names, mesh.axis_types))
    return Mesh(mesh.devices, mesh.axis_names, axis_types=kinds)


def _pad_edge(x: Any, axis: int, extra: int) -> Any:
    """Pad `x` along `axis` with `extra` copies of its last element (a real slice)."""
    n = x.shape[axis]
    last = lax.slice_in_dim(x, n - 1, n, axis=axis)
    shape = x.shape[:axis] + (extra,) + x.shape[axis + 1 :]
    return jnp.concatenate([x, jnp.broadcast_to(last, shape)], axis=axis)


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """One call's sharding: the mesh, and the global, local and padded sizes."""

    fun_name: str
    mesh: AnyMesh
    dims: tuple[tuple[str, tuple[str, ...]], ...]
    sizes: dict[str, int]
    local_sizes: dict[str, int]
    padded: dict[str, int]

    @property
    def manual(self) -> tuple[str, ...]:
        """The mesh axes that `shard=` names, which `shard_map` makes manual."""
        return tuple(a for _, axes in self.dims for a in axes)

    @property
    def others(self) -> tuple[str, ...]:
        """The mesh's other `Explicit` axes: `Auto` inside (`jax.sharding.auto_axes`),
        as `shard_map` would gather an argument split over them."""
        return tuple(a for a in _explicit(self.mesh) if a not in self.manual)

    @property
    def inside_mesh(self) -> AbstractMesh:
        """The mesh as the body sees it: manual on `manual`, `Auto` on `others`."""
        mesh = self.mesh.abstract_mesh if isinstance(self.mesh, Mesh) else self.mesh
        types = {a: AxisType.Manual for a in self.manual}
        return mesh.update_axis_types(types | {a: AxisType.Auto for a in self.others})

    def describe(self, nest: str) -> str:
        """Put `shard_map(...)` in front of the (local) nest description."""
        parts = [
            describe_split(
                name,
                self.sizes[name],
                axes,
                math.prod(self.mesh.shape[a] for a in axes),
                self.local_sizes[name],
                self.padded.get(name),
            )
            for name, axes in self.dims
        ]
        head = f"{self.fun_name}: "
        assert nest.startswith(head)
        return f"{head}shard_map({'; '.join(parts)}) -> {nest[len(head) :]}"

    def unbound_axes(self, axis_env: Sequence[tuple[str, int]]) -> AxesEnv:
        """The mesh axes that are neither manual nor a dim's name, with sizes."""
        bound = {name for name, _ in axis_env} | set(self.manual)
        return [(a, n) for a, n in self.mesh.shape.items() if a not in bound]

    def check_collectives(self, found: Sequence[tuple[str, tuple[str, ...]]]) -> None:
        """A collective of the body over a mesh axis that `shard=` does not name."""
        for prim, names in found:
            for a in names:
                if a in self.mesh.axis_names and a not in self.manual:
                    raise SpecError(
                        f"`{self.fun_name}`: the body uses the collective `{prim}` "
                        f"over mesh axis {a!r}, which is not manual: `shard="
                        f"{shard_repr(self.dims)}` makes manual only the mesh axes "
                        f"it names, and leaves {a!r} to the compiler. Shard a dim "
                        f"over {a!r} too, to make it manual; or drop the collective "
                        f"and compute with whole arrays (e.g. `jnp.sum`), which the "
                        f"compiler partitions over {a!r} itself."
                    )

    def known_spec(self, x: Any) -> list[Any] | None:
        """The entries of `x`'s sharding on this mesh: a concrete array's, a tracer's
        `shardings_seen` or its type's (`Explicit` axes only); `None` if unknown."""
        tracer = isinstance(x, jax.core.Tracer)
        s = _SEEN.get().get(id(x)) if tracer else getattr(x, "sharding", None)
        s = jax.typeof(x).sharding if tracer and s is None else s
        if not isinstance(s, NamedSharding) or s.mesh.shape != self.mesh.shape:
            return None
        return _padded_spec(s.spec, np.ndim(x))

    def _check_split(self, x: Any, spec: PartitionSpec) -> None:
        """`x` is not split over a manual axis along another dim than `spec` puts
        there, as far as `known_spec` knows (else, on `Auto` axes, JAX reshards it)."""
        owner = {a: name for name, axes in self.dims for a in axes}
        for i, (h, w) in enumerate(zip(self.known_spec(x) or [], spec)):
            for a in set(_names(h)) & set(owner) - set(_names(w)):
                raise SpecError(
                    f"`{self.fun_name}`: `shard={shard_repr(self.dims)}` maps dim "
                    f"{owner[a]!r} over mesh axis {a!r}, but an argument "
                    f"{describe(x)} is already split over {a!r} along its axis {i}, "
                    f"which is not dim {owner[a]!r}. Reshard it first (e.g. with "
                    "`jax.sharding.reshard`), or shard the dim over another mesh "
                    "axis."
                )

    def kept_splits(self, values: Leaves, in_dims: Sequence[Dims | None]) -> dict:
        """Each dim's axis of `others` (`{"M": ("m",)}`): the one axis splitting it in
        every input of `values` (dims `in_dims`) that splits it, if it divides it."""
        found: dict[str, set[str]] = {}
        for v, dims in zip(values, in_dims):
            spec = self.known_spec(v) or [None] * np.ndim(v)
            for name, i in present_axes(dims, (), np.ndim(v)).items() if dims else ():
                split = set(_names(spec[i])) & set(self.others)
                found.setdefault(name, set()).update(split)
        kept = {n: s.pop() for n, s in found.items() if len(s) == 1 and n in self.sizes}
        return {
            n: (a,) for n, a in kept.items() if not self.sizes[n] % self.mesh.shape[a]
        }

    def run(
        self,
        values: Leaves,
        leaf_axes: Sequence[dict[str, int]],
        out_dims: Sequence[Any],
        out_ndims: Sequence[int],
        local: Callable[[Leaves], Leaves],
        prepadded: Sequence[int] = (),
        in_dims: Sequence[Dims | None] = (),
    ) -> Leaves:
        """`local` (the nest of one device's block, at the local sizes) inside
        `jax.shard_map`, on the input leaves `values`; the outputs, sharded.

        The leaves numbered in `prepadded` already have the padded sizes. An output
        without a sharded dim (reduced by `local`) is replicated over its mesh
        axes; on `others`, see `kept_splits` (`in_dims`: the first leaves' dims)."""
        dims, kept = dict(self.dims), self.kept_splits(values, in_dims)
        values = list(values)
        for name, n_pad in self.padded.items():
            for i, axes in enumerate(leaf_axes):
                if name in axes and i not in prepadded:
                    values[i] = _pad_edge(
                        values[i], axes[name], n_pad - self.sizes[name]
                    )
        in_specs = [_spec(a, dims, np.ndim(v)) for v, a in zip(values, leaf_axes)]
        for v, spec in zip(values, in_specs):
            self._check_split(v, spec)
        values = [
            _reshard(v, s, self.mesh, self.manual) for v, s in zip(values, in_specs)
        ]
        out_axes = [present_axes(d, (), n) for d, n in zip(out_dims, out_ndims)]
        out_specs = [_spec(a, dims, n) for a, n in zip(out_axes, out_ndims)]
        # Under `jax.jit` even when called eagerly: the body's jaxpr was traced with
        # the mesh's axes manual, as in a traced `shard_map`.
        auto = {a: AxisType.Auto for a in self.others}
        mapped = jax.shard_map(
            lambda *local_values: local(list(local_values)),
            mesh=_retyped(self.mesh, auto),
            axis_names=set(self.manual),
            in_specs=tuple(in_specs),
            out_specs=out_specs,
            # The body was traced once, on one element, outside (see
            # `_body.trace_body`): its jaxpr does not carry the varying manual
            # axes that this check needs.
            check_vma=False,
        )
        if self.others:
            # jax-ml/jax#29162: on `Explicit` axes that are not manual, `shard_map`
            # gathers its inputs; on `Auto` ones the compiler keeps them split.
            specs = [_spec(a, kept | dims, n) for a, n in zip(out_axes, out_ndims)]
            mapped = jax.sharding.auto_axes(
                mapped,
                axes=self.others,
                out_sharding=[NamedSharding(self.mesh, s) for s in specs],
            )
        outs = jax.jit(mapped)(*values)
        if self.padded:
            trimmed = []
            for out, axes, spec in zip(outs, out_axes, out_specs):
                # A JAX array cannot be sharded unevenly: gather the padded dims.
                trim = [name for name in self.padded if name in axes]
                clear = [axes[name] for name in trim]
                gathered = [None if i in clear else e for i, e in enumerate(spec)]
                out = _reshard(
                    out, PartitionSpec(*gathered), self.mesh, self.manual, clear
                )
                for name in trim:
                    out = lax.slice_in_dim(out, 0, self.sizes[name], axis=axes[name])
                trimmed.append(out)
            outs = trimmed
        # A computed empty array with a `NamedSharding` is malformed in JAX (each
        # device holds the full shape, and `np.asarray` fails): return fresh empty
        # arrays, which hold no data to shard.
        return [jnp.zeros(o.shape, o.dtype) if o.size == 0 else o for o in outs]
