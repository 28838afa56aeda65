"""The planner's cache on disk: one JSON file per plan or calibration, its whole key
and value at `<cache dir>/v<FORMAT_VERSION>/<kind>/<hash of its key>.json`, used only
if its key, format and version match and the planner accepts its value (else, with a
warning, planned and written again). Writes replace it atomically: last writer wins."""

import contextlib
import dataclasses
import datetime
import hashlib
import json
import math
import os
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, get_args, get_type_hints

from .._resolve import Call
from .plan import Plan, PlanCandidate
from .search import auto_plan, candidate, fixed_dims, no_fit_message, Request


try:
    import fcntl
except ImportError:  # Windows: the cache is then not locked
    fcntl = None


FORMAT = "eqx_multimap.plan_cache"
FORMAT_VERSION = 1
ENV_VAR = "EQX_MULTIMAP_CACHE_DIR"
_OFF = ("off", "0", "false", "none", "no")
JSON = dict[str, Any]


def default_cache_dir() -> str | None:
    """The cache directory from the environment; `None` if disabled there."""
    if env := os.environ.get(ENV_VAR, "").strip():
        return None if env.lower() in _OFF else os.path.expanduser(env)
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or "~/.cache"
    return os.path.join(os.path.expanduser(base), "eqx_multimap")


def _warn(message: str) -> None:
    warnings.warn(f"eqx_multimap plan cache: {message}", RuntimeWarning, stacklevel=3)


class DiskCache:
    """JSON entries keyed by JSON-able dicts, in one directory."""

    def __init__(self, root: str):
        self.root = os.fspath(root)

    def path(self, kind: str, key: JSON) -> str:
        text = json.dumps(key, sort_keys=True)
        digest = hashlib.sha256(text.encode()).hexdigest()[:40]
        return os.path.join(self.root, f"v{FORMAT_VERSION}", kind, digest + ".json")

    def read(self, kind: str, key: JSON, parse: Callable = lambda x: x) -> Any:
        """The value stored for `key`, as `parse` reads it; `None` if there is none,
        or (with a warning) if the file is unusable or `parse` raises."""
        path = self.path(kind, key)
        header = dict(format=FORMAT, version=FORMAT_VERSION, kind=kind, key=key)
        header = json.loads(json.dumps(header))  # as JSON gives it back (lists)
        try:
            with open(path, encoding="utf-8") as fh:
                record = json.load(fh)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:  # unreadable, or not JSON (or not UTF-8)
            record = e
        if isinstance(record, Exception):
            problem = f"cannot read it ({type(record).__name__}: {record})"
        elif not isinstance(record, dict) or "value" not in record:
            problem = "it is not an eqx_multimap cache entry"
        elif wrong := [k for k, v in header.items() if record.get(k) != v]:
            problem = f"it has a different {', '.join(wrong)}"
        else:
            try:
                return parse(record["value"])
            except (ValueError, KeyError, TypeError, IndexError) as e:
                problem = f"its value is not valid here ({e})"
        _warn(f"ignoring {path}: {problem}. Planning again, and overwriting it.")
        return None

    @contextlib.contextmanager
    def lock(self, kind: str) -> Iterator[None]:
        """Hold the directory's `flock` for `kind` (where it cannot be taken, none)."""
        path = os.path.join(self.root, f"v{FORMAT_VERSION}", f"{kind}.lock")
        with contextlib.ExitStack() as held:  # closing the file releases the lock
            if fcntl is not None:
                with contextlib.suppress(OSError):
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    fcntl.flock(held.enter_context(open(path, "a")), fcntl.LOCK_EX)
            yield

    def write(self, kind: str, key: JSON, value: Any) -> str | None:
        """Store `value` for `key` atomically: its path, or `None` (and a warning)."""
        path = self.path(kind, key)
        record = dict(format=FORMAT, version=FORMAT_VERSION, kind=kind, key=key)
        record["value"] = value
        text = json.dumps(record, indent=1, sort_keys=True, allow_nan=False)
        directory, tmp = os.path.dirname(path), None
        try:
            os.makedirs(directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".json")
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
            os.replace(tmp, path)
        except (OSError, ValueError) as e:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            problem = f"{type(e).__name__}: {e}"
            _warn(f"cannot write {path} ({problem}); kept in memory only.")
            return None
        return path


_FIELDS = tuple(f.name for f in dataclasses.fields(PlanCandidate))
_KEPT = ("checkpoint", "summary", "measured", "basis", "searched")  # a `Plan`'s


def cand_json(c: PlanCandidate) -> JSON:
    """A candidate as JSON, non-finite numbers as `null`."""
    finite = lambda x: not isinstance(x, float) or math.isfinite(x)  # noqa: E731
    return {k: x if finite(x) else None for k, x in dataclasses.asdict(c).items()}


def plan_json(plan: Plan, how: str) -> JSON:
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    kept = {name: getattr(plan, name) for name in _KEPT}
    cands = [cand_json(c) for c in plan.candidates]
    chosen = plan.candidates.index(plan.chosen)
    return {"plan": dict(chosen=chosen, candidates=cands, how=how, created=now, **kept)}


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)


def _typed(d: JSON, cls: type, names: Iterable[str]) -> JSON:
    """`d`'s fields `names`, type-checked by `cls` (an `int` does for a `float`)."""
    hints = get_type_hints(cls)
    for name in names:
        kinds = get_args(hints[name]) or (hints[name],)
        kinds += (int,) * (float in kinds)
        _check(type(d[name]) in kinds, f"bad `{name}`")  # `bool` is no `int` here
    return {name: d[name] for name in names}


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
    _check(planned.isdisjoint(fixed_dims(call)), "a candidate scans a dim it must not")
    fields = _typed(d, PlanCandidate, set(_FIELDS) - {"scan", "vmap", "block", "trips"})
    nest = candidate(scan, vmap, sizes, fields.pop("source"))
    return dataclasses.replace(nest, **fields)


def plan_from_json(stored: Any, request: Request, path: str) -> "Plan | str":
    """A plan (or no-fit error message) stored at `path`, checked against the
    request; raises `ValueError` (or `KeyError`, `TypeError`) if it is not valid."""
    call, sizes, budget = request.call, request.sizes, request.budget
    if "no_fit" in stored:
        smallest = _cand_from_json(stored["no_fit"]["smallest"], call, sizes)
        _check((smallest.temp_bytes or 0) > budget, "an inconsistent no-fit result")
        return no_fit_message(request, smallest, int(stored["no_fit"]["n"]))
    p = stored["plan"]
    candidates = tuple(_cand_from_json(d, call, sizes) for d in p["candidates"])
    _check(type(p["chosen"]) is int, "bad chosen index")
    chosen = candidates[p["chosen"]]
    empty = any(sizes[n] == 0 for n in call.mapped)
    fits = (chosen.fits or empty) and (chosen.temp_bytes or 0) <= budget
    _check(bool(fits), "the chosen candidate does not fit the budget")
    how = f"{p['how']}, on {p['created']}"
    fields = dict(n_compiled=0, seconds=0.0, cache_path=path, **_typed(p, Plan, _KEPT))
    fields["cache"] = f"from the disk cache, {path} ({how}); nothing compiled now"
    return auto_plan(request, chosen, candidates, time_model=request.model, **fields)
