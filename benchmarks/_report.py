"""The report of `run.py`: Markdown tables with a takeaway under each, one figure per
question, and the headline summary (in `results.md` and in the terminal).

Everything here reads the result dicts that `run.py`'s sections return; nothing is
measured. Every takeaway is computed from the data it sits under.
"""

import os
import statistics
from collections.abc import Sequence


MiB = 2**20

# The grid's questions, as `question` in its pairs: (a, b, label in the report).
OURS_VS_HAND = (
    ("ours vmap", "vmap", "`vmap`"),
    ("ours scan(vmap)", "scan(vmap)", "`scan(vmap)`"),
    ("ours chunk k", "lax.map(bs=k)", "chunk / `lax.map`"),
)
NOISE = ("vmap (twin)", "vmap")
ORDER = ("scan(vmap)", "vmap(scan)")

PAIRED = (
    "Ratios marked *paired* are the median of the per-round ratios of two programs "
    "timed in the same rounds (in brackets: their interquartile range), which can "
    "differ from the ratio of the two median times (marked *of medians*)."
)


# ----------------------------------------------------------------------------------
# Formatting.


def table(header: Sequence[str], rows: Sequence[Sequence], align: str = "") -> str:
    """A Markdown table; `align` has an `l` or `r` per column (default `lrrr...`)."""
    align = align or "l" + "r" * (len(header) - 1)
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(rule) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def fmt_paired(p: dict) -> str:
    """A pair's paired ratio with its interquartile range, e.g. `1.02 [0.99, 1.05]`."""
    if p["paired"] is None:
        return "skipped"
    return f"{p['paired']:.2f} [{p['q25']:.2f}, {p['q75']:.2f}]"


def cell_label(cell: Sequence[int]) -> str:
    return "x".join(str(n) for n in cell)


def spread(values: Sequence[float], what: str) -> str:
    """`median 1.02 over 7 cells (0.97 to 1.10)`."""
    return (
        f"median {statistics.median(values):.2f} over {len(values)} {what} "
        f"({min(values):.2f} to {max(values):.2f})"
    )


def takeaway(text: str) -> str:
    return f"**Takeaway:** {text}"


# ----------------------------------------------------------------------------------
# Grid.


def _cell(r: dict) -> tuple[int, int, int]:
    return (r["b1"], r["b2"], r["L"])


def pairs_of(grid: dict, a: str, b: str | None = None) -> list[dict]:
    """The grid's pairs `a / b` (any `b` if `None`), one per cell, in cell order."""
    return [p for p in grid["pairs"] if p["a"] == a and (b is None or p["b"] == b)]


def measured(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["status"] == "ok"]


def noise_floor(grid: dict) -> tuple[float, float] | None:
    """The lowest and highest paired ratio of the two identical programs over the
    measured cells: how far apart two equal programs' ratios landed in this run."""
    ratios = [p["paired"] for p in measured(pairs_of(grid, *NOISE))]
    return (min(ratios), max(ratios)) if ratios else None


def _beyond(ratios: list[float], floor: tuple[float, float] | None) -> str:
    """How many ratios lie outside the noise floor, and on which side."""
    if floor is None:
        return ""
    lo, hi = floor
    above = sum(r > hi for r in ratios)
    below = sum(r < lo for r in ratios)
    return (
        f"outside the noise floor ({lo:.2f} to {hi:.2f}) in {above + below} of "
        f"{len(ratios)} ({above} above, {below} below)"
    )


def _skipped_note(grid: dict) -> str:
    if not grid["skipped"]:
        return ""
    cells = ", ".join(cell_label(c) for c in grid["skipped"])
    return (
        f"Skipped: {cells}, more than `--max-elements` = {grid['max_elements']:,} "
        "elements (in + out + the transposed copy of `vmap(scan)` is 12 bytes per "
        "element, and a call takes seconds on 2 cores). Their rows say `skipped`, "
        "in the tables and in the CSVs (`status`)."
    )


def _rows_by(grid: dict) -> dict[tuple, dict]:
    return {_cell(r) + (r["family"],): r for r in grid["rows"]}


