"""Runs inside QTOOL_ENGINES_PYTHON (vllm==0.33.0, sglang==0.5.23): what each engine's own code accepts, for
qtool.engines.accepts. Lists are read where the engine keeps them as data and probed (each candidate fed to the
engine's own parser, accepted when it picks a method instead of raising) where they are code.

argv[1]: JSON {"algos": [...], "kv_algos": [...], "specs": [[type, bits], ...], "layer_types": [...]};
stdout (last line): JSON {"vllm": {...}, "sglang": {...}}. Kept free of qtool imports: it runs in the other
interpreter.
"""

import ast
import contextlib
import inspect
import itertools
import json
import logging
import sys
import textwrap
import warnings
from unittest import mock

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)

# Layouts an exporter writes; the engines' scheme predicates look for one of them per (type, bits)
LAYOUTS = [
    {"strategy": "tensor"},
    {"strategy": "channel"},
    {"strategy": "group", "group_size": 128},
    {"strategy": "group", "group_size": 32},
    {"strategy": "tensor_group", "group_size": 16},
    {"strategy": "token"},
    {"strategy": "block", "block_structure": [128, 128]},
    {"strategy": "group", "group_size": 32, "scale_dtype": "torch.uint8"},
]
FORMATS = [
    "pack-quantized",
    "float-quantized",
    "int-quantized",
    "naive-quantized",
    "nvfp4-pack-quantized",
    "mxfp4-pack-quantized",
]
CAPABILITIES = [(9, 0), (10, 0)]  # H100 and B200: accepted on either counts
KV_SCHEME = {"strategy": "tensor", "dynamic": False, "symmetric": True}


def _quant_args(spec, layout, dynamic):
    from compressed_tensors.quantization import QuantizationArgs

    try:
        return QuantizationArgs(type=spec[0], num_bits=spec[1], symmetric=True, dynamic=dynamic, **layout)
    except Exception:  # noqa: BLE001 - a layout that type does not take (pydantic raises several kinds)
        return None


def _scheme_pairs(specs, make_config, pick):
    """(weights, input activations or None) pairs `pick(config, w, a, format)` maps to a scheme."""
    ok = set()
    for fmt, w, a in itertools.product(FORMATS, specs, specs + [None]):
        key = (tuple(w), None if a is None else tuple(a))
        if key in ok:
            continue
        cfg = make_config(fmt)
        for wl, al, dyn in itertools.product(LAYOUTS, [None] if a is None else LAYOUTS, [False, True]):
            wq, aq = _quant_args(w, wl, False), None if a is None else _quant_args(a, al, dyn)
            if wq is None or (a is not None and aq is None):
                continue
            try:
                pick(cfg, wq, aq, fmt)
            except (NotImplementedError, ValueError, ImportError):
                continue
            ok.add(key)
            break
    return [[list(w), a and list(a)] for w, a in ok]


def _skip_constructors(module, prefix):
    """Scheme constructors pick GPU kernels (absent here): the choice of scheme is what is probed."""
    stack = contextlib.ExitStack()
    for name in dir(module):
        obj = getattr(module, name)
        if isinstance(obj, type) and name.startswith(prefix):
            stack.enter_context(mock.patch.object(obj, "__init__", lambda self, *a, **k: None))
    return stack


