"""`qtool sensitivity BF16 QUANTIZED -o OUT`: how much each unit's quantization costs, measured.

One streamed pass over a BF16 checkpoint and its quantized sibling (NVFP4 of either flavour, AWQ / INT4)
on calibration windows (the dataset options of calibrate-kv). Output: OUT/sensitivity.json, a table with
one row per unit (qtool.ops.sensitivity.units: a layer's routed experts, its shared expert, its token
mixer, the MTP head, lm_head): its format, its bytes in BF16 and quantized, the extra bytes per GPU in BF16
at each TP size, and, for the units the quantized side quantizes, the measured error and effect
(qtool.ops.sensitivity.measure). `qtool plan hybrid` reads it.

plan -> execute: `plan()` reads headers, configs and the tokenizer (the windows); `execute()` runs the
pass through the output transaction (OUT.partial/, a journal per layer for --resume, the manifest).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from qtool.arch.layer_grid import row_name
from qtool.arch.model_map import build_map
from qtool.dist.launch import require_device
from qtool.errors import PlanError
from qtool.io.apply import OutputJob, input_hasher, write_output
from qtool.io.checkpoint import Checkpoint
from qtool.io.files import require_text_path
from qtool.io.jsonio import load_json, write_json
from qtool.io.manifest import RUN
from qtool.io.output import MANIFEST_NAME, OutputDir
from qtool.io.plan import OutputPlan
from qtool.ops.contract import Report
from qtool.ops.sensitivity.formats import FormatSet
from qtool.ops.sensitivity.measure import fill, measure, work_dir
from qtool.ops.sensitivity.schema import check_table
from qtool.ops.sensitivity.units import TP_SIZES, Unit, check_pair, list_units
from qtool.stream.calib_data import plan_calibration
from qtool.stream.layer_stream import LayerStreamer, streamed_files
from qtool.stream.memory_plan import need

TABLE = "sensitivity.json"
FORMAT = "qtool-sensitivity"
SCHEMA_VERSION = 1  # a table without --formats: byte for byte what it always was
FORMATS_SCHEMA_VERSION = 2  # with --formats: a top-level "formats" and each layer unit's row per format
SCHEMA_VERSIONS = (SCHEMA_VERSION, FORMATS_SCHEMA_VERSION)


@dataclass(frozen=True)
class SensitivityOptions:
    bf16: Path
    quantized: Path
    out: Path
    dataset: str = "builtin"
    samples: int = 4
    seq_len: int = 512
    device: str = "cpu"
    dtype: str | None = None
    batch_tokens: int | None = None
    force: bool = False
    resume: bool = False
    command: str | None = None
    formats: FormatSet | None = None  # measure each layer unit in each of these too (qtool.ops.sensitivity.formats)


@dataclass
class SensitivityPlan:
    options: SensitivityOptions
    bf: Checkpoint
    q: Checkpoint
    units: list[Unit]
    calib: object  # qtool.stream.calib_data.CalibSet
    work_dir: Path
    stream: dict = field(default_factory=dict)  # the BF16 side's StreamPlan (layer sizes, micro-batch)
    memory: object = None  # qtool.stream.memory_plan.MemoryNeed
    warnings: list[str] = field(default_factory=list)

    @property
    def layers_run(self) -> int | None:
        """The decoder layers the job runs (its progress's total)."""
        return self.stream.get("num_layers")

    def to_json(self) -> dict:
        measured = [u for u in self.units if u.measured]
        return {
            "bf16": str(self.bf.root),
            "quantized": str(self.q.root),
            "output": str(self.options.out),
            "units": len(self.units),
            "measured": [u.id for u in measured],
            **({} if self.options.formats is None else {"formats": _formats_plan(self.options.formats, self.units)}),
            "not_measured": {u.id: u.note for u in self.units if not u.measured},
            "calibration": self.calib.to_json(),
            "device": self.options.device,
            "work_dir": str(self.work_dir),
            "memory": {**self.stream, "need": self.memory.to_json() if self.memory else None},
            "warnings": self.warnings,
        }


def _formats_plan(formats: FormatSet, units: list[Unit]) -> dict:
    """The candidates, and the units measured in each format other than BF16 (--dry-run shows them)."""
    by_format: dict[str, list[str]] = {}
    for u in units:
        for f in u.formats or {}:
            if f != "bf16":
                by_format.setdefault(f, []).append(u.id)
    return {**formats.to_json(), "measured": by_format}


def plan(opts: SensitivityOptions) -> SensitivityPlan:

    require_device(opts.device, elsewhere=True)  # the CLI refused a run's missing GPU already
    # the table names them: a name that is not UTF-8 is refused now, not after the whole pass
    for path, flag in (
        (opts.bf16, "BF16"),
        (opts.quantized, "QUANTIZED"),
        (opts.out, "-o"),
        (opts.dataset, "--dataset"),
    ):
        require_text_path(path, flag)
    bf = Checkpoint.open(opts.bf16, require_config=True)
    q = Checkpoint.open(opts.quantized, require_config=True)
    bf_map, q_map = build_map(bf), build_map(q)
    check_pair(bf_map, q_map)
    units = list_units(bf_map, q_map, opts.formats)
    for u in units:
        if u.quantized and u.layer is not None and not u.note:
            u.measured = True
        elif u.quantized and not u.note:
            u.note = "not measured: its forward is not part of the decoder stream (cost listed)"
    OutputDir(opts.out, sources=[bf.root, q.root], force=opts.force, resume=opts.resume).check()
    calib = plan_calibration(bf, opts.dataset, opts.samples, opts.seq_len)

    sp = LayerStreamer(bf, device=opts.device, dtype=opts.dtype, batch_tokens=opts.batch_tokens).plan(
        calib.samples, calib.seq_len
    )
    # a BF16 layer and its quantized twin are dense at once (the twin's modules run on the same inputs), and
    # with --formats the layer's units coded in each candidate format (at most a layer each)
    coded = 0 if opts.formats is None else sum(c.value != "bf16" for c in opts.formats.candidates)
    memory = need(sp, device=opts.device, held_layers=2 + coded)
    p = SensitivityPlan(opts, bf, q, units, calib, work_dir(Path(opts.out)), sp.to_json(), memory)
    if memory.warning():
        p.warnings.append(memory.warning())
    return p


def table(p: SensitivityPlan) -> dict:
    """sensitivity.json: the sources, the windows and the unit rows. Nothing of the run itself (its timing
    is the manifest's run section): the same inputs give the same bytes, resumed or not."""
    formats = p.options.formats
    return {
        "format": FORMAT,
        "schema_version": SCHEMA_VERSION if formats is None else FORMATS_SCHEMA_VERSION,
        "bf16": {"path": str(p.bf.root)},
        "quantized": {"path": str(p.q.root)},
        "model": model_shape(p.bf),
        "tp_sizes": list(TP_SIZES),
        "calibration": p.calib.to_json(),
        "device": p.options.device,
        **({} if formats is None else {"formats": formats.to_json()}),
        "units": [u.to_json() for u in p.units],
    }


def output_plan(p: SensitivityPlan):
    """The output as the one executor runs it (qtool.io.apply.write_output): the table is the producer's
    (written once measured), the checkpoints are its inputs (their identity keys the resume, their sha256,
    taken from the pass's own reads, goes into the manifest and proves a resumed run's inputs unchanged)."""
    return OutputPlan(
        "sensitivity",
        [],
        sources={"bf16": p.bf.root, "quantized": p.q.root},
        inputs=sorted({h.path for ck in (p.bf, p.q) for h in ck.headers.values()}),
        summary={"units": len(p.units), "measured": sum(u.measured for u in p.units), "calibration": p.calib.to_json()},
    )


def execute(p: SensitivityPlan, *, progress=None) -> Report:
    o = p.options
    t0 = time.perf_counter()
    tx = OutputDir(o.out, sources=[p.bf.root, p.q.root], force=o.force, resume=o.resume)
    state: dict = {}

    def produce(_shards) -> None:
        result = measure(p, resume=o.resume, progress=progress, digests=hasher.read_digests)
        fill(p.units, result)
        state["table"], state["timing"] = table(p), result["timing"]
        write_json(tx.partial / TABLE, state["table"])

    def check() -> dict:
        shutil.rmtree(p.work_dir, ignore_errors=True)  # the hidden states: the table is all that is kept
        return {}

    with tx:
        # both checkpoints are hashed from the pass's reads (one read of each), as calibrate-kv's input: the
        # hasher hands them over
        hasher = input_hasher(tx, streamed_files(p.bf) | streamed_files(p.q))
        try:
            write_output(
                output_plan(p),
                tx,
                OutputJob(
                    command=o.command,
                    produce=produce,
                    check=check,
                    hasher=hasher,
                    extra=lambda: {RUN: {"timing": state["timing"]}},
                ),
            )
        finally:
            hasher.close()  # (after the pass: its reads hand their bytes to the hasher's digests)
    return Report(
        {
            "plan": p.to_json(),
            "table": state["table"],
            "output": str(tx.out),
            "timing": state["timing"],
            "seconds": time.perf_counter() - t0,
        }
    )


MODEL_KEYS = ("num_hidden_layers", "hidden_size", "num_experts", "moe_intermediate_size")


def model_shape(ck: Checkpoint) -> dict:
    """The text config's keys that tell one model from another (a table is about one model)."""
    return {k: ck.text_config.get(k) for k in MODEL_KEYS}


def check_table_model(data: dict, ck: Checkpoint, what: str) -> None:
    """A named error when the table was measured on another model than `ck` (tables of this schema name it)."""
    want = data.get("model")
    if want and model_shape(ck) != want:
        k = next(k for k in MODEL_KEYS if model_shape(ck).get(k) != want.get(k))
        raise PlanError(
            f"the sensitivity table was measured on another model than {what}",
            path=ck.root,
            expected=f"{k} {want.get(k)} (the table's)",
            got=f"{k} {ck.text_config.get(k)}",
            hint="give the table made from this model's checkpoints (qtool sensitivity BF16 QUANTIZED -o OUT)",
        )


def table_input(path: str | Path) -> Path:
    """What a command given the table at `path` reads, as an input no output may lie in: the sensitivity
    output directory (given as OUT/, or as OUT/sensitivity.json beside its manifest), else the JSON file
    itself (a table kept elsewhere: its directory is the user's)."""
    path = Path(path)
    if path.name == TABLE and (path.parent / MANIFEST_NAME).is_file():
        return path.parent
    return path


def load_table(path: str | Path) -> dict:
    """A sensitivity table: OUT/ (its sensitivity.json) or the JSON file itself; a named error otherwise."""
    path = Path(path)
    f = path / TABLE if path.is_dir() else path
    if not f.exists():
        raise PlanError(
            "no sensitivity table there",
            path=f,
            hint="make one: qtool sensitivity BF16 QUANTIZED -o OUT, then pass OUT (or OUT/sensitivity.json)",
        )
    data, _ = load_json(f, what="sensitivity table")
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise PlanError(
            "not a qtool sensitivity table",
            path=f,
            expected=f'{{"format": "{FORMAT}", ...}}',
            hint="make one with qtool sensitivity BF16 QUANTIZED -o OUT",
        )
    version = data.get("schema_version")
    if isinstance(version, bool) or version not in SCHEMA_VERSIONS:
        raise PlanError(
            "the sensitivity table has another schema version",
            path=f,
            expected=" or ".join(map(str, SCHEMA_VERSIONS)),
            got=data.get("schema_version"),
            hint="make it again with this qtool: qtool sensitivity BF16 QUANTIZED -o OUT",
        )
    check_table(data, f)  # types, signs and finiteness of every value the planner and the report use
    return data


def heat_cells(data: dict) -> dict:
    """The measured units as the report's layer grid places them: {row: {column: {"effect", "rank",
    "level"}}} (rank 1 = the most sensitive; level = effect / the largest effect, 0..1)."""
    measured = sorted(
        (u for u in data["units"] if u.get("measured") and u.get("effect") is not None and u.get("layer") is not None),
        key=lambda u: -u["effect"],
    )
    top = measured[0]["effect"] if measured and measured[0]["effect"] > 0 else 1.0
    out: dict = {}
    for rank, u in enumerate(measured, 1):
        out.setdefault(row_name(u["layer"], False), {})[u["kind"]] = {
            "effect": u["effect"],
            "error": u["error"],
            "rank": rank,
            "of": len(measured),
            "level": u["effect"] / top,
        }
    return out


__all__ = ["heat_cells", "SensitivityOptions", "SensitivityPlan", "TABLE", "execute", "load_table", "plan", "table"]
