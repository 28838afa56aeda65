"""Predicting a candidate nest's temporaries and costs from full vmap's, uncompiled.

Full vmap (of the planned dims) is compiled first. From its temporaries and costs,
and the shapes of the inputs and outputs, [`Reference`][] predicts every other
candidate of the call:

- **temporaries**: the body's temporaries for one loop iteration's block (full
  vmap's, scaled by the block); at each scan level, the slice of one iteration of
  every input it slices (and a transposed copy of what it scans, when its dim is
  not that array's leading axis) and one iteration's block of every output (or,
  differentiated, of every cotangent); and a transposed copy of each output whose
  scanned dims do not lead it. The search uses this to choose which blocks to
  compile, and corrects it by those compiled (`corrected`).
- **costs**: every candidate runs the body on every element, so its flops and
  transcendentals are full vmap's. Its bytes are full vmap's plus the inputs it
  re-reads on every loop trip: those that no scanned dim slices. Loop trips are
  priced by the time model.
"""

import dataclasses
import math
from typing import Any

from ._plan import PlanCandidate


@dataclasses.dataclass(frozen=True)
class Leaf:
    """An input leaf or output leaf: its bytes, and the axis of each of its mapped
    dims, in axis order."""

    nbytes: int
    axes: tuple[tuple[str, int], ...]

    @property
    def dims(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.axes)


def leaf(shape: Any, dtype: Any, axes: dict[str, int]) -> Leaf:
    # `itemsize`, not `np.dtype(dtype)`: typed PRNG keys' dtypes are JAX's own.
    nbytes = math.prod(shape) * int(getattr(dtype, "itemsize", 0) or 0)
    return Leaf(nbytes, tuple(sorted(axes.items(), key=lambda kv: kv[1])))


ScanNest = tuple[tuple[str, int | None], ...]


@dataclasses.dataclass(frozen=True)
class Reference:
    """Full vmap's compiled figures, and the leaves that every candidate reads and
    writes (outputs: those whose blocks count, see the module's docstring)."""

    block: int
    temp: int
    flops: float
    transcendentals: float
    nbytes: float
    trips: int
    scan: ScanNest
    sizes: dict[str, int]
    inputs: tuple[Leaf, ...]
    outputs: tuple[Leaf, ...]

    def _fraction(self, scan: ScanNest, dims: tuple[str, ...]) -> float:
        """The part of a leaf with `dims` that one iteration of the scans `scan`
        (outermost first) covers."""
        return float(
            math.prod(
                (k or 1) / max(self.sizes[n], 1) for n, k in scan if n in dims
            )
        )

    def _input_copies(self, scan: ScanNest, x: Leaf) -> float:
        """The bytes a nest of scans copies out of an input leaf: at each scan level
        that slices it, the slice of one iteration, and, when the level's dim is
        not the leading axis of what it scans, a transposed copy of that."""
        total, gone, axes = 0.0, set(), dict(x.axes)
        for level, (name, chunk) in enumerate(scan):
            if name not in axes:
                continue
            if any(a not in gone for a in range(axes[name])):
                total += x.nbytes * self._fraction(scan[:level], x.dims)
            total += x.nbytes * self._fraction(scan[: level + 1], x.dims)
            if chunk is None:
                gone.add(axes[name])
        return total

    def _output_blocks(self, scan: ScanNest, y: Leaf) -> float:
        """The bytes of an output leaf that a nest of scans holds: one iteration's
        block at each level, and a transposed copy of the whole when the scanned
        dims do not lead it."""
        total = sum(
            y.nbytes * self._fraction(scan[: level + 1], y.dims)
            for level in range(len(scan))
        )
        in_y = [n for n, _ in scan if n in y.dims]
        if list(y.dims[: len(in_y)]) != in_y:
            total += y.nbytes  # the stacked blocks, transposed once
        return total

    def _body(self, c: PlanCandidate) -> float:
        """The body's temporaries for one loop iteration of `c`: full vmap's,
        scaled to its block."""
        return self.temp * c.block / max(self.block, 1)

    def temp_bytes(self, c: PlanCandidate) -> int:
        """The temporaries of `c`, predicted (see the module's docstring)."""
        body = self._body(c)
        if c.scan == self.scan:
            return int(body)
        total = body + sum(self._input_copies(c.scan, x) for x in self.inputs)
        total += sum(self._output_blocks(c.scan, y) for y in self.outputs)
        return int(total)

    def shared_bytes(self, scan: ScanNest) -> int:
        """The bytes of the inputs that no dim of `scan` slices: every loop trip
        reads them whole."""
        scanned = {n for n, _ in scan}
        return sum(x.nbytes for x in self.inputs if not scanned & set(x.dims))

    def costs(self, c: PlanCandidate) -> tuple[float, float, float]:
        """Flops, transcendentals and bytes accessed of `c`."""
        extra = (c.trips - 1) * self.shared_bytes(c.scan)
        base = (self.trips - 1) * self.shared_bytes(self.scan)
        return self.flops, self.transcendentals, max(self.nbytes + extra - base, 0.0)

    def working_set(self, c: PlanCandidate) -> int:
        """The bytes one loop iteration of `c` touches: its temporaries, its inputs
        (slices, and the inputs read whole) and its block of every output."""
        inputs = sum(x.nbytes * self._fraction(c.scan, x.dims) for x in self.inputs)
        outputs = sum(y.nbytes * self._fraction(c.scan, y.dims) for y in self.outputs)
        return int(self._body(c) + inputs + outputs)


def corrected(
    ref: Reference, c: PlanCandidate, compiled: list[PlanCandidate]
) -> float:
    """The temporaries of `c` predicted, scaled by how the compiled block of its
    ladder nearest it (by block; those that scan the same dims first) compared with
    its own prediction."""
    if not compiled:
        return float(ref.temp_bytes(c))
    dims = [n for n, _ in c.scan]

    def rank(k: PlanCandidate) -> tuple[bool, float]:
        same = [n for n, _ in k.scan] == dims
        return (not same, abs(math.log(max(k.block, 1) / max(c.block, 1))))

    near = min(compiled, key=rank)
    ratio = (near.temp_bytes or 0) / max(ref.temp_bytes(near), 1)
    return ref.temp_bytes(c) * ratio
