"""`Planner`: its plan caches (memory, disk) and their keys, time model and counters."""

import collections as co
import contextlib
import dataclasses
import functools as ft
import hashlib
import importlib.metadata
import logging
import os
import re
import threading
import time
from typing import Any, Literal

import jax
import jaxlib

from .._blocks import known
from .._body import struct
from .._errors import SpecError
from .._jaxpr import calls_back, data_dependent
from .._progress_bar import Progress
from .._resolve import Call
from .._text import plural
from .cache import cand_json, default_cache_dir, DiskCache, plan_from_json, plan_json
from .measure import calibrate, measured
from .model import machine, TimeModel
from .plan import Plan, split_leaves
from .search import (
    collective_dims,
    localize,
    MAX_COMPILES,
    MemoryBudget,
    NoFit,
    Request,
    resolve_budget,
    Search,
    SEARCH_VERSION,
)


logger = logging.getLogger("eqx_multimap")
SYMBOLIC_STAND_IN = 2  # the size a symbolic dim is planned at (scanned: any will do)
CAP = 8.0  # measured mode stops timing at this many times the fastest's compile

PlanMode = Literal["auto"]  # the planners `filter_multi_vmap(plan=...)` takes by name


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """A wrapper's planning options (values, never plans; not a pytree): `given`, its
    own `Planner`, or `None` for the default planner of the process running the call."""

    given: "Planner | None"
    memory_budget: MemoryBudget

    @property
    def planner(self) -> "Planner":
        return default_planner() if self.given is None else self.given

    @property
    def mode(self) -> str:
        """`plan=` as the wrapper's repr shows it."""
        return "'auto'" if self.given is None else repr(self.given)


def plan_options(plan: Any, memory_budget: Any) -> "PlanOptions | None":
    """Validate `plan=` and `memory_budget=` (which needs `plan=`) when decorating."""
    if plan is not None and plan != "auto" and not isinstance(plan, Planner):
        raise SpecError(
            f"`filter_multi_vmap(..., plan=...)` must be 'auto', an "
            f"`eqx_multimap.Planner`, or `None`, but got {plan!r}."
        )
    b = memory_budget
    if b is not None and plan is None:
        raise SpecError(
            f"`filter_multi_vmap(..., memory_budget={b!r})` is only used by the "
            "planner: pass `plan='auto'` too, or drop `memory_budget`."
        )
    is_bytes = isinstance(b, int) and not isinstance(b, bool) and b >= 1
    if not (b is None or is_bytes or isinstance(b, float) and 0.0 < b <= 1.0):
        raise SpecError(
            "`filter_multi_vmap(..., memory_budget=...)` must be a positive `int` "
            "(bytes) or a `float` in (0, 1] (a fraction of device memory), but got "
            f"{b!r} of type `{type(b).__name__}`; e.g. `memory_budget=2**30` is 1 GiB."
        )
    given = None if isinstance(plan, str) else plan
    return None if plan is None else PlanOptions(given, memory_budget)


