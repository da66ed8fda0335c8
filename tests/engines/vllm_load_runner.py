"""Runs inside QTOOL_ENGINES_PYTHON (vllm==0.33.0): vLLM's REAL model construction and weight loader on
a CPU, over one checkpoint. Prints one JSON object: {"loaded": bool, "stage", "error", "tensors",
"params", "unwritten": [param names not (fully) written by load_weights], "dropped": [checkpoint tensors never read]}.

The approach of issue #15: `EngineArgs(...).create_engine_config()` with VLLM_TARGET_DEVICE=cpu, a
one-process gloo group, `initialize_model`, `DefaultModelLoader.get_all_weights` and `model.load_weights`,
then `process_weights_after_loading` for real. Only kernel-availability checks refuse a CPU, so vLLM's own
emulation kernels are registered for it (the NVFP4 linear registry has no CPU entry; the NVFP4 MoE
backend selection rejects CPU; the unquantized CPU MoE repacks with compiled ops the CUDA wheel lacks).
loader_probe.py finds parameters never (fully) written (NaN-filled before loading) and checkpoint tensors
the loader dropped without reading them. Kept free of qtool imports: it runs in the other interpreter.
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

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)


def _cpu_registrations() -> None:
    from vllm.model_executor.kernels import linear as kl
    from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
    from vllm.model_executor.layers.fused_moe.experts.nvfp4_emulation_moe import (
        Nvfp4QuantizationEmulationTritonExperts,
    )
    from vllm.model_executor.layers.fused_moe.oracle import nvfp4 as nv
    from vllm.model_executor.layers.quantization import modelopt
    from vllm.platforms import PlatformEnum

    kl._POSSIBLE_NVFP4_KERNELS.setdefault(PlatformEnum.CPU, [EmulationNvFp4LinearKernel])

    def pick(*_a, **_k):
        return nv.NvFp4MoeBackend.EMULATION, Nvfp4QuantizationEmulationTritonExperts

    nv.select_nvfp4_moe_backend = pick
    modelopt.select_nvfp4_moe_backend = pick
    # INT4 (W4A16) experts: the CPU backends need AMX / vLLM's compiled CPU ops; vLLM's own emulation backend
    from vllm.model_executor.layers.fused_moe.experts.int4_emulation_moe import Int4EmulationTritonExperts
    from vllm.model_executor.layers.fused_moe.oracle import int_wna16
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_wna16 as ct_wna16,
    )

    def pick_wna16(*_a, **_k):
        return int_wna16.WNA16MoEBackend.EMULATION, Int4EmulationTritonExperts

    int_wna16.select_wna16_moe_backend = ct_wna16.select_wna16_moe_backend = pick_wna16
    # the unquantized CPU MoE repacks its weights with vLLM's compiled CPU ops (absent from the CUDA wheel):
    # a layout change for its kernels after loading, not part of what is loaded
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    cpu_moe.cpu_prepack_moe_weight = lambda w, isa: w
    # FP8 per-tensor linears fused from shards of different weight scales (qkv_proj, gate_up_proj of a
    # mixed checkpoint) are requantized to their largest scale with a compiled op the CUDA wheel has only
    # on the GPU (w8a8_utils.requantize_with_max_scale): the same arithmetic in torch
    from vllm import _custom_ops

    _custom_ops.scaled_fp8_quant = _static_fp8_quant


def _static_fp8_quant(x, scale=None, *_a, **_k):
    import torch

    fp8 = torch.float8_e4m3fn
    return (x.float() / scale.float()).clamp(-448.0, 448.0).to(fp8), scale


def load(ckpt: str, mtp: bool = False) -> dict:
    """The target model's load, or with `mtp` the MTP drafter's (Qwen3_5MoeMTP, built from the speculative
    config's draft model config as the proposer builds it: llm_base_proposer.py _get_model)."""
    import torch

    out = new_result()
    try:
        _cpu_registrations()
        from vllm.config import set_current_vllm_config
        from vllm.distributed import init_distributed_environment, initialize_model_parallel
        from vllm.engine.arg_utils import EngineArgs

        spec = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}} if mtp else {}
        cfg = EngineArgs(
            model=ckpt,
            tokenizer=ckpt,
            tensor_parallel_size=1,
            enforce_eager=True,
            max_model_len=256,
            dtype="bfloat16",
            load_format="safetensors",
            skip_tokenizer_init=True,
            **spec,
        ).create_engine_config()
        model_config = cfg.speculative_config.draft_model_config if mtp else cfg.model_config
        with set_current_vllm_config(cfg):
            init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                backend="gloo",
                distributed_init_method=f"file://{tempfile.mktemp()}",
            )
            initialize_model_parallel(1, 1)
            from vllm.model_executor.model_loader import get_model_loader
            from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading

            out["stage"] = "build"
            with torch.device("cpu"):
                model = initialize_model(vllm_config=cfg, model_config=model_config)
            out["model"] = type(model).__name__
            params = dict(model.named_parameters())
            out["params"] = len(params)
            fill_nan(params, keep=lambda n: n.endswith(DEFAULTED))
            out["stage"] = "load"
            loader = get_model_loader(cfg.load_config)
            seen: list[str] = []
            probe = ConsumptionProbe()
            with probe:
                model.load_weights(watched_weights(loader.get_all_weights(model_config, model), probe, seen))
            record_load(out, params, seen, probe, mtp, skip=lambda n: n.endswith(DEFAULTED))
            process_weights_after_loading(model, model_config, torch.device("cpu"))
            record_done(out)
    except Exception as e:  # the verdict: what the engine says, in its words
        record_failure(out, e)
    return out


if __name__ == "__main__":
    main(load)
