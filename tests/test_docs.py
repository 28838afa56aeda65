"""The docs: the site builds under `strict: true`, its snippets are the library's
real output, and the code on its pages runs."""

import contextlib
import importlib.util
import io
import os
import pathlib
import re
import subprocess
import sys

import pytest


ROOT = pathlib.Path(__file__).parent.parent
DOCS = ROOT / "docs"

_spec = importlib.util.spec_from_file_location(
    "generate_snippets", DOCS / "_snippets" / "generate.py"
)
assert _spec is not None and _spec.loader is not None
snippets = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(snippets)


def _python_blocks(text: str) -> list[str]:
    """The ```python blocks of a page, except those marked `<!-- not run ... -->`
    on the line before, and snippet includes."""
    blocks = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            skip = i > 0 and lines[i - 1].strip().startswith("<!-- not run")
            j = i + 1
            while lines[j].strip() != "```":
                j += 1
            body = "\n".join(lines[i + 1 : j])
            if not skip and "--8<--" not in body:
                blocks.append(body)
            i = j
        i += 1
    return blocks


PAGES = sorted(
    str(p.relative_to(DOCS))
    for p in DOCS.rglob("*.md")
    if "_snippets" not in p.parts and "api" not in p.parts
)


def test_pages_found():
    assert {"index.md", "getting-started.md", "errors.md", "strategies.md"} <= set(
        PAGES
    )
    assert len(_python_blocks((DOCS / "getting-started.md").read_text())) >= 5


@pytest.mark.parametrize("page", PAGES + ["../README.md"])
def test_page_code_runs(page):
    blocks = _python_blocks((DOCS / page).read_text())
    namespace: dict = {"__name__": "__docs__"}
    for k, block in enumerate(blocks):
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                exec(compile(block, f"{page} block {k}", "exec"), namespace)
            except Exception as e:
                pytest.fail(f"{page}, code block {k} raised {e!r}:\n{block}")


@pytest.mark.parametrize("name", sorted(snippets.EXAMPLES))
def test_snippet_up_to_date(name):
    path = pathlib.Path(snippets.path_of(name))
    assert path.exists(), f"run `python docs/_snippets/generate.py` to write {path}"
    expected = snippets.render(snippets.EXAMPLES[name])
    assert path.read_text() == expected, (
        f"{path} is out of date: run `python docs/_snippets/generate.py`"
    )


def test_error_snippets_raise_the_documented_class():
    for name, code in snippets.EXAMPLES.items():
        if name.startswith("errors/"):
            out = snippets.run_example(code)
            assert re.search(r"^eqx_multimap\.(ShapeError|SpecError): ", out, re.M), (
                name,
                out,
            )


def _mkdocs_missing() -> str | None:
    # Top-level names only: `find_spec("a.b")` raises if `a` is missing.
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers"):
        if importlib.util.find_spec(module) is None:
            return module
    return None


@pytest.mark.skipif(
    _mkdocs_missing() is not None,
    reason=f"the docs need `pip install -e '.[docs]'` ({_mkdocs_missing()} is missing)",
)
def test_mkdocs_build_strict(tmp_path):
    site = tmp_path / "site"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["NO_MKDOCS_2_WARNING"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    api = (site / "api" / "filter_multi_vmap" / "index.html").read_text()
    assert "eqx_multimap.filter_multi_vmap" in api and "Arguments:" in api
    errors = (site / "errors" / "index.html").read_text()
    assert "got inconsistent sizes for dim" in errors  # a snippet was included
    example = (site / "examples" / "radio_interferometry" / "index.html").read_text()
    assert "EXPLICIT" not in example and "SkyModel" in example  # code included
