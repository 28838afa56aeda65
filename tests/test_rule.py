"""The one mapping rule: strategies choose how a mapped dim is mapped, never whether.

For random signatures, every strategy assignment (all vmap, each dim scanned,
chunked with remainders, `plan="auto"`, shard on 4 simulated devices) must give the
same values as an independent loop reference, and the body must see the same
per-element shapes.
"""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from eqx_multimap import filter_multi_vmap, Planner
from hypothesis import given, settings

from .helpers import loop_reference


_MAPPED = ("T", "F", "B")


@st.composite
def _specs(draw):
    """A signature: 1-3 mapped dims, 1-3 arguments, core dims in inputs and outputs."""
    n_mapped = draw(st.integers(1, 3))
    mapped = tuple(draw(st.permutations(_MAPPED))[:n_mapped])
    sizes = {n: draw(st.integers(1, 6)) for n in mapped}
    sizes["c"] = draw(st.integers(1, 3))
    n_args = draw(st.integers(1, 3))
    has = [
        draw(st.lists(st.sampled_from(mapped), unique=True, max_size=n_mapped))
        for _ in range(n_args)
    ]
    for name in mapped:  # every mapped dim is named by some input
        if not any(name in h for h in has):
            has[draw(st.integers(0, n_args - 1))].append(name)
    args, in_dims = [], []
    seed = draw(st.integers(0, 2**16))
    for i in range(n_args):
        tokens = list(has[i]) + (["c"] if draw(st.booleans()) else [])
        tokens = list(draw(st.permutations(tokens)))
        shape = tuple(sizes[t] for t in tokens)
        rng = np.random.default_rng(seed + i)
        args.append(jnp.asarray(rng.standard_normal(shape).astype(np.float32)))
        in_dims.append(" ".join(tokens))
    # The output keeps the core dim `c` (declared `core`) when some input has it.
    keep_c = any("c" in d.split() for d in in_dims) and draw(st.booleans())
    out = list(draw(st.permutations(mapped))) + (["c"] if keep_c else [])
    out = list(draw(st.permutations(out)))
    return mapped, sizes, args, tuple(in_dims), " ".join(out), keep_c


def _body_and_shapes(keep_c: bool):
    seen: list[tuple] = []

    def body(*xs):
        seen.append(tuple(x.shape for x in xs))
        total = sum((jnp.sum(jnp.cos(x)) for x in xs), start=jnp.float32(0))
        if keep_c:
            c = next(x for x in xs if x.ndim == 1)
            return jnp.sin(c) + total
        return total

    return body, seen


def _assignments(mapped, sizes):
    """Every strategy assignment to compare, as keyword dicts."""
    out = [("all vmap", {})]
    for name in mapped:
        out.append((f"scan {name}", {"scan": name}))
        chunk = max(1, sizes[name] - 1)  # a remainder whenever the size is > 1
        out.append((f"chunk {name}", {"scan": {name: chunk}}))
    out.append(("scan all", {"scan": " ".join(mapped)}))
    out.append(("auto", {"plan": Planner(), "memory_budget": 64}))
    return out


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(spec=_specs())
def test_every_assignment_gives_the_same_values_and_shapes(spec):
    mapped, sizes, args, in_dims, out_dims, keep_c = spec
    core = "c" if keep_c else None
    ref_body, _ = _body_and_shapes(keep_c)
    ref = loop_reference(ref_body, args, in_dims, mapped, out_dims)
    shapes = None
    for name, kw in _assignments(mapped, sizes):
        body, seen = _body_and_shapes(keep_c)
        f = filter_multi_vmap(body, in_dims=in_dims, out_dims=out_dims, core=core, **kw)
        try:
            out = f(*args)
        except Exception as e:  # only the planner may refuse: a budget nothing fits
            assert name == "auto" and "no nest fits" in str(e), (name, e)
            continue
        assert out.shape == ref.shape and out.dtype == ref.dtype, name
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5, err_msg=name)
        assert seen, name
        if shapes is None:
            shapes = seen[-1]
        assert seen[-1] == shapes, (name, seen[-1], shapes)


@pytest.mark.slow
@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 (simulated) devices")
@settings(max_examples=6, deadline=None)
@given(spec=_specs(), pad=st.booleans())
def test_sharding_gives_the_same_values_and_shapes(spec, pad):
    mapped, sizes, args, in_dims, out_dims, keep_c = spec
    core = "c" if keep_c else None
    mesh = jax.make_mesh((4,), ("d",), devices=jax.devices()[:4])
    ref_body, _ = _body_and_shapes(keep_c)
    ref = loop_reference(ref_body, args, in_dims, mapped, out_dims)
    shapes = None
    for name in mapped:
        if sizes[name] % 4 and not pad:
            continue
        for extra in ({}, {"scan": name}):
            body, seen = _body_and_shapes(keep_c)
            f = filter_multi_vmap(
                body,
                in_dims=in_dims,
                out_dims=out_dims,
                core=core,
                shard={name: "d"},
                mesh=mesh,
                pad=pad,
                **extra,
            )
            out = f(*args)
            np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
            assert out.shape == ref.shape and out.dtype == ref.dtype
            if shapes is None:
                shapes = seen[-1]
            assert seen[-1] == shapes