def ours_vs_hand_markdown(grid: dict) -> str:
    floor = noise_floor(grid)
    columns = [pairs_of(grid, a, b) for a, b, _ in OURS_VS_HAND]
    noise = pairs_of(grid, *NOISE)
    rows = [
        [*_cell(ps[0]), *(fmt_paired(p) for p in ps), ps[-1]["rounds"] or ""]
        for ps in zip(*columns, noise)
    ]
    header = ["b1", "b2", "L", *(label for *_, label in OURS_VS_HAND)]
    out = [
        "### Ours against hand-written",
        "",
        "Ours / hand-written per cell and strategy, paired: the median [and "
        "interquartile range] of the per-round time ratios; below 1 is ours faster. "
        "The last ratio column is two identical programs (`vmap (twin)` / `vmap`): "
        "the noise.",
        "",
        table(header + ["identical (noise)", "rounds"], rows),
        "",
    ]
    every = [p["paired"] for ps in columns for p in measured(ps)]
    if every:
        by = ", ".join(
            f"{label} {statistics.median(p['paired'] for p in measured(ps)):.2f}"
            for (*_, label), ps in zip(OURS_VS_HAND, columns)
        )
        out.append(
            takeaway(
                f"ours / hand-written: {spread(every, 'cell-strategies')}; median "
                f"by strategy: {by}; {_beyond(every, floor)}."
            )
        )
    return "\n".join(out)


def _pair_columns(p: dict, by: dict[tuple, dict]) -> list[str]:
    """A pair's median times of `a` and `b`, their ratio of medians, its paired
    ratio; or `skipped`."""
    if p["paired"] is None:
        return ["skipped", "skipped", "", "skipped"]
    ra, rb = by[_cell(p) + (p["a"],)], by[_cell(p) + (p["b"],)]
    return [
        f"{ra['median_ms']:.3g}",
        f"{rb['median_ms']:.3g}",
        f"{p['ratio_of_medians']:.2f}",
        fmt_paired(p),
    ]


def order_markdown(grid: dict) -> str:
    floor = noise_floor(grid)
    by = _rows_by(grid)
    a, b = ORDER
    rows = [[*_cell(p), *_pair_columns(p, by)] for p in pairs_of(grid, a, b)]
    out = [
        f"### Map order: `{a}` against `{b}`",
        "",
        f"Median times, their ratio (*of medians*), and the *paired* ratio `{a}` / "
        f"`{b}` (median [interquartile range] of the per-round ratios, which can "
        f"differ from the ratio of medians); below 1 is `{a}` faster.",
        "",
        table(
            [
                "b1",
                "b2",
                "L",
                f"`{a}` (ms)",
                f"`{b}` (ms)",
                "ratio, of medians",
                "ratio, paired",
            ],
            rows,
        ),
        "",
    ]
    ratios = [p["paired"] for p in measured(pairs_of(grid, a, b))]
    if ratios:
        faster = sum(r < 1 for r in ratios)
        out.append(
            takeaway(
                f"`{a}` / `{b}`: paired {spread(ratios, 'cells')}; `{a}` faster in "
                f"{faster} of {len(ratios)} cells; {_beyond(ratios, floor)}."
            )
        )
    return "\n".join(out)


def auto_markdown(grid: dict) -> str:
    floor = noise_floor(grid)
    by = _rows_by(grid)
    pairs = pairs_of(grid, "ours auto")
    rows = [
        [
            *_cell(p),
            f"`{p['note']}`" if p["note"] else "",
            "skipped" if p["paired"] is None else f"`{p['b']}`",
            *_pair_columns(p, by),
        ]
        for p in pairs
    ]
    out = [
        '### `plan="auto"` against the fastest fixed program',
        "",
        "*Fastest* is the fixed program (hand-written or ours; not the twin) with "
        "the lowest median time in the cell, picked after the fact from all of them: "
        "so the ratio `ours auto` / fastest leans above 1 even when auto's choice is "
        "as fast. *Paired* ratios are medians [interquartile ranges] of per-round "
        "ratios and can differ from the ratio *of medians*.",
        "",
        table(
            [
                "b1",
                "b2",
                "L",
                "auto's nest",
                "fastest",
                "auto (ms)",
                "fastest (ms)",
                "ratio, of medians",
                "ratio, paired",
            ],
            rows,
            "rrrllrrrr",
        ),
        "",
    ]
    ratios = [p["paired"] for p in measured(pairs)]
    if ratios:
        hi = floor[1] if floor else 1.0
        within = sum(r <= hi for r in ratios)
        out.append(
            takeaway(
                f"`ours auto` / fastest: paired {spread(ratios, 'cells')}; at most "
                f"the noise floor's top ({hi:.2f}) in {within} of {len(ratios)} "
                "cells."
            )
        )
    return "\n".join(out)


