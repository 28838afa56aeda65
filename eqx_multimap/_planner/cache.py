"""The planner's cache on disk: plans and time-model calibrations, as JSON files.

One file per entry, named by a hash of its key, under
`<cache dir>/v<FORMAT_VERSION>/<kind>/`. A file holds its whole key as well as its
value, and is used only if the key matches, its format and version are this
module's, and the planner accepts its value: an unreadable, corrupt or foreign file
gives a warning and is planned (and written) again, never a crash or a wrong plan.
Writes go to a temporary file in the same directory, then `os.replace` it into
place, so that processes sharing the directory never see half a file: the last
writer of a key wins, with a whole entry.

The cache directory is `Planner(cache_dir=...)`, else the environment variable
`EQX_MULTIMAP_CACHE_DIR` (`off` disables the disk cache), else
`$XDG_CACHE_HOME/eqx_multimap`, else `~/.cache/eqx_multimap`.

A plan is stored under a key of everything that determines it (`plan_key`: a
fingerprint of the body and its inputs, the sizes, options, budget, the time model,
the machine and the versions), as JSON (`plan_json`), and read back checked
against the call (`plan_from_json`). Nothing is pickled. A calibrated time model
is in the key by what it was calibrated for (the machine, and the model's terms),
not by its measured constants, so that calibrating again keeps the plans.

A calibration is stored once per machine and versions (`calibration_key`); the
processes that share the directory take its file lock (`DiskCache.lock`) to
calibrate, so that one measures and the others wait for its result.
"""

import contextlib
import dataclasses
import datetime
import hashlib
import importlib.metadata
import json
import math
import os
import re
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import jaxlib

from .._body import struct
from .._resolve import Call
from .cost import KEEP_WITHIN, MAX_MEASURED
from .model import machine
from .plan import Plan, PlanCandidate
from .search import MAX_COMPILES, SEARCH_VERSION
from .space import (
    auto_plan,
    block_and_trips,
    collective_dims,
    given_dims,
    no_fit_message,
    Request,
)


try:
    import fcntl
except ImportError:  # Windows: the cache is then not locked
    fcntl = None



FORMAT = "eqx_multimap.plan_cache"
FORMAT_VERSION = 1
ENV_VAR = "EQX_MULTIMAP_CACHE_DIR"
_OFF = ("off", "0", "false", "none", "no")


def default_cache_dir() -> str | None:
    """The cache directory from the environment; `None` if disabled there."""
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        return None if env.lower() in _OFF else os.path.expanduser(env)
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(
        os.path.expanduser("~"), ".cache"
    )
    return os.path.join(base, "eqx_multimap")


def _normal(key: Any) -> Any:
    """`key` as JSON gives it back (tuples as lists), for comparing keys."""
    return json.loads(json.dumps(key, sort_keys=True))


def _warn(message: str) -> None:
    warnings.warn(f"eqx_multimap plan cache: {message}", RuntimeWarning, stacklevel=3)


class DiskCache:
    """JSON entries keyed by JSON-able dicts, in one directory."""

    def __init__(self, root: str):
        self.root = os.fspath(root)

    def __repr__(self) -> str:
        return f"DiskCache({self.root!r})"

    def path(self, kind: str, key: dict[str, Any]) -> str:
        text = json.dumps(key, sort_keys=True)
        digest = hashlib.sha256(text.encode()).hexdigest()[:40]
        return os.path.join(self.root, f"v{FORMAT_VERSION}", kind, digest + ".json")

    def read(self, kind: str, key: dict[str, Any]) -> Any:
        """The value stored for `key`, or `None` (with a warning if a file is there
        but unusable)."""
        path = self.path(kind, key)
        try:
            with open(path, encoding="utf-8") as fh:
                record = json.load(fh)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:  # unreadable, or not JSON (or not UTF-8)
            self.invalid(path, f"cannot read it ({type(e).__name__}: {e})")
            return None
        problem = None
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            problem = "it is not an eqx_multimap cache entry"
        elif record.get("version") != FORMAT_VERSION:
            problem = (
                f"it has format version {record.get('version')!r}, not {FORMAT_VERSION}"
            )
        elif record.get("kind") != kind or record.get("key") != _normal(key):
            problem = "its key is not the one it is stored under"
        elif "value" not in record:
            problem = "it has no value"
        if problem is not None:
            self.invalid(path, problem)
            return None
        return record["value"]

    @contextlib.contextmanager
    def lock(self, kind: str) -> Iterator[None]:
        """Hold the directory's lock for `kind` against other processes (and
        threads): an exclusive `flock` on `<kind>.lock`, waited for. Where it
        cannot be taken (no `fcntl`, a read-only directory), nothing is locked."""
        path = os.path.join(self.root, f"v{FORMAT_VERSION}", f"{kind}.lock")
        if fcntl is None:
            yield
            return
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            yield
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:
                pass
            yield
        finally:
            os.close(fd)  # releases the lock

    def invalid(self, path: str, problem: str) -> None:
        _warn(f"ignoring {path}: {problem}. Planning again, and overwriting it.")

    def write(self, kind: str, key: dict[str, Any], value: Any) -> str | None:
        """Store `value` for `key` atomically; its path, or `None` (with a warning)
        if it could not be written."""
        path = self.path(kind, key)
        record = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "kind": kind,
            "key": key,
            "value": value,
        }
        text = json.dumps(record, indent=1, sort_keys=True, allow_nan=False)
        directory = os.path.dirname(path)
        tmp = None
        try:
            os.makedirs(directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".json")
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
            os.replace(tmp, path)
            tmp = None
        except OSError as e:
            _warn(
                f"cannot write {path} ({type(e).__name__}: {e}); kept in memory only."
            )
            return None
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        return path


