"""Run DSA2000-Cal's own `multi_vmap` tests against `eqx_multimap.multi_vmap`.

Not collected by pytest (its name does not start with `test_`); run it by hand:

    python tests/dsa2000_upstream.py [DSA2000_CAL_GIT_DIR] [--rev REV]

The git dir defaults to `$DSA2000_CAL_GIT`, else
`/work/.mirror/Joshuaalbert+DSA2000-Cal/repo` (a bare clone is fine). Nothing of
DSA2000-Cal is stored in this repository: everything is read from the git dir at run
time.

What it does:

1. Reads `dsa2000_common/common/tests/test_jax_utils.py` at `REV` (default `HEAD`)
   and writes it to a temporary directory with one change: `multi_vmap` is imported
   from `eqx_multimap` instead of `dsa2000_common.common.jax_utils`. The file's other
   imports (`vmap_or_scan`, `auto_multi_vmap`, ...) still come from DSA2000-Cal's own
   `jax_utils.py`, which an import hook serves, with the modules it imports in turn,
   from the git dir.
2. Writes a second copy with, in addition, the `match=` dropped from each
   `pytest.raises` whose text is JAX's own (listed in `EXEMPT`), so that the rest of
   a test runs past that assertion. The exception type is still checked.
3. Runs, in both copies, every test that calls `multi_vmap` directly. It also runs
   `test_multi_vmap_scan_performance`, which calls DSA2000-Cal's `auto_multi_vmap`:
   that searches `scan_dims` by calling `multi_vmap` from its own module, which is
   pointed at the shim for that test (so it is *not* an import-only change; it is
   reported apart).
4. Runs the same tests in the unchanged file, with DSA2000-Cal's own `multi_vmap`,
   as a control: a test that fails there too (say, because DSA2000-Cal's code
   predates the installed JAX) fails for reasons of its own.
5. Prints a table of the results. The exit status is 0 when every test passes in the
   second copy, and each failure in the first is at an exempt assertion or fails
   the same way in the control.
"""

import argparse
import ast
import dataclasses
import importlib.abc
import importlib.machinery
import importlib.util
import os
import pathlib
import subprocess
import sys
import tempfile


DEFAULT_GIT = "/work/.mirror/Joshuaalbert+DSA2000-Cal/repo"
SRC = "dsa2000_cal/src"
TEST_PATH = "dsa2000_common/common/tests/test_jax_utils.py"
JAX_UTILS = "dsa2000_common.common.jax_utils"

# `pytest.raises(..., match=...)` texts that are JAX's own messages, not
# DSA2000-Cal's: `jax.vmap` raises this one for a mapped dim whose only argument is
# `None`. The shim raises its own `SpecError` (a `ValueError`) there instead.
EXEMPT = {
    "must have at least one non-None value in in_axes": (
        "JAX's own text (jax.vmap's check of in_axes); the shim raises a SpecError "
        "naming the dim and the None argument"
    ),
}

# Tests that reach `multi_vmap` only through DSA2000-Cal's `auto_multi_vmap`.
INDIRECT = ("test_multi_vmap_scan_performance",)

# The copies of the test file that are run, and how each differs from DSA2000-Cal's.
SHIM_FILE = "test_jax_utils.py"
RELAXED_FILE = "test_jax_utils_exempt_relaxed.py"
CONTROL_FILE = "test_jax_utils_dsa_control.py"
HOW = {
    SHIM_FILE: "shim: import only",
    RELAXED_FILE: "shim: import only, exempt match= dropped",
    CONTROL_FILE: "control: DSA2000-Cal's own multi_vmap",
}


def git(git_dir: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["git", "-C", git_dir, *args], capture_output=True, text=True, check=False
    )


class GitModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """An import hook serving `dsa2000_common.*` from a git dir at one revision."""

    def __init__(self, git_dir: str, rev: str):
        self.git_dir = git_dir
        self.rev = rev
        self.sources: dict[str, tuple[str, str]] = {}

    def _show(self, path: str) -> str | None:
        proc = git(self.git_dir, "show", f"{self.rev}:{SRC}/{path}")
        return proc.stdout if proc.returncode == 0 else None

    def _is_tree(self, path: str) -> bool:
        proc = git(self.git_dir, "cat-file", "-t", f"{self.rev}:{SRC}/{path}")
        return proc.returncode == 0 and proc.stdout.strip() == "tree"

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] != "dsa2000_common":
            return None
        rel = fullname.replace(".", "/")
        source = self._show(rel + ".py")
        if source is not None:
            self.sources[fullname] = (source, f"{self.rev}:{SRC}/{rel}.py")
            return importlib.util.spec_from_loader(fullname, self, is_package=False)
        if self._is_tree(rel):
            init = self._show(rel + "/__init__.py") or ""
            self.sources[fullname] = (init, f"{self.rev}:{SRC}/{rel}/__init__.py")
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        source, origin = self.sources[module.__name__]
        module.__file__ = origin
        if module.__spec__ is not None and module.__spec__.submodule_search_locations:
            module.__path__ = []
        exec(compile(source, origin, "exec"), module.__dict__)


