"""Parsing of dims strings such as `"T F B 2 2"` or `"T ... F"`.

A dims string describes the *whole* shape of one array, in the notation of jaxtyping:

- a name (`T`, `freq`, `n1`, `D'`) is a named dim; every array using a name must
  agree on its size. A name is a Python identifier not starting with `_`, optionally
  followed by primes (`D'`, `T''`), so that a second copy of a dim can be told apart;
- an integer (`2`) is a dim of exactly that size; `rows=2` is the same as `2`;
- `_` (or any name starting with `_`, such as `_pol`) is one axis of any size, never
  checked and never mapped;
- `...` (or `*_`) is any number of axes;
- `*batch` is any number of axes whose shape every array using `batch` shares;
- `#B` (or `#2`) is a dim of that size or of size 1 (broadcast);
- the empty string is a scalar.

At most one of `...` and `*name` appears in a string.

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
    broadcast: bool = False  # `#B`: size 1 is also accepted

    def __str__(self) -> str:
        return ("#" if self.broadcast else "") + self.name


@dataclasses.dataclass(frozen=True)
class FixedDim:
    size: int
    broadcast: bool = False  # `#2`: size 1 is also accepted

    def __str__(self) -> str:
        return ("#" if self.broadcast else "") + str(self.size)


@dataclasses.dataclass(frozen=True)
class VariadicDim:
    """`*batch`: zero or more axes, whose shape is shared by every array naming it."""

    name: str

    def __str__(self) -> str:
        return "*" + self.name


@dataclasses.dataclass(frozen=True)
class AnonDim:
    label: str = "_"

    def __str__(self) -> str:
        return self.label


@dataclasses.dataclass(frozen=True)
class EllipsisDim:
    def __str__(self) -> str:
        return "..."


Token = NamedDim | FixedDim | AnonDim | EllipsisDim | VariadicDim


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
        """The named dims, variadic ones (`*batch`) included."""
        return tuple(
            t.name for t in self.tokens if isinstance(t, (NamedDim, VariadicDim))
        )

    @property
    def has_ellipsis(self) -> bool:
        """Whether one token (`...` or `*name`) stands for any number of axes."""
        return any(isinstance(t, (EllipsisDim, VariadicDim)) for t in self.tokens)

    @property
    def variadic(self) -> "VariadicDim | None":
        return next((t for t in self.tokens if isinstance(t, VariadicDim)), None)

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


def unstarred(name: object) -> object:
    """A strategy's key or name as a dim: a variadic dim named as annotated
    (`"*batch"`) is the dim `"batch"`; anything else is returned as it is."""
    if isinstance(name, str) and name[:1] == "*" and is_dim_name(name[1:]):
        return name[1:]
    return name


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
    tokens = [_parse_token(dims, raw) for raw in dims.split()]
    variadic = [str(t) for t in tokens if isinstance(t, (EllipsisDim, VariadicDim))]
    if len(variadic) > 1:
        if len(set(variadic)) == 1:
            what = f"`{variadic[0]}` may appear at most once, since it stands"
        else:
            listed = " and ".join(f"`{v}`" for v in dict.fromkeys(variadic))
            what = f"{listed} cannot both appear, since each stands"
        raise SpecError(
            f"Invalid dims string {dims!r}: {what} for all the remaining axes."
        )
    return Dims(tuple(tokens), dims)


def _parse_token(dims: str, raw: str) -> Token:
    """One token, read as jaxtyping reads it: prefixes `#` (broadcast), `*`
    (variadic), `_` (anonymous), `?` (tree path) and `name=` (documentation)."""
    if raw == "...":
        return EllipsisDim()
    flags: set[str] = set()
    rest = raw
    while rest and rest[0] in "#*_?" and not (rest[0] == "_" and "_" in flags):
        if rest[0] in flags:
            raise _token_error(dims, raw, f"uses `{rest[0]}` twice.")
        flags.add(rest[0])
        rest = rest[1:]
        if "_" in flags:
            break
    if rest.count("=") == 1 and "_" not in flags:
        rest = rest.split("=")[1]  # `rows=3` documents a `3`, as in jaxtyping
    if "?" in flags:
        raise _token_error(
            dims, raw, "depends on the pytree path (`?name`), which is not supported."
        )
    if "_" in flags and not ("_" + rest).isidentifier():
        raise _not_a_name(dims, raw)
    if "_" in flags:  # `_`, `_pol`, `*_`
        if "#" in flags:
            raise _token_error(dims, raw, "is anonymous, so it cannot be broadcast.")
        return EllipsisDim() if "*" in flags else AnonDim("_" + rest)
    if "*" in flags:
        if "#" in flags:
            raise _token_error(
                dims, raw, "is a broadcastable variadic dim, which is not supported."
            )
        if not is_dim_name(rest):
            raise _token_error(dims, raw, "is variadic, but `" + rest + "` is no name.")
        return VariadicDim(rest)
    if _INT.match(rest):
        return FixedDim(int(rest), "#" in flags)
    if raw.startswith("~"):
        raise _token_error(
            dims,
            raw,
            "uses the `~` of DSA2000-Cal's `multi_vmap`; in a dims string an "
            "unmapped axis is just a name that is not mapped, or `_`.",
        )
    if is_dim_name(rest):
        return NamedDim(rest, "#" in flags)
    if any(c in rest for c in "+-*/=()"):
        raise _token_error(
            dims,
            raw,
            "is a symbolic expression, which is not supported; use a name or an "
            "integer.",
        )
    raise _not_a_name(dims, raw)


def _not_a_name(dims: str, raw: str) -> SpecError:
    return _token_error(
        dims,
        raw,
        "is not a name, an integer, `_` or `...` (nor `*name` or `#name`). Names "
        "are Python identifiers not starting with `_`, optionally followed by "
        "primes, e.g. 'T', 'freq', 'n1', \"D'\".",
    )


def axes_of(dims: Dims, ndim: int) -> tuple[int, ...] | str:
    """The axis of each token of `dims` in an array of rank `ndim`.

    The ellipsis token (`...`, `*name`) gets `-1` (see `variadic_axes`). Returns a
    reason string (not an exception) when the rank does not fit, so that the caller
    can raise one error with full context.
    """
    n_fixed = sum(not isinstance(t, (EllipsisDim, VariadicDim)) for t in dims.tokens)
    if dims.has_ellipsis:
        if ndim < n_fixed:
            return f"has rank {ndim}, but dims {dims.source!r} need at least {n_fixed}"
    elif ndim != n_fixed:
        return f"has rank {ndim}, but dims {dims.source!r} need exactly {n_fixed}"
    out, axis = [], 0
    for t in dims.tokens:
        many = isinstance(t, (EllipsisDim, VariadicDim))
        out.append(-1 if many else axis)
        axis += ndim - n_fixed if many else 1
    return tuple(out)


def variadic_axes(dims: Dims, ndim: int) -> tuple[int, int]:
    """The first axis and the number of axes of the `...` or `*name` of `dims`, in
    an array of rank `ndim` (which fits, see `axes_of`)."""
    many = [isinstance(t, (EllipsisDim, VariadicDim)) for t in dims.tokens]
    return many.index(True), ndim - many.count(False)


def final_axis(dims: Dims, name: str, ndim: int) -> int:
    """The axis of the named dim `name` in an array of rank `ndim` with `dims`."""
    token_axes = axes_of(dims, ndim)
    assert not isinstance(token_axes, str)
    for t, ax in zip(dims.tokens, token_axes):
        if isinstance(t, NamedDim) and t.name == name:
            return ax
    raise AssertionError(name)


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
    names = tuple(unstarred(n) for n in names)  # `scan="*batch"`: the dim `batch`
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
