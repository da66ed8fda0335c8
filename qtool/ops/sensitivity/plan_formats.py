"""`qtool plan hybrid` on a table measured with `--formats`: one format per unit, the least summed error
within the memory fit, written as a quantization recipe.

Each layer unit of the table (routed experts, shared expert, token mixer) has a row per candidate format it
takes: its extra bytes per GPU at each TP against the quantized checkpoint the table measured (negative when
the format is smaller) and its measured effect (0 in BF16). The choice is a multiple-choice knapsack: pick
one format per unit, minimise the summed effect, with the summed extra bytes within the budget the memory
fit leaves (qtool.ops.sensitivity.plan_hybrid). `choose_formats` solves it exactly on a grid of at most GRID
cells of the budget (each cost rounded up to its cell, so the choice never exceeds the budget; it can miss
the best choice only by what that rounding hides: at most one cell per unit).

The recipe (qtool.recipes): each group's most chosen scheme in `groups`, the other layers in
`layer_overrides`, the table's NVFP4 block-scale method, its calibration windows; `qtool quantize BF16
--recipe RECIPE -o OUT` makes it and `qtool verify OUT` at the planned target checks it.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from qtool.errors import PlanError
from qtool.ops.sensitivity.formats import Candidate, parse_formats
from qtool.ops.sensitivity.units import Unit
from qtool.recipes import parse_recipe

GRID = 200_000  # budget cells: exact to 1/200000 of the budget
MEASURE_HINT = "measure them: qtool sensitivity BF16 QUANTIZED -o OUT --formats bf16,fp8,nvfp4"


def choose_formats(options: list[list[tuple[int, float]]], budget: int, grid: int = GRID) -> list[int] | None:
    """For each group of options (cost in bytes, may be negative; loss >= 0), the index of the one chosen:
    the least summed loss whose summed cost is at most `budget`; None when even the cheapest option of
    every group exceeds it. Ties go to the cheaper choice."""
    import numpy as np

    floor = [min(c for c, _ in opts) for opts in options]
    room = budget - sum(floor)  # the budget above every group's cheapest option
    if room < 0:
        return None
    cell = max(1, math.ceil(room / grid))
    cap = room // cell
    best = np.zeros(cap + 1)  # least loss at spent <= j cells, over the groups so far
    took = np.zeros((len(options), cap + 1), dtype=np.int32)
    for g, opts in enumerate(options):
        new = np.full(cap + 1, np.inf)
        for k, (c, loss) in sorted(enumerate(opts), key=lambda x: x[1][0]):  # cheaper first: ties keep it
            w = math.ceil((c - floor[g]) / cell)
            if w > cap:
                continue
            cand = np.full(cap + 1, np.inf)
            cand[w:] = best[: cap + 1 - w] + loss
            better = cand < new
            took[g][better] = k
            new = np.where(better, cand, new)
        best = new
    j = int(np.argmin(best))  # the least spent among the least losses
    out = [0] * len(options)
    for g in range(len(options) - 1, -1, -1):
        k = int(took[g, j])
        out[g] = k
        j -= math.ceil((options[g][k][0] - floor[g]) / cell)
    return out


def table_formats(table: dict, path: Path, asked: str | None) -> list[str]:
    """The formats the plan may choose: `--formats` (each one the table measured) or all the table's; a
    named error for a table measured without --formats or without a format asked for."""
    measured = (table.get("formats") or {}).get("candidates")
    if not measured:
        if asked is None:
            return []  # a schema-1 table: the BF16-splice plan
        raise PlanError(
            "the sensitivity table has no formats measured (it was made without --formats)",
            path=path,
            hint=f"{MEASURE_HINT}, or plan without --formats",
        )
    if asked is None:
        return list(measured)
    wanted = parse_formats(asked)
    lacking = [f for f in wanted.names if f not in measured]
    method = table["formats"]["nvfp4"]["weight_scale"]
    if lacking or (wanted.weight_scale is not None and wanted.weight_scale.value != method):
        got = ", ".join(lacking) if lacking else f"nvfp4:{wanted.weight_scale.value}"
        raise PlanError(
            f"--formats asks for {got}, which the sensitivity table did not measure",
            path=path,
            expected=f"of {', '.join(measured)} (nvfp4 block scales: {method})",
            got=asked,
            hint=f"plan with --formats {','.join(measured)}, or {MEASURE_HINT}",
        )
    return wanted.names


@dataclass
class FormatChoice:
    options: object  # PlanHybridOptions
    table: dict
    formats: list[str]  # the formats the plan chose from
    budget_bytes: int  # extra bytes per GPU (against the quantized checkpoint) the units may take
    chosen: list[tuple[Unit, str]]  # every planned unit and its format, in model order
    fixed: list[dict]
    fit: dict
    max_model_len: int
    notes: list[str] = field(default_factory=list)

    @property
    def tp(self) -> int:
        return self.options.tp

    def cost(self, u: Unit, fmt: str) -> int:
        return u.formats[fmt]["extra_bytes_per_gpu"][self.tp]

    @property
    def used_bytes(self) -> int:
        return sum(self.cost(u, f) for u, f in self.chosen)

    def predicted_error(self) -> dict:
        """The planner's objective for the plan, and for every planned unit in one format (where it takes it)."""
        out = {"planned": sum(u.formats[f]["effect"] for u, f in self.chosen)}
        measured = [u for u, _ in self.chosen if u.measured and u.effect is not None]
        if measured:
            out["quantized"] = sum(u.effect for u in measured)
        return out

    @property
    def method(self) -> str:
        return self.table["formats"]["nvfp4"]["weight_scale"]

    def recipe(self) -> dict:
        """The quantization recipe: per group its most chosen scheme, the other layers as overrides."""
        by_group: dict[str, dict[int, str]] = {}
        for u, f in self.chosen:
            by_group.setdefault(u.group, {})[u.layer] = f
        groups, overrides = {}, {}
        for group, layers in by_group.items():
            counts = Counter(layers.values())
            main = max(self.formats, key=lambda f: counts[f])  # (ties: the first of --formats)
            groups[group] = main
            for layer, f in layers.items():
                if f != main:
                    overrides.setdefault(layer, {})[group] = f
        o = self.options
        data = {
            "schema_version": 1,
            "name": o.name or "planned-formats",
            "description": (
                f"planned by qtool plan hybrid from {Path(str(o.sensitivity)).name}: one of "
                f"{', '.join(self.formats)} per unit, {_signed(self.used_bytes)} bytes per GPU against "
                f"{Path(self.table['quantized']['path']).name} at TP={o.tp} on {o.gpus}"
            ),
            "groups": groups,
        }
        if overrides:
            data["layer_overrides"] = {k: overrides[k] for k in sorted(overrides)}
        data["kv_cache"] = "fp8" if o.kv_cache_dtype == "fp8" else "none"
        if any(f == Candidate.NVFP4.value for _, f in self.chosen):
            data["nvfp4"] = {"weight_scale": self.method, "input_scale": "layer_max"}
        data["defaults"] = {"backend": "rtn", "format": "modelopt"}
        calib = self.table.get("calibration") or {}
        if all(calib.get(k) for k in ("dataset", "samples", "seq_len")):
            data["calibration"] = {k: calib[k] for k in ("dataset", "samples", "seq_len")}
        parse_recipe(data)  # what quantize will read: refused here, not there
        return data

    def verify_command(self, output: str = "OUT") -> str:
        o = self.options
        cmd = f"qtool verify {output} --gpus {o.gpus} --tp {o.tp} --max-model-len {self.max_model_len}"
        cmd += f" --max-num-seqs {o.max_num_seqs}"
        if o.kv_cache_dtype == "fp8":
            cmd += " --kv-cache-dtype fp8"
        if o.mtp:
            cmd += f" --mtp {o.mtp}"
        if o.gpu_memory_utilization is not None:
            cmd += f" --gpu-memory-utilization {o.gpu_memory_utilization}"
        return cmd

    def to_json(self) -> dict:
        o = self.options
        return {
            "sensitivity": str(o.sensitivity),
            "quantized": self.table["quantized"]["path"],
            "bf16": str(Path(o.bf16 or self.table["bf16"]["path"]).absolute()),
            "formats": self.formats,
            "nvfp4_weight_scale": self.method,
            "target": {
                "gpus": o.gpus,
                "tp": self.tp,
                "max_model_len": self.max_model_len,
                "max_num_seqs": o.max_num_seqs,
                "kv_cache_dtype": o.kv_cache_dtype,
                "mtp": o.mtp,
            },
            "budget_bytes_per_gpu": self.budget_bytes,
            "used_bytes_per_gpu": self.used_bytes,
            "headroom_bytes_per_gpu": self.budget_bytes - self.used_bytes,
            "chosen": [
                {"id": u.id, "format": f, "extra_bytes_per_gpu": self.cost(u, f), "effect": u.formats[f]["effect"]}
                for u, f in self.chosen
            ],
            "count": dict(Counter(f for _, f in self.chosen)),
            "fixed": self.fixed,
            "fit": self.fit,
            "predicted_error": self.predicted_error(),
            "planned_recipe": self.recipe(),
            "verify": self.verify_command(),
            "notes": self.notes,
        }


