"""What `help()` shows of the public API.

The docstrings are written for the API reference (mkdocstrings reads them from the
source): they link with MkDocs syntax, ``[`eqx_multimap.Monoid`][]`` and
`[Sharding](../sharding.md)`, and set examples in `!!! example` boxes. `help()` shows
`__doc__`, so `__doc__` is given the same text without that markup, and signatures
name the type aliases (`in_dims: InDims = None`) rather than spelling them out.
"""

import inspect
import re
import textwrap
from typing import Any


class _Alias:
    """An annotation shown by its name."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


# ``[`name`][]`` or ``[`name`][target]``, `[text][target]`, `[text](page.md#anchor)`.
_CROSSREF = re.compile(r"\[([^\[\]\n]+)\]\[[^\[\]\n]*\]")
_LINK = re.compile(r"\[([^\[\]\n]+)\]\([^()\s]+\)")
# `!!! example "Title"` (or `???`), the body indented under it.
_ADMONITION = re.compile(r'^( *)[!?]{3}\+? *(\w+)(?: +"([^"]*)")? *$', re.M)


def plain(doc: str) -> str:
    """`doc` without MkDocs markup: links become their text, and an admonition its
    title followed by its body, one level less indented."""
    doc = _CROSSREF.sub(r"\1", doc)
    doc = _LINK.sub(r"\1", doc)
    lines = doc.split("\n")
    out = []
    i = 0
    while i < len(lines):
        m = _ADMONITION.match(lines[i])
        if m is None:
            out.append(lines[i])
            i += 1
            continue
        indent, kind, title = m.group(1), m.group(2), m.group(3)
        out.append(f"{indent}{title or kind.capitalize()}:")
        i += 1
        body = []
        while i < len(lines) and (
            not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > len(indent)
        ):
            body.append(lines[i])
            i += 1
        # One level (4 columns) out, so the body sits under the title as before.
        body_text = textwrap.dedent("\n".join(body))
        out.extend(textwrap.indent(body_text, indent + "    ").split("\n"))
    return "\n".join(out)


def _named(annotation: Any, aliases: dict[str, Any]) -> Any:
    for name, alias in aliases.items():
        try:
            if annotation == alias:
                return _Alias(name)
        except Exception:  # an annotation that cannot be compared
            pass
    return annotation


def signature_by_alias(fn: Any, aliases: dict[str, Any]) -> inspect.Signature:
    """The signature of `fn`, each annotation that is one of `aliases` shown by its
    name."""
    sig = inspect.signature(fn)
    params = [
        p.replace(annotation=_named(p.annotation, aliases))
        for p in sig.parameters.values()
    ]
    return sig.replace(
        parameters=params, return_annotation=_named(sig.return_annotation, aliases)
    )


def for_help(public: dict[str, Any], aliases: dict[str, Any]) -> None:
    """Give every function and class of `public` (and other callables, such as an
    `lru_cache` wrapper) a plain `__doc__`, and every function a signature that names
    `aliases`."""
    for obj in public.values():
        ours = str(getattr(obj, "__module__", "")).startswith("eqx_multimap")
        if not callable(obj) or inspect.ismodule(obj) or not ours:
            continue
        if isinstance(obj.__doc__, str):
            try:
                obj.__doc__ = plain(obj.__doc__)
            except (AttributeError, TypeError):  # a class that fixes its doc
                pass
        if inspect.isfunction(obj):
            obj.__signature__ = signature_by_alias(obj, aliases)
