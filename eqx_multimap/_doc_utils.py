"""What `help()` shows of the public API.

The docstrings are written for the API reference (mkdocstrings reads them from the
source): they link with MkDocs syntax, ``[`eqx_multimap.Monoid`][]`` and
`[Sharding](../sharding.md)`, and set examples in `!!! example` boxes. `help()` shows
`__doc__`, so `__doc__` is given the same text without that markup (links become
their text).

A public function's signature stays its own: `inspect.signature` gives its
parameters with their real annotations, as `typing.get_type_hints` does. Only how it
prints is ours ([`Signature`][]): the public type aliases by name (`in_dims: InDims =
None`, not the union `InDims` stands for), and one parameter a line when the line
would be long, as `help()` prints a long signature from Python 3.13.
"""

import inspect
import re
import textwrap
from typing import Any


_WIDTH = 80  # longer signatures print one parameter a line (Python 3.13's `help()`)


class _Shown:
    """An annotation printed as `name` (only in the text of a signature)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


class Signature(inspect.Signature):
    """A function's own signature, printed with the type aliases `names` by name, and
    one parameter a line past `max_width` columns (`str`: past 80)."""

    __slots__ = ("_names",)

    def __init__(self, *args: Any, names: dict[str, Any] | None = None, **kw: Any):
        super().__init__(*args, **kw)
        self._names = names or {}

    def replace(self, **changes: Any) -> "Signature":
        """A copy with `changes`, printed alike (`inspect` replaces for a partial)."""
        out = super().replace(**changes)
        out._names = getattr(self, "_names", {})
        return out

    def _shown(self, annotation: Any) -> Any:
        for name, alias in getattr(self, "_names", {}).items():
            try:
                if annotation == alias:
                    return _Shown(name)
            except Exception:  # an annotation that cannot be compared
                pass
        return annotation

    def format(self, *, max_width: int | None = None, **_: Any) -> str:
        """The signature as text (`inspect.Signature.format`, Python 3.13)."""
        items = []
        positional_only, keyword_only = False, True
        for p in self.parameters.values():
            if p.kind is p.POSITIONAL_ONLY:
                positional_only = True
            elif positional_only:
                items.append("/")
                positional_only = False
            if p.kind is p.VAR_POSITIONAL:
                keyword_only = False
            elif p.kind is p.KEYWORD_ONLY and keyword_only:
                items.append("*")
                keyword_only = False
            items.append(str(p.replace(annotation=self._shown(p.annotation))))
        if positional_only:
            items.append("/")
        text = "({})".format(", ".join(items))
        if max_width is not None and len(text) > max_width:
            text = "(\n    {}\n)".format(",\n    ".join(items))
        if self.return_annotation is not self.empty:
            text += (
                f" -> {inspect.formatannotation(self._shown(self.return_annotation))}"
            )
        return text

    def __str__(self) -> str:
        return self.format(max_width=_WIDTH)


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


def for_help(public: dict[str, Any], aliases: dict[str, Any]) -> None:
    """Give every function and class of `public` (and other callables, such as an
    `lru_cache` wrapper) a plain `__doc__`, and every function its signature printed
    with `aliases` and the classes of `public` by name."""
    classes = {k: v for k, v in public.items() if isinstance(v, type)}
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
            sig = inspect.signature(obj)
            obj.__signature__ = Signature(
                list(sig.parameters.values()),
                return_annotation=sig.return_annotation,
                names={**classes, **aliases},
            )
