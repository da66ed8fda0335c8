"""`qtool plan hybrid`: the set of BF16 units that removes the most measured error within the memory fit.

Inputs: a sensitivity table (qtool.ops.sensitivity), the quantized checkpoint's headers (the table names
it), and the serving target (GPUs, TP, context, sequences, KV dtype, MTP). The budget per GPU is what
verify's memory fit (qtool.ops.verify.memory_fit) leaves unused at that target with the quantized
checkpoint as it is (or `--max-weights-gib` minus its weights per GPU). Each candidate unit costs its
extra bytes per GPU in BF16 at that TP and gains its measured effect (the error it adds to its layer's
output, which the BF16 unit removes); the choice is a 0/1 knapsack over the candidates, solved exactly on
a grid of at most GRID cells (costs rounded up to the cell: the choice never exceeds the budget).

Only what `assemble hybrid` can splice is a candidate: a layer's routed experts (whole: the engines load a
layer's experts as one fused MoE) and a layer's shared expert, of an NVFP4 checkpoint. The output is a
build recipe (assemble hybrid + calibrate-kv + patch-config + verify at the planned target) that
`qtool build` runs.

A table measured with `--formats` is planned by qtool.ops.sensitivity.plan_formats instead: one format per
unit (a multiple-choice knapsack) within the same budget, written as a quantization recipe.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from qtool.arch.model_map import build_map, check_config_sizes
from qtool.errors import PlanError, UsageError
from qtool.findings import Code
from qtool.io.checkpoint import Checkpoint, check_checkpoint_dir, reuse_opened
from qtool.io.files import require_text_path
from qtool.io.jsonio import atomic_write_text
from qtool.io.output import check_file_output
from qtool.ops.sensitivity import TABLE, load_table, table_input
from qtool.ops.sensitivity.plan_formats import GRID, FormatChoice, choose, kept_bf16, recipe_head, table_formats
from qtool.ops.sensitivity.units import Unit, unit_modules
from qtool.ops.verify import VerifyOptions, validate, verify
from qtool.ops.verify.memory_fit import DEFAULT_UTILIZATION, Target, default_context, kv_bytes_per_token, memory_fit
from qtool.sizes import human_bytes

GIB = 1 << 30
MAX_WEIGHTS_GIB = 1 << 20  # a PiB per GPU: far above any GPU, far below what overflows the byte arithmetic


@dataclass(frozen=True)
class PlanHybridOptions:
    sensitivity: Path
    gpus: str = "4x97887MiB"
    tp: int = 4
    max_model_len: int | None = None  # default: the model's context
    max_num_seqs: int = 1
    kv_cache_dtype: str = "auto"
    mtp: int = 0
    engine: str = "both"
    max_weights_gib: float | None = None  # a weights budget per GPU instead of the memory fit's
    gpu_memory_utilization: float | None = None
    quantized: Path | None = None  # default: the path the table names
    bf16: Path | None = None
    out: Path | None = None  # the build recipe to write
    force: bool = False  # replace a recipe this command wrote before
    dry_run: bool = False  # print the plan, write no recipe
    name: str | None = None  # the recipe's name (its output directory)
    formats: str | None = None  # a --formats table: the formats to choose from (default: all it measured)


@dataclass
class HybridChoice:
    options: PlanHybridOptions
    table: dict
    budget_bytes: int  # extra bytes per GPU the units may take
    chosen: list[Unit]
    candidates: list[Unit]
    fixed: list[dict]  # costs the plan pays whatever it chooses (an MTP head grafted for --mtp)
    fit: dict  # the quantized checkpoint's memory fit at the target
    max_model_len: int
    mtp_mode: str
    notes: list[str] = field(default_factory=list)

    @property
    def tp(self) -> int:
        return self.options.tp

    def cost(self, u: Unit) -> int:
        return u.extra_bytes_per_gpu[self.tp]

    @property
    def used_bytes(self) -> int:
        return sum(self.cost(u) for u in self.chosen)

    def predicted_error(self, bf16_ids: set[str]) -> float:
        """The sum of the effects of the measured units left quantized (the planner's objective)."""
        return sum(u.effect or 0.0 for u in self.table_units if u.measured and u.id not in bf16_ids)

    @property
    def table_units(self) -> list[Unit]:
        return [Unit.from_json(d) for d in self.table["units"]]

    def next_unit(self) -> Unit | None:
        """The best not chosen (gain per byte): what more memory would buy next."""
        ids = {u.id for u in self.chosen}
        rest = [u for u in self.candidates if u.id not in ids]
        return max(rest, key=lambda u: (u.effect or 0.0) / max(self.cost(u), 1), default=None)

    def hand_picked(self) -> dict:
        """The usual hand-picked hybrid (BF16 shared experts in every layer) by the same measure."""
        shared = [u for u in self.candidates if u.kind == "shared_expert"]
        cost = sum(self.cost(u) for u in shared)
        return {
            "units": [u.id for u in shared],
            "extra_bytes_per_gpu": cost,
            "fits": cost <= self.budget_bytes,
            "predicted_error": self.predicted_error({u.id for u in shared}),
        }

    def assemble_with(self) -> dict:
        """assemble hybrid's options for the choice (a build step's `with`)."""
        experts = sorted(u.layer for u in self.chosen if u.kind == "routed_experts")
        shared = sorted(u.layer for u in self.chosen if u.kind == "shared_expert")
        return {
            "nvfp4": "nvfp4",
            "bf16": "bf16",
            "bf16_expert_layers": experts,
            "bf16_shared_expert_layers": shared,
            "mtp": self.mtp_mode,
        }

    def recipe(self) -> dict:
        o = self.options
        calib = self.table.get("calibration") or {}
        verify = {
            "engine": o.engine,
            "tp": o.tp,
            "gpus": o.gpus,
            "max_model_len": self.max_model_len,
            "max_num_seqs": o.max_num_seqs,
            "kv_cache_dtype": "fp8" if o.kv_cache_dtype == "fp8" else "auto",
            "mtp": o.mtp,
        }
        if o.gpu_memory_utilization is not None:  # the budget was planned at it: the check must use it too
            verify["gpu_memory_utilization"] = o.gpu_memory_utilization
        fixes = ["router-ignore"] + (["mtp-ignore"] if self.mtp_mode != "keep" or self._has_mtp() else [])
        kv = {"replace_scales": True, "samples": calib.get("samples") or 4, "seq_len": calib.get("seq_len") or 512}
        if calib.get("dataset"):
            kv["dataset"] = calib["dataset"]
        return {
            "name": o.name or "planned-hybrid",
            "description": (
                f"planned by qtool plan hybrid: {len(self.chosen)} unit(s) BF16 in "
                f"{Path(self.table['quantized']['path']).name}, {human(self.used_bytes)} more per GPU "
                f"at TP={o.tp} on {o.gpus}"
            ),
            "sources": {"nvfp4": {"path": str(self.quantized_path)}, "bf16": {"path": str(self.bf16_path)}},
            "steps": [
                {"id": "hybrid", "op": "assemble", "with": self.assemble_with()},
                {"id": "kv", "op": "calibrate-kv", "input": "hybrid", "with": kv},
                {"id": "patched", "op": "patch-config", "input": "kv", "with": {"fixes": fixes}},
                {"id": "check", "op": "verify", "input": "patched", "with": verify},
            ],
        }

    def _has_mtp(self) -> bool:
        return any(u["id"] == "mtp" and u["quantized_bytes"] > 0 for u in self.table["units"])

    # absolute: the recipe is built from any working directory (a relative path would be read from that one)
    @property
    def quantized_path(self) -> Path:
        return Path(self.options.quantized or self.table["quantized"]["path"]).absolute()

    @property
    def bf16_path(self) -> Path:
        return Path(self.options.bf16 or self.table["bf16"]["path"]).absolute()

    def to_json(self) -> dict:
        nxt = self.next_unit()
        chosen = {u.id for u in self.chosen}
        return {
            "sensitivity": str(self.options.sensitivity),
            "quantized": str(self.quantized_path),
            "target": {
                "gpus": self.options.gpus,
                "tp": self.tp,
                "max_model_len": self.max_model_len,
                "max_num_seqs": self.options.max_num_seqs,
                "kv_cache_dtype": self.options.kv_cache_dtype,
                "mtp": self.options.mtp,
            },
            "budget_bytes_per_gpu": self.budget_bytes,
            "used_bytes_per_gpu": self.used_bytes,
            "headroom_bytes_per_gpu": self.budget_bytes - self.used_bytes,
            "chosen": [{"id": u.id, "extra_bytes_per_gpu": self.cost(u), "gain": u.effect} for u in self.chosen],
            "next": None if nxt is None else {"id": nxt.id, "extra_bytes_per_gpu": self.cost(nxt), "gain": nxt.effect},
            "fixed": self.fixed,
            "fit": self.fit,
            "predicted_error": {"quantized": self.predicted_error(set()), "planned": self.predicted_error(chosen)},
            "hand_picked": self.hand_picked(),
            "assemble": self.assemble_with(),
            "notes": self.notes,
        }


def knapsack(items: list[tuple[int, float]], budget: int) -> list[int]:
    """Indices of the items (cost in bytes, gain) with the largest total gain whose costs fit `budget`
    (exact on a grid of GRID cells; costs rounded up, so the total never exceeds the budget)."""
    import numpy as np

    if budget <= 0 or not items:
        return []
    if sum(c for c, _ in items) <= budget:
        return list(range(len(items)))
    cell = max(1, math.ceil(budget / GRID))
    cap = budget // cell
    best = np.zeros(cap + 1)
    took = np.zeros((len(items), cap + 1), dtype=bool)
    for k, (c, g) in enumerate(items):
        w = math.ceil(c / cell)
        if w > cap or g <= 0:
            continue
        cand = np.full(cap + 1, -1.0)
        cand[w:] = best[: cap + 1 - w] + g
        better = cand > best
        took[k] = better
        best = np.where(better, cand, best)
    out, j = [], int(np.argmax(best))
    for k in range(len(items) - 1, -1, -1):
        if took[k, j]:
            out.append(k)
            j -= math.ceil(items[k][0] / cell)
    return sorted(out)


def plan(opts: PlanHybridOptions) -> HybridChoice | FormatChoice:
    """The choice (reads the table and the quantized checkpoint's headers; writes nothing)."""
    with reuse_opened():  # the map below and verify's TP check read the same headers: parse them once
        return _plan(opts)


def _plan(opts: PlanHybridOptions) -> HybridChoice | FormatChoice:
    # the target's flags mean what they mean to verify, and are refused as verify refuses them
    validate(
        VerifyOptions(
            engine=opts.engine,
            tp=opts.tp,
            gpus=opts.gpus,
            max_model_len=opts.max_model_len,
            max_num_seqs=opts.max_num_seqs,
            kv_cache_dtype=opts.kv_cache_dtype,
            mtp=opts.mtp,
        )
    )
    _check_numbers(opts)
    for path, flag in (
        (opts.sensitivity, "--sensitivity"),
        (opts.out, "-o"),
        (opts.quantized, "--quantized"),
        (opts.bf16, "--bf16"),
    ):
        if path is not None:
            require_text_path(path, flag)  # the recipe and its comments name them
    check_recipe_output(opts)
    table = load_table(opts.sensitivity)
    check_recipe_output(opts, table)  # again, now that the table names its checkpoints
    table_file = Path(opts.sensitivity) / TABLE if Path(opts.sensitivity).is_dir() else Path(opts.sensitivity)
    formats = table_formats(table, table_file, opts.formats)  # [] for a table made without --formats
    units = [Unit.from_json(d) for d in table["units"]]
    qpath = Path(opts.quantized or table["quantized"]["path"])
    bpath = Path(opts.bf16 or table["bf16"]["path"])
    for path, flag in ((qpath, "--quantized"), (bpath, "--bf16")):
        require_text_path(path, flag)
        check_checkpoint_dir(
            path,
            flag,
            hint=f"pass {flag} PATH (the checkpoint the table was measured on, if moved)",
            missing="a checkpoint the table was measured on is not there",
        )
    q_ckpt = Checkpoint.open(qpath, require_config=True)
    check_config_sizes(q_ckpt)
    q = build_map(q_ckpt, read_values=False)
    _check_same_checkpoint(q, units, qpath, opts)
    if not formats and not any(u.spliceable for u in units):
        raise PlanError(
            "nothing in this table can be spliced: assemble hybrid splices BF16 routed or shared "
            "experts into an NVFP4 checkpoint",
            path=qpath,
            got=sorted({u.quantized_format for u in units if u.quantized}),
            hint="measure a ModelOpt or compressed-tensors NVFP4 checkpoint",
        )
    _check_tp(qpath, opts, [int(t) for t in table["tp_sizes"]])
    target = Target.parse(opts.gpus)
    length = opts.max_model_len or default_context(q.ckpt.text_config)
    fit = memory_fit(
        q,
        tp=opts.tp,
        target=target,
        kv_cache_dtype=opts.kv_cache_dtype,
        mtp=opts.mtp,
        max_model_len=length,
        max_num_seqs=opts.max_num_seqs,
        gpu_memory_utilization=(
            DEFAULT_UTILIZATION if opts.gpu_memory_utilization is None else opts.gpu_memory_utilization
        ),
    )
    has_mtp = any(u.id == "mtp" and u.quantized_bytes > 0 for u in units)
    fixed = []
    if opts.mtp > 0 and not has_mtp:
        mtp_unit = next((u for u in units if u.id == "mtp"), None)
        if mtp_unit is None:
            raise PlanError("--mtp: neither checkpoint has an MTP head", path=qpath, hint="plan with --mtp 0")
        # the fit above could not count what the grafted head adds: its weights and its layers' KV cache
        # (verify counts both on the assembled hybrid)
        cfg = q.ckpt.text_config
        kv = (
            opts.max_num_seqs
            * length
            * kv_bytes_per_token(cfg, int(cfg.get("mtp_num_hidden_layers") or 1), opts.tp, opts.kv_cache_dtype)
        )
        fixed.append(
            {"what": "MTP head grafted from BF16 (for --mtp)", "bytes_per_gpu": mtp_unit.extra_bytes_per_gpu[opts.tp]}
        )
        fixed.append({"what": "its KV cache at the target (for --mtp)", "bytes_per_gpu": kv})
    mtp_mode = "auto" if opts.mtp > 0 else "keep"
    notes = []
    unused = int(fit.usage_gib["unused"] * GIB) if fit.fits else 0
    if opts.max_weights_gib is not None:
        budget = int(opts.max_weights_gib * GIB - fit.weights_per_gpu_gib * GIB)
        if budget - sum(f["bytes_per_gpu"] for f in fixed) > unused:
            notes.append(
                f"--max-weights-gib allows {human(budget - unused)} per GPU more than the memory fit leaves "
                f"at this target: the recipe's verify step will refuse what exceeds it"
            )
    else:
        if not fit.fits:
            raise PlanError(
                f"the quantized checkpoint alone does not fit: {fit.reason}",
                path=qpath,
                hint=f"check it first: qtool verify {qpath} --gpus {opts.gpus} --tp {opts.tp}",
            )
        budget = unused
    if formats:  # one format per unit (qtool.ops.sensitivity.plan_formats): smaller formats may make room
        fixed += kept_bf16(units, opts.tp, opts.mtp)
        budget -= sum(f["bytes_per_gpu"] for f in fixed)
        return choose(opts, table, table_file, formats, budget, fixed, fit.to_json(), length, notes)
    budget -= sum(f["bytes_per_gpu"] for f in fixed)
    if budget < 0:
        if opts.max_weights_gib is not None:
            needed = fit.weights_per_gpu_gib * GIB + sum(f["bytes_per_gpu"] for f in fixed)
            hint = f"a --max-weights-gib of at least {gib_at_least(needed)}"
        else:
            hint = "a shorter --max-model-len, fewer --max-num-seqs, --kv-cache-dtype fp8, or more GPUs"
        if fixed:
            hint += f", or --mtp 0 (the grafted MTP head takes {human(sum(f['bytes_per_gpu'] for f in fixed))})"
        raise PlanError(f"no memory is left for BF16 units: {human(-budget)} per GPU short", path=qpath, hint=hint)
    candidates = [u for u in units if u.spliceable and u.measured and u.extra_bytes_per_gpu[opts.tp] > 0]
    left_out = [u.id for u in units if u.measured and not u.spliceable]
    if left_out:
        notes.append(f"measured but not spliceable by assemble hybrid: {', '.join(left_out)}")
    pick = knapsack([(u.extra_bytes_per_gpu[opts.tp], u.effect or 0.0) for u in candidates], budget)
    return HybridChoice(
        opts, table, budget, [candidates[k] for k in pick], candidates, fixed, fit.to_json(), length, mtp_mode, notes
    )


def _check_numbers(opts: PlanHybridOptions) -> None:
    """The library's side of the CLI's range checks (qtool.cli.common.number): a budget that is a number."""
    w = opts.max_weights_gib
    if w is not None and (
        isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0 or w > MAX_WEIGHTS_GIB
    ):
        raise UsageError(f"--max-weights-gib must be a finite number more than 0 and at most {MAX_WEIGHTS_GIB}", got=w)


def gib_at_least(needed_bytes: float, digits: int = 4) -> str:
    """`needed_bytes` in GiB, rounded up at `digits` significant digits: the printed value, read back, covers
    the need (a fix line whose value still falls short would send the user round again)."""
    gib = needed_bytes / GIB
    if gib <= 0:
        return "0"
    step = 10.0 ** (math.floor(math.log10(gib)) - digits + 1)
    value = math.ceil(gib / step) * step
    while float(f"{value:.{digits + 1}g}") * GIB < needed_bytes:
        value += step
    return f"{value:.{digits + 1}g}"


RECIPE_HEAD = "# written by qtool plan hybrid"


def check_recipe_output(opts: PlanHybridOptions, table: dict | None = None) -> None:
    """-o is a one-file output of the one contract: outside the inputs (both checkpoints, the ones the
    table names, the table's own directory), and replaced only with --force when this command wrote it."""
    if opts.out is None:
        return
    sources = [p for p in (opts.quantized, opts.bf16) if p]
    sources.append(table_input(opts.sensitivity))  # OUT/ of sensitivity, or its JSON file itself
    if table is not None:
        sources += [Path(table[k]["path"]) for k in ("quantized", "bf16")]
    check_file_output(
        Path(opts.out), sources=sources, force=opts.force, ours=lambda head: head.startswith(RECIPE_HEAD.encode())
    )


def _tp_shards(qpath: Path, opts: PlanHybridOptions, tp: int) -> list:
    """verify's tp-divisibility errors for the engines asked, at `tp` (on that many GPUs of the target's)."""
    t = Target.parse(opts.gpus)
    rep = verify(
        qpath, VerifyOptions(engine=opts.engine, tp=tp, gpus=f"{max(tp, t.num_gpus)}x{t.gpu_bytes / 2**20:.4f}MiB")
    )
    return [f for f in rep.findings if f.code is Code.TP_DIVISIBILITY and f.severity.value == "error"]


def _check_tp(qpath: Path, opts: PlanHybridOptions, table_tps: list[int]) -> None:
    """The target TP must shard the model (verify's own TP rule, for the engines asked) and be one the table
    has costs for: a plan for a TP the engines refuse would be a recipe that fails at its last step."""
    bad = _tp_shards(qpath, opts, opts.tp)
    if bad or opts.tp not in table_tps:
        ok = [tp for tp in table_tps if tp != opts.tp and not _tp_shards(qpath, opts, tp)]
        why = bad[0].message if bad else f"the table has costs for TP {table_tps}"
        hint = (
            f"plan at a TP it shards at ({', '.join(map(str, ok))}): qtool plan hybrid --sensitivity "
            f"{opts.sensitivity} --tp {ok[-1]} ..."
            if ok
            else "no TP size the table has costs for shards this model"
        )
        raise PlanError(f"--tp {opts.tp}: {why}", path=qpath, hint=hint)


def _check_same_checkpoint(q, units: list[Unit], qpath: Path, opts: PlanHybridOptions) -> None:
    """The quantized checkpoint is the one the table measured: each unit's bytes as the table has them."""
    have = {uid: sum(m.nbytes() for m in mods) for uid, mods in unit_modules(q).items()}
    differ = [u.id for u in units if have.get(u.id, 0) != u.quantized_bytes]
    if differ:
        raise PlanError(
            "the quantized checkpoint is not the one the table measured",
            path=qpath,
            got=f"{len(differ)} unit(s) differ, e.g. {differ[0]}: {have.get(differ[0], 0)} bytes here, "
            f"{next(u.quantized_bytes for u in units if u.id == differ[0])} in the table",
            hint=f"measure this checkpoint: qtool sensitivity BF16 {qpath} -o OUT (or pass --quantized "
            "the checkpoint the table was made from)",
        )


def human(n: float) -> str:
    return human_bytes(n)


def _one_line(path) -> str:
    """A path for the recipe's comment lines: a name with a newline (or another control character) shown
    quoted and escaped, so that it cannot end the comment and turn the rest of the name into YAML."""
    text = str(path)
    return text if text.isprintable() else json.dumps(text)


def write_recipe(choice: HybridChoice | FormatChoice, path: Path) -> None:
    """The build recipe (or, planned from a --formats table, the quantization recipe), written atomically."""
    import yaml

    if isinstance(choice, FormatChoice):
        head = recipe_head(choice, RECIPE_HEAD, _one_line, path)
    else:
        head = (
            f"{RECIPE_HEAD} ({_one_line(choice.options.sensitivity)}): run it with\n"
            f"#   qtool build {_one_line(path)} -o OUT\n"
        )
    atomic_write_text(path, head + yaml.safe_dump(choice.recipe(), sort_keys=False, default_flow_style=None, width=110))
