"""`multi_vmap`: a migration shim with the semantics of DSA2000-Cal's `multi_vmap`."""

import re
from collections.abc import Callable, Iterable
from typing import TypeVar

from ._errors import SpecError
from ._multi_vmap import filter_multi_vmap


_C = TypeVar("_C", bound=Callable)

_GROUP = re.compile(r"\[([^\[\]]*)\]")


def _groups(mapping: str | list[str], argname: str) -> list[list[str]]:
    if isinstance(mapping, (list, tuple)):
        mapping = ",".join(mapping)
    if not isinstance(mapping, str):
        raise SpecError(
            f"`multi_vmap(..., {argname}=...)` must be a string such as "
            f"'[T,F,B],[F]' (or a list of such strings), but got {mapping!r}."
        )
    text = mapping.strip()
    groups = _GROUP.findall(text)
    leftover = _GROUP.sub("", text).replace(",", "").strip()
    if leftover or not groups:
        raise SpecError(
            f"`multi_vmap(..., {argname}={mapping!r})`: expected comma-separated "
            "bracketed groups of dims, one per "
            f"{'argument' if argname == 'in_mapping' else 'output'}, e.g. "
            "'[T,F,B],[F],[]'."
        )
    out = []
    for g in groups:
        tokens = [t.strip() for t in g.split(",") if t.strip()]
        for t in tokens:
            name = t[1:] if t.startswith("~") else t
            if t != "..." and not (name.isidentifier() or name.isdigit()):
                raise SpecError(
                    f"`multi_vmap(..., {argname}={mapping!r})`: {t!r} is not a dim "
                    "name; use names such as 'T', '~X' (an unmapped output axis) or "
                    "'...'."
                )
        out.append(tokens)
    return out


def multi_vmap(
    f: _C,
    in_mapping: str | list[str],
    out_mapping: str | list[str],
    scan_dims: Iterable[str] | None = None,
    verbose: bool = False,
) -> _C:
    """Map `f` according to a DSA2000-Cal-style signature; a migration shim.

    This has the semantics of `multi_vmap` from DSA2000-Cal's `jax_utils`, and is
    implemented with [`eqx_multimap.filter_multi_vmap`][].

    **Arguments:**

    - `f`: the function to map, taking positional arguments.
    - `in_mapping`: one bracketed group per positional argument, e.g.
        `"[T,F,B],[F],[]"`. Only the leading dims need naming: a `...` is implied
        at the end of each group if absent; `[]` is an argument that is not mapped.
    - `out_mapping`: one bracketed group per output, e.g. `"[F,T,B,...]"`. Every
        name in it is a mapped dim (and must appear in some input); `~X` names one
        unmapped axis of the function's own output, `...` its remaining axes
        (implied at the end if absent). Several groups mean `f` returns a tuple.
    - `scan_dims`: the mapped dims to scan over instead of vmap.
    - `verbose`: print the implied per-element signature and the nest.

    **Returns:**

    The mapped function. Unlike DSA2000-Cal, scans are always placed outside vmaps
    (`scan(vmap(f))`); the values are the same, and this order is faster.

    !!! example

        ```python
        f = multi_vmap(
            lambda x, y: x + y,
            in_mapping="[n1,n2,n3],[n1,n2,n3,2,2]",
            out_mapping="[...,n1,n2]",
        )
        # x, y: (3, 4, 5, 2, 2) -> (5, 2, 2, 3, 4)
        ```
    """
    ins = _groups(in_mapping, "in_mapping")
    outs = _groups(out_mapping, "out_mapping")
    mapped: list[str] = []
    for group in outs:
        for t in group:
            if t != "..." and not t.startswith("~") and t not in mapped:
                mapped.append(t)
            if group.count(t) > 1:
                raise SpecError(
                    f"`multi_vmap(..., out_mapping={out_mapping!r})`: dim {t!r} "
                    "appears twice in one output."
                )
    for group in outs:
        missing = [m for m in mapped if m not in group]
        if missing:
            raise SpecError(
                f"`multi_vmap(..., out_mapping={out_mapping!r})`: output "
                f"[{','.join(group)}] must contain all mapped dims {mapped}; it lacks "
                f"{missing}."
            )
    for m in mapped:
        if not any(m in g for g in ins):
            raise SpecError(
                f"`multi_vmap`: mapped dim {m!r} of `out_mapping` appears in no "
                f"group of `in_mapping={in_mapping!r}`."
            )
    scan_set = set(scan_dims or ())
    unknown = scan_set.difference(mapped)
    if unknown:
        raise SpecError(
            f"`multi_vmap(..., scan_dims=...)` names {sorted(unknown)}, which are "
            f"not mapped dims; the mapped dims are {mapped}."
        )

    def to_dims(group: list[str]) -> str:
        tokens = ["_" if t.startswith("~") else t for t in group]
        if "..." not in tokens:
            tokens.append("...")
        return " ".join(tokens)

    in_dims = tuple(None if not g else to_dims(g) for g in ins)
    out_strings = [to_dims(g) for g in outs]
    out_dims = out_strings[0] if len(out_strings) == 1 else tuple(out_strings)
    scan = [m for m in mapped if m in scan_set]
    vmap = [m for m in mapped if m not in scan_set]
    if verbose:

        def core(dims: str) -> str:
            return "(" + ",".join(t for t in dims.split() if t not in mapped) + ")"

        core_in = ["(...)" if d is None else core(d) for d in in_dims]
        core_out = [core(d) for d in out_strings]
        print(
            f"=== multi_vmap({getattr(f, '__name__', f)!s}) ===\n"
            f"Implied function signature :: {','.join(core_in)} -> "
            f"{','.join(core_out)}"
        )
    return filter_multi_vmap(  # pyright: ignore[reportReturnType]
        f,
        in_dims=in_dims,
        out_dims=out_dims,
        scan=scan,
        vmap=vmap,
        verbose=verbose,
    )