def import_only(source: str) -> str:
    """`source` with `multi_vmap` imported from `eqx_multimap`; nothing else changed."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    for node in tree.body:
        if (
            isinstance(node, ast.ImportFrom)
            and node.module == JAX_UTILS
            and any(a.name == "multi_vmap" for a in node.names)
        ):
            assert node.end_lineno is not None
            rest = [a for a in node.names if a.name != "multi_vmap"]
            new = "from eqx_multimap import multi_vmap\n"
            if rest:
                node.names = rest
                new = ast.unparse(node) + "\n" + new
            return "".join(lines[: node.lineno - 1] + [new] + lines[node.end_lineno :])
    raise SystemExit(f"no `from {JAX_UTILS} import multi_vmap` in {TEST_PATH}")


def drop_exempt_matches(source: str) -> tuple[str, list[str]]:
    """`source` with `match=` removed from `pytest.raises` calls whose text is in
    `EXEMPT`; and the texts removed."""
    tree = ast.parse(source)
    cuts = []
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "raises"
        ):
            continue
        for kw in node.keywords:
            value = kw.value
            if (
                kw.arg == "match"
                and isinstance(value, ast.Constant)
                and value.value in EXEMPT
            ):
                segment = ast.get_source_segment(source, kw)
                assert segment is not None
                cuts.append((segment, value.value))
    for segment, _ in cuts:
        source = source.replace(", " + segment, "", 1)
    return source, [text for _, text in cuts]


def tests_calling(source: str, name: str) -> list[str]:
    """The top-level test functions whose body mentions `name`."""
    out = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            if any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node)):
                out.append(node.name)
    return out


@dataclasses.dataclass
class Result:
    outcome: str = "not run"
    message: str = ""


class Recorder:
    """A pytest plugin: records outcomes, and points DSA2000-Cal's `auto_multi_vmap`
    at the shim for the `INDIRECT` tests."""

    def __init__(self):
        self.results: dict[str, Result] = {}
        self.saved = None

    def pytest_runtest_logreport(self, report):
        result = self.results.setdefault(report.nodeid, Result())
        if report.when == "call" or report.failed or report.skipped:
            if result.outcome in ("not run", "passed"):
                result.outcome = report.outcome
                if report.failed:
                    result.message = str(report.longrepr)

    def pytest_runtest_setup(self, item):
        if item.nodeid in (f"{SHIM_FILE}::{t}" for t in INDIRECT):
            import eqx_multimap

            module = sys.modules[JAX_UTILS]
            self.saved = module.multi_vmap
            module.multi_vmap = eqx_multimap.multi_vmap

    def pytest_runtest_teardown(self, item):
        if self.saved is not None:
            sys.modules[JAX_UTILS].multi_vmap = self.saved
            self.saved = None


def actual(message: str) -> str:
    """The exception message that a `pytest.raises(match=...)` failure reports."""
    for line in message.splitlines():
        if "Actual message:" in line:
            return line.split("Actual message:", 1)[1].strip()
    return "?"


def short(message: str) -> str:
    """The `E ...` lines of a pytest failure, shortened."""
    lines = [ln[1:].strip() for ln in message.splitlines() if ln.startswith("E ")]
    text = " ".join(lines) or message.strip().splitlines()[-1]
    return text if len(text) < 300 else text[:297] + "..."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "git_dir",
        nargs="?",
        default=os.environ.get("DSA2000_CAL_GIT", DEFAULT_GIT),
        help="the DSA2000-Cal git dir (default: $DSA2000_CAL_GIT, else %(default)s)",
    )
    parser.add_argument("--rev", default="HEAD", help="the revision (default HEAD)")
    args = parser.parse_args(argv)

    proc = git(args.git_dir, "show", f"{args.rev}:{SRC}/{TEST_PATH}")
    if proc.returncode != 0:
        print(f"cannot read {TEST_PATH} from {args.git_dir}: {proc.stderr.strip()}")
        return 2
    original = proc.stdout
    commit = git(args.git_dir, "log", "-1", "--format=%h %cs", args.rev).stdout.strip()

    # Test this checkout's `eqx_multimap`, whatever else is installed.
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    sys.meta_path.insert(0, GitModules(args.git_dir, args.rev))
    try:
        importlib.import_module(JAX_UTILS)
    except Exception as e:
        print(f"cannot import DSA2000-Cal's {JAX_UTILS} from the git dir: {e!r}")
        return 2

    import pytest

    as_is = import_only(original)
    relaxed, dropped = drop_exempt_matches(as_is)
    direct = tests_calling(original, "multi_vmap")
    indirect = [t for t in tests_calling(original, "auto_multi_vmap") if t in INDIRECT]

    with tempfile.TemporaryDirectory(prefix="dsa2000_upstream_") as tmp:
        root = pathlib.Path(tmp)
        (root / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
        (root / SHIM_FILE).write_text(as_is)
        (root / RELAXED_FILE).write_text(relaxed)
        (root / CONTROL_FILE).write_text(original)
        ids = [f"{SHIM_FILE}::{t}" for t in direct + indirect]
        ids += [f"{RELAXED_FILE}::{t}" for t in direct]
        ids += [f"{CONTROL_FILE}::{t}" for t in direct + indirect]
        recorder = Recorder()
        cwd = os.getcwd()
        os.chdir(root)
        try:
            pytest.main(["-q", "--rootdir", str(root), *ids], plugins=[recorder])
        finally:
            os.chdir(cwd)

    print()
    print(f"DSA2000-Cal {commit}: {SRC}/{TEST_PATH}")
    print(f"`{JAX_UTILS}` (its other helpers): DSA2000-Cal's own, from the git dir")
    print(f"exempt `match=` texts dropped in the second copy: {dropped}")
    print()
    rows = []
    ok = True
    for nodeid, result in recorder.results.items():
        file, test = nodeid.split("::")
        how = HOW[file]
        if file == SHIM_FILE and test in INDIRECT:
            how = "shim: via DSA2000-Cal's auto_multi_vmap"
        control = recorder.results.get(f"{CONTROL_FILE}::{test}", Result())
        note = ""
        if result.outcome == "failed":
            exempt = [t for t in EXEMPT if t in result.message]
            note = short(result.message)
            if file == SHIM_FILE and exempt:
                note = f"exempt: {EXEMPT[exempt[0]]}. Raised: {actual(result.message)}"
            elif file == CONTROL_FILE:
                note = "(control) " + note
            elif control.outcome == "failed" and short(control.message) == note:
                note = "fails the same way with DSA2000-Cal's own: " + note
            else:
                ok = False
        elif result.outcome != "passed":
            ok = False
        rows.append((how, test, result.outcome, note))
    width = max(len(r[0]) for r in rows)
    width_t = max(len(r[1]) for r in rows)
    for how, test, outcome, note in rows:
        print(f"{how:<{width}}  {test:<{width_t}}  {outcome:<7}  {note}")
    print()
    print(
        "OK: all pass, but for exempt assertions and failures shared with the control"
        if ok
        else "FAILURES above"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
