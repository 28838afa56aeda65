"""The docs: the code on every page runs, its snippets are the library's real output,
and the site builds under `strict: true`.

The code runs as a reader would run it: in a fresh Python process with JAX's default
configuration (one CPU device, standard dtype promotion), not under this suite's
`conftest.py` (8 simulated devices, strict promotion).
"""

import concurrent.futures
import functools as ft
import html
import importlib.util
import inspect
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import typing

import pytest

from .helpers import clean_env


ROOT = pathlib.Path(__file__).parent.parent
DOCS = ROOT / "docs"
SNIPPETS = DOCS / "_snippets"
GENERATE = SNIPPETS / "generate.py"

_spec = importlib.util.spec_from_file_location("generate_snippets", GENERATE)
assert _spec is not None and _spec.loader is not None
snippets = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(snippets)

_TIMEOUT = 900  # seconds, per process


def _python_blocks(text: str) -> list[tuple[int, str]]:
    """The ```python blocks of a page, as (line of their first line, code), except
    those marked `<!-- not run ... -->` on the line before, and snippet includes."""
    blocks = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            skip = i > 0 and lines[i - 1].strip().startswith("<!-- not run")
            j = i + 1
            while lines[j].strip() != "```":
                j += 1
            body = textwrap.dedent("\n".join(lines[i + 1 : j]))
            if not skip and "--8<--" not in body:
                blocks.append((i + 2, body))
            i = j
        i += 1
    return blocks


# Every Markdown page (repository-relative), but the generated snippets.
PAGES = ["README.md"] + sorted(
    str(p.relative_to(ROOT)) for p in DOCS.rglob("*.md") if SNIPPETS not in p.parents
)
RUN_PAGES = [p for p in PAGES if _python_blocks((ROOT / p).read_text())]


# Runs one page's blocks in order, in one namespace. Each block is compiled under
# the page's path with its own line numbers, so a traceback points into the page.
_RUNNER = r"""
import json, sys, traceback

import jax

page, blocks = json.load(sys.stdin)
if jax.device_count() != 1:
    sys.exit(f"expected JAX's default of 1 CPU device, got {jax.devices()}")
namespace = {"__name__": "__main__"}
for k, (line, code) in enumerate(blocks):
    try:
        exec(compile("\n" * (line - 1) + code, page, "exec"), namespace)
    except BaseException:
        sys.stdout.flush()
        print(f"@@ block {k} (line {line}) raised:", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
"""


def _run_page(page: str) -> subprocess.CompletedProcess:
    blocks = _python_blocks((ROOT / page).read_text())
    return subprocess.run(
        [sys.executable, "-c", _RUNNER],
        input=json.dumps([page, blocks]),
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=_TIMEOUT,
    )


def _run_generate_check() -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(GENERATE), "--check"],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=_TIMEOUT,
    )


