"""Predicting a candidate nest's temporaries and costs from full vmap's, uncompiled.

Full vmap (of the planned dims) is compiled first. From its temporaries and costs,
and the shapes of the inputs and outputs, [`Reference`][] predicts every other
candidate of the call:

- **temporaries**: one loop iteration holds the body's temporaries for its block
  (full vmap's, scaled by the block), the slices of the scanned inputs, and its block
  of every output (or, differentiated, of every cotangent); an output whose scanned
  dims do not lead it is transposed once, whole. On `benchmarks/planner.py`'s
  workloads this is within 0.7-1.5x of XLA's figure for most blocks; it
  over-estimates small blocks of scans over inner dims, whose slices XLA does not
  copy. The search uses it to choose which blocks to compile, and corrects it by
  the blocks compiled (`corrected`).
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
    """An input leaf or output leaf: its bytes and its mapped dims, in axis order."""

    nbytes: int
    dims: tuple[str, ...]


def leaf(shape: Any, dtype: Any, dims: tuple[str, ...]) -> Leaf:
    # `itemsize`, not `np.dtype(dtype)`: typed PRNG keys' dtypes are JAX's own.
    return Leaf(math.prod(shape) * int(getattr(dtype, "itemsize", 0) or 0), dims)


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
    scan: tuple[tuple[str, int | None], ...]
    sizes: dict[str, int]
    inputs: tuple[Leaf, ...]
    outputs: tuple[Leaf, ...]

    def _fraction(self, c: PlanCandidate, dims: tuple[str, ...]) -> float:
        """The part of a leaf with `dims` that one loop iteration of `c` covers."""
        chunks = dict(c.scan)
        return float(
            math.prod(
                (chunks[n] or 1) / max(self.sizes[n], 1) for n in dims if n in chunks
            )
        )

    def temp_bytes(self, c: PlanCandidate) -> int:
        """The temporaries of `c`, predicted (see the module's docstring)."""
        if c.scan == self.scan:
            return int(self.temp * c.block / max(self.block, 1))
        scanned = [n for n, _ in c.scan]
        total = self.temp * c.block / max(self.block, 1)
        for x in self.inputs:
            if any(n in x.dims for n in scanned):
                total += x.nbytes * self._fraction(c, x.dims)
        for y in self.outputs:
            total += y.nbytes * self._fraction(c, y.dims)
            in_y = [n for n in scanned if n in y.dims]
            if list(y.dims[: len(in_y)]) != in_y:
                total += y.nbytes  # the stacked blocks, transposed once
        return int(total)

    def shared_bytes(self, scan: tuple[tuple[str, int | None], ...]) -> int:
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
        scanned = [n for n, _ in c.scan]
        inputs = sum(
            x.nbytes * (self._fraction(c, x.dims) if set(scanned) & set(x.dims) else 1)
            for x in self.inputs
        )
        outputs = sum(y.nbytes * self._fraction(c, y.dims) for y in self.outputs)
        body = self.temp * c.block / max(self.block, 1)
        return int(body + inputs + outputs)


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