def _signed(n: int) -> str:
    return f"+{n:,}" if n >= 0 else f"{n:,}"


def kept_bf16(units: list[Unit], tp: int, mtp: int) -> list[dict]:
    """Costs the recipe pays whatever it chooses: what quantize keeps BF16 (lm_head, the MTP head when the
    target runs it) where the quantized checkpoint has it smaller."""
    out = []
    for u in units:
        if u.formats is None and u.layer is None and (u.id != "mtp" or (mtp > 0 and u.quantized_bytes > 0)):
            extra = u.extra_bytes_per_gpu[tp]
            if extra:
                out.append({"what": f"{u.id} (quantize keeps it BF16)", "bytes_per_gpu": extra})
    return out


def choose(opts, table: dict, path: Path, formats: list[str], budget: int, fixed, fit, length, notes) -> FormatChoice:
    """The choice over the table's units with format rows (a named error when nothing fits)."""
    units = [Unit.from_json(d) for d in table["units"]]
    planned = [u for u in units if u.formats is not None]
    options = []
    for u in planned:
        allowed = [f for f in u.formats if f in formats]
        if not allowed:
            raise PlanError(
                f"{u.id} takes none of the formats asked ({', '.join(formats)})",
                path=path,
                expected=f"one of {', '.join(u.formats)} (the table's row of {u.id})",
                got=",".join(formats),
                hint=f"add one of {', '.join(u.formats)} to --formats",
            )
        options.append([(u.formats[f]["extra_bytes_per_gpu"][opts.tp], u.formats[f]["effect"], f) for f in allowed])
    pick = choose_formats([[(c, e) for c, e, _ in opts_u] for opts_u in options], budget)
    if pick is None:
        least = sum(min(c for c, _, _ in opts_u) for opts_u in options)
        raise PlanError(
            f"even the smallest format of every unit does not fit: {least - budget:,} bytes per GPU short",
            path=path,
            hint="a shorter --max-model-len, fewer --max-num-seqs, --kv-cache-dtype fp8, more GPUs, or "
            "smaller formats in --formats",
        )
    chosen = [(u, options[i][k][2]) for i, (u, k) in enumerate(zip(planned, pick, strict=True))]
    return FormatChoice(opts, table, formats, budget, chosen, fixed, fit, length, notes)


RUN_HINT = "quantize and check it"


def recipe_head(choice: FormatChoice, recipe_head: str, one_line, path: Path) -> str:
    """The recipe's comment lines: how to make and check the artifact it plans."""
    bf16 = Path(choice.options.bf16 or choice.table["bf16"]["path"]).absolute()
    return (
        f"{recipe_head} ({one_line(choice.options.sensitivity)}): {RUN_HINT} with\n"
        f"#   qtool quantize {one_line(bf16)} --recipe {one_line(path)} -o OUT\n"
        f"#   {choice.verify_command()}\n"
    )