class Planner:
    """Plans nests for `plan="auto"` and caches the plans, in memory and on disk.

    `plan="auto"` uses the default planner of the process running the call;
    `plan=Planner(...)` gives a wrapper its own (with its own in-memory cache).

    **Arguments:**

    - `measure`: `"short"` (the default): the time model ranks the candidates that fit
        the budget and, where it searched, times a short list with its pick on made-up
        inputs (as large as the call's, outside `memory_budget`), unless the body's cost
        depends on its data or it calls back into Python. `False`: the model alone (a
        plan `tune` made is still used). `True`: every candidate it may is timed, within
        the cap ([Measured mode](../planner.md#measured-mode)).
    - `cache_dir`: where plans and calibrations are kept, to be paid for once per
        machine. `None` (the default): `$EQX_MULTIMAP_CACHE_DIR` (`off`: none), else
        `$XDG_CACHE_HOME/eqx_multimap` or `~/.cache/eqx_multimap`. `False`: none.
    - `time_model`: the [`eqx_multimap.TimeModel`][] ranking candidates. `None` (the
        default): calibrated on first use (about a second, kept on disk).
    - `max_cache`: the most plans kept in memory.
    - `cap`: measured mode's (`True`, `tune`): timing stops at this many times the
        fastest candidate's compile (after a few candidates). Larger: a longer search.

    Under `jax.distributed`, every process plans by the model alone (the `time_model`
    given, else the default constants), so that all run one program; `tune` is an error.
    Planners with the same arguments are equal; a copy is the planner itself, a pickled
    one carries only its arguments; it is thread-safe. Its counters `n_plans`,
    `n_compiles` (while planning), `n_disk_hits` and `n_calibrations` are read by tests
    and benchmarks."""

    def __init__(
        self,
        *,
        measure: bool | Literal["short"] = "short",
        cache_dir: Any = None,  # a path, `False` or `None`; checked below
        time_model: TimeModel | None = None,
        max_cache: int = 256,
        cap: float = CAP,
    ):
        what = "`eqx_multimap.Planner("
        if not (isinstance(measure, bool) or measure == "short"):
            got = f"`True`, `False` or 'short', but got {measure!r}"
            raise SpecError(f"{what}measure=...)` must be {got}.")
        path = isinstance(cache_dir, (str, os.PathLike))
        if not (cache_dir is None or cache_dir is False or path):
            raise SpecError(
                f"{what}cache_dir=...)` must be a path, `None` (the default location) "
                f"or `False` (no disk cache), but got {cache_dir!r}."
            )
        if time_model is not None and not isinstance(time_model, TimeModel):
            raise SpecError(
                f"{what}time_model=...)` must be an `eqx_multimap.TimeModel` or "
                f"`None`, but got {time_model!r}."
            )
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
            raise SpecError(f"{what}cap=...)` must be a number > 0, but got {cap!r}.")
        where = os.fspath(cache_dir) if path else cache_dir
        self._config: dict[str, Any] = dict(measure=measure, cache_dir=where)
        self._config.update(time_model=time_model, max_cache=max_cache, cap=float(cap))
        # Keyed by its terms if calibrated, so that calibrating again keeps disk plans.
        terms = {"calibrated": sorted(f.name for f in dataclasses.fields(TimeModel))}
        self._model_key = terms if time_model is None else time_model.to_json()
        self._lock = threading.RLock()  # the caches and counters
        self._calibrating = threading.Lock()
        self._time_model = time_model
        self._cache: co.OrderedDict[Any, Plan | str] = co.OrderedDict()
        self._signatures: co.OrderedDict[Any, None] = co.OrderedDict()
        self.n_plans = self.n_compiles = self.n_disk_hits = self.n_calibrations = 0

    @property
    def measure(self) -> bool | Literal["short"]:
        return self._config["measure"]

    def __repr__(self) -> str:
        given = {"measure": self.measure, "cap": self._config["cap"]}
        args = [f"{k}={v!r}" for k, v in given.items() if v not in ("short", CAP)]
        return f"Planner({', '.join(args)})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Planner):
            return NotImplemented
        return self._config == other._config

    def __hash__(self) -> int:
        return hash(tuple(self._config.values()))

    def __deepcopy__(self, memo: dict | None = None) -> "Planner":
        return self

    __copy__ = __deepcopy__

    def __reduce__(self) -> tuple:  # a planner with the same arguments, caches empty
        return (ft.partial(Planner, **self._config), ())

    @property
    def cache_dir(self) -> str | None:
        """The disk cache's directory, or `None` if there is no disk cache."""
        return None if self._disk is None else self._disk.root

    @ft.cached_property
    def _disk(self) -> DiskCache | None:
        where = self._config["cache_dir"]
        where = default_cache_dir() if where is None else where
        return None if where in (None, False) else DiskCache(where)

    @property
    def time_model(self) -> TimeModel:
        """The time model given, else this machine's calibration (on disk, or made)."""
        if self._time_model is None:
            with self._calibrating:  # one thread calibrates; the others wait
                if self._time_model is None:
                    self._time_model = self._calibrated()
        return self._time_model

    def _calibrated(self) -> TimeModel:
        disk = self._disk
        key = {"machine": machine(), "versions": versions(), "calibration": 5}
        # One process calibrates; the others wait, then read its calibration.
        with disk.lock("calibration") if disk else contextlib.nullcontext():
            model = disk.read("calibration", key, TimeModel.from_json) if disk else None
            if model is not None:
                return model
            logger.info("eqx_multimap: calibrating the planner's time model")
            try:  # on one device, whatever mesh the call is traced under
                with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
                    model = calibrate()
            except Exception as e:  # a backend that cannot run the micro-benchmark
                why = f"({type(e).__name__}: {e}); using the default constants"
                logger.warning("eqx_multimap: could not calibrate the planner %s", why)
                return TimeModel.for_backend(jax.default_backend())
            with self._lock:
                self.n_calibrations += 1
            if disk is not None:
                disk.write("calibration", key, model.to_json())
            return model

    def first_time(self, signature: Any) -> bool:
        """Whether it is `signature`'s first un-jitted call (timed if measuring)."""
        with self._lock:
            first = signature not in self._signatures
            self._keep(self._signatures, signature, None)
            return first

    def clear(self) -> None:
        """Forget every plan cached in memory (the disk cache is kept)."""
        with self._lock:
            self._cache.clear()
            self._signatures.clear()

    def plan(
        self, call: Call, backward: bool = False, tune: bool = False, again=False
    ) -> Plan:
        """The (cached) plan of a resolved call; with `backward`, of its derivative's
        nest. With `tune`, candidates are timed on the call's concrete values unless a
        plan so timed is cached; with `again` too, always, replacing the cached one."""
        budget, src = resolve_budget(call.options.plan.memory_budget)
        sizes, shard = localize(call)
        # Nothing in a key refers back to the planner; `progress=` plans alike.
        opt = dataclasses.replace(call.options, plan=None, verbose=False, progress=None)
        key = (opt, budget, shard, tuple(sizes.items()), backward)
        call, sizes, note = for_every_size(call, sizes)
        body = fingerprint(call)
        key += (body, collective_dims(call), tuple(call.split))
        start = time.perf_counter()
        jaxpr = call.body.standalone.jaxpr.jaxpr
        data = data_dependent(jaxpr)
        # Under `jax.distributed`, by the model alone: timings differ between processes.
        several = jax.process_count() > 1
        if again and several:  # `eqx_multimap.tune`; an un-jitted call's, the model's
            raise SpecError(
                f"`{call.fun_name}`: `eqx_multimap.tune` under `jax.distributed` "
                f"({jax.process_count()} processes): each process would time its own "
                "candidates, and may choose another nest than the others, which "
                "must run the same program. Tune in one process, then fix the nest "
                "in your code (`scan=plan.scan, vmap=plan.vmap`)."
            )
        tune = tune and not several
        measure = tune or (self.measure is True and not data and not several)
        short = self.measure == "short" and not measure and not data
        short = short and not calls_back(jaxpr) and not several
        # The `Plan.basis`es that will do (none, to tune again).
        wanted = [] if again or several else ["arguments"] + ["inputs"] * (not tune)
        wanted += ["short"] * short + ["model"] * (not measure)
        with self._lock:
            old = self._cache.get(key)  # replaced, with `again`
            cached = None if again else old
            if isinstance(cached, Plan) and cached.basis in wanted:
                self._cache.move_to_end(key)
                return cached
        if isinstance(cached, str):  # no nest fit this signature
            raise SpecError(cached)
        if several and self._config["time_model"] is None:
            model = TimeModel.for_backend(jax.default_backend())
            model_key = model.to_json()
        else:
            model, model_key = self.time_model, self._model_key
        cap = self._config["cap"]
        request = Request(
            call, sizes, shard, budget, src, backward, model, cap, measure, tune, short
        )
        disk, found = self._disk, None
        disk_key = None if disk is None else plan_key(request, body, model_key)
        if disk is not None and not again:
            path = disk.path("plans", disk_key)
            read = lambda stored: plan_from_json(stored, request, path)
            found = disk.read("plans", disk_key, read)
        if found is not None:
            with self._lock:
                self.n_disk_hits += 1
        if isinstance(found, str):  # no nest fits, as found before
            self._store(key, found)
            raise SpecError(found)
        if found is not None and short and found.basis == "model" and found.searched:
            found = None  # a model-only planner's, where a short list is wanted
        if found is not None and found.basis in wanted:
            plan = dataclasses.replace(found, seconds=time.perf_counter() - start)
            earlier = f"read by an earlier call from the disk cache, {found.cache_path}"
            self._store(key, plan, earlier)
        else:
            plan = self._plan_now(request, key, disk_key, note, data)
        if isinstance(old, Plan) and again and old.spec != plan.spec:
            # JAX keeps traces (with the old nest) by function: it can only forget all.
            jax.clear_caches()
        if call.options.verbose:
            print(plan)
        return plan

    def _plan_now(
        self, request: Request, key: Any, disk_key: Any, note: str, data: Any
    ) -> Plan:
        """Search for the plan (its summary opening with `note`; `data`: why the body's
        cost depends on its data, if it does) and cache it, or the no-fit error."""
        call, disk = request.call, self._disk
        what = f"{call.fun_name}: planning" + " (backward)" * request.backward
        progress = Progress(what, call.options.verbose)
        search = Search(request, progress)
        try:
            # One device's nest: not on a traced `shard_map`'s mesh (its axes `Manual`).
            with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
                timed = request.measure or request.short
                plan = search.run(measured if timed else None)
        except NoFit as e:
            if disk is not None:
                no_fit = {"smallest": cand_json(e.smallest), "n": e.n}
                disk.write("plans", disk_key, {"no_fit": no_fit})
            self._store(key, str(e))
            raise SpecError(str(e)) from None
        finally:
            with self._lock:
                self.n_plans += 1
                self.n_compiles += search.compiler.n_compiled
            progress.close()
        summary = note + plan.summary
        if self.measure is True and not request.measure:  # its cost depends on data
            summary += f" The body's cost depends on its data ({data}): planned by the "
            summary += "model; call `eqx_multimap.tune(f, *args)` with real arguments "
            summary += "to measure."
        plan = dataclasses.replace(plan, summary=summary)
        how = f"{plan.seconds:.2f} s, {plural(plan.n_compiled, 'compile')}"
        path, where = None, "no disk cache, kept in this process only"
        if disk is not None:
            path = disk.write("plans", disk_key, plan_json(plan, f"planned in {how}"))
            failed = f"could not write it to {disk.path('plans', disk_key)}"
            where = f"written to {path}" if path else failed
        cache = f"planned now ({how}); {where}"
        plan = dataclasses.replace(plan, cache=cache, cache_path=path)
        self._store(key, plan, f"planned by an earlier call ({how}); {where}")
        return plan

    def _store(self, key: Any, value: "Plan | str", earlier: str = "") -> None:
        """Keep a plan (or no-fit message) in memory; `earlier`: where it came from."""
        if isinstance(value, Plan):
            cache = f"from this process's cache: {earlier}"
            value = dataclasses.replace(value, cache=cache)
        with self._lock:
            self._keep(self._cache, key, value)

    def _keep(self, cache: co.OrderedDict, key: Any, value: Any) -> None:
        cache[key] = value
        if len(cache) > self._config["max_cache"]:
            cache.popitem(last=False)


