"""`progress=`: a bar over the iterations of the outermost scan, reported from
inside the compiled program.

Not to be confused with `_planner.cost`, which logs the planner's own progress.

`filter_multi_vmap(..., progress=True)` puts a [`Meter`][] in the nest's `Build`.
When `_nest.run` builds the nest of one call, its outermost scan gets a [`Report`][]
and calls `jax.debug.callback` with the number of iterations done since its last
report, every iteration or, past [`REPORTS`][] iterations, every
`ceil(n / REPORTS)`-th and the last. It does so in its body, outside every vmap and
outside `jax.checkpoint` (which would call it again in the backward pass). So a map
reports one bar, never one per lane; under `jax.grad` only the forward pass
reports, since the callback takes no tangent. Under `shard=`, only the device at
index 0 on the mesh calls back.

The bar is host state of one traced call: it opens at the first report, counts the
iterations of the outermost scan, and closes when the count reaches their total
(each execution of the compiled program counts again from zero). A chunked scan's
remainder, vmapped, is not counted.
"""

import dataclasses
import functools as ft
import logging
import sys
import threading
import time
from typing import Any, Literal

import jax
import jax.lax as lax
from jax._src import traceback_util

from ._errors import SpecError


traceback_util.register_exclusion(__file__)


Kind = Literal["tqdm", "text"]

REPORTS = 100
"""The outermost scan calls back at most this many times (every iteration
when it has at most this many): each callback costs tens of microseconds."""

TEXT_EVERY = 0.1
"""The text bar prints a line each time another tenth of the iterations is done,"""
TEXT_SECONDS = 30.0
"""or when this many seconds have passed since its last line, and at the end."""


def tqdm_installed() -> bool:
    try:
        import tqdm.auto  # noqa: F401
    except ImportError:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class Meter:
    """What `progress=` asks for: the kind of bar, its label, and, under `shard=`,
    the mesh axes whose index 0 reports (the manual ones: the others are the
    compiler's)."""

    kind: Kind
    label: str = ""
    axes: tuple[str, ...] = ()


def make_meter(call: Any) -> Meter | None:
    """The [`Meter`][] of one call (a `_resolve.Call`), if `progress=` is on."""
    if call.options.progress is None:
        return None
    axes = () if call.shard is None else call.shard.manual
    label = call.fun_name.removeprefix("filter_multi_vmap(")[:-1]
    return Meter(call.options.progress, label, axes)


class _Bar:
    """The host side of one traced call's bar: counts the reports of its outermost
    scan."""

    def __init__(self, meter: Meter, total: int):
        self.meter = meter
        self.total = total
        self.count = 0
        self.bar: Any = None
        self.start = 0.0
        self.printed = (0, 0.0)  # count and time of the text bar's last line
        self.lock = threading.Lock()

    def report(self, trips: Any) -> None:
        """`trips` more iterations are done."""
        with self.lock:
            if self.count == 0:
                self._open()
            self.count += int(trips)
            self._show(int(trips))
            if self.count >= self.total:
                self._close()
                self.count = 0

    def _open(self) -> None:
        self.start = time.perf_counter()
        self.printed = (0, self.start)
        if self.meter.kind == "tqdm":
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total, desc=self.meter.label, leave=True)

    def _show(self, trips: int) -> None:
        if self.bar is not None:
            self.bar.update(trips)
            return
        now = time.perf_counter()
        last_count, last_time = self.printed
        due = max(1, int(self.total * TEXT_EVERY))
        if (
            self.count - last_count >= due
            or now - last_time >= TEXT_SECONDS
            or self.count >= self.total
        ):
            self.printed = (self.count, now)
            percent = 100 * self.count // self.total
            print(
                f"{self.meter.label}: {self.count}/{self.total} ({percent}%), "
                f"{now - self.start:.1f} s",
                file=sys.stderr,
                flush=True,
            )

    def _close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


@dataclasses.dataclass(frozen=True, eq=False)
class Report:
    """One traced call's bar, reported from its outermost scan of `size` iterations:
    called in the scan's body with the iteration's index."""

    bar: _Bar
    size: int

    def __call__(self, index: Any) -> None:
        axes, size = self.bar.meter.axes, self.size
        every = max(1, -(-size // REPORTS))
        done = index + 1  # the iterations done once this one is
        # Report every `every` iterations, and the last one; under `shard=`, from
        # device 0 alone.
        due = (done % every == 0) | (done == size)
        if axes:
            due = due & (lax.axis_index(axes) == 0)
        trips = done - every * ((done - 1) // every)
        if every == 1 and not axes:
            jax.debug.callback(self.bar.report, trips)
        else:
            report = ft.partial(jax.debug.callback, self.bar.report)
            lax.cond(due, report, lambda n: None, trips)


def report_for(meter: Meter, size: int) -> Report | None:
    """The [`Report`][] of a call whose outermost scan runs `size` iterations, or
    `None` when it runs none."""
    return Report(_Bar(meter, size), size) if size else None


def parse_progress(progress: Any) -> Kind | None:
    """The kind of bar that `progress=` asks for, checked at decoration."""
    if progress is None or progress is False:
        return None
    if progress is True:
        return "tqdm" if tqdm_installed() else "text"
    if isinstance(progress, str) and progress == "text":
        return "text"
    if isinstance(progress, str) and progress == "tqdm":
        if not tqdm_installed():
            raise SpecError(
                "`filter_multi_vmap(..., progress='tqdm')` needs `tqdm`, which is not "
                "installed. Install it (`pip install tqdm`), or pass `progress=True` "
                "to use `tqdm` when it is installed and plain text otherwise."
            )
        return "tqdm"
    raise SpecError(
        "`filter_multi_vmap(..., progress=...)` must be `False` (the default: no "
        "bar), `True` (a `tqdm` bar if `tqdm` is installed, else plain text on "
        f"stderr), `'tqdm'` or `'text'`, but got {progress!r} of type "
        f"`{type(progress).__name__}`."
    )


_logger = logging.getLogger("eqx_multimap")


class Progress:
    """Reports a planning run once it has taken `after` seconds: each step logged at
    INFO level on the `"eqx_multimap"` logger and, with `verbose`, on a `tqdm` bar."""

    def __init__(self, what: str, verbose: bool, after: float = 1.0):
        self.what, self.verbose, self.after = what, verbose, after
        self.start, self.n = time.perf_counter(), 0
        self.bar, self.reported = None, False

    def step(self, doing: str) -> None:
        self.n += 1
        elapsed = time.perf_counter() - self.start
        if elapsed < self.after:
            return
        self.reported = True
        what, n = self.what, self.n
        _logger.info("%s: %s (step %d, %.1f s so far)", what, doing, n, elapsed)
        if self.verbose and self.bar is None and tqdm_installed():
            from tqdm.auto import tqdm

            self.bar = tqdm(desc=self.what, initial=self.n - 1, leave=False)
        if self.bar is not None:
            self.bar.set_postfix_str(doing, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.reported:
            seconds = time.perf_counter() - self.start
            _logger.info("%s: planned in %.1f s (%d steps)", self.what, seconds, self.n)
