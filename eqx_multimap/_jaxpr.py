"""Reading a body's jaxpr: what the planner asks of it (a while loop in lockstep,
the bytes each op reads). Total: a jaxpr it cannot read gets the cautious answer."""

from collections.abc import Iterator
from typing import Any

from ._body import _sub_jaxprs


# Ops that move data, which XLA fuses into the ops that compute.
_MOVES = frozenset(
    "slice squeeze reshape broadcast_in_dim expand_dims transpose dynamic_slice "
    "dynamic_update_slice gather concatenate copy copy_p convert_element_type iota "
    "select_n pad rev".split()
)


def op_bytes(jaxpr: Any) -> list[int]:
    """The bytes each op of `jaxpr` reads (the ops of its sub-jaxprs, not the calls
    of them); none if it cannot be read, or if it runs a while loop in lockstep:
    the waste of a larger block, which the model cannot see, outweighs its threads."""
    try:
        if lockstep(jaxpr):
            return []
        ops = (e for e in _eqns(jaxpr) if e.primitive.name not in _MOVES)
        reads = [_reads(e) for e in ops if not _sub_jaxprs(e)]
        return [n for n in reads if n]
    except Exception:  # an unfamiliar jaxpr: no op is taken to be small
        return []


def _reads(eqn: Any) -> int:
    avals = [v.aval for v in eqn.invars]
    return int(sum(a.size * a.dtype.itemsize for a in avals if hasattr(a, "size")))


def lockstep(jaxpr: Any) -> bool:
    """Whether a vmapped program runs a while loop in lockstep: its predicate is
    batched (as is, or reduced by equinox's `unvmap_any`), so each block loops as
    long as its slowest element. A jaxpr it cannot read is taken to."""
    try:
        for eqn in _eqns(jaxpr):
            if eqn.primitive.name == "while":
                cond = eqn.params["cond_jaxpr"].jaxpr
                if cond.outvars[0].aval.shape or any(map(_unvmapped, _eqns(cond))):
                    return True
    except Exception:  # an unfamiliar jaxpr: the cautious answer
        return True
    return False


def _unvmapped(eqn: Any) -> bool:
    unvmap = eqn.primitive.name in ("unvmap_any", "unvmap_all")
    return unvmap and bool(eqn.invars[0].aval.shape)


def _eqns(jaxpr: Any) -> Iterator[Any]:
    """The equations of `jaxpr` and, after each, those of its sub-jaxprs."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in _sub_jaxprs(eqn):
            yield from _eqns(sub)
