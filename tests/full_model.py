"""Shared helpers of the tests that run the tiny model whole (calibrate-kv, eval kld, the layer reader and
streamer, data parallel, input hashes): fixtures (from tests/conftest.py when it provides them, else built
here once per session) and the full-model oracle."""

from __future__ import annotations

import contextlib

import pytest

_BUILT: dict[str, object] = {}


def fixture_dir(request, name: str):
    """The session fixture `name` (tiny_bf16, tiny_nvfp4_modelopt, tiny_nvfp4_ct) or a local build."""
    try:
        return request.getfixturevalue(name)
    except pytest.FixtureLookupError:
        pass
    if name not in _BUILT:
        from qtool.fixtures import tiny

        base = request.getfixturevalue("tmp_path_factory").mktemp("kvfix")
        if name == "tiny_bf16":
            _BUILT[name] = tiny.build_bf16(base / "bf16")
        elif name == "tiny_nvfp4_modelopt":
            _BUILT[name] = tiny.build_nvfp4_modelopt(fixture_dir(request, "tiny_bf16"), base / "mo")
        elif name == "tiny_nvfp4_ct":
            _BUILT[name] = tiny.build_nvfp4_ct(fixture_dir(request, "tiny_bf16"), base / "ct")
        else:
            raise KeyError(name)
    return _BUILT[name]


@contextlib.contextmanager
def capture_kv_full_model():
    """Record amax of K (the key returned by transformers' apply_rotary_pos_emb, i.e. after k_norm and
    rope) and of V (v_proj's output) per full-attention layer during a full-model forward. This capture
    point differs on purpose from calibrate-kv's (the attention-function inputs)."""
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as M

    rec: dict[int, list[float]] = {}
    current = {"layer": None}
    orig = M.apply_rotary_pos_emb

    def patched(q, k, cos, sin, unsqueeze_dim=1):
        qe, ke = orig(q, k, cos, sin, unsqueeze_dim)
        r = rec.setdefault(current["layer"], [0.0, 0.0])
        r[0] = max(r[0], float(ke.abs().amax().float()))
        return qe, ke

    handles = []

    def attach(layers):
        for i, layer in enumerate(layers):
            attn = getattr(layer, "self_attn", None)
            if attn is None:
                continue
            handles.append(
                attn.register_forward_pre_hook(lambda m, a, kw, i=i: current.update(layer=i), with_kwargs=True)
            )

            def vhook(m, a, out, i=i):
                r = rec.setdefault(i, [0.0, 0.0])
                r[1] = max(r[1], float(out.abs().amax().float()))

            handles.append(attn.v_proj.register_forward_hook(vhook))

    M.apply_rotary_pos_emb = patched
    try:
        yield rec, attach
    finally:
        M.apply_rotary_pos_emb = orig
        for h in handles:
            h.remove()


def dense_text_model(ckpt_dir):
    """transformers' Qwen3_5MoeTextModel holding the checkpoint's weights dequantized (all layers)."""
    import torch
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
        Qwen3_5MoeTextModel,
        Qwen3_5MoeTextRotaryEmbedding,
    )

    from qtool.stream.dequant import layer_state_dict, load_param
    from qtool.stream.layer_stream import LayerStreamer

    s = LayerStreamer(ckpt_dir)
    cfg = Qwen3_5MoeTextConfig(**{k: v for k, v in s.text_cfg_dict.items() if k != "model_type"})
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = Qwen3_5MoeTextModel(cfg)
    sd = {}
    for i in range(cfg.num_hidden_layers):
        want = {n: (tuple(p.shape), p.dtype) for n, p in model.layers[i].state_dict().items()}
        sd.update(
            {f"layers.{i}.{k}": v for k, v in layer_state_dict(s.model_map, i, torch.bfloat16, "cpu", want).items()}
        )
    sd["embed_tokens.weight"] = load_param(s.model_map, s.prefix + "embed_tokens.weight", torch.bfloat16)
    sd["norm.weight"] = load_param(s.model_map, s.prefix + "norm.weight", torch.bfloat16)
    model.load_state_dict(sd, strict=True, assign=True)
    model.rotary_emb = Qwen3_5MoeTextRotaryEmbedding(cfg)
    return model.eval()