def fingerprint(call: Call) -> str:
    """What determines a call's plan besides its options (the body's jaxpr, its
    leaves' shapes and mapped axes), stable from process to process."""
    axes = zip(call.values, call.leaf_axes)
    leaves = [(str(struct(v)), sorted(a.items())) for v, a in axes]
    text = str(call.body.jaxpr.jaxpr) + repr(leaves)
    text += repr([str(d) for d in call.out.dims])
    shares = split_leaves(call)[0]  # an input split over mesh axes: one piece here
    text += repr(shares) if max(shares, default=1) > 1 else ""
    text = re.sub(r" at 0x[0-9a-fA-F]+", "", text)
    return hashlib.sha256(text.encode()).hexdigest()


def versions() -> dict[str, str]:
    ours = importlib.metadata.version("eqx_multimap")  # as `eqx_multimap.__version__`
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "eqx_multimap": ours}


def plan_key(request: Request, fingerprint: str, model_key: Any) -> dict[str, Any]:
    """Everything that determines a plan, as JSON (`model_key`: the time model's;
    a measured plan and a planned one share it: the planner chooses by `Plan.basis`)."""
    call = request.call
    return {
        "body": fingerprint,
        "sizes": [[n, s] for n, s in request.sizes.items()],
        "scan": [[n, c] for n, c in call.options.scan],
        "vmap": list(call.options.vmap),
        "shard": [dataclasses.astuple(d) for d in request.shard],
        "collective": list(collective_dims(call)),
        "split": sorted(call.split),
        "checkpoint": call.options.checkpoint,
        "budget": request.budget,
        "backward": request.backward,
        "search": [SEARCH_VERSION, MAX_COMPILES],  # any cap's plan (`Planner(cap=)`)
        "time_model": model_key,
        "machine": machine(),
        "versions": versions(),
    }


