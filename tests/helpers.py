"""Test helpers: `tree_allclose`, `load_benchmark`, `clean_env`, and an independent
loop reference for mapping.

`loop_reference` deliberately shares no code with `eqx_multimap`: it reads the dims
strings with its own few lines, slices with numpy-style indexing one index
combination at a time, and stacks the per-element results with `np.stack`.
"""

import importlib
import importlib.util
import itertools as it
import os
import pathlib
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np


def tree_allclose(x, y, *, rtol=1e-5, atol=1e-8):
    return eqx.tree_equal(x, y, typematch=True, rtol=rtol, atol=atol)


BENCHMARKS = pathlib.Path(__file__).parent.parent / "benchmarks"


def load_benchmark(name: str) -> types.ModuleType:
    """The module `benchmarks/<name>.py`, which is not part of the package.

    `benchmarks/` goes on `sys.path` first, as `python benchmarks/<name>.py` puts it,
    so that the scripts import the timing harness as `harness`; and
    `load_benchmark("harness")` is that same module, not a second copy.
    """
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    if name == "harness":
        return importlib.import_module("harness")
    path = BENCHMARKS / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def clean_env() -> dict[str, str]:
    """This process's environment for a subprocess on the CPU, without JAX's or
    XLA's settings (`conftest.py` sets `XLA_FLAGS` for 8 devices), importing this
    checkout's `eqx_multimap`."""
    root = str(pathlib.Path(__file__).parent.parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(
        [root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    return env


def _tokens(dims: str, ndim: int) -> list[str]:
    """The token at each axis of an array of rank `ndim`; `...` expands to `...`s."""
    toks = dims.split()
    if "..." in toks:
        n_ell = ndim - (len(toks) - 1)
        assert n_ell >= 0, (dims, ndim)
        i = toks.index("...")
        toks = toks[:i] + ["..."] * n_ell + toks[i + 1 :]
    assert len(toks) == ndim, (dims, ndim)
    return toks


def _sizes(
    args: Sequence[Any], in_dims: Sequence[str | None], mapped: Sequence[str]
) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for x, dims in zip(args, in_dims):
        if dims is None:
            continue
        for tok, size in zip(_tokens(dims, np.ndim(x)), np.shape(x)):
            if tok in mapped:
                assert sizes.setdefault(tok, size) == size, (tok, sizes[tok], size)
    assert set(sizes) == set(mapped), (sizes, mapped)
    return sizes


def _slice(x: Any, dims: str | None, index: dict[str, int]) -> Any:
    if dims is None:
        return x
    idx = tuple(index.get(tok, slice(None)) for tok in _tokens(dims, np.ndim(x)))
    return x[idx]


def _to_out_dims(stacked, sizes: list[int], mapped: Sequence[str], dims: str, xp):
    """`stacked` has shape `(prod(sizes), *core)`; lay it out as `dims` says."""
    core = stacked.shape[1:]
    x = xp.reshape(stacked, tuple(sizes) + core)
    toks = _tokens(dims, x.ndim)
    perm = []
    core_axis = len(mapped)
    for tok in toks:
        if tok in mapped:
            perm.append(list(mapped).index(tok))
        else:
            perm.append(core_axis)
            core_axis += 1
    return jnp.asarray(xp.transpose(x, perm))


def loop_reference(
    fun: Callable,
    args: Sequence[Any],
    in_dims: Sequence[str | None],
    mapped: Sequence[str],
    out_dims: Any,
    xp: Any = np,
) -> Any:
    """Map `fun` with a Python loop over every index combination of `mapped` dims.

    **Arguments:**

    - `fun`: the per-element function, called as `fun(*element_args)`.
    - `args`: the full input arrays (or any value, for `None` dims).
    - `in_dims`: one dims string (or `None`, unmapped) per argument.
    - `mapped`: the names of the mapped dims; the loop runs over them in this order.
    - `out_dims`: a dims string for every output array, or a pytree prefix of the
        output with dims strings at its leaves.
    - `xp`: `numpy` (the default) to stack with `np.stack`, or `jax.numpy` for a
        reference that can be differentiated.

    **Returns:**

    The output pytree, with each array laid out in the order of its `out_dims`.
    Non-array output leaves are taken from the first element.
    """
    mapped = tuple(mapped)
    sizes = _sizes(args, in_dims, mapped)
    size_list = [sizes[n] for n in mapped]
    outs = []
    for combo in it.product(*(range(s) for s in size_list)):
        index = dict(zip(mapped, combo))
        outs.append(fun(*(_slice(x, d, index) for x, d in zip(args, in_dims))))
    if outs:
        stacked = jax.tree.map(
            lambda *xs: (
                xp.stack([xp.asarray(x) for x in xs]) if eqx.is_array(xs[0]) else xs[0]
            ),
            *outs,
        )
    else:
        # Some size is 0: get the per-element output shapes from zero-filled slices.
        def zeros_slice(x, d):
            if d is None:
                return x
            toks = _tokens(d, np.ndim(x))
            shape = [s for tok, s in zip(toks, np.shape(x)) if tok not in mapped]
            return jnp.zeros(shape, x.dtype)

        sliced = [zeros_slice(x, d) for x, d in zip(args, in_dims)]
        is_dyn = [eqx.is_array(x) for x in sliced]

        def call(*dyn):
            it_dyn = iter(dyn)
            full = [next(it_dyn) if a else x for x, a in zip(sliced, is_dyn)]
            return fun(*full)

        struct = jax.eval_shape(call, *(x for x, a in zip(sliced, is_dyn) if a))
        stacked = jax.tree.map(
            lambda s: (
                xp.zeros((0,) + s.shape, s.dtype)
                if isinstance(s, jax.ShapeDtypeStruct)
                else s
            ),
            struct,
        )

    def layout(d, sub):
        return jax.tree.map(
            lambda leaf: (
                _to_out_dims(leaf, size_list, mapped, d, xp)
                if isinstance(leaf, (np.ndarray, jax.Array))
                else leaf
            ),
            sub,
        )

    return jax.tree.map(layout, out_dims, stacked, is_leaf=lambda x: isinstance(x, str))
