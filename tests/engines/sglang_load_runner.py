"""Runs inside QTOOL_ENGINES_PYTHON (sglang==0.5.23): SGLang's REAL model construction and weight loader
on a CPU, over one checkpoint. Prints one JSON object like vllm_load_runner.py: {"loaded", "stage",
"error", "tensors", "params", "unwritten", "dropped", "model"}.

The approach of issue #15: `ServerArgs(device="cpu")` published as the scheduler publishes it, a one-process
gloo group, `ModelConfig.from_server_args` (with `is_draft_model` for the MTP drafter, which turns the
architecture into Qwen3_5ForCausalLMMTP as the NEXTN worker does), `_initialize_model`, the default
loader's weight iterator and `load_weights`, then every quant method's `process_weights_after_loading`.
Only kernel-availability checks refuse a CPU, so the runner says what the GPU would say:
- the platform is Blackwell (the NVFP4 MoE schemes refuse anything else: modelopt_quant.py
  ModelOptNvFp4FusedMoEMethod, compressed_tensors_w4a4_nvfp4_moe.py), through SGLang's own
  `override_platform`;
- torch.cuda reports capability 10.0 (compressed_tensors.py `_check_scheme_supported` asks it);
- the CUTLASS scale swizzle is a no-op: it pads the row count to 128 for the kernel, a layout change
  after loading that the tiny model (2 x 32 rows per expert) would need and the real one (2 x 1024) not;
- the Marlin repack of INT4 experts (a JIT-compiled CUDA kernel, also a layout change) returns a tensor of
  its output shape, and its workspace (sized by the GPU's SM count) is one element.
The radix cache is off (its Mamba snapshot buffer is a serving feature the CPU platform lacks).
loader_probe.py finds unwritten parameters and dropped tensors. Kept free of qtool imports.
"""

import logging
import os
import tempfile
import warnings

from loader_probe import (
    DEFAULTED,
    ConsumptionProbe,
    fill_nan,
    main,
    new_result,
    record_done,
    record_failure,
    record_load,
    watched_weights,
)

os.environ.setdefault("SGLANG_LOG_LEVEL", "error")
warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)

# parameters process_weights_after_loading derives from loaded ones (the swizzled block scales)
DERIVED = ("_blockscale_swizzled",)
# the NEXTN drafter's embedding and head are the target's (eagle_worker_v2.init_lm_head: set_embed_and_head)
SHARED_WITH_TARGET = ("lm_head.weight", "model.embed_tokens.weight")


def _cpu_as_blackwell() -> None:
    import torch
    from sglang.srt.layers.quantization import modelopt_quant
    from sglang.srt.runtime_context import override_platform

    override_platform(is_blackwell=True).install()
    torch.cuda.get_device_capability = lambda *a, **k: (10, 0)
    modelopt_quant.swizzle_blockscale = lambda scale: scale.clone()
    # INT4 experts: the Marlin repack is a JIT-compiled CUDA kernel (a layout change after loading); a tensor
    # of its output shape stands in, so the rest of process_weights_after_loading runs for real
    from sglang.srt.hardware_backend.gpu.quantization import gptq_kernels

    gptq_kernels.gptq_marlin_repack = lambda q, perm, size_k, size_n, num_bits: torch.zeros(
        size_k // 16, size_n * 16 // (32 // num_bits), dtype=torch.int32
    )
    # ... and its scratch workspace is sized by the GPU's SM count
    from sglang.srt.layers.quantization.compressed_tensors.schemes import compressed_tensors_wNa16_moe as wna16_moe

    wna16_moe.marlin_make_workspace = lambda device, max_blocks_per_sm=1: torch.zeros(1, dtype=torch.int, device=device)
    # FP8 per-tensor linears fused from shards of different weight scales (a mixed checkpoint's qkv_proj,
    # gate_up_proj) are requantized to their largest scale with an sgl_kernel op (quantization/utils.py
    # requantize_with_max_scale): the same arithmetic in torch
    from sglang.srt.layers.quantization import utils as quant_utils

    def static_fp8_quant(x, scale=None, *_a, **_k):
        return (x.float() / scale.float()).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale

    quant_utils.scaled_fp8_quant = static_fp8_quant


def load(ckpt: str, mtp: bool = False) -> dict:
    import torch

    out = new_result()
    try:
        _cpu_as_blackwell()
        from sglang.srt.configs.load_config import LoadConfig
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
        from sglang.srt.layers.dp_attention import init_dp_gathered_buffer, initialize_dp_attention
        from sglang.srt.layers.moe import initialize_moe_config
        from sglang.srt.model_loader.loader import _get_quantization_config, _initialize_model, get_model_loader
        from sglang.srt.model_loader.utils import set_default_torch_dtype
        from sglang.srt.runtime_context import SpawnRanks, publish
        from sglang.srt.server_args import ServerArgs

        spec = {"speculative_algorithm": "NEXTN"} if mtp else {}
        args = ServerArgs(
            model_path=ckpt,
            device="cpu",
            tp_size=1,
            dtype="bfloat16",
            skip_tokenizer_init=True,
            load_format="safetensors",
            disable_radix_cache=True,
            **spec,
        )
        publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
        initialize_moe_config()
        model_config = ModelConfig.from_server_args(args, is_draft_model=mtp)
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo", distributed_init_method=f"file://{tempfile.mktemp()}"
        )
        initialize_model_parallel()
        initialize_dp_attention(args)
        init_dp_gathered_buffer(model_config)
        load_config = LoadConfig(load_format="safetensors")
        loader = get_model_loader(load_config=load_config, model_config=model_config)
        out["stage"] = "build"
        quant_config = _get_quantization_config(model_config, load_config)
        cpu = torch.device("cpu")
        with set_default_torch_dtype(model_config.dtype):
            with cpu:
                model = _initialize_model(model_config, load_config, quant_config)
            out["model"] = type(model).__name__
            params = dict(model.named_parameters())
            out["params"] = len(params)
            fill_nan(params, keep=lambda n: n.endswith(DEFAULTED))
            out["stage"] = "load"
            seen: list[str] = []
            probe = ConsumptionProbe()
            with probe:
                loader.load_weights_only(
                    model, watched_weights(loader._get_all_weights(model_config, model), probe, seen), cpu
                )
            shared = SHARED_WITH_TARGET if mtp else ()
            record_load(out, params, seen, probe, mtp, skip=lambda n: n.endswith(DERIVED + DEFAULTED) or n in shared)
            loader.postprocess_weights(model, cpu)
            record_done(out)
    except Exception as e:  # the verdict: what the engine says, in its words
        record_failure(out, e)
    return out


if __name__ == "__main__":
    main(load)
