"""Regenerate the snippets in this folder by running them: `python generate.py`.

Each example is real code; its output (an error message, the `verbose=True` line) is
captured by running it, never written by hand. `tests/test_docs.py` re-runs every
example and fails if a snippet is out of date, so the docs cannot drift from the
library's actual messages.
"""

import contextlib
import io
import os
import sys
import textwrap


HERE = os.path.dirname(os.path.abspath(__file__))

# Run before every example, not shown in the snippet (each docs page shows it once).
PREAMBLE = """\
import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float
from eqx_multimap import filter_multi_vmap, multi_vmap
"""

_SCALE = """\
@filter_multi_vmap(
    in_dims={"vis": "T F B 2 2", "nu": "F"},
    out_dims="T F B 2 2",
    scan="T",
    vmap="F B",
)
def scale(vis, nu):
    return vis * nu
"""

# name -> code. Error examples end in the call that raises.
EXAMPLES = {
    # --- ShapeError: the data does not fit the dims.
    "errors/inconsistent": _SCALE
    + """
scale(jnp.ones((10, 4, 5, 2, 2)), jnp.arange(3.0))  # nu has 3 frequencies, vis 4
""",
    "errors/rank": _SCALE
    + """
scale(jnp.ones((10, 4, 5, 2)), jnp.arange(4.0))  # one axis short
""",
    "errors/fixed": _SCALE
    + """
scale(jnp.ones((10, 4, 5, 2, 3)), jnp.arange(4.0))  # 2 x 3, not 2 x 2
""",
    "errors/module": """\
class SkyModel(eqx.Module):
    l: Float[Array, "S"]
    flux: Float[Array, "F S"]


@filter_multi_vmap(
    in_dims={"sky": SkyModel(l="S", flux="F S"), "nu": "F"}, out_dims="F", vmap="F"
)
def total(sky, nu):
    return jnp.sum(sky.flux * sky.l) * nu


total(SkyModel(l=jnp.ones(3), flux=jnp.ones((4, 2))), jnp.arange(4.0))
""",
    "errors/output": """\
@filter_multi_vmap(in_dims="T F", out_dims="T 2", vmap="T")
def summary(x):
    return jnp.stack([x.min(), x.mean(), x.max()])  # 3 values, not 2


summary(jnp.ones((10, 4)))
""",
    "errors/not_array": _SCALE
    + """
scale(jnp.ones((10, 4, 5, 2, 2)), 2.0)  # a Python float, but its dims say 'F'
""",
    # --- SpecError: the specification itself is wrong.
    "errors/commas": """\
filter_multi_vmap(jnp.sin, in_dims="T,F,B", vmap="T F B")
""",
    "errors/ellipsis": """\
filter_multi_vmap(jnp.sin, in_dims="T ... F ...", vmap="T")
""",
    "errors/variadic": """\
filter_multi_vmap(jnp.sin, in_dims="*batch F", vmap="F")
""",
    "errors/unknown_dim": """\
f = filter_multi_vmap(jnp.sin, in_dims="T F", out_dims="T F", scan="X", vmap="F")
f(jnp.ones((10, 4)))
""",
    "errors/both": """\
filter_multi_vmap(jnp.sin, in_dims="T F", scan="T", vmap="T F")
""",
    "errors/chunk": """\
filter_multi_vmap(jnp.sin, in_dims="T F", scan={"T": 0}, vmap="F")
""",
    "errors/in_dims_key": _SCALE.replace('"vis": ', '"visibilities": ')
    + """
scale(jnp.ones((10, 4, 5, 2, 2)), jnp.arange(4.0))
""",
    "errors/out_dims": """\
f = filter_multi_vmap(jnp.sin, in_dims="T F", out_dims="F", vmap="T F")
f(jnp.ones((10, 4)))
""",
    # --- Outputs that are not errors.
    "verbose": """\
f = filter_multi_vmap(
    jnp.sin, in_dims="T F B", out_dims="F T B", scan={"T": 4}, vmap="F B", verbose=True
)
out = f(jnp.ones((10, 3, 5)))
print(out.shape)
""",
    "migration": """\
def f(x, y):
    return x + y


f_multi = multi_vmap(
    f,
    in_mapping="[n1,n2,n3],[n1,n2,n3,2,2]",
    out_mapping="[...,n1,n2]",
    scan_dims={"n1"},
    verbose=True,
)
x = jnp.ones((3, 4, 5, 2, 2))
out = f_multi(x, 2 * x)
print(out.shape)
""",
}


def run_example(code: str) -> str:
    """Run `code` after the preamble; return what it printed and what it raised."""
    namespace: dict = {"__name__": "__main__"}
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(PREAMBLE, "<preamble>", "exec"), namespace)
        try:
            exec(compile(code, "<example>", "exec"), namespace)
        except Exception as e:
            cls = type(e)
            print(f"{cls.__module__}.{cls.__qualname__}: {e}")
    return buf.getvalue().rstrip("\n")


def render(code: str) -> str:
    """The Markdown of one snippet: the code, then its output."""
    out = run_example(code)
    return (
        "```python\n"
        + code.rstrip("\n")
        + "\n```\n\n```text\n"
        + textwrap.dedent(out)
        + "\n```\n"
    )


def path_of(name: str) -> str:
    return os.path.join(HERE, name + ".md")


def main() -> int:
    for name, code in EXAMPLES.items():
        text = render(code)
        os.makedirs(os.path.dirname(path_of(name)), exist_ok=True)
        with open(path_of(name), "w") as fh:
            fh.write(text)
        print(f"wrote {os.path.relpath(path_of(name))}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
