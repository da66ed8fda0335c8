"""The report's charts, drawn by matplotlib as inline SVG (vector, text kept as text, no network or
font files needed to view them). Each takes the JSON objects the commands print, never the internals.

The SVG ids are made unique per chart (`svg.hashsalt` + an id prefix), so several charts can sit in one
HTML page without their clip paths colliding.
"""

from __future__ import annotations

import io
import re

# the storage-format colours of the grid (page.py uses the same table for the cells and the legend)
FORMAT_COLOURS = {
    "bf16": "#9aa5b1",
    "nvfp4": "#2e9e5b",
    "nvfp4-ct": "#1f8a8a",
    "fp8": "#e08a2c",
    "awq": "#7b5ea7",
    "int4-ct": "#a05195",
    "mxfp4": "#c4a000",
    "mixed": "#d64545",
}
USAGE_COLOURS = {
    "weights": "#3d6fb6",
    "kv_cache": "#2e9e5b",
    "gdn_state": "#e0b02c",
    "reserve": "#9aa5b1",
    "unused": "#e8ecf0",
}
SERIES = ["#3d6fb6", "#d64545", "#2e9e5b", "#7b5ea7", "#e08a2c"]


def _plt():
    import matplotlib

    matplotlib.use("Agg")  # no display, no GUI toolkit
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {
            "svg.fonttype": "none",
            "font.size": 9,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "svg.hashsalt": "qtool",
        }
    )
    return plt


def _svg(fig, prefix: str) -> str:
    plt = _plt()
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})  # reproducible output
    plt.close(fig)
    text = buf.getvalue()
    text = text[text.index("<svg") :]  # the XML prolog and DOCTYPE do not belong inside HTML
    # ids (clip paths, glyphs) unique per chart
    text = re.sub(r'id="([^"]+)"', lambda m: f'id="{prefix}-{m.group(1)}"', text)
    return re.sub(r'(url\(#|href="#)([^")]+)', lambda m: f"{m.group(1)}{prefix}-{m.group(2)}", text)


def kv_scales_chart(series: list[tuple[str, dict]], prefix: str) -> str | None:
    """k and v scale per full-attention layer (inspect's `kv_scales.values`), one pair of bars per layer
    and artifact; None when no artifact has values."""
    fig = kv_scales_figure(series)
    return None if fig is None else _svg(fig, prefix)


def kv_scales_figure(series: list[tuple[str, dict]]):
    """The KV-scale chart's matplotlib figure (its legend beside the axes: over them it covered the tallest
    bars)."""
    series = [(label, kv) for label, kv in series if kv.get("values")]
    if not series:
        return None
    plt = _plt()
    layers = sorted({v["layer"] for _, kv in series for v in kv["values"]})
    fig, ax = plt.subplots(figsize=(max(4.0, 0.35 * len(layers) * len(series) + 2), 2.6))
    width = 0.8 / (2 * len(series))
    for i, (label, kv) in enumerate(series):
        by_layer = {v["layer"]: v for v in kv["values"]}
        for j, which in enumerate(("k", "v")):
            xs = [layers.index(layer) + (2 * i + j - len(series) + 0.5) * width for layer in by_layer]
            ax.bar(
                xs,
                [by_layer[layer][which] for layer in by_layer],
                width,
                color=SERIES[(2 * i + j) % len(SERIES)],
                label=f"{which}_scale" + (f" ({label})" if len(series) > 1 else ""),
            )
    ax.set_xticks(range(len(layers)), [str(layer) for layer in layers])
    ax.set_xlabel("full-attention layer")
    ax.set_ylabel("scale")
    ax.legend(frameon=False, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    return fig


def memory_chart(fits: list[tuple[str, dict]], prefix: str) -> str | None:
    """Stacked bars per GPU of the TP group (verify's `fit.usage_gib`): weights, KV cache at the checked
    context, GDN state, reserve, unused, against the budget and the GPU's memory."""
    fits = [(label, f) for label, f in fits if f]
    if not fits:
        return None
    plt = _plt()
    bars = [(f"{label} GPU {g}" if len(fits) > 1 else f"GPU {g}", f) for label, f in fits for g in range(f["tp"])]
    fig, ax = plt.subplots(figsize=(6.5, 0.32 * len(bars) + 1.2))
    for y, (_name, f) in enumerate(bars):
        left = 0.0
        for part, colour in USAGE_COLOURS.items():
            width = f["usage_gib"].get(part, 0.0)
            ax.barh(
                y,
                width,
                left=left,
                color=colour,
                edgecolor="white",
                linewidth=0.5,
                label=part.replace("_", " ") if y == 0 else None,
            )
            left += width
        ax.plot([f["gpu_gib"]] * 2, [y - 0.4, y + 0.4], color="black", linewidth=1)
    ax.set_yticks(range(len(bars)), [name for name, _ in bars])
    ax.invert_yaxis()
    ax.set_xlabel("GiB per GPU (black tick: the GPU's memory; bars: the engine's budget)")
    ax.legend(frameon=False, ncol=5, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.35 - 0.02 * len(bars)))
    return _svg(fig, prefix)


def capacity_chart(fits: list[tuple[str, dict]], prefix: str) -> str | None:
    """Max concurrent sequences vs context length (verify's `fit.capacity`), log-log."""
    fits = [(label, f) for label, f in fits if f and f.get("capacity")]
    if not fits:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.0, 2.8))
    for i, (label, f) in enumerate(fits):
        pts = [(p["max_model_len"], p["max_num_seqs"]) for p in f["capacity"] if p["max_num_seqs"] > 0]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", markersize=3, color=SERIES[i % len(SERIES)], label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("max sequences")
    if len(fits) > 1:
        ax.legend(frameon=False, fontsize=8)
    ax.grid(True, which="major", alpha=0.3)
    return _svg(fig, prefix)


def kld_histogram_chart(results: list[tuple[str, dict]], prefix: str) -> str | None:
    """The KLD histograms (eval kld's `histogram`: fixed log-spaced edges), one step line per artifact."""
    results = [(label, r) for label, r in results if r and r.get("histogram")]
    if not results:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.0, 2.8))
    for i, (label, r) in enumerate(results):
        h = r["histogram"]
        total = max(1, sum(h["counts"]) + h["below"] + h["above"])
        ax.stairs(
            [c / total for c in h["counts"]],
            h["edges"],
            color=SERIES[i % len(SERIES)],
            label=f"{label} ({h['below']} below {h['edges'][0]:g})",
        )
    ax.set_xscale("log")
    ax.set_xlabel("KLD per position (nats)")
    ax.set_ylabel("fraction of positions")
    ax.legend(frameon=False, fontsize=8)
    return _svg(fig, prefix)


def kld_position_chart(results: list[tuple[str, dict]], prefix: str) -> str | None:
    """Mean KLD by position in the window (eval kld's `per_position`)."""
    results = [(label, r) for label, r in results if r and r.get("per_position")]
    if not results:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.0, 2.8))
    for i, (label, r) in enumerate(results):
        p = r["per_position"]
        ax.plot(p["position"], p["mean"], linewidth=1, color=SERIES[i % len(SERIES)], label=label)
    ax.set_xlabel("position in the window")
    ax.set_ylabel("mean KLD (nats)")
    ax.legend(frameon=False, fontsize=8)
    return _svg(fig, prefix)
