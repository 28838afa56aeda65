"""Costing candidate nests: XLA's memory and cost analyses of compiled ones, the
others predicted from full vmap's (`Reference`; see `docs/design.md`)."""

import dataclasses
import functools as ft
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .._blocks import blocks, NestSpec
from .._body import struct
from .._jaxpr import op_bytes
from .._nest import Build, build_levels, loop_body_inputs, run
from .._resolve import Call
from .model import PARALLEL_BYTES, TimeModel
from .plan import PlanCandidate, ScanNest, split_leaves


@dataclasses.dataclass(frozen=True)
class Leaf:
    """An input or output leaf: its bytes, and its mapped dims' axes, in order."""

    nbytes: int
    axes: dict[str, int]


def leaf(s: Any, axes: dict[str, int], shares: int = 1) -> Leaf:
    """`s` as a `Leaf`; its bytes those of one device's piece of `shares`."""
    # `itemsize`, not `np.dtype(dtype)`: typed PRNG keys' dtypes are JAX's own.
    nbytes = math.prod(s.shape) * int(getattr(s.dtype, "itemsize", 0) or 0) // shares
    return Leaf(nbytes, dict(sorted(axes.items(), key=lambda kv: kv[1])))


@dataclasses.dataclass(frozen=True)
class Reference:
    """Full vmap (`full`) and its compiled figures, and the leaves every candidate
    reads and writes (outputs: those whose blocks a loop iteration holds)."""

    full: PlanCandidate
    temp: int
    flops: float
    transcendentals: float
    nbytes: float
    sizes: dict[str, int]
    inputs: tuple[Leaf, ...]
    outputs: tuple[Leaf, ...]
    ops: tuple[int, ...]  # the bytes each op of full vmap reads

    def io(self) -> int:
        """The bytes of every input and output, each read or written once."""
        return sum(x.nbytes for x in self.inputs + self.outputs)

    def serial(self, c: PlanCandidate) -> float:
        return serial(self.ops, c.block / max(self.full.block, 1))

    def _bytes(self, scan: ScanNest, x: Leaf) -> float:
        """The bytes of a leaf that one iteration of `scan` covers."""
        parts = ((k or 1) / max(self.sizes[n], 1) for n, k in scan if n in x.axes)
        return x.nbytes * float(math.prod(parts))

    def _input_copies(self, scan: ScanNest, x: Leaf) -> float:
        """The bytes a nest of scans copies out of an input leaf: each slicing level's
        slice, and a transposed copy of it when its dim does not lead what it scans."""
        total, gone = 0.0, set()
        for level, (name, chunk) in enumerate(scan):
            if name not in x.axes:
                continue
            if any(a not in gone for a in range(x.axes[name])):
                total += self._bytes(scan[:level], x)
            total += self._bytes(scan[: level + 1], x)
            if chunk is None:
                gone.add(x.axes[name])
        return total

    def _output_blocks(self, scan: ScanNest, y: Leaf) -> float:
        """The bytes of an output leaf a nest of scans holds: each level's block, and a
        transposed copy of the whole when the scanned dims do not lead it."""
        in_y = [n for n, _ in scan if n in y.axes]
        copy = y.nbytes if list(y.axes)[: len(in_y)] != in_y else 0
        return sum(self._bytes(scan[: i + 1], y) for i in range(len(scan))) + copy

    def _body(self, c: PlanCandidate) -> float:
        return self.temp * c.block / max(self.full.block, 1)

    def temp_bytes(self, c: PlanCandidate) -> int:
        """The temporaries of `c`, predicted: the body's, scaled to its block, and
        the slices and blocks its scans copy."""
        if c.scan == self.full.scan:
            return int(self._body(c))
        copies = sum(self._input_copies(c.scan, x) for x in self.inputs)
        held = sum(self._output_blocks(c.scan, y) for y in self.outputs)
        return int(self._body(c) + copies + held)

    def costs(self, c: PlanCandidate) -> tuple[float, float, float]:
        """Flops, transcendentals and bytes accessed of `c`: full vmap's, and the
        inputs that no scanned dim slices re-read on every loop trip."""

        def shared(scan: ScanNest) -> int:
            scanned = {n for n, _ in scan}
            return sum(x.nbytes for x in self.inputs if scanned.isdisjoint(x.axes))

        extra = (c.trips - 1) * shared(c.scan)
        base = (self.full.trips - 1) * shared(self.full.scan)
        return self.flops, self.transcendentals, max(self.nbytes + extra - base, 0.0)

    def working_set(self, c: PlanCandidate) -> int:
        """The bytes one loop iteration of `c` touches."""
        inputs = sum(self._bytes(c.scan, x) for x in self.inputs)
        outputs = sum(self._bytes(c.scan, y) for y in self.outputs)
        return int(self._body(c) + inputs + outputs)


