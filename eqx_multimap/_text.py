"""How quantities read in plans and messages: bytes and seconds."""


def fmt_bytes(n: int | float) -> str:
    """`512 B`, `1.5 KiB`, `2.0 GiB`."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def fmt_seconds(s: float) -> str:
    """`3.1 ms`, `250 us`, `1.20 s`."""
    if s >= 1.0:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"
