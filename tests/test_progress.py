"""`progress=`: one bar per map over the outermost scan's iterations, reported from
inside the compiled program; off by default, and then absent from it."""

import importlib.util
import pathlib
import re
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from eqx_multimap import filter_multi_vmap, SpecError
from jax.sharding import AxisType


T, F, B = 37, 3, 4


class FakeBar:
    """Stands in for `tqdm.auto.tqdm`: records every bar and its updates."""

    bars: list["FakeBar"] = []

    def __init__(self, total=None, desc=None, leave=True):
        self.total, self.desc, self.n, self.closed = total, desc, 0, False
        self.updates = 0  # one per callback
        FakeBar.bars.append(self)

    def update(self, n=1):
        assert not self.closed
        self.n += n
        self.updates += 1

    def close(self):
        self.closed = True


@pytest.fixture
def bars(monkeypatch):
    # A fake `tqdm.auto` module, so the tests run whether `tqdm` is installed or not.
    FakeBar.bars = []
    auto = types.ModuleType("tqdm.auto")
    auto.tqdm = FakeBar
    package = types.ModuleType("tqdm")
    package.auto = auto
    monkeypatch.setitem(sys.modules, "tqdm", package)
    monkeypatch.setitem(sys.modules, "tqdm.auto", auto)

    def reported():
        jax.effects_barrier()  # the callbacks run asynchronously
        return [(b.n, b.total, b.closed) for b in FakeBar.bars]

    reported.updates = lambda: [b.updates for b in FakeBar.bars]

    return reported


def body(x, y):
    return jnp.tanh(x * y) + jnp.sum(y)


def data():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(T, F, B)), jnp.float32)
    y = jnp.linspace(0.5, 1.5, B, dtype=jnp.float32)
    return x, y


def reference(x, y):
    """A Python loop over every element."""
    x, y = np.asarray(x), np.asarray(y)
    return np.stack(
        [
            np.stack(
                [
                    np.stack([np.tanh(x[t, f, b] * y[b]) + y[b] for b in range(B)])
                    for f in range(F)
                ]
            )
            for t in range(T)
        ]
    )


def mapped(progress=True, **kwargs):
    return filter_multi_vmap(
        body, in_dims=("T F B", "B"), out_dims="T F B", progress=progress, **kwargs
    )


