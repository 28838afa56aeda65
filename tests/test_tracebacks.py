"""The traceback of one of our errors ends in the user's code: JAX's traceback filtering
hides the library's frames, as it hides JAX's own (and `JAX_TRACEBACK_FILTERING=off`
shows them).

Each case runs in a fresh process with JAX's defaults, and its traceback is read as
Python prints it.
"""

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import eqx_multimap
import pytest


PACKAGE = pathlib.Path(eqx_multimap.__file__).parent.resolve()
ROOT = PACKAGE.parent

# Each case is a function `case()` whose last line is the user's call that raises.
_CASES = {
    "shape_error": (
        "ShapeError",
        "got inconsistent sizes for dim 'F'",
        """\
        @filter_multi_vmap(in_dims={"vis": "T F", "nu": "F"}, out_dims="T F", scan="T")
        def scale(vis, nu):
            return vis * nu

        def case():
            return scale(jnp.ones((10, 4)), jnp.arange(3.0))  # USER CALL
        """,
    ),
    "shape_error_jit": (
        "ShapeError",
        "got inconsistent sizes for dim 'F'",
        """\
        @filter_multi_vmap(in_dims={"vis": "T F", "nu": "F"}, out_dims="T F", scan="T")
        def scale(vis, nu):
            return vis * nu

        @jax.jit
        def case():
            return scale(jnp.ones((10, 4)), jnp.arange(3.0))  # USER CALL
        """,
    ),
    "spec_error_decorating": (
        "SpecError",
        "is given both `vmap` and `scan`",
        """\
        def case():
            filter_multi_vmap(jnp.sin, in_dims="T F", scan="T", vmap="T F")  # USER CALL
        """,
    ),
    "spec_error_calling": (
        "SpecError",
        "has no `out_dims`",
        """\
        def case():
            f = filter_multi_vmap(lambda x: x, in_dims="T", scan="T")
            f(jnp.ones(3))  # USER CALL
        """,
    ),
    "spec_error_explain": (
        "SpecError",
        "`out_dims` names dim 'S'",
        """\
        def case():
            f = filter_multi_vmap(lambda x: x, in_dims="T", out_dims="T S")
            eqx_multimap.explain(f, jnp.ones(3))  # USER CALL
        """,
    ),
}

_HEADER = """\
import traceback
import eqx_multimap
import jax
import jax.numpy as jnp
from eqx_multimap import filter_multi_vmap
"""

_FOOTER = """
try:
    case()
except Exception as e:
    traceback.print_exception(e)
else:
    raise SystemExit("no error")
"""


def _traceback(tmp_path, name: str, filtering: str | None) -> tuple[str, str]:
    """The traceback that the case prints, and the path of the user's file."""
    user = tmp_path / f"user_{name}.py"
    user.write_text(_HEADER + textwrap.dedent(_CASES[name][2]) + _FOOTER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(ROOT)
    if filtering is not None:
        env["JAX_TRACEBACK_FILTERING"] = filtering
    proc = subprocess.run(
        [sys.executable, str(user)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stderr, str(user)


def _frames(text: str) -> list[tuple[str, int, str]]:
    """`(file, line, source)` of every frame of the last traceback in `text`."""
    last = text.rsplit("Traceback (most recent call last):", 1)[1]
    frame = r'^  File "([^"]+)", line (\d+), in \S+\n(.*)$'
    return [
        (m.group(1), int(m.group(2)), m.group(3).strip())
        for m in re.finditer(frame, last, re.M)
    ]


@pytest.mark.parametrize("name", list(_CASES))
def test_traceback_ends_in_user_code(tmp_path, name):
    error, message, _ = _CASES[name]
    text, user = _traceback(tmp_path, name, filtering=None)
    frames = _frames(text)
    assert re.search(rf"^eqx_multimap\.{error}: ", text, re.M), text
    assert message in text, text
    # No frame of ours, nor of JAX.
    ours = [f for f in frames if pathlib.Path(f[0]).resolve().is_relative_to(PACKAGE)]
    assert not ours, text
    assert not [f for f in frames if "/jax/" in f[0]], text
    # The user's call is the last frame (but for Equinox's bound-method trampoline,
    # which Equinox does not hide).
    mine = [f for f in frames if "/equinox/" not in f[0]]
    assert mine[-1][0] == user and mine[-1][2].endswith("# USER CALL"), text


def test_filtering_off_shows_the_library(tmp_path):
    # The check above can fail: without filtering, our frames are there.
    text, _ = _traceback(tmp_path, "shape_error", filtering="off")
    frames = _frames(text)
    assert any(pathlib.Path(f[0]).resolve().is_relative_to(PACKAGE) for f in frames)
    assert "got inconsistent sizes for dim 'F'" in text
