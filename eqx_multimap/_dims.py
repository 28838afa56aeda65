"""Parsing of dims strings such as `"T F B 2 2"` or `"T ... F"`.

A dims string describes the *whole* shape of one array, in the notation of jaxtyping:

- a name (`T`, `freq`, `n1`, `D'`) is a named dim; every array using a name must
  agree on its size. A name is a Python identifier not starting with `_`, optionally
  followed by primes (`D'`, `T''`), so that a second copy of a dim can be told apart;
- an integer (`2`) is a dim of exactly that size;
- `_` (or any name starting with `_`, such as `_pol`) is one axis of any size, never
  checked and never mapped;
- `...` is any number of axes (at most once per string);
- the empty string is a scalar.

Strings are parsed once, under `functools.lru_cache`, into a frozen [`Dims`][].
"""

import dataclasses
import functools as ft
import re
from typing import Any

from jax._src import traceback_util

from ._errors import SpecError


traceback_util.register_exclusion(__file__)


@dataclasses.dataclass(frozen=True)
class NamedDim:
    name: str

    def __str__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class FixedDim:
    size: int

    def __str__(self) -> str:
        return str(self.size)


@dataclasses.dataclass(frozen=True)
class AnonDim:
    label: str = "_"

    def __str__(self) -> str:
        return self.label


@dataclasses.dataclass(frozen=True)
class EllipsisDim:
    def __str__(self) -> str:
        return "..."


Token = NamedDim | FixedDim | AnonDim | EllipsisDim


@dataclasses.dataclass(frozen=True)
class Dims:
    """The parsed form of one dims string.

    `dtypes`, when not `None`, is the set of dtype names the array may have (filled
    in from jaxtyping annotations such as `Float[Array, "T F"]`); `dtype_desc` is the
    human-readable name of that set (`"Float"`).

    `scope`, when not `None`, is the path of the `eqx.Module` (or typed container)
    whose field these dims annotate (`"l1"`): its core dims are checked within that
    instance only, as jaxtyping checks a dataclass's fields; mapped dims are checked
    across the whole call.
    """

    tokens: tuple[Token, ...]
    source: str
    dtypes: frozenset[str] | None = None
    dtype_desc: str | None = None
    scope: str | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tokens if isinstance(t, NamedDim))

    @property
    def has_ellipsis(self) -> bool:
        return any(isinstance(t, EllipsisDim) for t in self.tokens)

    def __str__(self) -> str:
        return self.source

    def with_dtypes(self, dtypes: frozenset[str] | None, desc: str | None) -> "Dims":
        return dataclasses.replace(self, dtypes=dtypes, dtype_desc=desc)

    def scoped(self, scope: str | None) -> "Dims":
        return self if scope == self.scope else dataclasses.replace(self, scope=scope)

    def size_key(self, name: str, mapped: "set[str] | tuple[str, ...]") -> Any:
        """The key under which the size of dim `name` is bound: the name for a
        mapped dim or unscoped dims, else `(scope, name)`."""
        if self.scope is None or name in mapped:
            return name
        return (self.scope, name)


_INT = re.compile(r"^[0-9]+$")


def is_dim_name(name: object) -> bool:
    """Whether `name` is a dim name: a Python identifier not starting with `_`,
    followed by zero or more primes, such as `"T"`, `"n1"`, `"D'"` or `"T''"`."""
    if not isinstance(name, str):
        return False
    stem = name.rstrip("'")
    return stem.isidentifier() and not stem.startswith("_")


def _token_error(dims: str, token: str, why: str) -> SpecError:
    return SpecError(f"Invalid dims string {dims!r}: dim {token!r} {why}")


