"""The report as one self-contained HTML page: a Jinja2 template (qtool/data/report/report.html.j2), the
charts inline as SVG, the data the page was drawn from embedded as JSON. Nothing is loaded from the
network when the page is opened."""

from __future__ import annotations

from importlib import resources

from qtool.ops.report import charts

COLUMN_TITLES = {
    "attention": "attention / GDN",
    "router": "router",
    "shared_expert": "shared expert",
    "routed_experts": "routed experts",
    "other": "other",
}


def _cell(artifact: dict, row: str, col: str, cell: dict | None, marks: dict, heat: dict | None = None):
    """One grid cell: coloured by format, titled with its formats and byte count, flagged with the verify
    findings placed in it; with a sensitivity table, a heat mark (its opacity: the unit's measured effect
    against the most sensitive unit's) and the effect and rank in its title."""
    from markupsafe import Markup, escape

    hot = ((heat or {}).get("cells") or {}).get(row, {}).get(col)
    found = [artifact["verify"]["findings"][k] for k in marks.get(row, {}).get(col, [])]
    if cell is None and not found and hot is None:
        return Markup(f'<td class="empty" data-row="{escape(row)}" data-col="{escape(col)}"></td>')
    fmt = cell["format"] if cell else "none"
    lines = []
    if cell:
        lines.append(", ".join(f"{n} x {f}" for f, n in cell["formats"].items()) + f"; {cell['bytes']:,} bytes")
    for f in found:
        eng = f" [{f['engine']}]" if f.get("engine") else ""
        lines.append(f"{f['severity']} {f['code']}{eng}: {f['message']}")
    heat_attr = heat_mark = ""
    if hot is not None:
        lines.append(
            f"sensitivity: effect {hot['effect']:.3g}, error {hot['error']:.3g} (rank {hot['rank']} of {hot['of']})"
        )
        heat_attr = f' data-effect="{hot["effect"]:.6g}" data-rank="{hot["rank"]}"'
        heat_mark = f'<span class="heat" style="opacity:{0.15 + 0.85 * hot["level"]:.2f}"></span>'
    classes = [f"f-{fmt}"] + (["flag"] if found else [])
    badge = f'<span class="badge">!{len(found)}</span>' if found else ""
    return Markup(
        f'<td class="{" ".join(classes)}" data-row="{escape(row)}" data-col="{escape(col)}" '
        f'data-format="{escape(fmt)}" data-findings="{len(found)}"{heat_attr} '
        f'title="{escape(chr(10).join(lines))}">{escape(fmt)}{Markup(badge)}{Markup(heat_mark)}</td>'
    )


def page_charts(artifacts: list[dict]) -> dict[str, str | None]:
    labels = [a["label"] for a in artifacts]
    fits = [(label, a["verify"]["fit"]) for label, a in zip(labels, artifacts, strict=True)]
    klds = [(label, a["kld"]) for label, a in zip(labels, artifacts, strict=True)]
    return {
        "kv": charts.kv_scales_chart(
            [(label, a["inspect"]["kv_scales"]) for label, a in zip(labels, artifacts, strict=True)], "kv"
        ),
        "memory": charts.memory_chart(fits, "mem"),
        "capacity": charts.capacity_chart(fits, "cap"),
        "kld_histogram": charts.kld_histogram_chart(klds, "kldh"),
        "kld_position": charts.kld_position_chart(klds, "kldp"),
    }


def render(data: dict) -> str:
    """The page for `data` ({"qtool_version", "options", "artifacts": [artifact_data...], "difference"})."""
    import jinja2

    template_text = resources.files("qtool").joinpath("data/report/report.html.j2").read_text(encoding="utf-8")
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["dict_values"] = lambda d: list(d.values())
    template = env.from_string(template_text)
    svg = {k: (None if v is None else _markup(v)) for k, v in page_charts(data["artifacts"]).items()}
    import functools

    cell = functools.partial(_cell, heat=data.get("sensitivity"))
    return template.render(
        **data,
        data=data,
        charts=svg,
        cell=cell,
        colours=charts.FORMAT_COLOURS,
        column_titles=COLUMN_TITLES,
        kld_source=_kld_source(data.get("kld_run")),
    )


def _kld_source(run: dict | None) -> str | None:
    if not run:
        return None
    if run.get("files"):
        return "from saved `qtool eval kld --json` results: " + ", ".join(run["files"])
    return (
        f"qtool eval kld against {run['ref']}: {run['windows']} windows x {run['seq_len']} tokens of {run['dataset']}"
    )


def _markup(svg: str):
    from markupsafe import Markup

    return Markup(svg)  # matplotlib's own SVG output, not user text
