"""Costing candidate nests: XLA's memory and cost analyses of compiled ones, the
others predicted from full vmap's (`Reference`; see `docs/design.md`)."""

import dataclasses
import functools as ft
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from .._blocks import blocks, NestSpec
from .._body import struct
from .._jaxpr import op_bytes
from .._nest import Build, build_levels, loop_body_inputs, run
from .._resolve import Call
from .model import PARALLEL_BYTES, TimeModel
from .plan import PlanCandidate, ScanNest, split_leaves


class Leaf(NamedTuple):
    nbytes: int  # of an input or output leaf
    axes: dict[str, int]  # its mapped dims' axes, in order


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
        return sum(x.nbytes for x in self.inputs + self.outputs)

    def _bytes(self, scan: ScanNest, x: Leaf) -> float:
        """The bytes of a leaf that one iteration of `scan` covers."""
        parts = ((k or 1) / max(self.sizes[n], 1) for n, k in scan if n in x.axes)
        return x.nbytes * float(math.prod(parts))

    def _input_copies(self, scan: ScanNest, x: Leaf) -> float:
        """The bytes a nest of scans copies out of an input leaf: each slicing level's
        slice, and a transposed copy of it when its dim does not lead what it scans."""
        total, gone = 0.0, set()
        for level, (name, chunk) in enumerate(scan):
            if name in x.axes:
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
        """Temporaries: the body's scaled to `c`'s block, and what its scans copy."""
        if c.scan == self.full.scan:
            return int(self._body(c))
        copies = sum(self._input_copies(c.scan, x) for x in self.inputs)
        held = sum(self._output_blocks(c.scan, y) for y in self.outputs)
        return int(self._body(c) + copies + held)

    def costs(self, c: PlanCandidate) -> tuple[float, float, float]:
        """Full vmap's costs, plus unsliced inputs re-read on each of `c`'s trips."""
        extra, base = self._rereads(c), self._rereads(self.full)
        return self.flops, self.transcendentals, max(self.nbytes + extra - base, 0.0)

    def _rereads(self, c: PlanCandidate) -> int:
        scanned = {n for n, _ in c.scan}
        shared = sum(x.nbytes for x in self.inputs if scanned.isdisjoint(x.axes))
        return (c.trips - 1) * shared

    def working_set(self, c: PlanCandidate) -> int:
        inputs = sum(self._bytes(c.scan, x) for x in self.inputs)
        outputs = sum(self._bytes(c.scan, y) for y in self.outputs)
        return int(self._body(c) + inputs + outputs)


# XLA options for programs that are analysed, never run; on CPU, with `CPU_ONLY`.
ANALYSIS_OPTIONS = dict(
    xla_backend_optimization_level=0, xla_llvm_disable_expensive_passes=True
)
CPU_ONLY = {"xla_cpu_use_fusion_emitters": False}
Costs = tuple[float, float, float, int]  # flops, transcendentals, bytes, working set