@ft.lru_cache(maxsize=4096)
def parse_dims(dims: str) -> Dims:
    """Parse a dims string into a [`Dims`][]. Raises `SpecError` on a malformed one."""
    if not isinstance(dims, str):
        raise SpecError(
            f"A dims string must be a `str`, such as 'T F B 2 2', but got {dims!r} of "
            f"type `{type(dims).__name__}`."
        )
    if "," in dims:
        fixed = " ".join(p for p in re.split(r"[\s,\[\]]+", dims) if p)
        raise SpecError(
            f"Invalid dims string {dims!r}: dims should be separated with spaces, not "
            f"commas, e.g. {fixed!r}. (For the bracketed DSA2000-Cal notation "
            "'[T,F,B]' use `eqx_multimap.multi_vmap`.)"
        )
    if "[" in dims or "]" in dims or "(" in dims or ")" in dims:
        raise SpecError(
            f"Invalid dims string {dims!r}: dims strings have no brackets; write the "
            "dims separated by spaces, e.g. 'T F B'."
        )
    tokens: list[Token] = []
    seen_ellipsis = False
    for raw in dims.split():
        if raw == "...":
            if seen_ellipsis:
                raise SpecError(
                    f"Invalid dims string {dims!r}: `...` may appear at most once, "
                    "since it stands for all the remaining axes."
                )
            seen_ellipsis = True
            tokens.append(EllipsisDim())
        elif _INT.match(raw):
            tokens.append(FixedDim(int(raw)))
        elif raw.startswith("*"):
            raise _token_error(
                dims,
                raw,
                "is variadic, which is not supported; use `...` for any number of "
                "axes, e.g. 'T ... F'.",
            )
        elif raw.startswith("#"):
            raise _token_error(
                dims,
                raw,
                "is broadcastable, which is not supported; name the dim (e.g. 'F') "
                "and pass arrays of the full size.",
            )
        elif raw.startswith("~"):
            raise _token_error(
                dims,
                raw,
                "uses the `~` of DSA2000-Cal's `multi_vmap`; in a dims string an "
                "unmapped axis is just a name that is not mapped, or `_`.",
            )
        elif "=" in raw or any(c in raw for c in "+-*/"):
            raise _token_error(
                dims,
                raw,
                "is a symbolic expression, which is not supported; use a name or an "
                "integer.",
            )
        elif raw.startswith("_") and raw.isidentifier():
            tokens.append(AnonDim(raw))
        elif is_dim_name(raw):
            tokens.append(NamedDim(raw))
        else:
            raise _token_error(
                dims,
                raw,
                "is not a name, an integer, `_` or `...`. Names are Python "
                "identifiers not starting with `_`, optionally followed by primes, "
                "e.g. 'T', 'freq', 'n1', \"D'\".",
            )
    return Dims(tuple(tokens), dims)


def axes_of(dims: Dims, ndim: int) -> tuple[int, ...] | str:
    """The axis of each token of `dims` in an array of rank `ndim`.

    The ellipsis token gets `-1`. Returns a reason string (not an exception) when the
    rank does not fit, so that the caller can raise one error with full context.
    """
    n_fixed = sum(not isinstance(t, EllipsisDim) for t in dims.tokens)
    if dims.has_ellipsis:
        if ndim < n_fixed:
            return f"has rank {ndim}, but dims {dims.source!r} need at least {n_fixed}"
    elif ndim != n_fixed:
        return f"has rank {ndim}, but dims {dims.source!r} need exactly {n_fixed}"
    n_ellipsis = ndim - n_fixed
    out = []
    axis = 0
    for t in dims.tokens:
        if isinstance(t, EllipsisDim):
            out.append(-1)
            axis += n_ellipsis
        else:
            out.append(axis)
            axis += 1
    return tuple(out)


def parse_names(value, argname: str) -> tuple[str, ...]:
    """Parse a strategy's dim names: `"T F"`, `("T", "F")` or `None`."""
    if value is None:
        return ()
    if isinstance(value, str):
        if "," in value:
            raise SpecError(
                f"`filter_multi_vmap(..., {argname}=...)` got {value!r}: separate dim "
                "names with spaces, not commas, e.g. 'T F'."
            )
        names = tuple(value.split())
    else:
        try:
            names = tuple(value)
        except TypeError:
            raise SpecError(
                f"`filter_multi_vmap(..., {argname}=...)` must be a dims string such "
                f"as 'T F', or a sequence of dim names, but got {value!r}."
            ) from None
    for name in names:
        if not is_dim_name(name):
            raise SpecError(
                f"`filter_multi_vmap(..., {argname}=...)` got {name!r}, which is not a "
                "dim name. Dim names are Python identifiers not starting with `_`, "
                "optionally followed by primes, e.g. 'T', \"D'\"."
            )
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise SpecError(
            f"`filter_multi_vmap(..., {argname}=...)` names dim {dup!r} twice."
        )
    return names