def grid_tables_markdown(grid: dict) -> str:
    """Every program against full `vmap`, the median times and the compile times."""
    rows = [r for r in grid["rows"] if r["family"] != NOISE[0]]
    families = list(dict.fromkeys(r["family"] for r in rows))
    others = [fam for fam in families if fam != "vmap"]
    cells = grid["cells"]
    by = _rows_by(grid)
    ok = [c for c in cells if by[c + ("vmap",)]["status"] == "ok"]

    def cols(cell, fams, key, fmt, bold_min=False):
        values = {fam: by[cell + (fam,)][key] for fam in fams}
        if cell not in ok:
            return [*cell, *("skipped" for _ in fams)]
        best = min(values.values())
        return [
            *cell,
            *(
                f"**{v:{fmt}}**" if bold_min and v == best else f"{v:{fmt}}"
                for v in values.values()
            ),
        ]

    out = ["### Every program against full `vmap`", ""]
    out += [
        "*Paired* ratio of each program to the hand-written `vmap` timed in the same "
        "rounds: the median of the per-round ratios, which can differ from the ratio "
        "of the median times in the next table. Below 1 is faster than `vmap`.",
        "",
        table(
            ["b1", "b2", "L", *(f"`{f}`" for f in others)],
            [cols(c, others, "ratio_vs_vmap", ".2f") for c in cells],
        ),
        "",
    ]
    if ok:
        medians = {
            fam: statistics.median(by[c + (fam,)]["ratio_vs_vmap"] for c in ok)
            for fam in others
        }
        best = min(medians, key=medians.__getitem__)
        out.append(
            takeaway(
                f"median over {len(ok)} cells, paired against `vmap`: "
                + ", ".join(f"`{k}` {v:.2f}" for k, v in medians.items())
                + f"; lowest `{best}`."
            )
        )
    out += [
        "",
        "### Median time (ms)",
        "",
        "The fastest program of each cell in bold.",
        "",
        table(
            ["b1", "b2", "L", *(f"`{f}`" for f in families)],
            [cols(c, families, "median_ms", ".3g", bold_min=True) for c in cells],
        ),
        "",
    ]
    if ok:
        wins: dict[str, int] = {}
        for c in ok:
            fastest = min(families, key=lambda fam: by[c + (fam,)]["median_ms"])
            wins[fastest] = wins.get(fastest, 0) + 1
        ranked = sorted(wins.items(), key=lambda kv: -kv[1])
        out.append(
            takeaway(
                f"fastest by median, over {len(ok)} cells: "
                + ", ".join(f"`{k}` in {v}" for k, v in ranked)
                + "."
            )
        )
    out += [
        "",
        "### Compile time (s), lower + compile, timed apart",
        "",
        table(
            ["b1", "b2", "L", *(f"`{f}`" for f in families)],
            [cols(c, families, "compile_s", ".3f") for c in cells],
        ),
        "",
    ]
    if ok:

        def med(fams):
            return statistics.median(
                by[c + (f,)]["compile_s"] for c in ok for f in fams
            )

        hand = [f for f in families if not f.startswith("ours")]
        ours = [f for f in families if f.startswith("ours") and f != "ours auto"]
        text = (
            f"median compile time: hand-written {med(hand):.3f} s, "
            f"ours {med(ours):.3f} s"
        )
        if "ours auto" in families:
            text += f", `ours auto` {med(['ours auto']):.3f} s (its planning included)"
        out.append(takeaway(text + "."))
    return "\n".join(out)


