"""`qtool serve-config`: the launch command (shell) or docker-compose service for a verified artifact.

Verify runs first with the same target; an artifact with any error gets no command (VerificationError,
exit 3). Every flag is derived from what verify found:
- quantization: vLLM `--quantization modelopt_fp4` for ModelOpt NVFP4 (vllm/docs/features/quantization/
  modelopt.md), `compressed-tensors` for llm-compressor exports; SGLang `--quantization modelopt_fp4`
  (docs/formats.md §12), compressed-tensors is auto-detected (no flag);
- `--kv-cache-dtype fp8` (SGLang `fp8_e4m3`) only when every full-attention layer has calibrated scales;
- MTP: vLLM `--speculative-config {"method": "mtp", ...}` ("qwen3_next_mtp" before 0.17, docs/formats.md §12 "MTP flags
  -- vLLM"); SGLang NEXTN (`--speculative-algorithm NEXTN --speculative-num-steps N --speculative-eagle-topk 1
  --speculative-num-draft-tokens N+1`, SGLANG_ENABLE_SPEC_V2=True) plus `--mamba-scheduler-strategy
  extra_buffer` for the VLM format (Qwen3_5MoeForConditionalGeneration; docs/formats.md §12);
- parsers: `--reasoning-parser qwen3 --tool-call-parser qwen3_coder` (vLLM also --enable-auto-tool-choice);
- vision: vLLM `--mm-encoder-tp-mode data` with a vision tower, `--language-model-only` without;
- context: `--max-model-len` / `--context-length` from the fit; YaRN via `--hf-overrides` /
  `--json-model-override-args` when asked for (docs/formats.md §12) and
  VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 past max_position_embeddings;
- environment: the field report's PCIe NCCL settings (docs/formats.md §12) (NCCL_P2P_LEVEL=PHB, NCCL_IB_DISABLE=1) and
  loader tuning.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path

from qtool.engines import Engine, parse_version
from qtool.errors import UsageError, VerificationError
from qtool.findings import Code
from qtool.ops.verify import VerifyOptions, VerifyReport, verify

VLLM_MTP_METHOD_SINCE = (0, 17, 0)  # seed: "qwen3_next_mtp", "or for newer vLLM versions: mtp"
# the engines' published images, tagged with the release verify modelled (never `latest`: another
# release may load the artifact differently)
IMAGES = {Engine.VLLM: "vllm/vllm-openai:v{version}", Engine.SGLANG: "lmsysorg/sglang:v{version}"}
# docs/formats.md §12 (NCCL on PCIe): PHB is the safe P2P level on PCIe-only hosts (SYS can deadlock).
COMMON_ENV = {"NCCL_P2P_LEVEL": "PHB", "NCCL_IB_DISABLE": "1", "SAFETENSORS_FAST_GPU": "1", "OMP_NUM_THREADS": "8"}


class OutputFormat(str, Enum):
    SHELL = "shell"
    COMPOSE = "compose"


@dataclass
class ServeOptions:
    engine: str = "vllm"
    tp: int = 4
    mtp: int = 0
    port: int = 8000
    format: OutputFormat = OutputFormat.SHELL
    gpus: str = "4x97887MiB"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    kv_cache_dtype: str | None = None  # None: fp8 when calibrated scales exist, else auto
    gpu_memory_utilization: float = 0.9
    yarn: float | None = None
    served_model_name: str | None = None
    host: str = "0.0.0.0"
    hub: str | None = None  # the hf:ORG/NAME[@REV] source (the engine downloads ORG/NAME at `commit` itself)
    commit: str | None = None


@dataclass
class Launch:
    engine: str
    env: dict[str, str]
    argv: list[str]
    report: VerifyReport
    notes: list[str] = field(default_factory=list)

    def shell(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        lines = [env + " \\"] if env else []
        args = self.argv
        head = shlex.join(args[:3])
        rest = args[3:]
        parts = [head]
        i = 0
        while i < len(rest):  # one flag (with its value) per line
            if i + 1 < len(rest) and not rest[i + 1].startswith("--"):
                parts.append(shlex.join(rest[i : i + 2]))
                i += 2
            else:
                parts.append(shlex.quote(rest[i]))
                i += 1
        lines.append(" \\\n  ".join(parts))
        return "\n".join(lines) + "\n"

    def compose(self, model_dir: str | None, port: int, tp: int) -> str:
        """A docker-compose service. `model_dir`: bound read-only at /model by its absolute path (a relative
        one would be a named volume); None for a Hub model, whose download cache is bound instead."""
        eng, _, version = self.engine.partition("@")
        eng = Engine(eng)
        q = json.dumps
        if model_dir is not None:
            volume = f"{os.path.abspath(model_dir)}:/model:ro"
        else:
            from huggingface_hub import constants

            volume = f"{os.path.abspath(constants.HF_HOME)}:/root/.cache/huggingface"
        out = [
            "services:",
            f"  qwen35-{eng.value}:",
            f"    image: {q(IMAGES[eng].format(version=version))}",
            "    ipc: host",
            '    shm_size: "16g"',
            "    ports:",
            f"      - {q(f'{port}:{port}')}",
            "    environment:",
        ]
        out += [f"      - {q(f'{k}={v}')}" for k, v in self.env.items()]
        out += [
            "    volumes:",
            f"      - {q(volume)}",
            "    deploy:",
            "      resources:",
            "        reservations:",
            "          devices:",
            "            - driver: nvidia",
            f"              count: {tp}",
            "              capabilities: [gpu]",
            "    entrypoint:",
        ]
        out += [f"      - {q(a)}" for a in self.argv]
        out.append("    restart: unless-stopped")
        return "\n".join(out) + "\n"


def _yarn_rope(report: VerifyReport, factor: float) -> dict:
    rope = dict(report.facts.get("rope_parameters") or {})
    orig = int(report.facts.get("max_position_embeddings") or 262144)
    rope.update({"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": orig})
    return {"text_config": {"rope_parameters": rope}}


def plan(path: str | Path, opts: ServeOptions) -> Launch:
    v = parse_version(opts.engine)
    if opts.yarn is not None and opts.yarn <= 1:
        raise UsageError("--yarn FACTOR must be > 1", got=opts.yarn)
    max_len = opts.max_model_len
    vopts = VerifyOptions(
        engine=str(v),
        tp=opts.tp,
        gpus=opts.gpus,
        max_model_len=max_len,
        max_num_seqs=opts.max_num_seqs,
        kv_cache_dtype=opts.kv_cache_dtype,  # None: verify's
        gpu_memory_utilization=opts.gpu_memory_utilization,
        mtp=opts.mtp,
    )
    rep = verify(path, vopts)
    rope = rep.facts.get("rope_parameters") or {}
    skipped_yarn = None
    if opts.yarn and "yarn" in (rope.get("rope_type"), rope.get("type")):
        # patch-config --yarn already did it: applying it again would scale the context twice
        skipped_yarn = (
            f"--yarn {opts.yarn} skipped: the checkpoint's config already has YaRN (factor "
            f"{rope.get('factor')}, max_position_embeddings {rep.facts.get('max_position_embeddings')})"
        )
        opts = replace(opts, yarn=None)
    # the KV-cache dtype verify judged with (without --kv-cache-dtype: fp8 where real scales exist,
    # qtool.ops.verify.served_kv_cache_dtype) is the launch's
    vopts = replace(vopts, kv_cache_dtype=rep.kv_cache_dtype)
    if rep.ok and opts.yarn and max_len is None:
        # the YaRN-extended context: verify the final target once more
        max_len = int(int(rep.facts.get("max_position_embeddings") or 262144) * opts.yarn)
        vopts = replace(vopts, max_model_len=max_len)
        rep = verify(path, vopts)
    if not rep.ok:
        errs = rep.errors()
        raise VerificationError(
            f"refusing to emit a launch command: verify found {len(errs)} error(s)",
            path=str(path),
            got="; ".join(f"[{f.code.value}] {f.module or ''} {f.message}" for f in errs[:3]),
            hint=errs[0].fix or "run `qtool verify` for the full list",
        )
    launch = _build(rep, v, vopts, opts)
    if skipped_yarn:
        launch.notes.insert(0, skipped_yarn)
    return launch


def _build(rep: VerifyReport, v, vopts: VerifyOptions, opts: ServeOptions) -> Launch:
    facts = rep.facts
    fit = rep.fit
    assert fit is not None
    if opts.hub:  # the engine fetches the repo itself, at the commit verify read
        model = opts.hub.removeprefix("hf:").partition("@")[0]
        name = opts.served_model_name or model.split("/")[-1]
    else:
        model = "/model" if opts.format is OutputFormat.COMPOSE else os.path.abspath(rep.path)
        name = opts.served_model_name or Path(os.path.abspath(rep.path)).name
    source = ["--revision", opts.commit] if opts.hub and opts.commit else []
    # only a checkpoint that ships its own code needs it (verify warns about that); never by default
    remote = ["--trust-remote-code"] if facts.get("remote_code") else []
    notes = []
    yarn = opts.yarn
    kv_fp8 = vopts.kv_cache_dtype == "fp8"
    qm, algo = facts.get("quant_method"), (facts.get("quant_algo") or "").upper()
    mtp = opts.mtp if facts.get("mtp") else 0
    vlm = facts.get("architecture") == "Qwen3_5MoeForConditionalGeneration"
    maxpos = int(facts.get("max_position_embeddings") or 262144)
    env = dict(COMMON_ENV)
    if v.engine is Engine.VLLM:
        env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        if fit.max_model_len > maxpos:
            env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
        argv = [
            "vllm",
            "serve",
            model,
            *source,
            "--served-model-name",
            name,
            "--host",
            opts.host,
            "--port",
            str(opts.port),
            "--tensor-parallel-size",
            str(opts.tp),
            *remote,
        ]
        if qm == "modelopt" and algo == "NVFP4":
            argv += ["--quantization", "modelopt_fp4"]
        elif qm == "compressed-tensors":
            argv += ["--quantization", "compressed-tensors"]
        argv += [
            "--gpu-memory-utilization",
            str(vopts.gpu_memory_utilization),
            "--max-model-len",
            str(fit.max_model_len),
        ]
        if vopts.max_num_seqs:
            argv += ["--max-num-seqs", str(vopts.max_num_seqs)]
        if kv_fp8:
            argv += ["--kv-cache-dtype", "fp8"]
        argv += ["--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder"]
        argv += ["--mm-encoder-tp-mode", "data"] if facts.get("vision") else (["--language-model-only"] if vlm else [])
        if mtp:
            method = "mtp" if v.at_least(VLLM_MTP_METHOD_SINCE) else "qwen3_next_mtp"
            argv += [
                "--speculative-config",
                json.dumps({"method": method, "num_speculative_tokens": mtp}, separators=(",", ":")),
            ]
        if yarn:
            argv += ["--hf-overrides", json.dumps(_yarn_rope(rep, yarn), separators=(",", ":"))]
    else:
        env["SGLANG_DISABLE_DEEP_GEMM"] = "1"
        if mtp:
            env["SGLANG_ENABLE_SPEC_V2"] = "True"
        argv = [
            "python3",
            "-m",
            "sglang.launch_server",
            "--model-path",
            model,
            *source,
            "--served-model-name",
            name,
            "--host",
            opts.host,
            "--port",
            str(opts.port),
            "--tp-size",
            str(opts.tp),
            *remote,
        ]
        if qm == "modelopt" and algo == "NVFP4":
            argv += ["--quantization", "modelopt_fp4"]
        argv += ["--mem-fraction-static", str(vopts.gpu_memory_utilization), "--context-length", str(fit.max_model_len)]
        if vopts.max_num_seqs:
            argv += ["--max-running-requests", str(vopts.max_num_seqs)]
        if kv_fp8:
            argv += ["--kv-cache-dtype", "fp8_e4m3"]
        argv += ["--reasoning-parser", "qwen3", "--tool-call-parser", "qwen3_coder"]
        if mtp:
            argv += [
                "--speculative-algorithm",
                "NEXTN",
                "--speculative-num-steps",
                str(mtp),
                "--speculative-eagle-topk",
                "1",
                "--speculative-num-draft-tokens",
                str(mtp + 1),
            ]
            if vlm:
                argv += ["--mamba-scheduler-strategy", "extra_buffer"]
        if yarn:
            argv += ["--json-model-override-args", json.dumps(_yarn_rope(rep, yarn), separators=(",", ":"))]
    if not kv_fp8:
        notes.append(_bf16_kv_note(rep.facts))
    notes += [f"{f.message}; fix: {f.fix}" for f in rep.findings if f.code is Code.MTP_UNSTABLE]
    return Launch(str(v), env, argv, rep, notes)


def _bf16_kv_note(facts: dict) -> str:
    """Why the KV cache is BF16: the scales are missing, or they are there and --kv-cache-dtype auto was asked."""
    if facts.get("kv_scales_calibrated"):
        return (
            "KV cache in BF16 (--kv-cache-dtype auto): the checkpoint's calibrated FP8 k/v scales are not used; "
            "without --kv-cache-dtype the launch serves an FP8 KV cache with them"
        )
    return "KV cache in BF16: no calibrated FP8 k/v scales (qtool calibrate-kv adds them)"


def render(launch: Launch, opts: ServeOptions) -> str:
    if opts.format is OutputFormat.COMPOSE:
        return launch.compose(None if opts.hub else launch.report.path, opts.port, opts.tp)
    return launch.shell()
