"""What a report shows of one artifact, as plain JSON: the objects `inspect --json`, `verify --json`
and `eval kld --json` print (one source of truth), and what the page adds by joining them: the verify
findings placed in the layer grid, the manifest's provenance, the serve-config launch command.

The page embeds exactly this data (script#qtool-report-data); the tests compare it with the commands'
own JSON output.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from qtool.arch.layer_grid import cell_of
from qtool.arch.qwen35 import Naming
from qtool.errors import QtoolError
from qtool.hub.headers import stand_in_commit
from qtool.io.output import MANIFEST_NAME
from qtool.ops.inspect import inspect_checkpoint
from qtool.ops.serve_config import ServeOptions, plan, render
from qtool.ops.verify import parse_engines, verify


@dataclass(frozen=True)
class Artifact:
    path: Path  # what the ops read (a local directory, or the header-only stand-in of an hf: source)
    label: str  # what the page calls it (the user's argument: a path or hf:ORG/NAME@REV)


def artifact_data(art: Artifact, verify_opts, kld: dict | None = None, kv_cache_dtype: str | None = None) -> dict:
    """One artifact's section of the report; its memory fit and launch lines with the KV-cache dtype
    serve-config would use (`kv_cache_dtype`, else fp8 where the artifact's scales are calibrated)."""
    inspected = inspect_checkpoint(art.path)
    # kv_cache_dtype None: verify judges it with the dtype it is served with (fp8 where calibrated), once
    rep = verify(art.path, replace(verify_opts, deep=False, kv_cache_dtype=kv_cache_dtype))
    verify_opts = replace(verify_opts, kv_cache_dtype=rep.kv_cache_dtype)  # the launch lines' too
    verified = rep.to_json()
    if art.label != str(art.path):  # an hf: source's stand-in: messages and fixes name the source
        inspected, verified = (_renamed(x, str(art.path), art.label) for x in (inspected, verified))
    naming = Naming(inspected["naming"])
    return {
        "label": art.label,
        "inspect": inspected,
        "verify": verified,
        "marks": place_findings(verified["findings"], naming, inspected["grid"]),
        "kld": kld,
        "provenance": provenance(art.path),
        "expert_coverage": expert_coverage(art.path),
        "launch": launch_commands(art, verify_opts),
    }


def _renamed(obj, old: str, new: str):
    if isinstance(obj, str):
        return obj.replace(old, new)
    if isinstance(obj, list):
        return [_renamed(x, old, new) for x in obj]
    if isinstance(obj, dict):
        return {k: _renamed(v, old, new) for k, v in obj.items()}
    return obj


def place_findings(findings: list[dict], naming: Naming, grid: dict) -> dict:
    """{"cells": {row: {column: [finding index]}}, "elsewhere": [finding index]}: each verify finding in
    the grid cell of the module it names (what an engine will do differently from the tensors, in place);
    a finding whose row the grid does not draw (an MTP head that is missing) is listed beside it."""
    drawn = {"model"} | {r["row"] for r in grid["rows"]}
    cells: dict[str, dict[str, list[int]]] = {}
    elsewhere: list[int] = []
    for i, f in enumerate(findings):
        where = cell_of(f["module"], naming) if f.get("module") else None
        if where is None or where[0] not in drawn:
            elsewhere.append(i)
            continue
        row, col = where
        cells.setdefault(row, {}).setdefault(col, []).append(i)
    return {"cells": cells, "elsewhere": elsewhere}


def provenance(root: Path) -> dict | None:
    """The manifest's record of how the artifact was made: qtool version, command, operation, library
    versions, sources (path or Hub repo, commit, every file's sha256), the build recipe and its steps.
    None for a checkpoint qtool did not make."""
    path = Path(root) / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        m = None
    if not isinstance(m, dict):
        return {"error": f"{path} is not a readable qtool manifest (JSON object)"}
    sources = []
    for name, src in (m.get("sources") or {}).items():
        if not isinstance(src, dict):
            continue
        files = src.get("files") or {}
        sources.append(
            {
                "name": name,
                "path": src.get("path"),
                "repo": src.get("repo"),
                "commit": src.get("commit") or src.get("revision"),
                "files": [
                    {"file": f, "sha256": (v or {}).get("sha256"), "bytes": (v or {}).get("bytes")}
                    for f, v in sorted(files.items())
                ],
            }
        )
    build = m.get("build") or None
    if isinstance(build, dict) and isinstance(build.get("sources"), dict):
        # a build's artifact: its sources are the recipe's (the last step's input is only a step directory)
        sources = [_recipe_source(n, s) for n, s in build["sources"].items() if isinstance(s, dict)]
    if build:
        build = {
            "recipe": build.get("recipe"),
            "final_key": build.get("final_key"),
            "sources": build.get("sources"),
            "steps": [{k: s.get(k) for k in ("id", "op", "key", "inputs")} for s in build.get("steps") or []],
        }
    return {
        "qtool_version": m.get("qtool_version"),
        "operation": m.get("operation"),
        "command": m.get("command"),
        "libraries": m.get("libraries") or {},
        "sources": sources,
        "build": build,
    }


def expert_coverage(root: Path) -> list[dict] | None:
    """How many calibration tokens each layer's routed experts saw when qtool quantized them, per layer:
    min / median / max, the experts that saw none, and the experts below the recipe's token floor that
    were coded by the fallback rule (qtool.ops.quantize.coverage; a manifest from before the floor existed:
    the experts that saw none, coded with the layer's largest input amax). Read from the manifest: quantize's
    own `layers`, or a build's quantize step's report. None where the artifact was not quantized by qtool (or
    its manifest is unreadable: provenance says so)."""
    try:
        manifest = json.loads((Path(root) / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict):
        return None
    # quantize's own manifest, else a build's: its quantize step's report (the last one, if several)
    steps = (manifest.get("run") or {}).get("steps") or []
    candidates = [manifest.get("layers")] + [
        s["report"].get("layers") for s in reversed(steps) if isinstance(s, dict) and isinstance(s.get("report"), dict)
    ]
    for layers in candidates:
        rows = [_coverage_row(entry) for entry in layers if isinstance(entry, dict)] if isinstance(layers, list) else []
        if rows and all(r is not None for r in rows):
            return rows
    return None


def _coverage_row(entry: dict) -> dict | None:
    tokens = entry.get("tokens_per_expert")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, int) for t in tokens):
        return None
    ordered = sorted(tokens)
    return {
        "layer": entry.get("layer"),
        "scheme": entry.get("routed_experts"),
        "experts": len(tokens),
        "min": ordered[0],
        "median": statistics.median(ordered),
        "max": ordered[-1],
        "without_tokens": [i for i, t in enumerate(tokens) if t == 0],
        "expert_tokens": entry.get("expert_tokens", "natural"),
        "min_expert_tokens": entry.get("min_expert_tokens", 1),
        "fallback_rule": entry.get("fallback_rule", "layer_amax"),
        "fallback": entry.get("experts_fallback", [i for i, t in enumerate(tokens) if t == 0]),
    }


