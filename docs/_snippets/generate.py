"""Regenerate the snippets in this folder by running them: `python generate.py`.

Each example is real code; its output (an error message, a `print`) is captured by
running it, never written by hand. `python generate.py --check` renders every
example again and fails if a file differs; `tests/test_docs.py` runs that in a fresh
process with JAX's default configuration, so the docs cannot drift from what the
library actually prints.

Outputs are deterministic: shapes, values, error messages, and sizes that XLA
reports when it compiles (nothing is timed). The one exception, how long planning
took, is masked (`_MASKS`); the planner in the examples uses the default time model
and no disk cache, so that nothing depends on the machine or on earlier runs.
"""

import contextlib
import difflib
import io
import os
import re
import sys
import textwrap


HERE = os.path.dirname(os.path.abspath(__file__))

# Run before every example, not shown in the snippet (each docs page shows it once).
PREAMBLE = """\
import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int
import eqx_multimap
from eqx_multimap import filter_multi_vmap, multi_vmap
"""

# Parts of an output that change from run to run, and what they are shown as.
_MASKS = [
    (re.compile(r"\d+\.\d\d s\)"), "X.XX s)"),
    (re.compile(r"planned in \d+\.\d\d s"), "planned in X.XX s"),
    (re.compile(r"\(\d+\.\d\d s, "), "(X.XX s, "),
]

_SCALE = """\
@filter_multi_vmap(
    in_dims={"vis": "T F B 2 2", "nu": "F"},
    out_dims="T F B 2 2",
    scan="T",
)
def scale(vis, nu):
    return vis * nu
"""

