"""The two error types raised by `eqx_multimap`.

- [`eqx_multimap.ShapeError`][] is for bad *data*: the arrays passed at call time do
  not have the shapes (or dtypes) that the dims describe.
- [`eqx_multimap.SpecError`][] is for a bad *specification*: a malformed dims string,
  a strategy naming an unknown dim, an `in_dims` that does not fit the arguments.

They deliberately do not share a base class other than `Exception`, so that code
catching one never swallows the other (as in jaxtyping, where `AnnotationError` does
not inherit from `TypeCheckError`).

Both print their message wrapped by `_text.wrap` (counting, on the first line, the
`eqx_multimap.ShapeError: ` that Python prints before it), so that it reads in a
terminal or on a docs page. The message as raised, one line per thought, stays in
`error.args[0]`.
"""

from collections.abc import Sequence
from typing import Any

from ._text import wrap


def did_you_mean(unknown: Sequence[Any], names: Sequence[str]) -> str:
    """` Did you mean 'vis' (not 'viz')?` for the unknown names close to known ones
    (see `near_miss`), or the empty string."""
    hints = []
    for key in unknown:
        if not isinstance(key, str):
            continue
        close = [p for p in names if near_miss(key, p)]
        if close:
            hints.append(f"{close[0]!r} (not {key!r})")
    return f" Did you mean {', '.join(hints)}?" if hints else ""


def near_miss(a: str, b: str) -> bool:
    """Whether two different names differ only in case, or (both of three or more
    characters) by one edit: a character added, dropped or changed, or two
    adjacent characters swapped."""
    if a == b:
        return False
    if a.lower() == b.lower():
        return True
    if min(len(a), len(b)) < 3 or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        diff = [i for i in range(len(a)) if a[i] != b[i]]
        if len(diff) == 1:
            return True
        i, j = diff[0], diff[-1]
        return len(diff) == 2 and j == i + 1 and a[i] == b[j] and a[j] == b[i]
    short, long = (a, b) if len(a) < len(b) else (b, a)
    return any(long[:i] + long[i + 1 :] == short for i in range(len(long)))


def _typo_of(name: str, meant: str) -> bool:
    """Whether dim `name` looks like a typo of dim `meant`: a near miss, or `meant`
    with one or two characters added at its end, in any case (`Fr`, `fq` for `F`).
    Two distinct one-letter names (`K` and `T`) never are."""
    added = len(name) - len(meant)
    lower = name.lower().startswith(meant.lower())
    return near_miss(name, meant) or (0 < added <= 2 and lower)


def typo_hint(places: dict[str, list[str]], declared: Sequence[str] = ()) -> str:
    """For a call that failed: each dim written in one place only (`places` lists,
    in order, where each dim is written) that looks like a typo of another dim,
    written elsewhere or `declared` core; where it was written and the dim probably
    meant. One sentence a line, each starting on a new line; or the empty string."""
    lines = []
    said: set[frozenset[str]] = set()
    for name, where in places.items():
        if len(where) != 1 or name in declared:
            continue
        meant = [m for m in [*places, *declared] if m != name and _typo_of(name, m)]
        if not meant or frozenset((name, meant[0])) in said:
            continue
        m = meant[0]
        said.add(frozenset((name, m)))
        how = (
            f"is named by {', '.join(places[m])}"
            if m in places
            else "is declared `core`"
        )
        lines.append(
            f"\nDid you mean {m!r} for {name!r}? {name!r} is named only by "
            f"{where[0]}, while {m!r} {how}."
        )
    return "".join(lines)


class _Wrapped:
    """Mixed into both errors (before the built-in exception class): prints the
    message wrapped."""

    args: tuple

    def __str__(self) -> str:
        message = super().__str__()
        if len(self.args) != 1 or not isinstance(self.args[0], str):
            return message
        cls = type(self)
        return wrap(message, len(f"{cls.__module__}.{cls.__qualname__}: "))


class ShapeError(_Wrapped, TypeError):
    """Raised when the arrays passed to a mapped function do not match their dims.

    The message names the argument path as written at the call site (for example
    `model.flux` or `kwargs['nu']`), the dim, and every size that was seen for it,
    together with where each size was bound.
    """


class SpecError(_Wrapped, ValueError):
    """Raised when a dims string, strategy or `in_dims`/`out_dims` is malformed.

    This is an error in the code that calls [`eqx_multimap.filter_multi_vmap`][], not
    in the data it is called with.
    """


ShapeError.__module__ = "eqx_multimap"
SpecError.__module__ = "eqx_multimap"