#
# Plans: their keys, and their values as JSON.
#


def fingerprint(call: Call) -> str:
    """What determines a call's plan besides its options: the body's jaxpr, and the
    shapes and dtypes of every input leaf with its mapped axes.

    Stable from process to process (object addresses that a jaxpr may print, e.g.
    of callbacks, are dropped), so it can key the disk cache."""
    text = str(call.body.jaxpr.jaxpr) + repr(
        [
            (str(struct(v)), sorted(a.items()))
            for v, a in zip(call.values, call.leaf_axes)
        ]
    )
    text += repr([str(d) for d in call.out.dims])
    text = re.sub(r" at 0x[0-9a-fA-F]+", "", text)
    return hashlib.sha256(text.encode()).hexdigest()


def calibration_key() -> dict[str, Any]:
    """What a calibration is stored under: the machine and the versions."""
    return {"machine": machine(), "versions": versions(), "calibration": 1}


def versions() -> dict[str, str]:
    """The versions of JAX, jaxlib and `eqx_multimap` (part of every key)."""
    try:
        ours = importlib.metadata.version("eqx_multimap")
    except importlib.metadata.PackageNotFoundError:
        ours = "unknown"
    return {
        "jax": jax.__version__,
        "jaxlib": getattr(jaxlib, "__version__", "unknown"),
        "eqx_multimap": ours,
    }


def plan_key(
    request: Request, collective: tuple[str, ...], fingerprint: str
) -> dict[str, Any]:
    """Everything that determines a plan, as JSON: the request, the dims the body
    uses in collectives, and the body's fingerprint."""
    call = request.call
    return {
        "body": fingerprint,
        "sizes": [[n, s] for n, s in request.sizes.items()],
        "scan": [[n, c] for n, c in call.options.scan],
        "vmap": list(call.options.vmap),
        "shard": [dataclasses.astuple(d) for d in request.shard],
        "collective": list(collective),
        "checkpoint": call.options.checkpoint,
        "budget": request.budget,
        "backward": request.backward,
        "search": [SEARCH_VERSION, MAX_COMPILES, MAX_MEASURED, KEEP_WITHIN],
        "time_model": (
            request.model.to_json() if request.model_key is None else request.model_key
        ),
        "machine": machine(),
        "versions": versions(),
    }


_CAND_FIELDS = tuple(f.name for f in dataclasses.fields(PlanCandidate))


def _finite(x: Any) -> Any:
    return None if isinstance(x, float) and not math.isfinite(x) else x


def cand_json(c: PlanCandidate) -> dict[str, Any]:
    """A candidate as JSON (non-finite numbers as `null`)."""
    d = {name: _finite(getattr(c, name)) for name in _CAND_FIELDS}
    d["scan"] = [[n, k] for n, k in c.scan]
    d["vmap"] = list(c.vmap)
    return d


def plan_json(plan: Plan, how: str) -> dict[str, Any]:
    """A plan as JSON: its candidates, which was chosen, and how it was made."""
    return {
        "plan": {
            "chosen": plan.candidates.index(plan.chosen),
            "candidates": [cand_json(c) for c in plan.candidates],
            "checkpoint": plan.checkpoint,
            "summary": plan.summary,
            "measured": plan.measured,
            "basis": plan.basis,
            "how": how,
            "created": datetime.datetime.now()
            .astimezone()
            .isoformat(timespec="seconds"),
        }
    }