# name -> code. Error examples end in the call that raises.
EXAMPLES = {
    # --- The mapping rule.
    "rule": """\
x = jnp.ones((2, 3, 4))  # S B c
y = jnp.arange(12.0).reshape(3, 4)  # B d
b = lambda a, w: a * jnp.sum(w)

for strategies in [{}, {"scan": "S"}, {"scan": "B"}, {"scan": {"S": 1}, "vmap": "B"}]:
    f = filter_multi_vmap(b, in_dims=("S B c", "B d"), out_dims="S B c", **strategies)
    print(f"{strategies}: {f(x, y)[..., 0].tolist()}")  # every c is the same


# `c` is in the output, so it is mapped. For the body to see it whole, say so:
def b_rows(a, w):
    print(f"a: {a.shape}, w: {w.shape}")  # once, when the body is traced
    return a * jnp.sum(w)


g = filter_multi_vmap(b_rows, in_dims=("S B c", "B d"), out_dims="S B c", core="c")
print(g(x, y)[..., 0].tolist())
""",
    "repr": """\
f = filter_multi_vmap(jnp.sin, in_dims="T F B", out_dims="F T B", scan={"T": 4})
print(f)
""",
    "verbose": """\
f = filter_multi_vmap(
    jnp.sin, in_dims="T F B", out_dims="F T B", scan={"T": 4}, verbose=True
)
out = f(jnp.ones((10, 3, 5)))
print(out.shape)
""",
    # --- Memory, as XLA reports it when compiling (nothing is run).
    "order_memory": """\
def f(x):
    return jnp.sin(x**2 + 1)


def scan_over(g):  # `g` mapped over the leading axis with `lax.scan`
    return lambda xs: jax.lax.scan(lambda c, x: (c, g(x)), None, xs)[1]


xs = jax.ShapeDtypeStruct((1000, 1000, 10), jnp.float32)
nests = {
    "scan(vmap(f))": scan_over(jax.vmap(f)),
    "vmap(scan(f))": jax.vmap(scan_over(f)),
}
for name, nest in nests.items():
    temp = jax.jit(nest).lower(xs).compile().memory_analysis().temp_size_in_bytes
    print(f"{name}: {temp} bytes of temporary memory")
""",
    "scan_memory": """\
def body(x, y, v):
    w = jnp.exp(jnp.outer(x, y))  # (M, K) = (1024, 1024): 4 MiB per element
    return (w @ v) / jnp.sum(w, axis=1)


n, m, k = 256, 1024, 1024
args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in [(n, m), (n, k), (n, k)]]
for strategy in [{}, {"scan": "n"}, {"scan": {"n": 16}}]:
    f = filter_multi_vmap(
        body, in_dims=("n M", "n K", "n K"), out_dims="n M", core="M", **strategy
    )
    temp = jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes
    print(f"{strategy or 'vmap'}: {temp / 2**20:.1f} MiB of temporary memory")
""",
    "explain": """\
def body(x, y):
    w = jnp.exp(jnp.outer(x, y))  # (M, K): 1 MiB per element
    return (w @ y) / jnp.sum(w, axis=1)


# The time model alone (nothing timed), its default constants (not calibrated to
# this machine) and no disk cache, so that the output is the same everywhere;
# `plan="auto"` calibrates, times a short list where the model searched, caches.
planner = eqx_multimap.Planner(
    measure=False, time_model=eqx_multimap.TimeModel(), cache_dir=False
)
f = filter_multi_vmap(
    body,
    in_dims={"x": "n M", "y": "n K"},
    out_dims="n M",
    core="M",  # the body sees rows; only `n` is mapped
    plan=planner,
    memory_budget=32 * 2**20,  # 32 MiB of temporary memory
)
x = jax.ShapeDtypeStruct((256, 512), jnp.float32)  # nothing is run
print(eqx_multimap.explain(f, x, x))
""",
    # --- ShapeError: the data does not fit the dims.
    "errors/inconsistent": _SCALE
    + """
scale(jnp.ones((10, 4, 5, 2, 2)), jnp.arange(3.0))  # nu has 3 frequencies, vis 4
""",
    "errors/core": """\
@filter_multi_vmap(in_dims=("T K", "K"), out_dims="T")
def dot(x, w):
    return x @ w  # x: (K,), w: (K,): K is a core dim


dot(jnp.ones((10, 3)), jnp.ones(4))
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
    in_dims={"sky": SkyModel(l="S", flux="F S"), "nu": "F"}, out_dims="F"
)
def total(sky, nu):
    return jnp.sum(sky.flux * sky.l) * nu


total(SkyModel(l=jnp.ones(3), flux=jnp.ones((4, 2))), jnp.arange(4.0))
""",
    "errors/output": """\
@filter_multi_vmap(in_dims="T F", out_dims="T 2")
def summary(x):
    return jnp.stack([x.min(), x.mean(), x.max()])  # 3 values, not 2


summary(jnp.ones((10, 4)))
""",
    "errors/no_array": _SCALE
    + """
scale(jnp.ones((10, 4, 5, 2, 2)), [0.0, 1.0, 2.0, 3.0])  # a list, not an array
""",
    "errors/annotation_list": """\
def gather(x: Float[Array, "T N"], ant1: Int[Array, " B"]) -> Float[Array, "T B"]:
    return x[ant1]


f = filter_multi_vmap(gather)
f(jnp.ones((10, 4)), [0, 1, 3])
""",
    "body_note": """\
@filter_multi_vmap(
    in_dims={"vis": "T F B 2 2", "nu": "f"},  # `f`, a typo for `F`
    out_dims="T F B 2 2",
)
def scale(vis, nu):
    return vis * nu


scale(jnp.ones((10, 4, 5, 2, 2)), jnp.arange(4.0))
""",
    "bad_call": _SCALE
    + """
scale(jnp.ones((10, 4, 5, 2, 2)), mu=jnp.arange(4.0))  # `mu` for `nu`
""",
    "errors/scalar": _SCALE
    + """
scale(jnp.ones((10, 4, 5, 2, 2)), 2.0)  # a Python float, but its dims say 'F'
""",
    # --- SpecError: the specification itself is wrong.
    "errors/commas": """\
filter_multi_vmap(jnp.sin, in_dims="T,F,B", out_dims="T F B")
""",
    "errors/ellipsis": """\
filter_multi_vmap(jnp.sin, in_dims="T ... F ...", out_dims="T")
""",
    "errors/variadic": """\
filter_multi_vmap(jnp.sin, in_dims="*batch F ...", out_dims="F")
""",
    "errors/both": """\
filter_multi_vmap(jnp.sin, in_dims="T F", out_dims="T F", scan="T", vmap="T F")
""",
    "errors/chunk": """\
filter_multi_vmap(jnp.sin, in_dims="T F", out_dims="T F", scan={"T": 0})
""",
    "errors/unmapped": """\
b = lambda a, w: a * jnp.sum(w)
filter_multi_vmap(b, in_dims=("S B c", "B d"), out_dims="S B c", scan="d")
""",
    "errors/unmapped_annotation": """\
def total(x: Float[Array, "T F"]) -> Float[Array, " T"]:
    return jnp.sum(x)


f = filter_multi_vmap(total, vmap="F")
f(jnp.ones((10, 4)))
""",
    "errors/no_out_dims": """\
def wave(x):
    return jnp.sin(x)


f = filter_multi_vmap(wave, in_dims="T F", scan="T")
f(jnp.ones((10, 4)))
""",
    "errors/out_dims": """\
filter_multi_vmap(
    lambda x: (2 * x, jnp.sum(x)), in_dims="T F", out_dims=("T F", "T"), scan="T"
)
""",
    "errors/unknown_dim": """\
f = filter_multi_vmap(lambda x: jnp.stack([x, -x]), in_dims="T", out_dims="T S")
f(jnp.ones(10))
""",
    "errors/core_not_output": """\
filter_multi_vmap(jnp.sum, in_dims="T c", out_dims="T", core="c")
""",
    "errors/in_dims_key": _SCALE.replace('"vis": ', '"viz": '),
    # --- The migration shim.
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
            # Notes, as Python prints them; not JAX's own about traceback filtering.
            for note in getattr(e, "__notes__", ()):
                if "JAX has removed its internal frames" not in note:
                    print(note)
    out = buf.getvalue().rstrip("\n")
    for pattern, shown in _MASKS:
        out = pattern.sub(shown, out)
    return out


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


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for name, code in EXAMPLES.items():
        text = render(code)
        path = path_of(name)
        if check:
            if not os.path.exists(path):
                stale.append(f"{name}: missing")
            else:
                with open(path) as fh:
                    old = fh.read()
                if old != text:
                    diff = difflib.unified_diff(
                        old.splitlines(), text.splitlines(), "file", "now", lineterm=""
                    )
                    stale.append(f"{name}: out of date\n" + "\n".join(diff))
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            fh.write(text)
        print(f"wrote {os.path.relpath(path)}", file=sys.stderr)
    if stale:
        print(
            "Run `python docs/_snippets/generate.py`; these snippets differ from "
            "what their code prints now:\n  " + "\n  ".join(stale),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
