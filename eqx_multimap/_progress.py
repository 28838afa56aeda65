"""Progress of a long planning run: logged, and optionally shown on a progress bar."""

import logging
import time
from typing import Any


logger = logging.getLogger("eqx_multimap")

# Planning that has taken longer than this reports its progress.
PROGRESS_AFTER = 1.0


class Progress:
    """Reports what a long planning run is doing.

    Once planning has taken `after` seconds, every step is logged at INFO level on
    the `"eqx_multimap"` logger and, with `verbose`, shown on a `tqdm` progress bar
    (if `tqdm` is installed; it is optional)."""

    def __init__(self, what: str, verbose: bool, after: float = PROGRESS_AFTER):
        self.what = what
        self.verbose = verbose
        self.after = after
        self.start = time.perf_counter()
        self.n = 0
        self.bar: Any = None
        self.reported = False

    def step(self, doing: str) -> None:
        self.n += 1
        elapsed = time.perf_counter() - self.start
        if elapsed < self.after:
            return
        self.reported = True
        logger.info(
            "%s: %s (step %d, %.1f s so far)", self.what, doing, self.n, elapsed
        )
        if self.verbose and self.bar is None:
            try:
                from tqdm.auto import tqdm
            except ImportError:  # optional: the `bench` extra installs it
                self.verbose = False
            else:
                self.bar = tqdm(desc=self.what, initial=self.n - 1, leave=False)
        if self.bar is not None:
            self.bar.set_postfix_str(doing, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.reported:
            logger.info(
                "%s: planned in %.1f s (%d steps)",
                self.what,
                time.perf_counter() - self.start,
                self.n,
            )

