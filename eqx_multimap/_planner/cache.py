"""The planner's cache on disk: plans and calibrations, one JSON file per entry.

An entry is `<cache dir>/v<FORMAT_VERSION>/<kind>/<hash of its key>.json`, holding
its whole key and value. It is used only if its key, format and version match and
the planner accepts its value; any other file gives a warning and is planned (and
written) again. Writes replace the file atomically: the last writer wins, whole.
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
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jaxlib

from .._body import struct
from .._resolve import Call
from .cost import KEEP_WITHIN, WALK_FIRST, WALK_SLOWER
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
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = base or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "eqx_multimap")


def _warn(message: str) -> None:
    warnings.warn(f"eqx_multimap plan cache: {message}", RuntimeWarning, stacklevel=3)


class DiskCache:
    """JSON entries keyed by JSON-able dicts, in one directory."""

    def __init__(self, root: str):
        self.root = os.fspath(root)

    def path(self, kind: str, key: dict[str, Any]) -> str:
        text = json.dumps(key, sort_keys=True)
        digest = hashlib.sha256(text.encode()).hexdigest()[:40]
        return os.path.join(self.root, f"v{FORMAT_VERSION}", kind, digest + ".json")

    def read(
        self, kind: str, key: dict[str, Any], parse: Callable = lambda x: x
    ) -> Any:
        """The value stored for `key`, as `parse` reads it; `None` if there is none,
        or (with a warning) if the file is unusable or `parse` raises."""
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
            version = record.get("version")
            problem = f"it has format version {version!r}, not {FORMAT_VERSION}"
        elif record.get("kind") != kind or record.get("key") != json.loads(
            json.dumps(key, sort_keys=True)  # as JSON gives it back (tuples as lists)
        ):
            problem = "its key is not the one it is stored under"
        elif "value" not in record:
            problem = "it has no value"
        if problem is None:
            try:
                return parse(record["value"])
            except (ValueError, KeyError, TypeError, IndexError) as e:
                problem = f"its value is not valid here ({e})"
        self.invalid(path, problem)
        return None

    @contextlib.contextmanager
    def lock(self, kind: str) -> Iterator[None]:
        """Hold the directory's `flock` for `kind` (where it cannot be taken, none)."""
        path = os.path.join(self.root, f"v{FORMAT_VERSION}", f"{kind}.lock")
        fd = None
        if fcntl is not None:
            with contextlib.suppress(OSError):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
                fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fd is not None:
                os.close(fd)  # releases the lock

    def invalid(self, path: str, problem: str) -> None:
        _warn(f"ignoring {path}: {problem}. Planning again, and overwriting it.")

    def write(self, kind: str, key: dict[str, Any], value: Any) -> str | None:
        """Store `value` for `key` atomically: its path, or `None` (and a warning)."""
        path = self.path(kind, key)
        record = dict(format=FORMAT, version=FORMAT_VERSION, kind=kind, key=key)
        record["value"] = value
        text = json.dumps(record, indent=1, sort_keys=True, allow_nan=False)
        tmp = None
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            directory = os.path.dirname(path)
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".json")
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
            os.replace(tmp, path)
            tmp = None
        except (OSError, ValueError) as e:
            problem = f"{type(e).__name__}: {e}"
            _warn(f"cannot write {path} ({problem}); kept in memory only.")
            return None
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
        return path


def fingerprint(call: Call) -> str:
    """What determines a call's plan besides its options (the body's jaxpr, its
    leaves' shapes and mapped axes), stable from process to process."""
    axes = zip(call.values, call.leaf_axes)
    leaves = [(str(struct(v)), sorted(a.items())) for v, a in axes]
    text = str(call.body.jaxpr.jaxpr) + repr(leaves)
    text += repr([str(d) for d in call.out.dims])
    text = re.sub(r" at 0x[0-9a-fA-F]+", "", text)
    return hashlib.sha256(text.encode()).hexdigest()


def calibration_key() -> dict[str, Any]:
    return {"machine": machine(), "versions": versions(), "calibration": 2}


def versions() -> dict[str, str]:
    try:
        ours = importlib.metadata.version("eqx_multimap")
    except importlib.metadata.PackageNotFoundError:
        ours = "unknown"
    jaxlib_version = getattr(jaxlib, "__version__", "unknown")
    return {"jax": jax.__version__, "jaxlib": jaxlib_version, "eqx_multimap": ours}


def plan_key(request: Request, collective: tuple, fingerprint: str) -> dict[str, Any]:
    """Everything that determines a plan, as JSON (a measured plan and a planned
    one share it: which will do is the planner's choice, by `Plan.basis`)."""
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
        "search": [SEARCH_VERSION, MAX_COMPILES, KEEP_WITHIN, WALK_FIRST, WALK_SLOWER],
        "time_model": request.model_key,
        "machine": machine(),
        "versions": versions(),
    }