# Each case: the strategies, and the trips of the outermost scan.
CASES = {
    "scan": (dict(scan="T"), T),
    "two scans": (dict(scan="T F"), T),
    # 4 chunks of 8; the remaining 5 elements are a vmap, and report nothing.
    "chunked": (dict(scan={"T": 8}), T // 8),
    # The remainder (5 elements of `T`, vmapped around a scan over `F`) runs
    # after the 4 chunks and is not counted either.
    "chunked, then a scan": (dict(scan={"T": 8, "F": None}), T // 8),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("jit", [True, False])
def test_one_report_per_trip(bars, case, jit):
    kwargs, trips = CASES[case]
    f = mapped(**kwargs)
    x, y = data()
    out = (jax.jit(f) if jit else f)(x, y)
    np.testing.assert_allclose(out, reference(x, y), rtol=1e-6, atol=1e-6)
    assert bars() == [(trips, trips, True)]
    assert bars.updates() == [trips]  # one callback per trip
    # The next execution of the same program opens a new bar.
    (jax.jit(f) if jit else f)(x, y)
    assert bars() == [(trips, trips, True)] * 2


def test_long_scan_reports_a_hundred_times(bars):
    # 250 trips: a callback every 3 trips (83 of them) and one for the last trip.
    f = filter_multi_vmap(
        lambda x: 2 * x, in_dims="T B", out_dims="T B", scan="T", progress="tqdm"
    )
    x = jnp.arange(250 * 2, dtype=jnp.float32).reshape(250, 2)
    np.testing.assert_array_equal(f(x), 2 * np.asarray(x))
    assert bars() == [(250, 250, True)]
    assert bars.updates() == [84]
    # Under `jax.grad` too (the callback sits in a `lax.cond` then).
    grad = jax.jit(jax.grad(lambda x: jnp.sum(f(x) ** 2)))(x)
    np.testing.assert_array_equal(grad, 8 * np.asarray(x))
    assert bars() == [(250, 250, True)] * 2
    assert bars.updates() == [84] * 2


@pytest.mark.parametrize("checkpoint", [False, True])
def test_grad_reports_the_forward_pass_once(bars, checkpoint):
    f = mapped(scan={"T": 8, "F": None}, checkpoint=checkpoint)
    loss = lambda x, y: jnp.sum(f(x, y) ** 2)  # noqa: E731

    def ref_body(x, y):
        return jnp.tanh(x * y) + jnp.sum(y)

    ref = jax.vmap(jax.vmap(jax.vmap(ref_body, (0, 0)), (0, None)), (0, None))
    ref_loss = lambda x, y: jnp.sum(ref(x, y) ** 2)  # noqa: E731
    x, y = data()
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, y)
    expected = jax.grad(ref_loss, argnums=(0, 1))(x, y)
    for g, e in zip(grads, expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)
    trips = T // 8  # the chunks; the remainder is not counted
    assert bars() == [(trips, trips, True)]


def test_planned_map_reports_only_the_chosen_nest(bars):
    # `T` is scanned as given, so the chosen nest's outermost scan has T trips,
    # whatever the planner does with `F` and `B`; its analysis compiles report
    # nothing.
    f = mapped(scan="T", plan="auto")
    x, y = data()
    out = f(x, y)
    np.testing.assert_allclose(out, reference(x, y), rtol=1e-6, atol=1e-6)
    assert bars() == [(T, T, True)]
    jax.grad(lambda x: jnp.sum(f(x, y)))(x)
    assert bars() == [(T, T, True)] * 2


def test_user_vmap_gives_one_bar(bars):
    f = mapped(scan="T")
    x, y = data()
    out = jax.vmap(f, in_axes=(None, 0))(x, jnp.stack([y, 2 * y]))
    np.testing.assert_allclose(out[1], reference(x, 2 * y), rtol=1e-6, atol=1e-6)
    assert bars() == [(T, T, True)]


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")
def test_shard_reports_one_device(bars):
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
    f = mapped(scan="T", shard={"B": "y"}, mesh=mesh)
    x, y = data()
    out = jax.jit(f)(x, y)
    np.testing.assert_allclose(out, reference(x, y), rtol=1e-6, atol=1e-6)
    # One bar of T trips, not one per device (8 devices run the scan).
    assert bars() == [(T, T, True)]
    grad = jax.jit(jax.grad(lambda y: jnp.sum(f(x, y))))(y)
    ref = lambda y: jnp.sum(jnp.tanh(x * y[None, None]) + y[None, None])  # noqa: E731
    expected = jax.grad(ref)(y)
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-4)
    assert bars() == [(T, T, True)] * 2


def test_no_scan_no_bar(bars):
    f = mapped()  # every dim vmapped
    x, y = data()
    np.testing.assert_allclose(f(x, y), reference(x, y), rtol=1e-6, atol=1e-6)
    assert bars() == []
    assert _custom_calls(jax.jit(f).lower(x, y).compile().as_text()) == []


def _hlo(progress, **kwargs):
    f = mapped(progress, **kwargs)
    return jax.jit(f).lower(*data()).compile().as_text()


def _custom_calls(text):
    """The custom calls of a compiled module (a host callback is one); its
    metadata, which names this file's functions, does not count."""
    return [line for line in text.splitlines() if " custom-call(" in line]


@pytest.mark.parametrize("kwargs", [dict(scan="T"), dict(scan={"T": 8}, plan="auto")])
def test_off_compiles_no_callback(kwargs):
    assert _custom_calls(_hlo(False, **kwargs)) == []
    (on,) = _custom_calls(_hlo("text", **kwargs))  # the check can fail
    assert "callback" in on


def test_text_bar(capfd):
    x, y = data()
    mapped("text", scan="T")(x, y)
    jax.effects_barrier()
    lines = capfd.readouterr().err.splitlines()
    # A line at each tenth of the trips (every 3 of 37), and at the end.
    assert len(lines) == T // 3 + 1
    assert lines[0].startswith("body: 3/37 (8%), ")
    assert lines[-1].startswith("body: 37/37 (100%), ")


def test_progress_in_repr():
    assert "progress='text'" in repr(mapped(scan="T", progress="text"))
    assert "progress" not in repr(mapped(scan="T", progress=False))


@pytest.mark.parametrize("bad", ["bar", 1, "TQDM", [True]])
def test_bad_progress_raises(bad):
    message = r"(?s)progress=\.\.\.\)` must be `False`.*but got " + re.escape(repr(bad))
    with pytest.raises(SpecError, match=message):
        filter_multi_vmap(body, in_dims=("T", None), out_dims="T", progress=bad)


def test_overhead_example_runs(bars, capsys):
    path = pathlib.Path(__file__).parent.parent / "examples" / "progress.py"
    spec = importlib.util.spec_from_file_location("progress_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--trips", "20", "--lanes", "2", "--seconds", "0"]) == 0
    out = capsys.readouterr().out
    for transform in ("forward", "grad"):
        for name in ("progress=False", "twin (noise floor)", "'text'", "'tqdm'"):
            assert f"| {transform} | {name} | " in out


def test_without_tqdm(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # `import tqdm.auto` fails
    with pytest.raises(SpecError, match=r"(?s)progress='tqdm'\)` needs `tqdm`"):
        mapped("tqdm", scan="T")
    assert "progress='text'" in repr(mapped(True, scan="T"))  # the fallback