def _compared_strings(func, attr):
    """String constants `self.<attr> == "..."` compares against in `func`'s source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == attr:
            out |= {c.value for c in node.comparators if isinstance(c, ast.Constant)}
    return out


def vllm(q):
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from vllm.model_executor.layers.quantization import modelopt
    from vllm.model_executor.layers.quantization.compressed_tensors import compressed_tensors as ct
    from vllm.model_executor.models.qwen3_5 import Qwen3_5DecoderLayer
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability
    from vllm.utils.torch_utils import get_kv_cache_quant_algo_string

    def algo_ok(algo):  # ModelOptQuantConfigBase.from_config: "ModelOpt currently only supports: ..."
        with mock.patch.object(modelopt.ModelOptQuantConfigBase, "_from_config", classmethod(lambda *a, **k: 1)):
            try:
                return modelopt.ModelOptQuantConfigBase.from_config({"quantization": {"quant_algo": algo}}) == 1
            except ValueError:
                return False

    def kv_algo(cfg):  # the KV-cache dtype "auto" resolves to; "auto" = unquantized (vllm/utils/torch_utils.py)
        return get_kv_cache_quant_algo_string(cfg) not in (None, "auto")

    def modelopt_kv_scheme_ok(scheme):  # config.json: the KV method needs kv_cache_quant_method, the dtype too
        with mock.patch.object(
            modelopt.ModelOptQuantConfigBase, "_from_config", classmethod(lambda cls, **k: k["kv_cache_quant_method"])
        ):
            method = modelopt.ModelOptQuantConfigBase.from_config(
                {"quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_scheme": scheme}
            )
        return method is not None and kv_algo({"quant_method": "modelopt", "kv_cache_scheme": scheme})

    def ct_kv_scheme_ok(scheme):
        try:
            ct.CompressedTensorsKVCacheMethod.validate_kv_cache_scheme(scheme)
            return True
        except (NotImplementedError, ValueError):
            return False

    def layer_type_ok(t):  # the config transformers builds, then the decoder layer's branches
        try:
            cfg = Qwen3_5MoeTextConfig(num_hidden_layers=1, layer_types=[t])
        except Exception:  # noqa: BLE001 - transformers validation: any error is a refusal
            return False
        return cfg.layer_types[0] in _compared_strings(Qwen3_5DecoderLayer.__init__, "layer_type")

    def make_ct(fmt):
        return ct.CompressedTensorsConfig.from_config({"config_groups": {}, "ignore": [], "format": fmt})

    pairs = []
    with _skip_constructors(ct, "CompressedTensorsW"):
        for cap in CAPABILITIES:
            with mock.patch.object(current_platform, "get_device_capability", return_value=DeviceCapability(*cap)):
                pairs += _scheme_pairs(
                    q["specs"], make_ct, lambda c, w, a, f: c._get_scheme_from_parts(w, a, format=f, layer_name="probe")
                )
    kv_schemes = q["specs"]
    return {
        "quant_algos_list": list(modelopt.QUANT_ALGOS),
        "quant_algos": [a for a in q["algos"] if algo_ok(a)],
        "kv_algos": [
            a
            for a in q["kv_algos"]
            if kv_algo({"quant_method": "modelopt", "quantization": {"kv_cache_quant_algo": a}})
        ],
        "kv_schemes_modelopt": [
            s for s in kv_schemes if modelopt_kv_scheme_ok({"type": s[0], "num_bits": s[1], **KV_SCHEME})
        ],
        "kv_schemes_ct": [s for s in kv_schemes if ct_kv_scheme_ok({"type": s[0], "num_bits": s[1], **KV_SCHEME})],
        "schemes": sorted({json.dumps(p) for p in pairs}),
        "layer_types": [t for t in q["layer_types"] if layer_type_ok(t)],
    }


def sglang(q):
    import torch
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.configs.qwen3_5 import Qwen3_5MoeTextConfig
    from sglang.srt.layers.quantization import get_quantization_config
    from sglang.srt.layers.quantization.compressed_tensors import compressed_tensors as ct
    from sglang.srt.mem_cache.kv_cache_dtype import configure_kv_cache_dtype
    from sglang.srt.models.qwen3_5 import ALL_DECODER_LAYER_TYPES

    def quant_cfg(quant_config_dict):  # ModelConfig._parse_modelopt_quant_config, then that method's from_config
        parsed = ModelConfig._parse_modelopt_quant_config(None, quant_config_dict)
        if not parsed:
            return None  # hf_quant_config.json unrecognised: the model is built unquantized
        method = get_quantization_config(parsed["quant_method"])
        try:  # the file as written (ModelOpt configs) ...
            return method.from_config(quant_config_dict)
        except Exception:  # noqa: BLE001 - ... or the settings the parser derived for another method (mxfp8 -> Fp8Config)
            return method.from_config({**quant_config_dict, **parsed})

    def algo_ok(algo):
        body = {
            "quant_algo": algo,
            "kv_cache_quant_algo": "FP8",
            "group_size": 16,
            "exclude_modules": [],
            "quantized_layers": {"x": {"quant_algo": "NVFP4"}},
        }
        try:
            return quant_cfg({"producer": {"name": "modelopt"}, "quantization": body}) is not None
        except Exception:  # noqa: BLE001 - any error at config load is a refusal
            return False

    def kv_dtype(cfg):  # what --kv-cache-dtype auto resolves to for a model with this quant config
        model = torch.nn.Module()
        model.quant_config = cfg
        resolved, _ = configure_kv_cache_dtype(
            server_args_kv_cache_dtype="auto",
            model=model,
            model_dtype=torch.bfloat16,
            is_draft_worker=False,
            is_dflash=False,
            speculative_draft_attention_backend="",
        )
        return resolved

    def kv_algo_ok(a):
        return (
            kv_dtype(
                quant_cfg(
                    {
                        "quantization": {
                            "quant_algo": "NVFP4",
                            "kv_cache_quant_algo": a,
                            "group_size": 16,
                            "exclude_modules": [],
                        }
                    }
                )
            )
            is not None
        )

    def modelopt_kv_scheme_ok(scheme):
        return (
            kv_dtype(
                quant_cfg(
                    {
                        "quant_method": "modelopt",
                        "quant_algo": "NVFP4",
                        "group_size": 16,
                        "ignore": [],
                        "kv_cache_scheme": scheme,
                    }
                )
            )
            is not None
        )

    def ct_kv_scheme_ok(scheme):
        return ct.CompressedTensorsKVCacheMethod.is_supported_scheme(scheme)

    def layer_types_read():  # does layers_block_type follow layer_types, or full_attention_interval only?
        a = Qwen3_5MoeTextConfig(
            num_hidden_layers=4, full_attention_interval=4, layer_types=["full_attention"] * 4
        ).layers_block_type
        b = Qwen3_5MoeTextConfig(
            num_hidden_layers=4, full_attention_interval=4, layer_types=["linear_attention"] * 4
        ).layers_block_type
        return a != b

    def make_ct(fmt):
        return ct.CompressedTensorsConfig.from_config({"config_groups": {}, "ignore": [], "format": fmt})

    pairs = []
    with _skip_constructors(ct, "CompressedTensorsW"):
        for cap in CAPABILITIES:
            with mock.patch.object(torch.cuda, "get_device_capability", return_value=cap):
                pairs += _scheme_pairs(q["specs"], make_ct, lambda c, w, a, f: c._get_scheme_from_parts(w, a, format=f))
    return {
        "quant_algos": [a for a in q["algos"] if algo_ok(a)],
        "kv_algos": [a for a in q["kv_algos"] if kv_algo_ok(a)],
        "kv_schemes_modelopt": [
            s for s in q["specs"] if modelopt_kv_scheme_ok({"type": s[0], "num_bits": s[1], **KV_SCHEME})
        ],
        "kv_schemes_ct": [s for s in q["specs"] if ct_kv_scheme_ok({"type": s[0], "num_bits": s[1], **KV_SCHEME})],
        "schemes": sorted({json.dumps(p) for p in pairs}),
        "layer_types_read": layer_types_read(),
        "decoder_layer_types": sorted(ALL_DECODER_LAYER_TYPES),
    }


if __name__ == "__main__":
    query = json.loads(sys.argv[1])
    result = {}
    for name, probe in (("vllm", vllm), ("sglang", sglang)):
        with contextlib.redirect_stdout(sys.stderr):
            result[name] = probe(query)
    print(json.dumps(result))