def _opt(x: Any, kinds: tuple[type, ...]) -> Any:
    if x is not None and (isinstance(x, bool) or not isinstance(x, kinds)):
        raise ValueError(f"bad value {x!r}")
    return x


def _cand_from_json(d: Any, call: Call, sizes: dict[str, int]) -> PlanCandidate:
    """A stored candidate, checked to be a valid nest of this call."""
    if not isinstance(d, dict) or set(d) != set(_CAND_FIELDS):
        raise ValueError("a candidate does not have the fields of one")
    scan = tuple((str(n), None if k is None else int(k)) for n, k in d["scan"])
    vmap = tuple(str(n) for n in d["vmap"])
    names = [n for n, _ in scan] + list(vmap)
    if sorted(names) != sorted(call.mapped):
        raise ValueError(f"a candidate maps {names}, not the mapped dims")
    if any(k is not None and not 1 <= k <= sizes[n] for n, k in scan):
        raise ValueError("a candidate has a chunk out of range")
    if scan[: len(call.options.scan)] != call.options.scan:
        raise ValueError("a candidate does not keep the scans given")
    planned = {n for n, _ in scan[len(call.options.scan) :]}
    if planned & (set(given_dims(call)) | set(collective_dims(call))):
        raise ValueError("a candidate scans a dim it must not")
    block, trips = block_and_trips(scan, vmap, sizes)
    fits = d["fits"]
    if fits is not None and not isinstance(fits, bool):
        raise ValueError("bad `fits`")
    if not isinstance(d["source"], str) or not isinstance(d["reason"], str):
        raise ValueError("bad descriptions")
    num = (int, float)
    return PlanCandidate(
        scan=scan,
        vmap=vmap,
        block=block,
        trips=trips,
        source=d["source"],
        temp_bytes=_opt(d["temp_bytes"], (int,)),
        flops=_opt(d["flops"], num),
        transcendentals=_opt(d["transcendentals"], num),
        bytes_accessed=_opt(d["bytes_accessed"], num),
        working_set=_opt(d["working_set"], (int,)),
        seconds=_opt(d["seconds"], num),
        fits=fits,
        fresh_bytes=_opt(d["fresh_bytes"], (int,)),
        measured=_opt(d["measured"], num),
        reason=d["reason"],
        predicted=d["predicted"] is True,
    )


def plan_from_json(stored: Any, request: Request) -> "Plan | str":
    """A stored plan (or no-fit error message), checked against the request;
    raises `ValueError` (or `KeyError`, `TypeError`) if it is not a valid one."""
    call, sizes, budget = request.call, request.sizes, request.budget
    if not isinstance(stored, dict):
        raise ValueError("not a stored plan")
    if "no_fit" in stored:
        nf = stored["no_fit"]
        smallest = _cand_from_json(nf["smallest"], call, sizes)
        if smallest.temp_bytes is None or smallest.temp_bytes <= budget:
            raise ValueError("the stored no-fit result is inconsistent")
        return no_fit_message(
            call, budget, smallest, int(nf["n"]), sizes, request.backward
        )
    p = stored["plan"]
    candidates = tuple(_cand_from_json(d, call, sizes) for d in p["candidates"])
    index = p["chosen"]
    if isinstance(index, bool) or not isinstance(index, int):
        raise ValueError("bad chosen index")
    chosen = candidates[index]
    if not chosen.fits and not any(sizes[n] == 0 for n in call.mapped):
        raise ValueError("the chosen candidate does not fit the budget")
    if chosen.temp_bytes is not None and chosen.temp_bytes > budget:
        raise ValueError("the chosen candidate does not fit the budget")
    checkpoint, measured, basis = p["checkpoint"], p["measured"], p["basis"]
    if not isinstance(checkpoint, bool) or not isinstance(measured, bool):
        raise ValueError("bad flags")
    if basis not in ("arguments", "inputs", "model"):
        raise ValueError("bad basis")
    for text in (p["summary"], p["how"], p["created"]):
        if not isinstance(text, str):
            raise ValueError("bad descriptions")
    return auto_plan(
        request,
        chosen,
        candidates,
        n_compiled=0,
        seconds=0.0,
        checkpoint=checkpoint,
        time_model=request.model,
        summary=p["summary"],
        measured=measured,
        basis=basis,
        cache=f"{p['how']}, on {p['created']}",
    )