# XLA options for programs that are analysed, never run; on CPU, with `CPU_ONLY`.
ANALYSIS_OPTIONS = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
}
CPU_ONLY = {"xla_cpu_use_fusion_emitters": False}


def analysed(lowered: Any) -> Any:
    """`lowered` compiled for its memory and cost analyses only."""
    options = ANALYSIS_OPTIONS | (CPU_ONLY if jax.default_backend() == "cpu" else {})
    try:
        return lowered.compile(options)
    except Exception as e:  # a jaxlib that knows no `CPU_ONLY` option
        if "No such compile option" not in str(e):
            raise
        return lowered.compile(ANALYSIS_OPTIONS)


class Compiler:
    """Compiles candidate nests of one call, each input leaf an argument at the sizes
    planned for. With `backward`, a candidate's program (its memory; what measured
    mode runs) is the nest's reverse-mode derivative, every scan body checkpointed."""

    def __init__(
        self,
        call: Call,
        sizes: dict[str, int],
        model: TimeModel,
        backward: bool = False,
        report: Callable[[str], None] = lambda doing: None,
    ):
        self.problem = call.problem(sizes, standalone=True)
        self.checkpoint, self.isolate = call.options.checkpoint, call.isolate
        self.backward, self.model, self.sizes = backward, model, sizes
        self.report = report  # each step of planning, as `Progress.step`
        self.specs = []
        for v, axes in zip(call.values, call.leaf_axes):
            shape = list(np.shape(v))
            for name, ax in axes.items():
                shape[ax] = sizes[name]
            self.specs.append(struct(v, tuple(shape)))
        self.shares = split_leaves(call)[0]  # the input leaves split over other axes
        self.n_compiled = 0
        self.programs: dict[NestSpec, Any] = {}  # by nest: those `memory` compiled
        self.jaxprs: dict[NestSpec, Any] = {}  # and their jaxprs
        # Differentiated, the outputs whose cotangents a loop iteration holds.
        self._outs: list[tuple[int, Any]] = []

    def compile(
        self, fn: Callable[[list], Any], specs: Any, what: str = "", runs: bool = False
    ) -> Any:
        """Compile `fn` for `specs`: to run (`runs`), else to analyse (`analysed`)."""
        return self._compiled(jax.jit(fn).trace(specs), what, runs)

    def _compiled(self, traced: Any, what: str, runs: bool = False) -> Any:
        self.report(what)
        self.n_compiled += 1
        return traced.lower().compile() if runs else analysed(traced.lower())

    def build(self, spec: NestSpec) -> Build:
        # Differentiated, the backward pass recomputes one block at a time.
        checkpoint = self.checkpoint or (self.backward and bool(spec.scan))
        return Build(isolate=self.isolate, checkpoint=checkpoint)

    def _program(self, spec: NestSpec, forward: bool = False) -> tuple[Callable, Any]:
        """A candidate's program (with `forward`, the nest even when differentiated),
        and the `ShapeDtypeStruct`s of its one argument."""
        nest = ft.partial(run, self.problem, spec, self.build(spec))
        if forward or not self.backward:
            return nest, self.specs
        outs = jax.eval_shape(nest, self.specs)
        inexact = lambda s: jax.numpy.issubdtype(s.dtype, jax.numpy.inexact)
        diff_in = [i for i, s in enumerate(self.specs) if inexact(s)]
        diff_out = [i for i, s in enumerate(outs) if inexact(s)]
        self._outs = [(i, outs[i]) for i in diff_out]

        def gradient(args: list) -> Any:
            values, cts = args

            def of_inexact(xs: list) -> list:
                given = dict(zip(diff_in, xs))
                out = nest([given.get(i, v) for i, v in enumerate(values)])
                return [out[i] for i in diff_out]

            _, pullback = jax.vjp(of_inexact, [values[i] for i in diff_in])
            return pullback(cts)

        return gradient, [self.specs, [outs[i] for i in diff_out]]

    def memory(self, cand: PlanCandidate) -> int:
        fn, specs = self._program(cand.spec)
        traced = jax.jit(fn).trace(specs)
        compiled = self._compiled(traced, f"compiling {cand.nest(self.sizes)}")
        self.programs[cand.spec], self.jaxprs[cand.spec] = compiled, traced.jaxpr.jaxpr
        return int(compiled.memory_analysis().temp_size_in_bytes)

    def reference(self, full: PlanCandidate) -> Reference:
        """What the search predicts every candidate from: full vmap (`full`, its
        memory compiled), its costs, and the leaves."""
        assert full.temp_bytes is not None
        ops = tuple(op_bytes(self.jaxprs[full.spec]))
        compiled = self.programs[full.spec]
        if full.scan and self.backward:  # the forward nest: its loop bodies are added
            what = f"compiling the forward nest of {full.nest(self.sizes)}"
            compiled = self.compile(*self._program(full.spec, True), what)
        flops, trans, nbytes, _ = self.corrected_cost(compiled, full)
        outs = self._outs if self.backward else enumerate(compiled.out_info)
        inputs = tuple(map(leaf, self.specs, self.problem.leaf_axes, self.shares))
        outputs = []
        for i, s in outs:  # an output's mapped dims in order: their axes, roughly
            mapped = [n for n in self.problem.out_dims[i].names if n in self.sizes]
            outputs.append(leaf(s, {name: a for a, name in enumerate(mapped)}))
        return Reference(
            full, full.temp_bytes, flops, trans, nbytes, self.sizes, inputs,
            tuple(outputs), ops,
        )  # fmt: skip

    def predicted_costs(self, cand: PlanCandidate, ref: Reference) -> PlanCandidate:
        costs = (*ref.costs(cand), ref.working_set(cand))
        return self._with_costs(cand, costs, ref.serial(cand), ref.io())

    def _with_costs(
        self, cand: PlanCandidate, costs: tuple, serial: float, io: int
    ) -> PlanCandidate:
        """`cand` with its `costs` (as `corrected_cost`'s) and its estimated time."""
        flops, trans, nbytes, ws = costs
        trips = cand.trips if cand.scan else 0
        seconds = self.model.seconds(flops, trans, nbytes, trips, ws, serial, io)
        return dataclasses.replace(
            cand, flops=flops, transcendentals=trans, bytes_accessed=nbytes,
            working_set=ws, seconds=seconds,
        )  # fmt: skip

    def evaluate(self, cand: PlanCandidate, budget: int | None) -> PlanCandidate:
        """Compile `cand` (a forward nest: a fixed one): its temporary memory, and if
        it fits, its costs from its own compile."""
        temp = self.memory(cand)
        fits = None if budget is None else temp <= budget
        cand = dataclasses.replace(cand, temp_bytes=temp, fits=fits)
        if fits is False:
            return cand
        assert not self.backward
        compiled = self.programs[cand.spec]
        io = sum(leaf(s, {}).nbytes for s in [*self.specs, *compiled.out_info])
        io -= self.elsewhere(self.specs)
        one = serial(op_bytes(self.jaxprs[cand.spec]), 1.0)
        return self._with_costs(cand, self.corrected_cost(compiled, cand), one, io)

    def corrected_cost(
        self, compiled: Any, cand: PlanCandidate
    ) -> tuple[float, float, float, int]:
        """Flops, transcendentals, bytes and working set (the largest footprint of a
        loop body, or of the whole when nothing loops), loop bodies counted fully: XLA
        counts a while loop's body once, so each block's (the vmaps inside its scans)
        is compiled on its own and its cost added `trips - 1` more times. Both without
        the inputs' pieces held elsewhere, each counted as read once."""
        total, ws = list(xla_costs(compiled)), 0
        total[2] -= self.elsewhere(self.specs)
        what = f"costing the loop body of {cand.nest(self.sizes)}"
        looping = [b for b in blocks(cand.spec, self.problem.sizes) if b.trips > 1]
        for block in looping:
            specs, axes = loop_body_inputs(self.specs, self.problem.leaf_axes, block)
            nest = build_levels(self.problem.body, block.vmaps, axes)
            body = self.compile(nest, specs, what)
            n, away = block.trips - 1, self.elsewhere(specs)
            total = [t + n * b for t, b in zip(total, xla_costs(body))]
            total[2] -= n * away
            ws = max(ws, _footprint(body) - away)
        whole = _footprint(compiled) - self.elsewhere(self.specs)
        return total[0], total[1], max(total[2], 0.0), ws if looping else whole

    def elsewhere(self, specs: Sequence[Any]) -> int:
        """The bytes of the input leaves `specs` that other devices hold: their pieces
        on the mesh axes that `shard=` leaves to the compiler."""
        pieces = zip(specs, self.shares)
        return sum(leaf(s, {}).nbytes - leaf(s, {}, k).nbytes for s, k in pieces)


def serial(ops: Sequence[int], scale: float) -> float:
    """The share of the bytes the `ops` read (scaled by `scale`) read by ops too
    small for XLA to split over threads (`PARALLEL_BYTES`)."""
    return sum(n for n in ops if n * scale < PARALLEL_BYTES) / max(sum(ops), 1)


def _footprint(compiled: Any) -> int:
    m = compiled.memory_analysis()
    return int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes)


def xla_costs(compiled: Any) -> tuple[float, float, float]:
    """XLA's flops, transcendentals and bytes accessed of a compiled program."""
    ca = compiled.cost_analysis() or {}
    keys = ("flops", "transcendentals", "bytes accessed")
    return tuple(float(ca.get(k, 0.0)) for k in keys)  # type: ignore
