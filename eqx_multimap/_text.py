"""How text reads in plans and messages: bytes, seconds, plurals, arrays, and
lines wrapped to fit a terminal or a docs page.

[`wrap`][] breaks each line longer than `width` (100) columns into lines of at most
`width`, each break as late as fits, of the best kind there is: after a sentence;
else after a `;` or `:`; else after a comma that ends a clause; else after the
message's subject (`` `filter_multi_vmap(f)`: ``); else between words, outside
brackets if it can be. A `backticked` or 'quoted' name is never broken. So a phrase
that a test or a search looks for is rarely split (a test can match any whitespace
where a message may break). [`fill`][] reflows a paragraph of prose (a plan's
reasons), and [`wrap_nest`][] breaks a line holding a nest before its arrows.
"""

import re
import textwrap
from typing import Any

import numpy as np


def fmt_bytes(n: int | float) -> str:
    """`512 B`, `1.5 KiB`, `2.0 GiB`."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def fmt_seconds(s: float) -> str:
    """`3.1 ms`, `250 us`, `1.20 s`; `1 ms`, not `1e+03 us`."""
    s = float(f"{s:.3g}")  # three digits first: 999.96 us is 1 ms
    if s >= 1.0:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


def plural(n: int, noun: str) -> str:
    """`"1 chunk"`, `"3 chunks"`, `"2 classes"`."""
    if n == 1:
        return f"1 {noun}"
    return f"{n} {noun}es" if noun.endswith("s") else f"{n} {noun}s"


def names_str(names: Any) -> str:
    """`dim 'F'`, `dims 'T', 'F'`: named dims, for errors."""
    names = list(dict.fromkeys(names))
    quoted = ", ".join(repr(n) for n in names)
    return f"dim {quoted}" if len(names) == 1 else f"dims {quoted}"


def describe(x: Any) -> str:
    """`float32[3,4]`, the way JAX names an array in its own errors."""
    shape = ",".join(str(s) for s in np.shape(x))
    dtype = getattr(x, "dtype", None)
    name = getattr(dtype, "name", str(dtype))
    return f"{name}[{shape}]"


#
# Wrapping.
#

_LONG = 100

# Spans never broken: `code`, and 'quoted' or "quoted" names (an apostrophe inside a
# word, as in "function's", opens no quote).
_UNBREAKABLE = re.compile(r"`[^`\n]*`|(?<!\w)'[^'\n]*'(?!\w)|(?<!\w)\"[^\"\n]*\"(?!\w)")
_SENTENCE_END = re.compile(r"(?<!\be\.g)(?<!\bi\.e)[.?!]$")
_CLAUSE_WORD = re.compile(r"[a-z]{2,}\b")  # a comma before one may end a clause
_SUBJECT = re.compile(r"^ *(`[^`\n]*`:? ?)+:$")  # "`filter_multi_vmap(f)`:"

# Kinds of break, best first.
_SENTENCE, _CLAUSE, _COMMA, _SUBJECT_END, _WORD, _BRACKETED = 5, 4, 3, 2, 1, 0


def _breaks(line: str) -> list[tuple[int, int]]:
    """`(index of a space, kind of break there)` for every space after the line's
    indent and outside an unbreakable span."""
    protected = set()
    for m in _UNBREAKABLE.finditer(line):
        protected.update(range(m.start(), m.end()))
    start = len(line) - len(line.lstrip(" "))
    out = []
    depth = 0
    for i in range(start, len(line) - 1):
        if i in protected:
            continue
        c = line[i]
        depth += (c in "([{") - (c in ")]}")
        if c != " " or line[i - 1] == " " or line[i + 1] == " ":
            continue
        before = line[:i]
        if depth > 0:
            kind = _BRACKETED
        elif _SUBJECT.match(before):
            kind = _SUBJECT_END
        elif _SENTENCE_END.search(before):
            kind = _SENTENCE
        elif before.endswith((":", ";")):
            kind = _CLAUSE
        elif before.endswith(",") and _CLAUSE_WORD.match(line, i + 1):
            kind = _COMMA
        else:
            kind = _WORD
        out.append((i, kind))
    return out


def _break_at(line: str, offset: int, width: int) -> int | None:
    """Where to break a line that starts `offset` columns in: at the latest break of
    the best kind that fits in `width` columns, or at the first break if none fits."""
    breaks = _breaks(line)
    fit = [(kind, i) for i, kind in breaks if offset + i <= width]
    if fit:
        return max(fit)[1]
    return breaks[0][0] if breaks else None


def wrap(message: str, prefix: int = 0, width: int = _LONG) -> str:
    """`message` with each line longer than `width` columns broken (its first line
    starting `prefix` columns in). A continuation is indented as its line, or under
    its bullet."""
    lines = []
    for k, line in enumerate(message.split("\n")):
        indent = len(line) - len(line.lstrip(" "))
        if line[indent:].startswith(("* ", "- ")):
            indent += 2
        offset = prefix if k == 0 else 0
        while offset + len(line) > width:
            i = _break_at(line, offset, width)
            if i is None:
                break
            lines.append(line[:i])
            line = " " * indent + line[i + 1 :]
            offset = 0
        lines.append(line)
    return "\n".join(lines)


def wrap_nest(line: str, width: int = 100, indent: str = "    ") -> str:
    """A line holding a nest, broken where it is longer than `width` columns: before
    an arrow (the next line starts `indent` and `-> `), else after a `;`, or after
    the line's title (`f: `)."""
    parts = re.split(r"( -> |; )", line)
    lines = [parts[0]]
    if len(parts[0]) > width and ": " in parts[0]:
        title, first = parts[0].split(": ", 1)
        lines = [f"{title}:", f"{indent}   {first}"]
    for sep, piece in zip(parts[1::2], parts[2::2]):
        if len(lines[-1]) + len(sep) + len(piece) <= width:
            lines[-1] += sep + piece
        elif sep == "; ":
            lines[-1] += ";"
            lines.append(f"{indent}   {piece}")
        else:
            lines.append(f"{indent}-> {piece}")
    return "\n".join(lines)


def fill(text: str, width: int, indent: str = "") -> str:
    """`text` reflowed into lines of at most `width` columns, each starting `indent`,
    never broken inside a word."""
    return textwrap.TextWrapper(
        width, indent, indent, break_long_words=False, break_on_hyphens=False
    ).fill(text)
