import itertools as it

import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
import pytest
from eqx_multimap import filter_multi_vmap, multi_vmap, parse_dims, SpecError
from eqx_multimap._dims import is_dim_name, parse_names

from .helpers import loop_reference


def _loop(f, x, y):
    """Reference for `[n1,n2,n3],[n1,n2,n3,2,2] -> [...,n1,n2]` by explicit loops."""
    n1, n2 = x.shape[:2]
    rows = []
    for i in range(n1):
        rows.append(np.stack([np.asarray(f(x[i, j], y[i, j])) for j in range(n2)]))
    out = np.stack(rows)  # (n1, n2, n3, 2, 2)
    return np.moveaxis(out, (0, 1), (-2, -1))


@pytest.mark.parametrize("scan_dims", [None, {"n1"}, {"n2"}, {"n1", "n2"}])
def test_dsa_docstring_example(scan_dims):
    # The example of DSA2000-Cal's `multi_vmap` docstring.
    def f(x, y):
        return x + y

    n1, n2, n3 = 3, 4, 5
    x = jnp.arange(n1 * n2 * n3 * 4, dtype=jnp.float32).reshape(n1, n2, n3, 2, 2)
    y = -2.0 * x
    f_multi = multi_vmap(
        f,
        in_mapping="[n1,n2,n3],[n1,n2,n3,2,2]",
        out_mapping="[...,n1,n2]",
        scan_dims=scan_dims,
    )
    out = f_multi(x, y)
    assert out.shape == (n3, 2, 2) + (n1, n2)
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, _loop(f, x, y))


def test_unmapped_arg_tuple_outputs_and_tilde():
    # `[]` is an unmapped argument; `~X` names an unmapped output axis.
    def f(x, w):
        # x: (F,), w: (2,) -> ((2, F), ())
        return w[:, None] * x[None, :], jnp.sum(x)

    x = jnp.arange(3 * 4 * 5, dtype=jnp.float32).reshape(3, 4, 5)  # T B F
    w = jnp.array([1.0, -1.0])
    g = multi_vmap(
        f, in_mapping="[T,B],[]", out_mapping="[B,~X,T,...],[T,B]", scan_dims=["T"]
    )
    a, b = g(x, w)
    ref_a = np.stack(
        [np.stack([np.asarray(f(x[t, b_], w)[0]) for t in range(3)]) for b_ in range(4)]
    )  # (B, T, 2, F)
    ref_a = np.swapaxes(ref_a, 1, 2)  # (B, 2, T, F)
    ref_b = np.array([[float(np.sum(x[t, b_])) for b_ in range(4)] for t in range(3)])
    assert a.shape == (4, 2, 3, 5) and b.shape == (3, 4)
    np.testing.assert_allclose(a, ref_a)
    np.testing.assert_allclose(b, ref_b, rtol=1e-6)


def test_scan_dims_lower_to_a_loop():
    f = multi_vmap(jnp.sin, in_mapping="[T,F]", out_mapping="[T,F]", scan_dims={"T"})
    jaxpr = jax.make_jaxpr(f)(jnp.ones((3, 4)))
    assert any(eqn.primitive is lax.scan_p for eqn in jaxpr.jaxpr.eqns)
    g = multi_vmap(jnp.sin, in_mapping="[T,F]", out_mapping="[T,F]")
    jaxpr = jax.make_jaxpr(g)(jnp.ones((3, 4)))
    assert not any(eqn.primitive is lax.scan_p for eqn in jaxpr.jaxpr.eqns)


def test_list_mappings_match_hand_written_nest():
    x = jnp.arange(24.0).reshape(2, 3, 4)
    f = multi_vmap(
        lambda a: a**2, in_mapping=["[i,j]"], out_mapping=["[j,i,...]"], verbose=False
    )
    ref = jax.vmap(jax.vmap(lambda a: a**2, in_axes=0), in_axes=1)(x)
    np.testing.assert_array_equal(f(x), ref)
    for i, j in it.product(range(2), range(3)):
        np.testing.assert_array_equal(f(x)[j, i], x[i, j] ** 2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(in_mapping="T,F", out_mapping="[T]"), r"bracketed groups.*\[T,F,B\]"),
        (
            dict(in_mapping="[T]", out_mapping="[T,T]"),
            r"'T' appears twice in output \[T,T\];\s+each dim must be unique",
        ),
        (dict(in_mapping="[T],[F]", out_mapping="[T,F],[T]"), r"lacks \['F'\]"),
        (
            dict(in_mapping="[T]", out_mapping="[T,K]"),
            r"'K' must be in some input dims, but no group",
        ),
        (
            dict(in_mapping="[T]", out_mapping="[T]", scan_dims={"F"}),
            r"(?s)scan_dims=.*\['F'\].*mapped dims are \['T'\]",
        ),
        (dict(in_mapping="[T-1]", out_mapping="[T]"), r"'T-1' is not a dim label"),
    ],
)
def test_errors(kwargs, match):
    with pytest.raises(SpecError, match=match):
        multi_vmap(jnp.sin, **kwargs)


#
# The dims grammar: names with primes.
#


@pytest.mark.parametrize(
    "name, ok",
    [
        ("T", True),
        ("n1", True),
        ("D'", True),
        ("T''", True),
        ("_", False),
        ("_a'", False),
        ("'", False),
        ("3'", False),
        ("D'x", False),
        ("", False),
        (3, False),
    ],
)
def test_is_dim_name(name, ok):
    assert is_dim_name(name) is ok


def test_primed_names_in_dims_strings():
    dims = parse_dims("D' T'' 3 _ ...")
    assert dims.names == ("D'", "T''")
    assert [str(t) for t in dims.tokens] == ["D'", "T''", "3", "_", "..."]
    assert parse_names("D' T", "scan") == ("D'", "T")
    x, y = np.arange(3.0, dtype=np.float32), np.arange(4.0, dtype=np.float32)
    f = filter_multi_vmap(
        lambda a, b: a * b, in_dims=("D", "D'"), out_dims="D' D", scan="D'", vmap="D"
    )
    ref = loop_reference(lambda a, b: a * b, [x, y], ["D", "D'"], ["D", "D'"], "D' D")
    out = f(jnp.asarray(x), jnp.asarray(y))
    assert out.shape == (4, 3) and out.dtype == jnp.float32
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize(
    "call, matches",
    [
        (
            lambda: parse_dims("D'x T"),
            [r"dim \"D'x\" is not a name", r"optionally followed by primes"],
        ),
        (
            lambda: parse_dims("_a' T"),
            [r"dim \"_a'\" is not a name", r"not starting with `_`"],
        ),
        (
            lambda: parse_names("T _a'", "scan"),
            [r"`filter_multi_vmap\(\.\.\., scan=\.\.\.\)` got \"_a'\"", r"primes"],
        ),
    ],
)
def test_primed_name_errors(call, matches):
    for match in matches:
        with pytest.raises(SpecError, match=match):
            call()