def grid_markdown(grid: dict) -> str:
    floor = noise_floor(grid)
    identical = (
        "identical"
        if grid["twin_identical"]
        else "**not identical** (so the noise floor is not clean)"
    )
    intro = (
        "Programs: hand-written `vmap` (`vmap(vmap(f))`), `scan(vmap)`, `vmap(scan)` "
        "and `lax.map(bs=k)`, and ours (`filter_multi_vmap`) with the same "
        "strategies; `lax.map(bs=k)` and `ours chunk k` use `k = b1 // 8` (so the "
        "remainder path runs too)."
    )
    if grid["auto"]:
        intro += ' `ours auto` is `plan="auto"`.'
    intro += (
        " `vmap (twin)` is the hand-written `vmap` compiled a second time, as a "
        f"separate executable; the optimised HLO of the two is {identical}. In each "
        "cell every program is compiled first, then all are timed side by side, "
        "interleaved round by round."
    )
    out = [
        "## Grid: `sin(x**2 + 1)` over `(b1, b2, L)`, mapped over `b1, b2`",
        "",
        intro,
        "",
        PAIRED,
    ]
    if floor is not None:
        out[-1] += (
            " The *noise floor* is the range of the paired ratio `vmap (twin)` / "
            f"`vmap` over the cells: {floor[0]:.2f} to {floor[1]:.2f} in this run."
        )
    if grid["skipped"]:
        out += ["", _skipped_note(grid)]
    out += ["", ours_vs_hand_markdown(grid), "", order_markdown(grid)]
    if grid["auto"]:
        out += ["", auto_markdown(grid)]
    else:
        out += [
            "",
            '`ours auto`: not measured, this `eqx_multimap` has no `plan="auto"`.',
        ]
    out += ["", grid_tables_markdown(grid)]
    return "\n".join(out)


# ----------------------------------------------------------------------------------
# Memory and bandwidth.


def _scan_vs_vmap(mem: dict) -> list[tuple[str, dict, dict]]:
    by = {(r["workload"], r["strategy"]): r for r in mem["rows"]}
    workloads = dict.fromkeys(r["workload"] for r in mem["rows"])
    return [(w, by[(w, "scan")], by[(w, "vmap")]) for w in workloads]


def memory_markdown(mem: dict) -> str:
    rows = mem["rows"]
    out = [
        "## Memory: a big per-element intermediate",
        "",
        f"`n = {mem['n']}` elements, `M = K = {mem['m']}`: `exp(outer(x, y))` is "
        f"`{fmt_bytes(mem['intermediate'])}` when all `n` are vmapped at once. Temp "
        "bytes are from `compiled.memory_analysis()`; peak RSS is that of a fresh "
        "subprocess per row (`VmHWM`: JAX, the inputs and the compiled program "
        "included), and 'run adds' is how far the one call raised it above the RSS "
        "before the call. Times are side by side in one process: the median [and "
        "interquartile range] over rounds.",
        "",
    ]
    if any(r["strategy"] == "auto" for r in rows):
        out += [
            f'`auto` is `plan="auto"` with `memory_budget` = '
            f"{fmt_bytes(mem['budget'])}.",
            "",
        ]
    out += [
        "Time / `vmap` is given twice: *paired* (the median of the per-round ratios) "
        "and *of medians* (the ratio of the median times); the two can differ.",
        "",
        table(
            [
                "workload",
                "strategy",
                "temp bytes",
                "peak RSS",
                "run adds",
                "time (ms)",
                "time / vmap, paired",
                "time / vmap, of medians",
            ],
            [
                [
                    f"`{r['workload']}`",
                    r["strategy"],
                    fmt_bytes(r["temp_bytes"]),
                    fmt_bytes(r["peak_rss"]),
                    fmt_bytes(r["run_peak_rss"] - r["rss_before_run"]),
                    f"{r['median_ms']:.3g} [{r['q25_ms']:.3g}, {r['q75_ms']:.3g}]",
                    f"{r['ratio_vs_vmap']:.2f}",
                    f"{r['ratio_of_medians']:.2f}",
                ]
                for r in rows
            ],
            "llrrrrrr",
        ),
        "",
        takeaway(
            "`scan` against `vmap`: "
            + "; ".join(
                f"`{w}` temp {fmt_bytes(s['temp_bytes'])} vs "
                f"{fmt_bytes(v['temp_bytes'])}, time {s['median_ms']:.3g} vs "
                f"{v['median_ms']:.3g} ms ({s['ratio_vs_vmap']:.2f}x, paired)"
                for w, s, v in _scan_vs_vmap(mem)
            )
            + "."
        ),
    ]
    return "\n".join(out)


