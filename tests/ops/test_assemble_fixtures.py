"""`assemble hybrid` on the tiny checkpoints built by the real producers (transformers, ModelOpt,
llm-compressor), and the numerics check: the hybrid, dequantized and run through transformers, is closer
to the BF16 original (KLD over token windows) than the NVFP4 source."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qtool.io.checkpoint import Checkpoint
from qtool.ops.assemble import HybridOptions, MtpMode, execute, plan_hybrid

FIXTURES = {
    "tiny_bf16": lambda d, fx: _tiny().build_bf16(d / "m"),
    "tiny_bf16_fused": lambda d, fx: _tiny().build_bf16(d / "m", layout="fused"),
    "tiny_nvfp4_modelopt": lambda d, fx: _tiny().build_nvfp4_modelopt(fx("tiny_bf16"), d / "m", mtp=True),
    "tiny_nvfp4_modelopt_nomtp": lambda d, fx: _tiny().build_nvfp4_modelopt(fx("tiny_bf16"), d / "m"),
    "tiny_nvfp4_ct": lambda d, fx: _tiny().build_nvfp4_ct(fx("tiny_bf16"), d / "m"),
}


def _tiny():
    from qtool.fixtures import tiny

    return tiny


@pytest.fixture(scope="module")
def fx(request, tmp_path_factory):
    """Session fixtures of tests/conftest.py when present, else built here once per module."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            try:
                cache[name] = Path(request.getfixturevalue(name))
            except pytest.FixtureLookupError:
                cache[name] = Path(FIXTURES[name](tmp_path_factory.mktemp(name), get))
        return cache[name]

    return get


@pytest.fixture(autouse=True)
def _hash_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QTOOL_CACHE_DIR", str(tmp_path / "hash-cache"))


def _assemble(nv, bf, out, **kw):
    plan = plan_hybrid(HybridOptions(nvfp4=nv, bf16=bf, out=out, **kw))
    return plan, execute(plan)


@pytest.mark.parametrize(
    "nv_name,bf_name,mtp",
    [
        ("tiny_nvfp4_modelopt_nomtp", "tiny_bf16_fused", "graft"),
        ("tiny_nvfp4_modelopt", "tiny_bf16", "keep"),
        ("tiny_nvfp4_ct", "tiny_bf16_fused", "keep"),
    ],
)
def test_real_producers(fx, tmp_path, nv_name, bf_name, mtp):
    nv, bf = fx(nv_name), fx(bf_name)
    out = tmp_path / "out"
    plan, res = _assemble(nv, bf, out, bf16_expert_layers=(0,))
    assert plan.mtp_action == mtp and res.checks["passed"], res.checks
    o = Checkpoint.open(out)
    assert "mtp.fc.weight" in o.tensors
    assert not [k for k in o.tensors if k.endswith("gate_up_proj")]
    assert not [k for k in o.tensors if ".shared_expert." in k and not k.endswith(".weight")]
    # every non-weight file of the NVFP4 source is carried over (configs patched, others identical)
    for p in nv.iterdir():
        if p.suffix != ".safetensors" and p.name not in ("model.safetensors.index.json",):
            assert (out / p.name).exists(), p.name
            if p.name not in ("config.json", "hf_quant_config.json"):
                assert (out / p.name).read_bytes() == p.read_bytes()
    from qtool.ops.inspect import inspect_checkpoint

    assert inspect_checkpoint(out)["problems"] == [] or all(
        c.get("inherited") is not None for c in res.checks["checks"] if c["name"] == "consistency"
    )


def test_mtp_from_bf16_replaces_kept_head(fx, tmp_path):
    nv, bf = fx("tiny_nvfp4_modelopt"), fx("tiny_bf16_fused")
    plan, res = _assemble(nv, bf, tmp_path / "out", mtp=MtpMode.FROM_BF16)
    assert plan.mtp_action == "from-bf16" and res.checks["passed"]
    m = json.loads((tmp_path / "out" / "qtool-manifest.json").read_text())
    origins = {t: o for s in m["shards"].values() for t, o in s["tensors"].items()}
    assert origins["mtp.layers.0.mlp.experts.0.up_proj.weight"]["source"] == "bf16"
    assert "slice" in origins["mtp.layers.0.mlp.experts.0.up_proj.weight"]


def _dense_dir(src: Path, dst: Path, bf16_config: Path) -> Path:
    """A BF16 copy of `src` that transformers can load: quantized modules dequantized (qtool.formats via
    qtool.stream.dequant), MTP and KV scales left out (transformers drops them anyway)."""
    import torch
    from safetensors.torch import save_file

    from qtool.arch.model_map import QUANTIZED_FORMATS, build_map
    from qtool.io.reader import read_tensor
    from qtool.stream.dequant import dense_weight

    mm = build_map(Checkpoint.open(src))
    sd = {}
    for mod in mm.modules.values():
        if mod.name.startswith("mtp."):
            continue
        if mod.format in QUANTIZED_FORMATS:
            sd[mod.name + ".weight"] = dense_weight(mod, torch.bfloat16).contiguous()
            continue
        for p, info in mod.params.items():
            if p in ("k_scale", "v_scale", "input_scale", "weight_scale_2", "weight_scale"):
                continue
            sd[info.name] = read_tensor(info)
    dst.mkdir()
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_bytes((bf16_config / "config.json").read_bytes())
    return dst


def _logits(model_dir: Path, ids):
    import torch
    from transformers import Qwen3_5MoeForConditionalGeneration

    model = Qwen3_5MoeForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def test_hybrid_closer_to_bf16_than_nvfp4(fx, tmp_path):
    import torch

    bf, nv = fx("tiny_bf16"), fx("tiny_nvfp4_modelopt_nomtp")
    out = tmp_path / "hybrid"
    _, res = _assemble(nv, bf, out, bf16_expert_layers=(0, 1, 2))
    assert res.checks["passed"]
    vocab = json.loads((bf / "config.json").read_text())["text_config"]["vocab_size"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (3, 24), generator=g)  # three token windows
    ref = torch.log_softmax(_logits(bf, ids), -1)

    def kld(d: Path) -> float:
        lp = torch.log_softmax(_logits(_dense_dir(d, tmp_path / (d.name + "-dense"), bf), ids), -1)
        return float((ref.exp() * (ref - lp)).sum(-1).mean())

    k_nv, k_hy = kld(nv), kld(out)
    assert k_hy < k_nv, (k_hy, k_nv)