def _recipe_source(name: str, src: dict) -> dict:
    """A build recipe's source as the provenance table shows one: where it is (the Hub repo, the builtin's
    name, the local path) and its commit."""
    ident = src.get("identity") if isinstance(src.get("identity"), dict) else {}
    kind, ref = src.get("kind"), src.get("ref")
    where = {"hub": None, "builtin": f"builtin {ref}"}.get(kind, src.get("path") or ref)
    if src.get("overridden"):  # `build --source NAME=PATH` stood in for the recipe's source
        where = f"{src.get('path')} (--source, for the recipe's {kind} {ref})"
    return {
        "name": name,
        "path": where,
        "repo": ref if kind == "hub" else None,
        "commit": ident.get("commit"),
        "files": [],
    }


def launch_commands(art: Artifact, verify_opts) -> dict[str, dict]:
    """engine -> {"command": the serve-config shell text} or {"refused": why} (serve-config refuses an
    artifact that verify fails), for each engine the report checks, with the report's KV-cache dtype (the
    one its memory fit assumed); an hf: source is served by repo id at the commit it was read at."""
    hub = art.label if art.label.startswith("hf:") else None
    out: dict[str, dict] = {}
    for v in parse_engines(verify_opts.engine):
        opts = ServeOptions(
            engine=str(v),
            tp=verify_opts.tp,
            mtp=verify_opts.mtp,
            gpus=verify_opts.gpus,
            max_model_len=verify_opts.max_model_len,
            max_num_seqs=verify_opts.max_num_seqs,
            kv_cache_dtype=verify_opts.kv_cache_dtype,
            gpu_memory_utilization=verify_opts.gpu_memory_utilization,
            hub=hub,
            commit=stand_in_commit(art.path) if hub else None,
        )
        try:
            out[str(v)] = {"command": render(plan(art.path, opts), opts)}
        except QtoolError as e:
            out[str(v)] = {"refused": e.message + (f" ({e.got})" if e.got else "")}
    return out


def grid_difference(a: dict, b: dict) -> list[dict]:
    """Cells whose storage format differs between two artifacts' grids (inspect's `grid`): one entry per
    column and run of consecutive decoder layers with the same pair of formats, e.g. {"rows": "layers
    0-59", "column": "routed_experts", "a": "nvfp4", "b": "bf16", "cells": 60}."""

    def cells(grid: dict) -> dict[tuple[str, str], str]:
        out = {("model", c): cell["format"] for c, cell in grid["model"].items()}
        for r in grid["rows"]:
            out.update({(r["row"], c): cell["format"] for c, cell in r["cells"].items()})
        return out

    ca, cb = cells(a), cells(b)
    out: list[dict] = []
    for col in list(dict.fromkeys(a["model_columns"] + a["columns"] + b["columns"])):
        rows = sorted(
            {r for r, c in set(ca) | set(cb) if c == col and ca.get((r, c)) != cb.get((r, c))}, key=_row_order
        )
        for row in rows:
            pair = (ca.get((row, col)), cb.get((row, col)))
            last = out[-1] if out else None
            layer = _layer_of(row)
            if (
                last
                and last["column"] == col
                and (last["a"], last["b"]) == pair
                and layer is not None
                and last["_last"] == layer - 1
            ):
                last["_last"] = layer
                last["cells"] += 1
                last["rows"] = f"layers {last['_first']}-{layer}"
                continue
            out.append(
                {"rows": row, "column": col, "a": pair[0], "b": pair[1], "cells": 1, "_first": layer, "_last": layer}
            )
    for d in out:
        del d["_first"], d["_last"]
    return out


def _layer_of(row: str) -> int | None:
    return int(row.split()[1]) if row.startswith("layer ") else None


def _row_order(row: str) -> tuple[int, int]:
    layer = _layer_of(row)
    return (0, 0) if row == "model" else (1, layer) if layer is not None else (2, 0)
