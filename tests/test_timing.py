"""The benchmarks' timing harness, `benchmarks/harness.py`: the interleaving order,
the calibration of calls per sample and of rounds, and the ratio and formatting
helpers, with a fake clock (no real times), and the twin and HLO helpers on real
compiled programs."""

import jax.numpy as jnp
import pytest

from .helpers import load_benchmark


harness = load_benchmark("harness")


class FakeClock:
    """A clock that only moves when a fake program runs."""

    def __init__(self):
        self.now = 0.0
        self.calls: list[str] = []

    def __call__(self) -> float:
        return self.now

    def program(self, name: str, seconds: float):
        def thunk():
            self.calls.append(name)
            self.now += seconds

        return thunk


def test_rounds_rotate_the_order_and_settle_each_sample():
    clock = FakeClock()
    fns = [clock.program(n, 2**-6) for n in "abc"]
    times = harness.time_interleaved(
        fns, seconds=0.0, min_rounds=3, max_rounds=3, settle=1, clock=clock
    )
    # One untimed call each, then per round every thunk once (settled: twice),
    # round r starting from the r-th thunk.
    rounds = ["aabbcc", "bbccaa", "ccaabb"]
    assert clock.calls == list("abc") + [c for r in rounds for c in r]
    assert times == [[2**-6] * 3] * 3


def test_calls_per_sample_and_rounds_follow_the_first_calls():
    clock = FakeClock()
    fns = [clock.program("quick", 1e-3), clock.program("slow", 4e-3)]
    times = harness.time_interleaved(
        fns, seconds=0.2, min_sample=5e-3, settle=0, max_rounds=100, clock=clock
    )
    # 5 calls per sample make the quickest sample 5 ms; a round is 5 x 5 ms.
    assert clock.calls.count("quick") == 1 + 5 * 8
    assert times == [[pytest.approx(1e-3)] * 8, [pytest.approx(4e-3)] * 8]


def test_rounds_stay_within_their_bounds():
    for seconds, expected in ((0.0, 4), (1e3, 6)):
        clock = FakeClock()
        times = harness.time_interleaved(
            [clock.program("a", 0.01)],
            seconds=seconds,
            min_rounds=4,
            max_rounds=6,
            clock=clock,
        )
        assert len(times[0]) == expected


def test_drop_above_stops_timing_slow_thunks_after_two_rounds():
    clock = FakeClock()
    fns = [clock.program("fast", 0.01), clock.program("slow", 0.02)]
    times = harness.time_interleaved(
        fns, 0.0, min_rounds=5, max_rounds=5, settle=0, drop_above=1.25, clock=clock
    )
    assert len(times[0]) == 5 and len(times[1]) == 2


def test_a_probe_drops_the_rounds_another_job_disturbed():
    clock = FakeClock()
    # The probe runs twice per round (settled, timed). It is slow (a core taken) in
    # the second and fourth rounds, and the programs 3x slower then.
    slow = iter([1, 1, 2, 2, 1, 1, 2, 2, 1, 1] + [2] * 6)
    taken = False

    def probe_run():
        nonlocal taken
        taken = next(slow) > 1
        clock.now += 2e-3 if taken else 1e-3

    def program():
        clock.now += 3e-2 if taken else 1e-2

    probe = harness.Probe(probe_run)
    times = harness.time_interleaved(
        [program] * 2, 0.0, min_rounds=5, max_rounds=5, settle=0, clock=clock,
        probe=probe,
    )  # fmt: skip
    assert probe.disturbed() == [False, True, False, True, False]
    assert times == [[pytest.approx(1e-2)] * 3] * 2
    # A later call, every round slow: the median moves, and the rounds are kept.
    times = harness.time_interleaved(
        [program], 0.0, min_rounds=3, max_rounds=3, settle=0, clock=clock,
        probe=probe,
    )  # fmt: skip
    assert probe.disturbed(5) == [False] * 3
    assert times == [[pytest.approx(3e-2)] * 3]


def test_the_probe_runs_a_threaded_program():
    probe = harness.Probe()
    for _ in range(3):
        probe.time()
    assert len(probe.times) == 3 and min(probe.times) > 0
    assert probe.disturbed(3) == []


def test_ratios_and_quartiles():
    assert harness.paired_ratios([2.0, 6.0, 3.0], [1.0, 2.0, 3.0]) == [2.0, 3.0, 1.0]
    assert harness.quartiles([5.0]) == (5.0, 5.0, 5.0)
    assert harness.quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 3.0, 4.0)
    assert harness.fmt_ratios([1.0, 2.0, 3.0, 4.0, 5.0]) == "3.00 (2.00 to 4.00)"


@pytest.mark.parametrize(
    "n, text",
    [(0, "0 B"), (512, "512 B"), (1536, "1.5 KiB"), (3 * 2**20, "3.0 MiB")]
    + [(2**30, "1.0 GiB"), (5 * 2**40, "5120.0 GiB"), (-2048, "-2.0 KiB")],
)
def test_fmt_bytes(n, text):
    assert harness.fmt_bytes(n) == text


@pytest.mark.parametrize(
    "s, text",
    [(2.5e-4, "250 us"), (3.14e-3, "3.14 ms"), (0.25, "250 ms"), (1.2, "1.20 s")]
    + [(9.9996e-4, "1 ms"), (0.99996, "1.00 s"), (9.994e-4, "999 us")],
)
def test_fmt_seconds(s, text):
    assert harness.fmt_seconds(s) == text


def _program(x):
    return jnp.sin(x) * 2


def test_twins_are_separate_executables_with_the_same_hlo():
    x = jnp.ones((4, 3), jnp.float32)
    a = harness.compiled(_program, x)
    again = harness.compiled(_program, x)
    twin = harness.compiled(harness.fresh(_program), x)
    other = harness.compiled(lambda x: jnp.cos(x) * 2, x)
    assert again.runtime_executable() is a.runtime_executable()
    assert harness.same_hlo(a, twin)
    assert not harness.same_hlo(a, other)
    with pytest.raises(ValueError, match="one executable twice"):
        harness.same_hlo(a, again)
    assert harness.temp_bytes(a) >= 0
    assert harness.fresh(_program)(x).shape == (4, 3)


def test_count_compiles_counts_traces_and_compiles_only_while_active():
    x = jnp.ones((4, 3), jnp.float32)
    with harness.count_compiles() as counts:
        harness.compiled(harness.fresh(_program), x)
        harness.compiled(harness.fresh(_program), x)
    assert counts == {"traces": 2, "compiles": 2}
    harness.compiled(harness.fresh(_program), x)
    assert counts == {"traces": 2, "compiles": 2}