@ft.cache
def _processes() -> dict[str, concurrent.futures.Future]:
    """Every page's process, and the snippets' check, started together on first use
    and run a few at a time."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2)
    futures = {page: pool.submit(_run_page, page) for page in RUN_PAGES}
    futures["snippets"] = pool.submit(_run_generate_check)
    pool.shutdown(wait=False)
    return futures


def test_pages_found():
    assert {
        "README.md",
        "docs/index.md",
        "docs/getting-started.md",
        "docs/errors.md",
        "docs/strategies.md",
        "docs/sharding.md",
    } <= set(RUN_PAGES)
    assert len(_python_blocks((DOCS / "getting-started.md").read_text())) >= 5


@pytest.mark.slow
@pytest.mark.parametrize("page", RUN_PAGES)
def test_page_code_runs(page):
    proc = _processes()[page].result()
    if proc.returncode != 0:
        where = re.search(r"^@@ (block \d+ \(line \d+\)) raised:$", proc.stderr, re.M)
        pytest.fail(
            f"{page}, {where.group(1) if where else 'before its first block'}, "
            f"in a fresh process with JAX's defaults:\n{proc.stderr[-4000:]}",
            pytrace=False,
        )


@pytest.mark.slow
def test_snippets_up_to_date():
    proc = _processes()["snippets"].result()
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_error_snippets_raise_the_documented_class():
    for name in snippets.EXAMPLES:
        if name.startswith("errors/"):
            text = pathlib.Path(snippets.path_of(name)).read_text()
            assert re.search(r"^eqx_multimap\.(ShapeError|SpecError): ", text, re.M), (
                name
            )


def test_every_snippet_is_used():
    pages = "\n".join((ROOT / p).read_text() for p in PAGES)
    for path in SNIPPETS.rglob("*.md"):
        rel = path.relative_to(DOCS).as_posix()
        assert f'--8<-- "{rel}"' in pages, f"{rel} is included by no page"
        assert path.relative_to(SNIPPETS).with_suffix("").as_posix() in (
            snippets.EXAMPLES
        ), f"{rel} has no example in generate.py"


def test_readme_error_is_a_snippet():
    # The README cannot include snippets; its error message is one, verbatim.
    text = pathlib.Path(snippets.path_of("errors/inconsistent")).read_text()
    message = text.split("```text\n")[1].split("```")[0]
    assert message in (ROOT / "README.md").read_text()


def _mkdocs_missing() -> str | None:
    # Top-level names only: `find_spec("a.b")` raises if `a` is missing.
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers"):
        if importlib.util.find_spec(module) is None:
            return module
    return None


_NEEDS_MKDOCS = pytest.mark.skipif(
    _mkdocs_missing() is not None,
    reason=f"the docs need `pip install -e '.[docs]'` ({_mkdocs_missing()} is missing)",
)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    """The site, built once under `strict: true`."""
    site = tmp_path_factory.mktemp("docs") / "site"
    env = clean_env()
    env["NO_MKDOCS_2_WARNING"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=_TIMEOUT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return site


@pytest.mark.slow
@_NEEDS_MKDOCS
def test_mkdocs_build_strict(site):
    api = (site / "api" / "filter_multi_vmap" / "index.html").read_text()
    assert "eqx_multimap.filter_multi_vmap" in api and "Arguments:" in api
    assert 'href="../../sharding/' in api  # the API page links the Sharding page
    planner = (site / "api" / "planner" / "index.html").read_text()
    assert "eqx_multimap.Planner" in planner
    errors = (site / "errors" / "index.html").read_text()
    assert "got inconsistent sizes for dim" in errors  # a snippet was included
    example = (site / "examples" / "radio_interferometry" / "index.html").read_text()
    assert "EXPLICIT" not in example and "SkyModel" in example  # code included
    # Output blocks wrap (their long lines, if any, are not cut off).
    assert "language-text highlight" in errors
    css = (site / "stylesheets" / "extra.css").read_text()
    assert re.search(r"\.language-text pre > code \{[^}]*white-space: pre-wrap", css)


# Lines known to be longer than `_COLUMNS`, each to be shortened at its source: the
# start of the line, and what prints it.
_KNOWN_LONG: dict[str, str] = {}  # line starts let through, with why
_COLUMNS = 100  # what a code block shows at 1,280 px without scrolling


def _blocks(page: str) -> list[list[str]]:
    """The lines of every code or output block of a built page."""
    blocks = []
    block = r'<div class="language-\w+ highlight"><pre>(.*?)</pre>'
    for m in re.finditer(block, page, re.S):
        blocks.append(html.unescape(re.sub(r"<[^>]+>", "", m.group(1))).splitlines())
    return blocks


@pytest.mark.slow
@_NEEDS_MKDOCS
def test_blocks_fit_the_page(site):
    long = []
    n = 0
    for path in sorted(site.rglob("*.html")):
        for lines in _blocks(path.read_text()):
            n += 1
            for line in lines:
                if len(line) > _COLUMNS and not line.startswith(tuple(_KNOWN_LONG)):
                    long.append(f"{path.relative_to(site)}: {len(line)}: {line}")
    assert n > 100, n  # the blocks were found
    assert not long, "\n".join(long)


_MAX_WORDS = 2500  # a page that a reader reads through
_MAX_WORDS_OF = {"planner/index.html": 1500}  # a user's page, not a design note
_BLOCK_TAG = re.compile(
    r"</?(?:p|li|div|pre|h\d|tr|td|th|br|ul|ol|table|blockquote|details)\b[^>]*>"
)


@pytest.mark.slow
@_NEEDS_MKDOCS
def test_pages_are_short(site):
    long = {}
    for path in sorted(site.rglob("index.html")):
        page = path.relative_to(site).as_posix()
        if page.startswith("api/"):
            continue  # the reference
        article = re.search(r"<article[^>]*>(.*?)</article>", path.read_text(), re.S)
        if article is not None:
            text = _BLOCK_TAG.sub(" ", article.group(1))  # words end at blocks,
            text = re.sub(r"<[^>]+>", "", text)  # not at a highlighted token
            words = len(html.unescape(text).split())
            if words > _MAX_WORDS_OF.get(page, _MAX_WORDS):
                long[page] = words
    assert not long, long


@pytest.mark.parametrize(
    "example", ["calibration.py", "progress.py", "radio_interferometry.py"]
)
def test_example_help_is_complete(example):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / example), "--help"],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=_TIMEOUT,
    )
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    description = text.split("\n\n")[1]
    assert description.rstrip().endswith("."), description  # not cut off
    assert "(default: None)" not in text and text.count("(default:") == len(
        re.findall(r"\(default: [^)]", text)
    )
    assert not re.search(r"\(default: [^)]*\) \(default:", text)  # not twice
    # Every option has its help: no entry is the option alone.
    entries = re.split(r"\n(?=  -)", text.split("options:\n")[1].rstrip())
    for entry in entries:
        alone = re.fullmatch(r"  -[-\w]+(?: [A-Z_]+| \{[\w,]+\})?", entry)
        assert alone is None, f"{example}: {entry.strip()} has no help"


def _public_functions():
    import eqx_multimap

    for name in dir(eqx_multimap):
        obj = getattr(eqx_multimap, name)
        if not name.startswith("_") and inspect.isfunction(obj):
            yield name, obj


def _signature_lines(text: str) -> list[str]:
    """The signature of `pydoc.render_doc`'s text: its third line, or, printed one
    parameter a line, the lines to the closing parenthesis."""
    lines = text.splitlines()[2:]
    end = next(i for i, line in enumerate(lines) if not line.startswith(" ")) + 1
    if lines[0].endswith("("):
        end = next(i for i, line in enumerate(lines) if line.startswith(")")) + 1
    return lines[:end]


def test_signatures_are_true():
    # `inspect.signature` and `typing.get_type_hints` give the real annotations:
    # types and typing forms, never an object of ours standing in for one.
    for name, fn in _public_functions():
        sig = inspect.signature(fn)
        hints = typing.get_type_hints(fn)
        annotations = {p.name: p.annotation for p in sig.parameters.values()}
        annotations["return"] = sig.return_annotation
        for key, ann in annotations.items():
            if ann is inspect.Parameter.empty:
                assert key not in hints, (name, key)
                continue
            assert not type(ann).__module__.startswith("eqx_multimap"), (name, key)
            assert hints[key] == ann, (name, key)
    import eqx_multimap

    assert "importlib" not in dir(eqx_multimap)


def test_help_is_plain():
    # `help()` shows the signature with the type aliases by name, and the docstrings
    # without MkDocs markup (the API page, built from the source, keeps its links:
    # `test_mkdocs_build_strict`).
    import pydoc

    import eqx_multimap

    text = pydoc.render_doc(eqx_multimap.filter_multi_vmap, renderer=pydoc.plaintext)
    signature = "\n".join(_signature_lines(text))
    for alias in ["InDims", "OutDims", "ScanSpec", "ReduceSpec", "ShardSpec"]:
        assert f": {alias} = None" in signature, signature
    one_line = re.sub(r"\(\n +", "(", re.sub(r",\n +", ", ", signature))
    one_line = one_line.replace(",\n)", ")").replace("\n)", ")")
    assert len(one_line) < 450, one_line  # 1,000 with the aliases spelled out
    for name, fn in _public_functions():
        doc = pydoc.render_doc(fn, renderer=pydoc.plaintext)
        lines = _signature_lines(doc)
        assert all(len(line) <= 200 for line in lines), (name, lines)
        assert "eqx_multimap." not in "".join(lines), (name, lines)  # by name
    for name in (
        eqx_multimap.__all__ if hasattr(eqx_multimap, "__all__") else dir(eqx_multimap)
    ):
        obj = getattr(eqx_multimap, name)
        if name.startswith("_") or not callable(obj):
            continue
        doc = pydoc.render_doc(obj, renderer=pydoc.plaintext)
        assert not re.search(r"\]\[|\]\([^)]*\.md|^\s*[!?]{3}", doc, re.M), name
        assert "(more)" not in doc, name  # a link keeps its text
    assert "See Progress on long scans." in " ".join(text.split())
    assert "Example:" in text and "See Sharding." in text
