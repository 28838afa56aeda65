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
"""

import hashlib
import json
import os
import tempfile
import warnings
from typing import Any

from jax._src import traceback_util


traceback_util.register_exclusion(__file__)


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
