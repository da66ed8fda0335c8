"""Post-assembly checks on a checkpoint directory, from headers and configs only (reusable by `verify`).

- structure: every tensor the architecture (text_config) needs is present with the right dtype and shape
  for the format it is stored in; no stale quantization tensors (scales next to a BF16 weight, scales
  without a weight); no tensors outside the architecture (expert index >= num_experts, layer >= layers);
  never fused next to per-expert routed experts.
- expectations: what a given operation promised (e.g. hybrid: shared experts BF16, chosen layers' routed
  experts BF16, MTP present or absent).
- consistency: qtool.ops.inspect.find_problems (config vs tensors, KV scales, ignore lists) reports no error
  (its warnings, e.g. engine rules qtool does not model, are listed and pass).
Each check gives {"name", "ok", "problems": [message], "findings": [qtool.findings.Finding JSON]};
run_checks gives {"passed", "checks"}.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from qtool.arch.model_map import Format, ModelMap, Module, build_map
from qtool.arch.qwen35 import Group, text_prefix
from qtool.errors import VerificationError
from qtool.findings import Code, by_severity, error
from qtool.io import plan as io_plan
from qtool.io.checkpoint import CONFIG_NAME, HF_QUANT_CONFIG_NAME, Checkpoint
from qtool.io.dtypes import FLOAT_DTYPES, FP8_DTYPES
from qtool.io.files import hash_file
from qtool.io.plan import Index, Json, Text, index_text_of
from qtool.io.quant_config import summarize
from qtool.ops import inspect as inspect_op
from qtool.ops.inspect import find_problems, value_problems

MAX_PROBLEMS = 20

# Parameters each storage format may carry on a Linear module (KV scales live on k/v_proj in ModelOpt).
ALLOWED_PARAMS: dict[Format, frozenset[str]] = {
    Format.BF16: frozenset({"weight", "bias", "k_scale", "v_scale"}),
    Format.NVFP4: frozenset({"weight", "weight_scale", "weight_scale_2", "input_scale", "k_scale", "v_scale"}),
    Format.NVFP4_CT: frozenset(
        {"weight_packed", "weight_scale", "weight_global_scale", "input_global_scale", "k_scale", "v_scale"}
    ),
    Format.FP8: frozenset({"weight", "weight_scale", "input_scale", "k_scale", "v_scale"}),
    Format.MXFP4: frozenset({"weight", "weight_packed", "weight_scale", "input_scale", "k_scale", "v_scale"}),
}
QUANT_ONLY = frozenset(
    {
        "weight_scale",
        "weight_scale_2",
        "input_scale",
        "weight_packed",
        "weight_global_scale",
        "input_global_scale",
        "weight_zero_point",
        "weight_shape",
        "qweight",
        "qzeros",
        "scales",
    }
)


@dataclass
class Expectations:
    """What an operation promised about its output."""

    bf16_shared_experts: bool = False
    bf16_shared_expert_layers: tuple[int, ...] | None = None  # with bf16_shared_experts; None: every layer
    bf16_expert_layers: tuple[int, ...] = ()
    quantized_expert_layers: tuple[int, ...] | None = None  # None: not checked
    mtp: bool | None = None  # True: an MTP head must be present; False: none; None: not checked
    notes: list[str] = field(default_factory=list)


class _Problems(list):
    """Findings (qtool.findings), at most MAX_PROBLEMS of them listed."""

    more = 0

    def add(self, code: Code, module: str | None, msg: str) -> None:
        if len(self) < MAX_PROBLEMS:
            self.append(error(code, module, msg, FIX.get(code)))
        else:
            self.more += 1

    def messages(self) -> list[str]:
        return [f.message for f in self] + ([f"... ({self.more} more problems not listed)"] if self.more else [])

    def result(self, name: str, extra: _Problems | None = None) -> dict:
        """A check's JSON result: ok, problem messages and the findings themselves."""
        found = list(self) + list(extra or [])
        return {
            "name": name,
            "ok": not found and not self.more,
            "problems": self.messages() + (extra.messages() if extra else []),
            "findings": [f.to_json() for f in found],
        }