def for_every_size(call: Call, sizes: dict) -> tuple[Call, dict[str, int], str]:
    """A call with symbolic sizes (`jax.export`) as planned, and a note for the
    summary: a plan must hold for every size, so each such dim is scanned outermost,
    at a stand-in size; where the nest cannot do so, a `SpecError` names the dim."""
    symbolic = [n for n, s in call.sizes.items() if not known(s)]
    if not symbolic:
        return call, sizes, ""
    options = call.options
    for name in symbolic:
        if name not in call.mapped:
            why = "a core dim: the planner compiles the body, which needs its size"
        elif name in options.shard_names:
            why = "it is sharded: the planner needs its size per device"
        elif name in options.vmap:
            why = "`vmap=` names it: the memory of a vmap grows with its size"
        elif name in collective_dims(call):
            why = "the body uses it in a collective, so it cannot be scanned"
        elif name in call.split:
            why = "an input splits it over devices, so it cannot be scanned"
        else:
            continue
        raise SpecError(
            f"`{call.fun_name}`: `plan=...` cannot plan dim '{name}' of symbolic "
            f"size {call.sizes[name]} (as `jax.export` gives it): {why}. A plan must "
            f"hold for every size of '{name}'. Give '{name}' a concrete size, or drop "
            "`plan=` and choose its strategies."
        )
    unscanned = [(n, None) for n in symbolic if n not in options.scan_names]
    scan = options.scan + tuple(unscanned)
    call = dataclasses.replace(call, options=dataclasses.replace(options, scan=scan))
    stand_in = {**sizes, **{n: dict(scan)[n] or SYMBOLIC_STAND_IN for n in symbolic}}
    dims = ", ".join(
        f"'{n}' (size {call.sizes[n]}, planned at {stand_in[n]})" for n in symbolic
    )
    note = f"Symbolic sizes: {dims} scanned outermost (one element at a time, or by "
    note += "the chunks `scan=` gives), which holds for every size. "
    return call, stand_in, note


_DEFAULT_PLANNER = Planner()


def default_planner() -> Planner:
    """The planner of `plan="auto"` in this process, created with the module."""
    return _DEFAULT_PLANNER
