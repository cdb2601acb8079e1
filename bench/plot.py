"""Latency against context per path, from a report (bench/report.py), as a PNG.

One panel per (op, dtype, batch): median latency (log) against context (log), one line
per path, solid for the smallest page size and dashed for the others; prefill panels use
L = S. matplotlib is optional (extra `bench`): without it the plot is skipped with a message.
"""

from __future__ import annotations

from .grid import PATHS

STYLES = ("-", "--", ":")


def _panels(cases):
    panels = {}
    for c in cases:
        if c["op"] != "write" and "median_s" in c:
            panels.setdefault((c["op"], c["dtype"], c["batch"]), []).append(c)
    return dict(sorted(panels.items(), key=lambda kv: (kv[0][0] != "decode", kv[0][1] != "float32", kv[0][2])))


def plot(report: dict, png: str) -> str:
    """Writes the PNG; returns a line saying what happened."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"plot skipped: matplotlib is not installed (optional extra: pip install '.[bench]'); not written: {png}"
    panels = _panels(report["cases"])
    if not panels:
        return "plot skipped: no timed attention cases"
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.8 * rows), squeeze=False)
    colors = dict(zip(PATHS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    page_sizes = sorted({c["page_size"] for c in report["cases"] if "page_size" in c and c["op"] != "write"})
    for ax, ((op, dtype, batch), cases) in zip(axes.flat, panels.items()):
        for path in PATHS:
            for ps, style in zip(page_sizes, STYLES):
                pts = sorted((c["context"], c["median_s"] * 1e3) for c in cases
                             if c["path"] == path and c["page_size"] == ps)
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", ms=3, color=colors[path],
                            label=f"{path} ps{ps}" if len(page_sizes) > 1 else path)
        ax.set(xscale="log", yscale="log", title=f"{op} {dtype} B{batch}",
               xlabel="context S" + (" (= L)" if op == "prefill" else ""), ylabel="median latency, ms")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    m = report["machine"]
    fig.suptitle(f"pagecheck operator latency ({report['level']} grid, {m['cpu']}, {m['kernel_threads']} threads)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return f"plot written: {png}"