def bandwidth_markdown(bw: dict) -> str:
    b1, b2, L = bw["shape"]
    rows = bw["rows"]
    out = [
        "## Bandwidth: elementwise maps against memcpy",
        "",
        f"`xs` of shape `({b1}, {b2}, {L})` float32 ({fmt_bytes(bw['nbytes'])}); every "
        "row reads and writes that many bytes, so GB/s counts 2 x that. The two "
        "copies are the references: `numpy copyto` into a preallocated, touched "
        "buffer (the memory bandwidth), and a jitted `x.copy()` (which, like every "
        "jitted function, writes a freshly allocated output).",
        "",
        "GB/s is from the median time; the fractions are *paired* (the median of "
        "the per-round time ratios against the reference, all rows timed side by "
        "side), so they can differ from the ratio of the GB/s.",
        "",
        table(
            [
                "function",
                "method",
                "median (ms)",
                "GB/s",
                "of memcpy, paired",
                "of XLA copy, paired",
            ],
            [
                [
                    r["function"]
                    if r["function"] == "(copy)"
                    else f"`{r['function']}`",
                    r["method"],
                    f"{r['median_ms']:.3g}",
                    f"{r['bandwidth_gbs']:.2f}",
                    f"{100 * r['frac_memcpy']:.0f}%",
                    f"{100 * r['frac_xla_copy']:.0f}%",
                ]
                for r in rows
            ],
            "llrrrr",
        ),
        "",
    ]
    maps = [r for r in rows if r["function"] != "(copy)"]
    best = max(maps, key=lambda r: r["frac_xla_copy"])
    copy = next(r for r in rows if r["method"] == "numpy copyto")
    out.append(
        takeaway(
            f"the maps run at {100 * min(r['frac_xla_copy'] for r in maps):.0f}% to "
            f"{100 * best['frac_xla_copy']:.0f}% of the XLA copy's speed (best: "
            f"`{best['function']}` with {best['method']}); numpy `copyto` moved "
            f"{copy['bandwidth_gbs']:.2f} GB/s."
        )
    )
    return "\n".join(out)


# ----------------------------------------------------------------------------------
# Figures.


