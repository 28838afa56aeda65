"""The automatic planner behind `filter_multi_vmap(..., plan="auto")`: `Planner`.

A plan picks, for the mapped dims of one call signature that no strategy names,
which to scan, in which order and with which chunk sizes; the rest are vmapped
(`_search` says how). A [`Planner`][] owns the plan cache (in memory, and on disk:
`_plan_cache`), the time model (calibrated on first use: `_time_model`) and its
statistics; `plan="auto"` uses one shared by the process, and `plan=Planner(...)`
gives a wrapper its own. `describe_fixed` describes a nest that is not planned.
"""

import collections as co
import dataclasses
import logging
import os
import time
from typing import Any, Literal

import jax
from jax._src import traceback_util

from ._budget import check_budget, MemoryBudget, resolve_budget
from ._candidates import candidate, collective_dims, localize
from ._costing import Compiler
from ._errors import SpecError
from ._plan import Plan
from ._plan_cache import (
    cand_json,
    default_cache_dir,
    DiskCache,
    fingerprint,
    plan_from_json,
    plan_json,
    plan_key,
    versions,
)
from ._progress import Progress
from ._reasons import NoFit
from ._resolve import Call
from ._request import plan_for, Request
from ._search import Search
from ._time_model import calibrate, machine, TimeModel


traceback_util.register_exclusion(__file__)

logger = logging.getLogger("eqx_multimap")


PlanMode = Literal["auto"]
"""The planners `filter_multi_vmap(..., plan=...)` accepts by name."""

MAX_CACHE = 256
"""The most plans a `Planner` keeps in memory, by default."""


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """A wrapper's planning options: its planner and memory budget. Not a pytree."""

    planner: "Planner"
    memory_budget: MemoryBudget
    verbose: bool = False

    def __repr__(self) -> str:
        budget = "" if self.memory_budget is None else f", {self.memory_budget!r}"
        return f"{self.planner!r}{budget}"


def plan_options(plan: Any, memory_budget: Any, verbose: bool) -> "PlanOptions | None":
    """Validate `plan=` and `memory_budget=` at decoration time."""
    if plan is not None and plan != "auto" and not isinstance(plan, Planner):
        raise SpecError(
            f"`filter_multi_vmap(..., plan=...)` must be 'auto', an "
            f"`eqx_multimap.Planner`, or `None`, but got {plan!r}."
        )
    if memory_budget is not None:
        check_budget(plan, memory_budget)
    if plan is None:
        return None
    planner = DEFAULT_PLANNER if plan == "auto" else plan
    return PlanOptions(planner, memory_budget, bool(verbose))


