"""The bandwidth picture: fraction of a same-run device-to-device copy against
the hidden size N, one line per op (and kernel variant), under the copy's
ceiling; drawn from the results `cunorm bench` returns or writes (--output,
--json), so a saved run can be plotted later. matplotlib is the optional extra
`cunorm[plot]`."""
from __future__ import annotations

INSTALL_HINT = 'plotting needs matplotlib: pip install "cunorm[plot]"'
FORMATS = (".png", ".svg")


def figure_class(path: str):
    """matplotlib's Figure, for drawing to `path`: ValueError unless it ends in
    .png or .svg, ImportError with the install hint without matplotlib. A
    Figure of its own rather than pyplot's: no display is needed, and a
    caller's pyplot backend is left alone (savefig renders PNG with Agg)."""
    if not str(path).lower().endswith(FORMATS):
        raise ValueError(f"{path}: expected a .png or .svg file")
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    return Figure


def series(results: dict) -> dict:
    """{(op, variant): [(N, median, min, max), ...] sorted by N} from bench
    results: the bandwidth table (variant None), `compare` (a variant each,
    with the spread over rounds) or --graph (variants "API" and "graph
    replay"). attention_delta is left out: its x is the head dim, not N."""
    lines: dict = {}

    def add(key, n, mid, lo=None, hi=None):
        lines.setdefault(key, []).append((n, mid, mid if lo is None else lo, mid if hi is None else hi))

    for row in results.get("rows", []):
        if row["op"].startswith("attention_delta"):
            continue
        if "variants" in row:
            for variant, v in row["variants"].items():
                if "skipped" in v:  # keeps the variants' order where the first size skipped one
                    lines.setdefault((row["op"], variant), [])
                    continue
                add((row["op"], variant), row["n"], v["fraction_of_copy"], v["fraction_min"], v["fraction_max"])
        elif "fraction_of_copy" in row:
            add((row["op"], None), row["n"], row["fraction_of_copy"], row.get("fraction_min"), row.get("fraction_max"))
        elif "graph" in row:
            add((row["op"], "API"), row["n"], row["api"])
            add((row["op"], "graph replay"), row["n"], row["graph"])
    return {key: sorted(points) for key, points in lines.items() if points}


STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P")


def plot_bandwidth(results: dict, path: str) -> None:
    """Writes the bandwidth picture of `results` to `path` (.png or .svg):
    a color per variant and a line style per op where there are variants,
    else a color per op. ValueError when the results hold no fractions of
    copy (--host measures time per call) or the suffix is neither."""
    fig = figure_class(path)(figsize=(9, 5), layout="constrained")
    lines = series(results)
    if not lines:
        raise ValueError("nothing to plot: these results hold no fraction of copy per hidden size "
                         "(--host measures time per call)")
    from matplotlib import colormaps

    ops = list(dict.fromkeys(op for op, _ in lines))
    variants = list(dict.fromkeys(variant for _, variant in lines))
    colored = variants if variants != [None] else ops
    palette = colormaps["tab10" if len(colored) <= 10 else "tab20"].colors
    ax = fig.add_subplot()
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="device-to-device copy")
    for (op, variant), points in lines.items():
        n, mid, lo, hi = zip(*points)
        color = palette[colored.index(op if variant is None else variant) % len(palette)]
        style = ops.index(op) if variant is not None else 0
        ax.plot(n, mid, color=color, linestyle=STYLES[style % len(STYLES)], marker=MARKERS[style % len(MARKERS)],
                markersize=4, label=op if variant is None else f"{op} ({variant})")
        if lo != hi:  # the spread over interleaved rounds
            ax.fill_between(n, lo, hi, color=color, alpha=0.2, linewidth=0)
    sizes = sorted({p[0] for points in lines.values() for p in points})
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(n) for n in sizes], rotation=45)
    ax.minorticks_off()
    ax.set_ylim(0, max(1.05, max(p[3] for points in lines.values() for p in points) * 1.05))
    ax.set_xlabel("hidden size N (log2)")
    ax.set_ylabel("fraction of a device-to-device copy")
    title = results.get("gpu", "")
    if "copy_gbps" in results:
        title += f": copy {results['copy_gbps']:.0f} GB/s"
    if "dtype" in results:
        title += f", {results['dtype']}"
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.savefig(path)