def _pyplot():
    """`matplotlib.pyplot` on the Agg backend (files only, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _ratio_limits(series: list[list[dict]], floor) -> tuple[float, float]:
    """y limits that show every median, the noise floor and 1, and the interquartile
    ranges unless they reach far beyond those (a few slow rounds must not flatten the
    rest); what lies beyond is drawn on the edge."""
    pairs = [p for ps in series for p in ps if p["paired"] is not None]
    core = [p["paired"] for p in pairs] + [1.0] + list(floor or ())
    span = max(max(core) - min(core), 0.1)
    lo = max(min([p["q25"] for p in pairs] + core), min(core) - span)
    hi = min(max([p["q75"] for p in pairs] + core), max(core) + span)
    pad = 0.05 * (hi - lo)
    return lo - pad, hi + pad


def _ratio_series(ax, pairs, offset, style, label, limits) -> int:
    """Per cell: every round's ratio as a faint dot, and the median with its
    interquartile range as an error bar, at categorical position `i + offset`.

    Rounds outside `limits` are drawn on the edge as hollow triangles; returns how
    many there were."""
    lo, hi = limits
    xs, meds, err_lo, err_hi = [], [], [], []
    n_out = 0
    for i, p in enumerate(pairs):
        if p["paired"] is None:
            continue
        rounds = [float(r) for r in p["round_ratios"].split()]
        for k, r in enumerate(rounds):
            x = i + offset + 0.02 * ((k % 5) - 2)
            if lo <= r <= hi:
                ax.plot(x, r, ls="none", marker=".", ms=3, alpha=0.35, **_color(style))
            else:
                n_out += 1
                ax.plot(
                    x,
                    hi if r > hi else lo,
                    ls="none",
                    marker="^" if r > hi else "v",
                    ms=5,
                    mfc="white",
                    clip_on=False,
                    **_color(style),
                )
        xs.append(i + offset)
        meds.append(p["paired"])
        err_lo.append(p["paired"] - p["q25"])
        err_hi.append(p["q75"] - p["paired"])
    ax.errorbar(
        xs,
        meds,
        yerr=[err_lo, err_hi],
        ls="none",
        capsize=3,
        label=label,
        ms=6,
        **style,
    )
    return n_out


def _color(style: dict) -> dict:
    return {"color": style["color"]}


def _ratio_axes(ax, grid: dict, ylabel: str, hint: str, limits, n_out: int) -> None:
    """Categorical cells on x, the line at 1, the noise floor band, skipped cells."""
    import matplotlib.transforms as mtransforms

    cells = grid["cells"]
    ax.axhline(1.0, color="black", lw=0.8)
    floor = noise_floor(grid)
    if floor is not None:
        ax.axhspan(
            *floor,
            color="grey",
            alpha=0.2,
            lw=0,
            label=f"noise floor: identical programs, {floor[0]:.2f} to {floor[1]:.2f}",
        )
    ax.set_ylim(*limits)
    ax.set_xticks(range(len(cells)), [cell_label(c) for c in cells], rotation=45)
    ax.set_xlim(-0.6, len(cells) - 0.4)
    ax.set_xlabel("b1 x b2 x L")
    trans = mtransforms.blended_transform_factory(ax.transData, ax.transAxes)
    for i, cell in enumerate(cells):
        if cell in grid["skipped"]:
            n = cell[0] * cell[1] * cell[2]
            ax.text(
                i,
                0.5,
                f"skipped: {n:,} elements\n> max {grid['max_elements']:,}",
                transform=trans,
                rotation=90,
                ha="center",
                va="center",
                color="dimgrey",
                fontsize=8,
                bbox=dict(facecolor="white", edgecolor="lightgrey"),
            )
    ax.set_ylabel(f"{ylabel}\n({hint})")
    if n_out:
        ax.text(
            1.01,
            0.0,
            f"{n_out} rounds beyond the axis:\nhollow triangles on its edge",
            transform=ax.transAxes,
            fontsize=8,
            color="dimgrey",
            va="bottom",
        )
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def plot_ours_vs_hand(grid: dict, path: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(grid["cells"])) + 4, 5))
    series = [
        (pairs_of(grid, a, b), f"ours / hand-written, {label.replace('`', '')}")
        for a, b, label in OURS_VS_HAND
    ]
    series.append((pairs_of(grid, *NOISE), "identical programs (the noise)"))
    styles = [
        dict(color="C0", marker="o"),
        dict(color="C1", marker="s"),
        dict(color="C2", marker="^"),
        dict(color="dimgrey", marker="D"),
    ]
    limits = _ratio_limits([ps for ps, _ in series], noise_floor(grid))
    width = 0.6 / len(series)
    n_out = 0
    for k, ((pairs, label), style) in enumerate(zip(series, styles)):
        offset = (k - (len(series) - 1) / 2) * width
        n_out += _ratio_series(ax, pairs, offset, style, label, limits)
    _ratio_axes(ax, grid, "time ratio, paired", "below 1: ours faster", limits, n_out)
    ax.set_title(
        "ours vs hand-written: median and interquartile range of the per-round "
        "ratios; dots: every round",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_order(grid: dict, path: str) -> None:
    plt = _pyplot()
    a, b = ORDER
    pairs = pairs_of(grid, a, b)
    fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(grid["cells"])) + 4, 5))
    limits = _ratio_limits([pairs], noise_floor(grid))
    style = dict(color="C3", marker="o")
    n_out = _ratio_series(ax, pairs, 0.0, style, f"{a} / {b}", limits)
    _ratio_axes(ax, grid, f"{a} / {b}, paired", f"below 1: {a} faster", limits, n_out)
    ax.set_title(
        f"{a} vs {b}: median and interquartile range of the per-round ratios; "
        "dots: every round",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _label_points(ax, xs, values, labels) -> None:
    for x, v, t in zip(xs, values, labels):
        ax.annotate(
            t,
            (x, v),
            textcoords="offset points",
            xytext=(6, 0),
            ha="left",
            va="center",
            fontsize=7,
        )


def plot_memory(mem: dict, path: str) -> None:
    """Two panels, compiled temp bytes and time, both on log axes. A log axis has no
    0: a strategy with 0 temp bytes is a hollow marker on the bottom axis, `0 B`."""
    plt = _pyplot()
    import matplotlib.ticker as ticker

    rows = mem["rows"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    by = {(r["workload"], r["strategy"]): r for r in rows}
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(13, 5))
    positive = [r["temp_bytes"] for r in rows if r["temp_bytes"] > 0]
    bottom = min(positive + [mem["intermediate"]]) / 10
    width = 0.7 / len(strategies)
    for i, s in enumerate(strategies):
        style = dict(color=f"C{i}", marker="osD^v"[i % 5], ms=7, ls="none")
        xs = [
            w + (i - (len(strategies) - 1) / 2) * width for w in range(len(workloads))
        ]
        sub = [by[(w, s)] for w in workloads]
        temps = [r["temp_bytes"] for r in sub]
        at = [t if t > 0 else bottom for t in temps]
        pos = [(x, t) for x, t in zip(xs, temps) if t > 0]
        ax_mem.plot([x for x, _ in pos], [t for _, t in pos], label=s, **style)
        zeros = [x for x, t in zip(xs, temps) if t <= 0]
        ax_mem.plot(zeros, [bottom] * len(zeros), mfc="white", clip_on=False, **style)
        _label_points(ax_mem, xs, at, map(fmt_bytes, temps))
        meds = [r["median_ms"] for r in sub]
        ax_time.errorbar(
            xs,
            meds,
            yerr=[
                [r["median_ms"] - r["q25_ms"] for r in sub],
                [r["q75_ms"] - r["median_ms"] for r in sub],
            ],
            capsize=3,
            label=s,
            **style,
        )
        _label_points(ax_time, xs, meds, (f"{m:.3g}" for m in meds))
    ax_mem.axhline(
        mem["intermediate"],
        color="grey",
        ls=":",
        lw=1,
        label=f"all n intermediates at once: {fmt_bytes(mem['intermediate'])}",
    )
    for ax, title in (
        (ax_mem, "compiled temp bytes (log; hollow on the axis: 0 B)"),
        (ax_time, "time (ms, log): median and interquartile range"),
    ):
        ax.set_yscale("log")
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_xlim(-0.5, len(workloads) - 0.5)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    ax_mem.set_ylim(bottom=bottom)
    # Bytes at every 32x, in B/KiB/MiB/GiB; times as plain numbers at 1, 2, 5 x 10^k.
    ax_mem.yaxis.set_major_locator(
        ticker.FixedLocator([2.0**k for k in range(0, 50, 5)])
    )
    ax_mem.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: fmt_bytes(v)))
    ax_time.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax_time.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax_time.margins(y=0.1)
    handles, labels = ax_mem.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.suptitle(f"memory and time: scan vs vmap (n={mem['n']}, M=K={mem['m']})")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def grid_figures(grid: dict, out: str) -> list[tuple[str, str]]:
    """Write the grid's figures into `out`; return their (file name, title)s."""
    figures = [
        ("ours_vs_hand.png", "ours vs hand-written", plot_ours_vs_hand),
        ("order.png", "scan(vmap) vs vmap(scan)", plot_order),
    ]
    for name, _, plot in figures:
        plot(grid, os.path.join(out, name))
    return [(name, title) for name, title, _ in figures]