def analysed(lowered: Any) -> Any:
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
        self.report, self.n_compiled = report, 0  # report: as `Progress.step`
        self.specs = []
        for v, axes in zip(call.values, call.leaf_axes):
            shape = list(np.shape(v))
            for name, ax in axes.items():
                shape[ax] = sizes[name]
            self.specs.append(struct(v, tuple(shape)))
        self.shares = split_leaves(call)[0]  # the input leaves split over other axes
        self.programs: dict[NestSpec, Any] = {}  # by nest: those `memory` compiled
        self.jaxprs: dict[NestSpec, Any] = {}  # and their jaxprs
        self._outs: list[tuple[int, Any]] = []  # differentiated: those with cotangents

    def compile(self, fn: Callable, specs: Any, what: str, runs: bool = False) -> Any:
        return self._compiled(jax.jit(fn).trace(specs), what, runs)

    def _compiled(self, traced: Any, what: str, runs: bool = False) -> Any:
        self.report(what)
        self.n_compiled += 1
        return traced.lower().compile() if runs else analysed(traced.lower())

    def build(self, spec: NestSpec) -> Build:
        # Differentiated, the backward pass recomputes one block at a time.
        return Build(self.isolate, self.checkpoint or self.backward and bool(spec.scan))

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

            return jax.vjp(of_inexact, [values[i] for i in diff_in])[1](cts)

        return gradient, [self.specs, [outs[i] for i in diff_out]]

    def memory(self, cand: PlanCandidate) -> int:
        fn, specs = self._program(cand.spec)
        traced = jax.jit(fn).trace(specs)
        compiled = self._compiled(traced, f"compiling {cand.nest(self.sizes)}")
        self.programs[cand.spec], self.jaxprs[cand.spec] = compiled, traced.jaxpr.jaxpr
        return int(compiled.memory_analysis().temp_size_in_bytes)

    def reference(self, full: PlanCandidate) -> Reference:
        """Full vmap's figures (`full`, its memory compiled): the candidates' basis."""
        assert full.temp_bytes is not None
        compiled = self.programs[full.spec]
        if full.scan and self.backward:  # the forward nest: its loop bodies are added
            what = f"compiling the forward nest of {full.nest(self.sizes)}"
            compiled = self.compile(*self._program(full.spec, True), what)
        figures = (full.temp_bytes, *self.corrected_cost(compiled, full)[:3])
        ins = tuple(map(leaf, self.specs, self.problem.leaf_axes, self.shares))
        outs = []  # an output's mapped dims in order: their axes, roughly
        for i, s in self._outs if self.backward else enumerate(compiled.out_info):
            mapped = [n for n in self.problem.out_dims[i].names if n in self.sizes]
            outs.append(leaf(s, {name: a for a, name in enumerate(mapped)}))
        ops = tuple(op_bytes(self.jaxprs[full.spec]))
        return Reference(full, *figures, self.sizes, ins, tuple(outs), ops)

    def predicted_costs(self, cand: PlanCandidate, ref: Reference) -> PlanCandidate:
        share = serial(ref.ops, cand.block / max(ref.full.block, 1))
        costs = (*ref.costs(cand), ref.working_set(cand), share, ref.io())
        return self._with_costs(cand, costs)

    def _with_costs(self, cand: PlanCandidate, costs: tuple) -> PlanCandidate:
        """`cand` costed: `costs` as `TimeModel.seconds` takes them, less `trips`."""
        flops, trans, nbytes, ws, serial, io = costs
        trips = cand.trips if cand.scan else 0
        seconds = self.model.seconds(flops, trans, nbytes, trips, ws, serial, io)
        costed = dict(flops=flops, transcendentals=trans, bytes_accessed=nbytes)
        return dataclasses.replace(cand, **costed, working_set=ws, seconds=seconds)

    def evaluate(self, cand: PlanCandidate, budget: int | None) -> PlanCandidate:
        """Compile `cand` (a fixed forward nest): its memory; if it fits, its costs."""
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
        return self._with_costs(cand, (*self.corrected_cost(compiled, cand), one, io))

    def corrected_cost(self, compiled: Any, cand: PlanCandidate) -> Costs:
        """Flops, transcendentals, bytes and working set (the largest footprint of a
        loop body, or the whole's if nothing loops), less the inputs' pieces held
        elsewhere. XLA counts a while loop's body once: each block's (the vmaps in its
        scans) is compiled alone and its cost added `trips - 1` more times."""
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
        """The bytes of input leaves `specs` other devices hold (`split_leaves`)."""
        pieces = zip(specs, self.shares)
        return sum(leaf(s, {}).nbytes - leaf(s, {}, k).nbytes for s, k in pieces)


def serial(ops: Sequence[int], scale: float) -> float:
    """The share of `ops`' bytes (times `scale`) in ops too small for XLA to thread."""
    return sum(n for n in ops if n * scale < PARALLEL_BYTES) / max(sum(ops), 1)


def _footprint(compiled: Any) -> int:
    m = compiled.memory_analysis()
    return int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes)


def xla_costs(compiled: Any) -> tuple[float, float, float]:
    ca = compiled.cost_analysis() or {}
    keys = ("flops", "transcendentals", "bytes accessed")
    return tuple(float(ca.get(k, 0.0)) for k in keys)  # type: ignore
