"""The planner's memory budget: `memory_budget=` checked, and resolved to bytes."""

import os
from typing import Any

import jax

from ._errors import SpecError
from ._timing import fmt_bytes


MemoryBudget = int | float | None
"""Bytes as an `int`, a fraction of device memory as a `float` in `(0, 1]`."""

DEFAULT_BUDGET_FRACTION = 0.5
"""The budget when `plan="auto"` is given without `memory_budget`."""


def check_budget(plan: Any, memory_budget: Any) -> None:
    """Check `memory_budget=` at decoration time: it needs `plan=`, and bytes or a
    fraction."""
    if plan is None:
        raise SpecError(
            f"`filter_multi_vmap(..., memory_budget={memory_budget!r})` is only used "
            "by the planner: pass `plan='auto'` too, or drop `memory_budget`."
        )
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float)):
        raise SpecError(
            "`filter_multi_vmap(..., memory_budget=...)` must be an `int` (bytes) or "
            "a `float` in (0, 1] (a fraction of device memory), but got "
            f"{memory_budget!r} of type `{type(memory_budget).__name__}`."
        )
    if isinstance(memory_budget, int):
        if memory_budget < 1:
            raise SpecError(
                f"`filter_multi_vmap(..., memory_budget={memory_budget!r})`: a budget "
                "in bytes must be a positive `int`."
            )
    elif not (0.0 < memory_budget <= 1.0):
        raise SpecError(
            f"`filter_multi_vmap(..., memory_budget={memory_budget!r})`: a `float` "
            "budget is a fraction of device memory and must be in (0, 1]; give "
            "bytes as an `int`, e.g. `memory_budget=2**30`."
        )


def _device_memory() -> tuple[int, str]:
    device = jax.local_devices()[0]
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # some backends do not implement it
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"memory of {device}"
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 0
    if ram <= 0:
        raise SpecError(
            f"`filter_multi_vmap(..., plan='auto')`: a fractional `memory_budget` "
            f"needs the memory size of {device}, which is unavailable, and so is the "
            "size of physical RAM; give the budget in bytes as an `int`."
        )
    return int(ram), (
        f"physical RAM (os.sysconf), as {device.platform} reports no device memory"
    )


def resolve_budget(memory_budget: MemoryBudget) -> tuple[int, str]:
    """The budget in bytes, and a description of where it came from."""
    if isinstance(memory_budget, int):
        return memory_budget, f"memory_budget={memory_budget}"
    fraction = DEFAULT_BUDGET_FRACTION if memory_budget is None else memory_budget
    total, where = _device_memory()
    given = "default " if memory_budget is None else ""
    return int(total * fraction), (
        f"{given}memory_budget={fraction:g} of {fmt_bytes(total)} {where}"
    )



def over_budget(temp: int, budget: int) -> str:
    """`1.2 GiB > 512.0 MiB`, in bytes when the two would print alike."""
    a, b = fmt_bytes(temp), fmt_bytes(budget)
    if a == b:
        a, b = f"{temp:,} B", f"{budget:,} B"
    return f"{a} > {b}"