FIX = {
    Code.MISSING_TENSOR: "the export or download is incomplete: rebuild it (qtool assemble ...) or re-download "
    "the shard that should hold it",
    Code.STALE_TENSOR: "remove the stale tensors (rebuild with qtool assemble, which drops scales of BF16 modules)",
    Code.DTYPE_MISMATCH: "re-export the module; a relabelled dtype means a corrupt or mis-converted shard",
    Code.SHAPE_MISMATCH: "the tensor does not match config.json: wrong model revision or a broken conversion",
    Code.MIXED_EXPERT_LAYOUT: "rebuild with qtool assemble hybrid (it writes per-expert BF16 experts, never fused "
    "next to per-expert)",
    Code.BAD_CONFIG: "restore config.json from the source repository",
}


def _mismatch(got_shape, want_shape) -> Code:
    """A tensor of the wrong kind: its shape differs, or only its dtype."""
    return Code.SHAPE_MISMATCH if tuple(got_shape) != tuple(want_shape) else Code.DTYPE_MISMATCH


def _linear(
    mods: dict[str, Module], name: str, out: int, inn: int, probs: _Problems, required: bool = True
) -> Format | None:
    m = mods.get(name)
    if m is None:
        if required:
            probs.add(Code.MISSING_TENSOR, name, f"missing module {name}")
        return None
    fmt = m.format
    p = m.params
    if fmt is Format.BF16:
        w = p["weight"]
        if w.dtype not in FLOAT_DTYPES or tuple(w.shape) != (out, inn):
            probs.add(
                _mismatch(w.shape, (out, inn)),
                f"{name}.weight",
                f"{name}.weight is {w.dtype}{list(w.shape)}, expected a float [{out}, {inn}]",
            )
    elif fmt is Format.NVFP4 or fmt is Format.NVFP4_CT:
        wk = "weight" if fmt is Format.NVFP4 else "weight_packed"
        gk = "weight_scale_2" if fmt is Format.NVFP4 else "weight_global_scale"
        want = {wk: ("U8", (out, inn // 2)), "weight_scale": ("F8_E4M3", (out, inn // 16))}
        for k, (dt, shape) in want.items():
            t = p.get(k)
            if t is None:
                probs.add(Code.MISSING_TENSOR, name, f"{name} ({fmt.value}) lacks {k}")
            elif t.dtype != dt or tuple(t.shape) != shape:
                probs.add(
                    _mismatch(t.shape, shape),
                    f"{name}.{k}",
                    f"{name}.{k} is {t.dtype}{list(t.shape)}, expected {dt}{list(shape)}",
                )
        g = p.get(gk)
        if g is None:
            probs.add(Code.MISSING_TENSOR, name, f"{name} ({fmt.value}) lacks {gk}")
        elif g.dtype != "F32" or g.numel != 1:
            probs.add(
                Code.DTYPE_MISMATCH if g.numel == 1 else Code.SHAPE_MISMATCH,
                f"{name}.{gk}",
                f"{name}.{gk} is {g.dtype}{list(g.shape)}, expected a float32 scalar",
            )
    elif fmt is Format.MXFP4:
        wk = "weight" if "weight" in p else "weight_packed"
        for k, dts, shape in ((wk, ("U8",), (out, inn // 2)), ("weight_scale", ("U8", "F8_E8M0"), (out, inn // 32))):
            t = p.get(k)
            if t is None:
                probs.add(Code.MISSING_TENSOR, name, f"{name} (mxfp4) lacks {k}")
            elif t.dtype not in dts or tuple(t.shape) != shape:
                probs.add(
                    _mismatch(t.shape, shape),
                    f"{name}.{k}",
                    f"{name}.{k} is {t.dtype}{list(t.shape)}, expected {dts[0]}{list(shape)}",
                )
    elif fmt is Format.FP8:
        w = p["weight"]
        if w.dtype not in FP8_DTYPES or tuple(w.shape) != (out, inn):
            probs.add(
                _mismatch(w.shape, (out, inn)),
                f"{name}.weight",
                f"{name}.weight is {w.dtype}{list(w.shape)}, expected FP8 [{out}, {inn}]",
            )
    elif fmt is None:
        probs.add(Code.MISSING_TENSOR, name, f"{name} has no weight matrix (params: {sorted(p)})")
    if fmt in ALLOWED_PARAMS:
        stale = sorted(set(p) - ALLOWED_PARAMS[fmt])
        if stale:
            probs.add(Code.STALE_TENSOR, name, f"{name} is {fmt.value} but also carries stale {stale}")
    return fmt


def _vector(mm: ModelMap, name: str, shape: tuple[int, ...], probs: _Problems) -> None:
    t = mm.ckpt.tensors.get(name)
    if t is None:
        probs.add(Code.MISSING_TENSOR, name, f"missing tensor {name}")
    elif tuple(t.shape) != shape:
        probs.add(Code.SHAPE_MISMATCH, name, f"{name} has shape {list(t.shape)}, expected {list(shape)}")


def _experts_by_block(mods: dict[str, Module]) -> dict[str, list[Module]]:
    """'...mlp.experts.' -> its per-expert modules, built once (a 397B map has ~120k of them)."""
    out: dict[str, list[Module]] = {}
    for n, m in mods.items():
        if m.expert is not None:
            head, sep, _ = n.partition(".mlp.experts.")
            if sep:
                out.setdefault(head + ".mlp.experts.", []).append(m)
    return out


_SPLIT = object()  # a projection of a fused experts block given per expert instead (checked as such)


def _moe(
    mm: ModelMap, mods: dict[str, Module], p: str, cfg: dict, probs: _Problems, experts: dict[str, list[Module]]
) -> dict[str, set]:
    """Check one MoE block at prefix `p` (ending in 'mlp.'); returns {part: formats}."""
    H, E, inter = cfg["hidden_size"], cfg["num_experts"], cfg["moe_intermediate_size"]
    Is = cfg.get("shared_expert_intermediate_size", inter)
    fmts: dict[str, set] = {"shared": set(), "experts": set()}
    _linear(mods, p + "gate", E, H, probs)
    _linear(mods, p + "shared_expert_gate", 1, H, probs)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        o, i = (H, Is) if proj == "down_proj" else (Is, H)
        fmts["shared"].add(_linear(mods, f"{p}shared_expert.{proj}", o, i, probs))
    fused = mods.get(p + "experts")
    per_expert = experts.get(p + "experts.", [])
    if fused is not None and per_expert:
        probs.add(Code.MIXED_EXPERT_LAYOUT, f"{p}experts", f"{p}experts mixes the fused layout and per-expert tensors")
    if fused is not None:
        gu, dn = fused.params.get("gate_up_proj"), fused.params.get("down_proj")
        # a projection may stay per expert beside a fused other one (vLLM 0.33's loader maps each tensor on
        # its own: a fused gate_up_proj and per-expert down_proj.weight load, every parameter written)
        have = {(m.expert, m.name.rsplit(".", 1)[-1]) for m in per_expert}
        if gu is None and all((e, q) in have for e in range(E) for q in ("gate_proj", "up_proj")):
            for e in range(E):
                for q in ("gate_proj", "up_proj"):
                    fmts["experts"].add(_linear(mods, f"{p}experts.{e}.{q}", inter, H, probs))
            gu = _SPLIT
        if dn is None and all((e, "down_proj") in have for e in range(E)):
            for e in range(E):
                fmts["experts"].add(_linear(mods, f"{p}experts.{e}.down_proj", H, inter, probs))
            dn = _SPLIT
        if gu is _SPLIT:
            pass
        elif gu is None or tuple(gu.shape) != (E, 2 * inter, H):
            probs.add(
                Code.MISSING_TENSOR if gu is None else Code.SHAPE_MISMATCH,
                f"{p}experts.gate_up_proj",
                f"{p}experts.gate_up_proj is {None if gu is None else list(gu.shape)}, "
                f"expected [{E}, {2 * inter}, {H}]",
            )
        if dn is _SPLIT:
            pass
        elif dn is None or tuple(dn.shape) != (E, H, inter):
            probs.add(
                Code.MISSING_TENSOR if dn is None else Code.SHAPE_MISMATCH,
                f"{p}experts.down_proj",
                f"{p}experts.down_proj is {None if dn is None else list(dn.shape)}, expected [{E}, {H}, {inter}]",
            )
        fmts["experts"].add(Format.BF16)
        return fmts
    for e in range(E):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            o, i = (H, inter) if proj == "down_proj" else (inter, H)
            fmts["experts"].add(_linear(mods, f"{p}experts.{e}.{proj}", o, i, probs))
    extra = sorted({m.expert for m in per_expert if m.expert is not None and m.expert >= E})
    if extra:
        probs.add(Code.STALE_TENSOR, f"{p}experts", f"{p}experts has experts beyond num_experts={E}: {extra[:5]}")
    return fmts


def _attention(mm: ModelMap, mods: dict[str, Module], p: str, cfg: dict, full: bool, probs: _Problems) -> None:
    H = cfg["hidden_size"]
    if full:
        nh, nkv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
        hd = cfg.get("head_dim")
        if None in (nh, nkv, hd):
            return
        gate = 2 if cfg.get("attn_output_gate", True) else 1
        _linear(mods, p + "self_attn.q_proj", nh * hd * gate, H, probs)
        _linear(mods, p + "self_attn.k_proj", nkv * hd, H, probs)
        _linear(mods, p + "self_attn.v_proj", nkv * hd, H, probs)
        _linear(mods, p + "self_attn.o_proj", H, nh * hd, probs)
        _vector(mm, p + "self_attn.q_norm.weight", (hd,), probs)
        _vector(mm, p + "self_attn.k_norm.weight", (hd,), probs)
        return
    nk, dk = cfg.get("linear_num_key_heads"), cfg.get("linear_key_head_dim")
    nv, dv = cfg.get("linear_num_value_heads"), cfg.get("linear_value_head_dim")
    if None in (nk, dk, nv, dv):
        return
    qkv = 2 * nk * dk + nv * dv
    a = p + "linear_attn."
    _linear(mods, a + "in_proj_qkv", qkv, H, probs)
    _linear(mods, a + "in_proj_z", nv * dv, H, probs)
    _linear(mods, a + "in_proj_b", nv, H, probs)
    _linear(mods, a + "in_proj_a", nv, H, probs)
    _linear(mods, a + "out_proj", H, nv * dv, probs)
    _vector(mm, a + "conv1d.weight", (qkv, 1, cfg.get("linear_conv_kernel_dim", 4)), probs)
    _vector(mm, a + "A_log", (nv,), probs)
    _vector(mm, a + "dt_bias", (nv,), probs)
    _vector(mm, a + "norm.weight", (dv,), probs)


def check_structure(mm: ModelMap, expect: Expectations | None = None) -> dict:
    probs = _Problems()
    cfg = mm.ckpt.text_config
    need = ("hidden_size", "num_experts", "moe_intermediate_size", "num_hidden_layers")
    if not all(isinstance(cfg.get(k), int) for k in need):
        probs.add(Code.BAD_CONFIG, None, f"config lacks one of {need}")
        return probs.result("structure")
    mods = mm.modules
    H, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg.get("vocab_size")
    tp = text_prefix(mm.naming)
    layer_fmts: dict[int, dict[str, set]] = {}
    experts = _experts_by_block(mods)
    for n in range(L):
        p = f"{tp}layers.{n}."
        _vector(mm, p + "input_layernorm.weight", (H,), probs)
        _vector(mm, p + "post_attention_layernorm.weight", (H,), probs)
        _attention(mm, mods, p, cfg, mm.layer_types[n] == "full_attention" if n < len(mm.layer_types) else False, probs)
        layer_fmts[n] = _moe(mm, mods, p + "mlp.", cfg, probs, experts)
    if V:
        _vector(mm, tp + "embed_tokens.weight", (V, H), probs)
        if not cfg.get("tie_word_embeddings", False) and not (mm.ckpt.config or {}).get("tie_word_embeddings"):
            _linear(mods, "lm_head", V, H, probs)
    _vector(mm, tp + "norm.weight", (H,), probs)
    for name, role in mm.roles.items():
        if role.layer is not None and role.group is not Group.MTP and role.layer >= L:
            probs.add(Code.STALE_TENSOR, name, f"{name} belongs to layer {role.layer}, the config has {L} layers")
        if role.group is Group.OTHER:
            probs.add(Code.STALE_TENSOR, name, f"{name} is not part of the Qwen3.5-MoE architecture")
    for m in mods.values():
        if m.format is None and m.param_names & QUANT_ONLY:
            probs.add(
                Code.STALE_TENSOR,
                m.name,
                f"{m.name} carries {sorted(m.param_names & QUANT_ONLY)} but no weight (stale scales)",
            )
    mtp_mods = [m for m in mods.values() if m.group is Group.MTP]
    mtp_fmts = None
    if mtp_mods:
        for suffix in ("fc", "norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"):
            if f"mtp.{suffix}" not in mods:
                probs.add(Code.MISSING_TENSOR, f"mtp.{suffix}", f"MTP head lacks mtp.{suffix}")
        if "mtp.fc" in mods:
            _linear(mods, "mtp.fc", H, 2 * H, probs)
        mtp_fmts = _moe(mm, mods, "mtp.layers.0.mlp.", cfg, probs, experts)
    if (
        mm.expert_layout == "mixed"
        or mm.mtp_expert_layout == "mixed"
        or (mm.expert_layout and mm.mtp_expert_layout and mm.expert_layout != mm.mtp_expert_layout)
    ):
        probs.add(
            Code.MIXED_EXPERT_LAYOUT,
            None,
            f"routed experts mix layouts (decoder layers: {mm.expert_layout}, MTP: {mm.mtp_expert_layout})",
        )
    if expect is not None:
        return probs.result("structure", _check_expectations(layer_fmts, mtp_fmts, expect))
    return probs.result("structure")


def _check_expectations(layer_fmts: dict[int, dict[str, set]], mtp_fmts, expect: Expectations) -> _Problems:
    probs = _Problems()
    for n, f in layer_fmts.items():
        shared_promised = expect.bf16_shared_experts and (
            expect.bf16_shared_expert_layers is None or n in expect.bf16_shared_expert_layers
        )
        if shared_promised and f["shared"] - {Format.BF16, None}:
            probs.add(
                Code.EXPECTATION_NOT_MET,
                f"layers.{n}.mlp.shared_expert",
                f"layer {n}: shared expert is {sorted(x.value for x in f['shared'] if x)}, expected bf16",
            )
        if n in expect.bf16_expert_layers and f["experts"] - {Format.BF16, None}:
            probs.add(
                Code.EXPECTATION_NOT_MET,
                f"layers.{n}.mlp.experts",
                f"layer {n}: routed experts are {sorted(x.value for x in f['experts'] if x)}, expected bf16",
            )
        if (
            expect.quantized_expert_layers is not None
            and n in expect.quantized_expert_layers
            and (Format.BF16 in f["experts"])
        ):
            probs.add(
                Code.EXPECTATION_NOT_MET,
                f"layers.{n}.mlp.experts",
                f"layer {n}: routed experts are BF16, expected them quantized (unchanged)",
            )
    if expect.mtp is True and mtp_fmts is None:
        probs.add(Code.EXPECTATION_NOT_MET, "mtp", "the MTP head is missing")
    if expect.mtp is False and mtp_fmts is not None:
        probs.add(Code.EXPECTATION_NOT_MET, "mtp", "an MTP head is present but should not be")
    return probs


def consistency_problems(mm: ModelMap) -> list:
    """What qtool.ops.inspect.find_problems reports for `mm` (Findings)."""
    summary = summarize(mm.ckpt.config, mm.ckpt.hf_quant_config)
    return find_problems(mm, summary)


def _line(f) -> str:
    return f"[{f.code.value}] {f.message}"


def check_consistency(mm: ModelMap, baseline: Callable[[], list] | None = None) -> dict:
    """find_problems must report no error; problems the source an operation started from already had
    (`baseline()`: `consistency_problems` of the source, only called when there are problems) are
    reported as inherited and do not fail the check. Its warnings (what qtool did not check) are listed
    under "warnings" and do not fail it either."""
    found, warnings = by_severity(consistency_problems(mm))
    inherited = []
    if baseline is not None and found:
        before = {(f.code, f.message) for f in baseline()}
        inherited = [f for f in found if (f.code, f.message) in before]
        found = [f for f in found if (f.code, f.message) not in before]
    out = {
        "name": "consistency",
        "ok": not found,
        "problems": [_line(f) for f in found],
        "findings": [f.to_json() for f in found],
    }
    if warnings:
        out["warnings"] = [f.to_json() for f in warnings]
    if baseline is not None and inherited:
        out["inherited"] = [_line(f) for f in inherited]
    return out


def inspect_check(found: list) -> dict:
    """A writer's check result from find_problems' findings on its output (quantize, convert): it passes
    without errors; warnings are recorded beside ("inspect_warnings", only when there are some), and do
    not fail it."""
    errors, warnings = by_severity(found)
    out = {
        "inspect_problems": [f.to_json() for f in errors],
        "passed": not errors,
        "summary": errors[0].message if errors else None,
    }
    if warnings:
        out["inspect_warnings"] = [f.to_json() for f in warnings]
    return out


def run_checks(path: str | Path, expect: Expectations | None = None, baseline: ModelMap | None = None) -> dict:
    source = None if baseline is None else (lambda: consistency_problems(baseline))
    return finish_checks(start_checks(path, expect), source)


@dataclass
class StartedChecks:
    mm: ModelMap
    structure: dict
    sizes_unchecked: bool


def start_checks(
    path: str | Path, expect: Expectations | None = None, *, shards_complete: bool = True
) -> StartedChecks:
    """The checks that need headers and configs only (structure). With `shards_complete=False` they can
    run while shard data is still being written; `finish_checks` then checks every shard's size."""
    ckpt = Checkpoint.open(path, require_config=True, check_file_sizes=shards_complete)
    mm = build_map(ckpt, read_values=shards_complete)  # KV scale values are data, read when complete
    return StartedChecks(mm, check_structure(mm, expect), not shards_complete)


def finish_checks(started: StartedChecks, baseline: Callable[[], list] | None = None) -> dict:
    """The rest, once every shard is complete: shard sizes (if not checked yet) and consistency (which
    reads a few scale values; `baseline`: see check_consistency)."""
    structure = started.structure
    if started.sizes_unchecked:
        short = _short_shards(started.mm.ckpt)
        if short:
            structure = {
                **structure,
                "ok": False,
                "problems": structure["problems"] + [f.message for f in short],
                "findings": structure["findings"] + [f.to_json() for f in short],
            }
            return {"passed": False, "checks": [structure]}  # no values to read from incomplete shards
        started.mm.read_kv_values()
    checks = [structure, check_consistency(started.mm, baseline)]
    return {"passed": all(c["ok"] for c in checks), "checks": checks}


class PlannedProblems:
    """qtool.ops.inspect.find_problems of an output that a job writes over minutes (quantize's layers),
    found without opening the written output again at its end: what needs headers and configs only comes
    from the plan's own view of the output (qtool.io.plan.header_checkpoint), found in a thread once
    `begin` is called while the job writes; `result` then reads the scale values back from the written
    files. Valid once every shard is known to hold the header the plan promised (write_output checks the
    produced ones; `check_written` the others) and every config and index file the bytes planned (the
    thread checks the planned ones as opening the output would: the configs' field types, the index mapping
    exactly the shards' tensors; `result` compares the written files' sha256 with theirs). At the 397B's
    372k tensors, opening the written output and mapping it again held quantize's end for 2.4 s on the
    2-core VM."""

    def __init__(self, plan, root: Path, mm: ModelMap | None = None) -> None:
        """`mm`: the output's model map the planner made already (qtool.io.plan.header_checkpoint as
        written under `root`, KV values not read), or None to make it here."""
        self.plan, self.root, self.mm = plan, Path(root), mm
        self._thread: threading.Thread | None = None
        self._found: tuple | None = None  # (map, summary, structure problems, side files' planned sha256)
        self._error: BaseException | None = None

    def begin(self) -> None:
        """Find the structure problems in a thread (once; a caller begins when the thread would compete with
        nothing urgent: quantize after its first layer is written, not during its start)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._find, name="qtool-output-check", daemon=True)
            self._thread.start()

    def _find(self) -> None:
        try:
            jsons = {e.name: e.obj for e in self.plan.entries(Json)}
            config, hq = jsons.get(CONFIG_NAME), jsons.get(HF_QUANT_CONFIG_NAME)
            Checkpoint.check_config_types(self.root, config, hq)
            mm = self.mm or build_map(
                io_plan.header_checkpoint(self.root, self.plan, config, hq, as_written=True), read_values=False
            )
            summary = summarize(config, hq)
            self._found = (mm, summary, inspect_op.structure_problems(mm, summary), self._side_files(mm.ckpt))
        except BaseException as e:  # noqa: BLE001 -- raised by result()
            self._error = e

    def _side_files(self, view: Checkpoint) -> dict[str, str]:
        """The sha256 of each planned config, index and text file, once the index is known to map exactly
        the planned shards' tensors (what Checkpoint.open would check of the written one)."""
        import hashlib
        import json

        digests = {}
        for e in self.plan.entries(Json, Text, Index):
            if isinstance(e, Index):
                data = "".join(index_text_of(e)).encode()
                held = {name: rel for rel, h in view.headers.items() for name in h.tensors}
                mapped = json.loads(data).get("weight_map")
                if mapped != held:
                    odd = next(
                        (n for n in sorted(set(held) | set(mapped or {})) if (mapped or {}).get(n) != held.get(n)), None
                    )
                    raise VerificationError(
                        "the planned index does not map the planned shards' tensors (a qtool bug)",
                        path=self.root / e.name,
                        tensor=odd,
                        expected=held.get(odd),
                        got=(mapped or {}).get(odd),
                    )
            else:
                data = self.plan.json_bytes(e) if isinstance(e, Json) else e.text.encode()
            digests[e.name] = hashlib.sha256(data).hexdigest()
        return digests

    def found_early(self) -> list:
        """The structure's errors if the thread has found them by now (else []; the error it failed with,
        raised): a job that writes for an hour stops at the next layer, not at its end. (Its warnings, such
        as engine rules not modelled, stop nothing: `result` gives them with the rest.)"""
        if self._error is not None:  # (a plan the thread could not check: the planned index, a config)
            raise self._error
        found = self._found
        return by_severity(found[2])[0] if found is not None else []

    def result(self) -> list:
        """Every problem (Findings), in find_problems' order: the structure's, then the values' read now."""
        self.begin()
        self._thread.join()
        if self._error is not None:
            raise self._error
        mm, summary, structure, side = self._found
        for name, digest in side.items():
            if hash_file(self.root / name) != digest:
                raise VerificationError(
                    "a written file is not what the plan promised (a qtool bug)",
                    path=self.root / name,
                    expected=f"sha256 {digest}",
                )
        mm.read_kv_values()
        return structure + value_problems(mm, summary)


def _short_shards(ckpt: Checkpoint) -> list:
    out = []
    for rel, h in ckpt.headers.items():
        want = max((t.end for t in h.tensors.values()), default=h.data_start)
        got = Path(h.path).stat().st_size
        if got < want:
            out.append(error(Code.TRUNCATED_SHARD, rel, f"{rel} is {got} bytes, its header describes {want}"))
    return out


def hybrid_expectations(plan) -> Expectations:
    """What `assemble hybrid` promises (plan: qtool.ops.assemble.plan.HybridPlan)."""
    L = plan.nv.text_config.get("num_hidden_layers", 0)
    bf = set(plan.options.bf16_expert_layers)
    src_quant = {
        m.layer
        for m in plan.nv_map.modules.values()
        if m.group is Group.ROUTED_EXPERTS and m.format not in (None, Format.BF16)
    }
    mtp = {"keep": True, "graft": True, "from-bf16": True, "drop": False}.get(plan.mtp_action)
    shared = plan.options.bf16_shared_expert_layers
    return Expectations(
        bf16_shared_experts=shared is None or bool(shared),
        bf16_shared_expert_layers=None if shared is None else tuple(sorted(set(shared))),
        bf16_expert_layers=tuple(sorted(bf)),
        quantized_expert_layers=tuple(n for n in range(L) if n not in bf and n in src_quant),
        mtp=mtp,
    )