def memory_figures(mem: dict, out: str) -> list[tuple[str, str]]:
    plot_memory(mem, os.path.join(out, "memory.png"))
    return [("memory.png", "memory and time: scan vs vmap")]


def no_figures(result: dict, out: str) -> list[tuple[str, str]]:
    """The bandwidth section has its table only."""
    del result, out
    return []


# ----------------------------------------------------------------------------------
# The headline summary.


def summary_rows(results: dict[str, dict]) -> list[list[str]]:
    """The headline answers, one row each: question, median, range, note."""
    rows = []
    grid = results.get("grid")
    if grid is not None:
        floor = noise_floor(grid)
        for a, b, label in OURS_VS_HAND:
            ratios = [p["paired"] for p in measured(pairs_of(grid, a, b))]
            if ratios:
                rows.append(
                    [
                        f"ours / hand-written, {label.replace('`', '')}",
                        f"{statistics.median(ratios):.2f}",
                        f"{min(ratios):.2f} to {max(ratios):.2f}",
                        _beyond(ratios, floor).replace("the noise floor ", "noise "),
                    ]
                )
        if floor is not None:
            ratios = [p["paired"] for p in measured(pairs_of(grid, *NOISE))]
            rows.append(
                [
                    "noise floor: identical programs",
                    f"{statistics.median(ratios):.2f}",
                    f"{floor[0]:.2f} to {floor[1]:.2f}",
                    f"{len(ratios)} cells",
                ]
            )
        ratios = [p["paired"] for p in measured(pairs_of(grid, *ORDER))]
        if ratios:
            faster = sum(r < 1 for r in ratios)
            rows.append(
                [
                    "scan(vmap) / vmap(scan)",
                    f"{statistics.median(ratios):.2f}",
                    f"{min(ratios):.2f} to {max(ratios):.2f}",
                    f"scan(vmap) faster in {faster} of {len(ratios)} cells",
                ]
            )
        ratios = [p["paired"] for p in measured(pairs_of(grid, "ours auto"))]
        if ratios:
            hi = floor[1] if floor else 1.0
            rows.append(
                [
                    'plan="auto" / fastest fixed',
                    f"{statistics.median(ratios):.2f}",
                    f"{min(ratios):.2f} to {max(ratios):.2f}",
                    f"at most noise top ({hi:.2f}) in "
                    f"{sum(r <= hi for r in ratios)} of {len(ratios)}",
                ]
            )
    mem = results.get("memory")
    if mem is not None:
        for w, s, v in _scan_vs_vmap(mem):
            rows.append(
                [
                    f"memory {w}: scan / vmap time",
                    f"{s['ratio_vs_vmap']:.2f}",
                    f"{s['ratio_q25']:.2f} to {s['ratio_q75']:.2f} (IQR)",
                    f"temp {fmt_bytes(s['temp_bytes'])} vs "
                    f"{fmt_bytes(v['temp_bytes'])}; {s['median_ms']:.3g} vs "
                    f"{v['median_ms']:.3g} ms",
                ]
            )
    return rows


SUMMARY_HEADER = ("headline (paired ratios)", "median", "range", "note")


def summary_markdown(rows: list[list[str]]) -> str:
    return "\n".join(
        [
            "## Summary",
            "",
            PAIRED + " The grid's ranges are over cells; the memory rows' over rounds.",
            "",
            table(SUMMARY_HEADER, rows, "lrll"),
        ]
    )


def summary_text(rows: list[list[str]]) -> str:
    """`rows` as a plain-text table for the terminal."""
    lines = [list(SUMMARY_HEADER), *rows]
    widths = [max(len(r[k]) for r in lines) for k in range(len(SUMMARY_HEADER))]
    lines.insert(1, ["-" * w for w in widths])
    return "\n".join(
        "  ".join(
            c.rjust(w) if k == 1 else c.ljust(w)
            for k, (c, w) in enumerate(zip(r, widths))
        ).rstrip()
        for r in lines
    )
