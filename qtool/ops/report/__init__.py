"""`qtool report`: one or two artifacts as one self-contained HTML page (layer x module-group grid by
storage format with the verify findings in place, KV scales, expert layout, memory fit per GPU and
sequences vs context, KLD against a reference, provenance and the launch command).

plan(ReportOptions) checks the options, the checkpoints' presence, the KLD results and the output file
(nothing is read beyond headers, configs and the manifest); execute(plan) runs inspect and verify (and
eval kld with --ref), draws the page and writes it atomically. The page's numbers are the objects those
commands print with --json (qtool.ops.report.data).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from qtool import __version__
from qtool.errors import CheckpointError, UsageError
from qtool.hub.headers import stand_in_commit
from qtool.io.checkpoint import Checkpoint, checkpoint_not_found, reuse_opened
from qtool.io.files import read_regular, require_text_path
from qtool.io.jsonio import atomic_write_text
from qtool.io.output import check_file_output
from qtool.ops.kld import RESULT_KEYS, KldOptions, run
from qtool.ops.report.data import Artifact, artifact_data, grid_difference
from qtool.ops.report.page import render
from qtool.ops.sensitivity import check_table_model, heat_cells, load_table, table_input
from qtool.ops.verify import validate
from qtool.ops.verify.memory_fit import Target

GENERATOR = '<meta name="generator" content="qtool report'
MAX_ARTIFACTS = 2  # a page compares two side by side; more would not fit a screen's width


@dataclass(frozen=True)
class ReportOptions:
    artifacts: tuple[Artifact, ...]
    out: Path
    verify: object  # qtool.ops.verify.VerifyOptions: engine, TP, GPUs, context, KV dtype, MTP
    ref: str | None = None  # eval kld's reference (each artifact is evaluated against it)
    kld: tuple[str, ...] = ()  # saved `eval kld --json` results, one per artifact in order
    kld_options: object | None = None  # qtool.ops.kld.KldOptions for --ref
    ref_label: str | None = None  # how the user named --ref (an hf: source), for the page
    force: bool = False
    # --kv-cache-dtype as given; None: each artifact's as serve-config chooses it (fp8 where calibrated)
    kv_cache_dtype: str | None = None
    sensitivity: Path | None = None  # a `qtool sensitivity` table: drawn as a heat layer on the grid


@dataclass
class ReportPlan:
    options: ReportOptions
    klds: list[dict | None]  # per artifact: a loaded --kld result, or None (then --ref runs eval kld)

    def to_json(self) -> dict:
        o = self.options
        return {
            "artifacts": [a.label for a in o.artifacts],
            "out": str(o.out),
            "ref": o.ref,
            "kld": list(o.kld),
            "engine": o.verify.engine,
            "tp": o.verify.tp,
            "gpus": o.verify.gpus,
        }


@dataclass
class ReportResult:
    path: str
    bytes: int
    artifacts: list[str]
    ok: list[bool]
    sections: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "path": self.path,
            "bytes": self.bytes,
            "artifacts": self.artifacts,
            "ok": self.ok,
            "sections": self.sections,
        }


def plan(opts: ReportOptions) -> ReportPlan:
    validate(opts.verify)
    # the page names its inputs: a name that is not UTF-8 cannot be written into it (said now, not at the end)
    named = (
        [(a.label, "CKPT") for a in opts.artifacts]
        + [(k, "--kld") for k in opts.kld]
        + [(p, flag) for p, flag in ((opts.ref_label, "--ref"), (opts.sensitivity, "--sensitivity")) if p is not None]
    )
    for path, flag in named:
        require_text_path(path, flag)
    if opts.sensitivity is not None:  # a named error now, not after the page's work
        table = load_table(opts.sensitivity)
        for a in opts.artifacts:
            check_table_model(table, Checkpoint.open(a.path, require_config=True), a.label)
    if not opts.artifacts:
        raise UsageError("give the checkpoint to report on", hint="qtool report CKPT -o report.html")
    if len(opts.artifacts) > MAX_ARTIFACTS:
        raise UsageError(f"a report compares at most {MAX_ARTIFACTS} artifacts", got=len(opts.artifacts))
    for a in opts.artifacts:
        if not Path(a.path).exists():
            raise checkpoint_not_found(a.label)
        if opts.ref and _header_only(Path(a.path)):
            raise UsageError(
                "--ref needs the checkpoint's data, and this is a header-only stand-in",
                path=a.label,
                hint="download it first (qtool download ORG/NAME -o DIR) or report a local copy",
            )
    if opts.ref and opts.kld:
        raise UsageError(
            "--ref and --kld both give the KLD: pass one",
            hint="--ref REF runs eval kld now; --kld FILE.json reads a saved `eval kld --json` result",
        )
    if opts.kld and len(opts.kld) != len(opts.artifacts):
        raise UsageError(
            f"--kld gives {len(opts.kld)} result(s) for {len(opts.artifacts)} artifact(s)",
            hint="pass one --kld FILE.json per checkpoint, in the same order",
        )
    _check_output(opts)
    klds = [load_kld(Path(k)) for k in opts.kld] or [None] * len(opts.artifacts)
    return ReportPlan(opts, klds)


def _header_only(path: Path) -> bool:
    return stand_in_commit(path) is not None


def _check_output(opts: ReportOptions) -> None:
    """-o is an output of the one contract (qtool.io.output.check_file_output): an .html file outside
    every input, replacing only a report qtool wrote, and that only with --force."""
    out = opts.out
    if out.is_dir():
        raise UsageError("-o names a directory", path=out, hint="name the .html file to write, e.g. -o report.html")
    if out.suffix.lower() not in (".html", ".htm"):
        raise UsageError("-o must name an .html file", got=str(out), hint="e.g. -o report.html")
    sources = [a.path for a in opts.artifacts] + [Path(k) for k in opts.kld] + ([Path(opts.ref)] if opts.ref else [])
    if opts.sensitivity is not None:
        sources.append(table_input(opts.sensitivity))
    check_file_output(
        out, sources=sources, force=opts.force, ours=lambda head: GENERATOR in head[:512].decode("utf-8", "replace")
    )


def load_kld(path: Path) -> dict:
    """A saved `eval kld --json` result, checked: it must hold the statistics the page draws."""
    if not os.path.lexists(path):
        raise CheckpointError(
            "KLD result not found", path=path, hint="save one with `qtool eval kld ... --json > FILE`"
        )
    try:
        obj = json.loads(read_regular(path, "KLD result").decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(
            f"KLD result is not JSON ({e})",
            path=path,
            hint="save it with `qtool eval kld --ref REF --test TEST --json > FILE`",
        ) from None
    if isinstance(obj, dict) and isinstance(obj.get("result"), dict):
        obj = obj["result"]  # the full report (`--dry-run`-less to_json) holds it under "result"
    missing = [k for k in RESULT_KEYS if not isinstance(obj, dict) or k not in obj]
    if missing:
        raise CheckpointError(
            "KLD result lacks " + ", ".join(missing),
            path=path,
            hint="re-run `qtool eval kld ... --json` with this qtool version (it prints them)",
        )
    bad = [k for k in RESULT_KEYS if not _kld_value_ok(k, obj[k])]
    if bad:
        raise CheckpointError(
            "KLD result has values of the wrong type: " + ", ".join(bad),
            path=path,
            hint="save it anew with `qtool eval kld ... --json > FILE` (it was edited or truncated)",
        )
    return {k: obj[k] for k in RESULT_KEYS}


def _kld_value_ok(key: str, v) -> bool:
    num = (int, float)
    if key == "histogram":
        return (
            isinstance(v, dict)
            and isinstance(v.get("edges"), list)
            and isinstance(v.get("counts"), list)
            and len(v["edges"]) == len(v["counts"]) + 1
            and all(isinstance(x, num) for x in v["edges"] + v["counts"])
            and isinstance(v.get("below"), int)
            and isinstance(v.get("above"), int)
        )
    if key == "per_position":
        return v is None or (isinstance(v, dict) and all(isinstance(v.get(k), list) for k in ("position", "mean")))
    return isinstance(v, num) and not isinstance(v, bool)


def execute(p: ReportPlan, *, progress=None) -> ReportResult:

    o = p.options

    with reuse_opened():  # inspect, verify and serve-config read the same headers: parse them once
        artifacts = [
            artifact_data(a, o.verify, kld, o.kv_cache_dtype) for a, kld in zip(o.artifacts, p.klds, strict=True)
        ]
    if o.ref:  # after the header-only work: a broken artifact fails before the long run
        for a, art in zip(artifacts, o.artifacts, strict=True):
            a["kld"] = run_kld(o.ref, art.path, o.kld_options, progress)
    klds = [a["kld"] for a in artifacts]
    difference = (
        grid_difference(artifacts[0]["inspect"]["grid"], artifacts[1]["inspect"]["grid"])
        if len(artifacts) == 2
        else None
    )
    v = o.verify
    kld_run = None
    if o.ref:
        ko = o.kld_options
        kld_run = {
            "ref": o.ref_label or o.ref,
            "dataset": getattr(ko, "dataset", "builtin"),
            "windows": getattr(ko, "windows", None),
            "seq_len": getattr(ko, "seq_len", None),
        }
    elif o.kld:
        kld_run = {"files": list(o.kld)}

    target = Target.parse(v.gpus)  # the header names the GPUs the TP group uses, not all that were given
    heat = None
    if o.sensitivity is not None:
        cells = heat_cells(load_table(o.sensitivity))
        top = sorted(
            ({"row": r, "col": c, "rank": h["rank"]} for r, cols in cells.items() for c, h in cols.items()),
            key=lambda t: t["rank"],
        )[:5]
        table = load_table(o.sensitivity)
        heat = {"path": str(o.sensitivity), "cells": cells, "top": top, "measured_on": table["quantized"]["path"]}
    data = {
        "qtool_version": __version__,
        "artifacts": artifacts,
        "difference": difference,
        "kld_run": kld_run,
        "sensitivity": heat,
        "options": {
            "engine": v.engine,
            "tp": v.tp,
            "gpus": v.gpus,
            "num_gpus": target.num_gpus,
            "gpu_size": f"{target.gpu_bytes / 2**20:.0f} MiB",
            "max_model_len": v.max_model_len,
            "max_num_seqs": v.max_num_seqs,
            "kv_cache_dtype": o.kv_cache_dtype or "fp8 where calibrated, else auto (as serve-config)",
            "mtp": v.mtp,
        },
    }
    html = render(data)
    atomic_write_text(o.out, html)
    sections = (
        ["verdict", "grid", "kv", "memory", "provenance"]
        + (["kld"] if any(klds) else [])
        + (["difference"] if difference is not None else [])
        + (["sensitivity"] if heat else [])
    )
    return ReportResult(
        str(o.out),
        len(html.encode("utf-8")),
        [a["label"] for a in artifacts],
        [a["verify"]["ok"] for a in artifacts],
        sections,
    )


def run_kld(ref: str, test: Path, kld_options, progress) -> dict:
    """eval kld of `test` against `ref` (the same run and result as `qtool eval kld --ref REF --test TEST`)."""
    rep = run(ref, str(test), opts=kld_options or KldOptions(), progress=progress)
    return {k: rep.result[k] for k in RESULT_KEYS}