_FIELDS = tuple(f.name for f in dataclasses.fields(PlanCandidate))
_KEPT = ("checkpoint", "summary", "measured", "basis")  # stored fields of a `Plan`
_NUMBERS = ("flops", "transcendentals", "bytes_accessed", "seconds", "measured")
_INTS = ("temp_bytes", "working_set")


def cand_json(c: PlanCandidate) -> dict[str, Any]:
    """A candidate as JSON, non-finite numbers as `null`."""
    finite = lambda x: not isinstance(x, float) or math.isfinite(x)  # noqa: E731
    d = {k: getattr(c, k) if finite(getattr(c, k)) else None for k in _FIELDS}
    return {**d, "scan": [[n, k] for n, k in c.scan], "vmap": list(c.vmap)}


def plan_json(plan: Plan, how: str) -> dict[str, Any]:
    """A plan as JSON: its candidates, which was chosen, and how it was made."""
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    return {
        "plan": {
            "chosen": plan.candidates.index(plan.chosen),
            "candidates": [cand_json(c) for c in plan.candidates],
            **{name: getattr(plan, name) for name in _KEPT},
            "how": how,
            "created": now,
        }
    }


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)


def _cand_from_json(d: Any, call: Call, sizes: dict[str, int]) -> PlanCandidate:
    """A stored candidate, checked to be a valid nest of this call."""
    _check(isinstance(d, dict) and set(d) == set(_FIELDS), "not a candidate")
    scan = tuple((str(n), None if k is None else int(k)) for n, k in d["scan"])
    vmap = tuple(str(n) for n in d["vmap"])
    names = [n for n, _ in scan] + list(vmap)
    _check(sorted(names) == sorted(call.mapped), f"a candidate maps {names}")
    _check(all(k is None or 1 <= k <= sizes[n] for n, k in scan), "a bad chunk")
    _check(scan[: len(call.options.scan)] == call.options.scan, "given scans lost")
    planned = {n for n, _ in scan[len(call.options.scan) :]}
    frozen = set(given_dims(call)) | set(collective_dims(call))
    _check(not planned & frozen, "a candidate scans a dim it must not")
    for name in _NUMBERS + _INTS:
        x, kinds = d[name], (int,) if name in _INTS else (int, float)
        _check(x is None or (isinstance(x, kinds) and not isinstance(x, bool)), name)
    _check(d["fits"] is None or isinstance(d["fits"], bool), "bad `fits`")
    _check(isinstance(d["source"], str) and isinstance(d["reason"], str), "text")
    block, trips = block_and_trips(scan, vmap, sizes)
    rest = {k: d[k] for k in _FIELDS if k not in ("scan", "vmap", "block", "trips")}
    rest["predicted"] = d["predicted"] is True
    return PlanCandidate(scan=scan, vmap=vmap, block=block, trips=trips, **rest)


def plan_from_json(stored: Any, request: Request, path: str) -> "Plan | str":
    """A plan (or no-fit error message) stored at `path`, checked against the
    request; raises `ValueError` (or `KeyError`, `TypeError`) if it is not valid."""
    call, sizes, budget = request.call, request.sizes, request.budget
    _check(isinstance(stored, dict), "not a stored plan")
    if "no_fit" in stored:
        nf = stored["no_fit"]
        smallest = _cand_from_json(nf["smallest"], call, sizes)
        temp = smallest.temp_bytes
        _check(temp is not None and temp > budget, "an inconsistent no-fit result")
        n = int(nf["n"])
        return no_fit_message(request, smallest, n)
    p = stored["plan"]
    candidates = tuple(_cand_from_json(d, call, sizes) for d in p["candidates"])
    index = p["chosen"]
    _check(isinstance(index, int) and not isinstance(index, bool), "bad chosen index")
    chosen = candidates[index]
    empty = any(sizes[n] == 0 for n in call.mapped)
    fits = (chosen.fits or empty) and (chosen.temp_bytes or 0) <= budget
    _check(bool(fits), "the chosen candidate does not fit the budget")
    flags = (p["checkpoint"], p["measured"])
    _check(all(isinstance(x, bool) for x in flags), "bad flags")
    _check(p["basis"] in ("arguments", "inputs", "model"), "bad basis")
    texts = (p["summary"], p["how"], p["created"])
    _check(all(isinstance(t, str) for t in texts), "bad descriptions")
    how = f"{p['how']}, on {p['created']}"
    return auto_plan(
        request,
        chosen,
        candidates,
        n_compiled=0,
        seconds=0.0,
        time_model=request.model,
        cache=f"from the disk cache, {path} ({how}); nothing compiled now",
        cache_path=path,
        **{name: p[name] for name in _KEPT},
    )