class Planner:
    """Plans nests for `plan="auto"`, and caches the plans, in memory and on disk.

    `plan="auto"` uses one `Planner` shared by the process; pass `plan=Planner(...)`
    to give a wrapper a planner (and an in-memory cache) of its own.

    **Arguments:**

    - `measure`: `False` (the default) ranks the candidates that fit the budget by
        the time model's estimate; `True` also compiles the model's best few and
        runs them on fresh inputs of the call's shapes and dtypes, side by side,
        and takes the fastest (keeping the model's choice when it measured
        within 1.10x of the fastest). Slower to plan (seconds), but right where
        the model cannot see the difference.
    - `cache_dir`: where plans and calibrations are kept on disk, so that a plan
        (a measured one in particular) is paid for once per machine. `None` (the
        default): the environment variable `EQX_MULTIMAP_CACHE_DIR` (`off`
        disables the disk cache), else `$XDG_CACHE_HOME/eqx_multimap`, else
        `~/.cache/eqx_multimap`. `False`: no disk cache.
    - `time_model`: the [`eqx_multimap.TimeModel`][] that ranks candidates.
        `None` (the default): calibrated on first use for the backend and device
        kind (a micro-benchmark of about a second, kept in the disk cache).
    - `max_cache`: the most plans kept in memory.

    The counters `n_plans` (planning runs), `n_compiles` (programs compiled while
    planning), `n_disk_hits` (plans read from disk) and `n_calibrations` are read by
    tests and benchmarks.
    """

    def __init__(
        self,
        *,
        measure: bool = False,
        cache_dir: Any = None,  # a path, `False` or `None`; checked below
        time_model: TimeModel | None = None,
        max_cache: int = MAX_CACHE,
    ):
        if not isinstance(measure, bool):
            raise SpecError(
                f"`eqx_multimap.Planner(measure=...)` must be `True` or `False`, but "
                f"got {measure!r}."
            )
        if not (
            cache_dir is None
            or cache_dir is False
            or isinstance(cache_dir, (str, os.PathLike))
        ):
            raise SpecError(
                "`eqx_multimap.Planner(cache_dir=...)` must be a path, `None` (the "
                "default location) or `False` (no disk cache), but got "
                f"{cache_dir!r}."
            )
        if time_model is not None and not isinstance(time_model, TimeModel):
            raise SpecError(
                "`eqx_multimap.Planner(time_model=...)` must be an "
                f"`eqx_multimap.TimeModel` or `None`, but got {time_model!r}."
            )
        self.measure = measure
        self.max_cache = max_cache
        self._cache_dir = cache_dir
        self._disk: DiskCache | None = None
        self._disk_resolved = False
        self._time_model = time_model
        self._cache: co.OrderedDict[Any, Plan | str] = co.OrderedDict()
        self.n_plans = 0
        self.n_compiles = 0
        self.n_disk_hits = 0
        self.n_calibrations = 0

    def __repr__(self) -> str:
        if self is DEFAULT_PLANNER:
            return "'auto'"
        return "Planner(measure=True)" if self.measure else "Planner()"

    @property
    def cache_dir(self) -> str | None:
        """The disk cache's directory, or `None` if there is no disk cache."""
        disk = self._disk_cache()
        return None if disk is None else disk.root

    def _disk_cache(self) -> DiskCache | None:
        if not self._disk_resolved:
            where = self._cache_dir
            if where is None:
                where = default_cache_dir()
            self._disk = None if where in (None, False) else DiskCache(os.fspath(where))
            self._disk_resolved = True
        return self._disk

    @property
    def time_model(self) -> TimeModel:
        """The time model: the one given, else calibrated for this machine (read
        from the disk cache, or measured and stored there)."""
        if self._time_model is None:
            self._time_model = self._calibrated()
        return self._time_model

    def _calibrated(self) -> TimeModel:
        disk = self._disk_cache()
        key = {"machine": machine(), "versions": versions(), "calibration": 1}
        if disk is not None:
            stored = disk.read("calibration", key)
            if stored is not None:
                try:
                    return TimeModel.from_json(stored)
                except ValueError as e:
                    disk.invalid(disk.path("calibration", key), str(e))
        logger.info("eqx_multimap: calibrating the planner's time model")
        try:
            model = calibrate()
        except Exception as e:  # a backend that cannot run the micro-benchmark
            logger.warning(
                "eqx_multimap: could not calibrate the planner's time model (%s: "
                "%s); using the default constants",
                type(e).__name__,
                e,
            )
            return TimeModel.for_backend(jax.default_backend())
        self.n_calibrations += 1
        if disk is not None:
            disk.write("calibration", key, model.to_json())
        return model

    def clear(self) -> None:
        """Forget every plan cached in memory (the disk cache is kept)."""
        self._cache.clear()

    def plan(self, call: Call, backward: bool = False) -> Plan:
        """The (cached) automatic plan for a resolved call.

        With `backward`, the plan of the nest that differentiation runs: the memory
        budget is then that of its reverse-mode derivative.

        With `shard=`, the plan is for the local nest inside `shard_map`: the sharded
        dims keep their strategy (scanned if in `scan`, else vmapped) at their local
        sizes; the other mapped dims are planned, under the budget per device.
        """
        options = call.options.plan
        budget, source = resolve_budget(options.memory_budget)
        sizes, shard = localize(call)
        collective = collective_dims(call)
        body = fingerprint(call)
        key = (
            call.options,
            budget,
            shard,
            tuple(sizes.items()),
            body,
            backward,
            collective,
        )
        if key in self._cache:
            self._cache.move_to_end(key)
            cached = self._cache[key]
            if isinstance(cached, str):  # no nest fit this signature
                raise SpecError(cached)
            return cached
        start = time.perf_counter()
        request = Request(
            call, sizes, shard, budget, source, backward, self.time_model, self.measure
        )
        disk = self._disk_cache()
        disk_key = None
        if disk is not None:
            disk_key = plan_key(request, collective, body)
            found = self._read(disk, disk_key, request)
            if isinstance(found, str):  # no nest fits, as found before
                self._store(key, found)
                raise SpecError(found)
            if found is not None:
                found = dataclasses.replace(
                    found, seconds=time.perf_counter() - start
                )
                self._store(key, found)
                if options.verbose:
                    print(found)
                return found
        plan = self._plan_now(request, disk, disk_key, key)
        if options.verbose:
            print(plan)
        return plan

    def _read(
        self, disk: DiskCache, disk_key: dict[str, Any], request: Request
    ) -> "Plan | str | None":
        """The plan (or no-fit message) stored on disk for this call, if valid."""
        stored = disk.read("plans", disk_key)
        if stored is None:
            return None
        path = disk.path("plans", disk_key)
        try:
            found = plan_from_json(stored, request)
        except (ValueError, KeyError, TypeError, IndexError) as e:
            disk.invalid(path, f"its plan is not valid here ({e})")
            return None
        self.n_disk_hits += 1
        if isinstance(found, str):
            return found
        return dataclasses.replace(
            found,
            cache=f"hit: read from {path} ({found.cache}); nothing compiled now",
        )

    def _plan_now(
        self,
        request: Request,
        disk: DiskCache | None,
        disk_key: dict[str, Any] | None,
        key: Any,
    ) -> Plan:
        """Search for the plan, and keep it (or the no-fit error) in the caches."""
        call = request.call
        what = f"{call.fun_name}: planning"
        what += " (backward)" if request.backward else ""
        progress = Progress(what, call.options.plan.verbose)
        search = Search(request, progress)
        self.n_plans += 1
        try:
            plan = search.run()
        except NoFit as e:
            message = str(e)
            if disk is not None and disk_key is not None:
                smallest = cand_json(e.smallest)
                value = {"no_fit": {"smallest": smallest, "n": e.n}}
                disk.write("plans", disk_key, value)
            self._store(key, message)
            raise SpecError(message) from None
        finally:
            self.n_compiles += search.compiler.n_compiled
            progress.close()
        n = plan.n_compiled
        how = f"planned in {plan.seconds:.2f} s with {n} compile{'' if n == 1 else 's'}"
        if disk is None or disk_key is None:
            cache = f"off: {how}, kept in memory only"
        else:
            written = disk.write("plans", disk_key, plan_json(plan, how))
            path = disk.path("plans", disk_key)
            cache = (
                f"miss: {how}, written to {written}"
                if written is not None
                else f"miss: {how}; could not write it to {path}"
            )
        plan = dataclasses.replace(plan, cache=cache)
        self._store(key, plan)
        return plan

    def _store(self, key: Any, value: "Plan | str") -> None:
        self._cache[key] = value
        if len(self._cache) > self.max_cache:
            self._cache.popitem(last=False)


DEFAULT_PLANNER = Planner()
"""The planner of `plan="auto"`."""


#
# A fixed nest, described.
#


def describe_fixed(call: Call) -> Plan:
    """A `Plan` for a fixed nest: its one candidate compiled, with no budget."""
    start = time.perf_counter()
    sizes, shard = localize(call)
    model = TimeModel.for_backend(jax.default_backend())
    compiler = Compiler(call, sizes, model, backward=False)
    given = call.given_nest()
    cand = candidate(given.scan, given.vmap, sizes, "given")
    if all(sizes[n] > 0 for n in call.mapped):
        cand = compiler.evaluate(cand, None)
    cand = dataclasses.replace(cand, reason="the nest the strategies give")
    return plan_for(
        call,
        sizes,
        cand,
        (cand,),
        auto=False,
        budget_bytes=None,
        budget_source="",
        n_compiled=compiler.n_compiled,
        seconds=time.perf_counter() - start,
        shard=shard,
        summary=(
            f"Fixed nest {cand.nest(sizes)}: the strategies given (`scan=`, `vmap=`, "
            "`shard=`), not planned."
        ),
    )
