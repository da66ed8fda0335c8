"""qtool inspect on real-scale sparse layouts: facts, speed-relevant scale, and each problem code."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys

import pytest

from qtool.fixtures.sparse import build_sparse
from qtool.io.checkpoint import Checkpoint
from qtool.ops.inspect import inspect_checkpoint


@pytest.fixture(scope="module")
def s397_nvfp4(tmp_path_factory):
    return build_sparse(tmp_path_factory.mktemp("s397") / "ckpt", model="397b", flavour="modelopt-nvfp4")


@pytest.fixture(scope="module")
def s35_src(tmp_path_factory):
    return build_sparse(tmp_path_factory.mktemp("s35") / "ckpt", model="35b", flavour="modelopt-nvfp4")


@pytest.fixture()
def s35(s35_src, tmp_path):
    """A private copy (sparse-preserving) that a test may damage."""
    dst = tmp_path / "ckpt"
    shutil.copytree(
        s35_src, dst, copy_function=lambda a, b: subprocess.run(["cp", "--sparse=always", a, b], check=True)
    )
    return dst


def codes(rep):
    return sorted({p["code"] for p in rep["problems"]})


def test_real_scale_397b_nvfp4(s397_nvfp4):
    rep = inspect_checkpoint(s397_nvfp4)
    assert rep["architecture"] == "Qwen3_5MoeForConditionalGeneration"
    assert rep["num_layers"] == 60
    assert rep["layer_types"] == {"linear_attention": 45, "full_attention": 15}
    assert rep["full_attention_layers"] == list(range(3, 60, 4))
    assert rep["num_tensors"] > 370_000
    assert rep["groups"]["routed_experts"]["format"] == "nvfp4"
    assert rep["groups"]["routed_experts"]["tensors"] == 60 * 512 * 3 * 4
    for g in ("shared_expert", "attention", "linear_attn", "router", "mtp", "vision", "lm_head"):
        assert rep["groups"][g]["format"] == "bf16", g
    assert rep["groups"]["norm"]["format"] is None  # norms do not count
    assert rep["expert_layout"] == "per_expert" and rep["mtp"] and rep["vision"]
    kv = rep["kv_scales"]
    assert {k: kv[k] for k in ("layers", "calibrated", "naming")} == {
        "layers": list(range(3, 60, 4)),
        "calibrated": True,
        "naming": "modelopt",
    }
    assert [v["layer"] for v in kv["values"]] == kv["layers"]
    assert all(0 < v["k"] < 1 and 0 < v["v"] < 1 for v in kv["values"])  # calibrated values, read as scalars
    # the grid: 60 decoder rows + MTP; NVIDIA's layout has NVFP4 routed experts and BF16 everywhere else
    grid = rep["grid"]
    assert [r["row"] for r in grid["rows"]] == [f"layer {i}" for i in range(60)] + ["mtp"]
    for r in grid["rows"][:60]:
        assert r["cells"]["routed_experts"] == {
            "format": "nvfp4",
            "formats": {"nvfp4": 512 * 3},
            "modules": 512 * 3,
            "bytes": r["cells"]["routed_experts"]["bytes"],
        }
        assert {c["format"] for k, c in r["cells"].items() if k != "routed_experts"} == {"bf16"}
    assert (
        sum(c["bytes"] for r in grid["rows"] for c in r["cells"].values())
        + sum(c["bytes"] for c in grid["model"].values())
        <= rep["total_bytes"]
    )
    assert rep["quantization"]["quant_method"] == "modelopt"
    assert rep["quantization"]["hf_quant_config"]["schema"] == "modelopt-native"
    assert rep["problems"] == []
    # about 233 GB of NVFP4 data, all of it holes: nothing was read
    assert 200e9 < rep["total_bytes"] < 260e9


def _poke_scalars(ckpt_dir, values: dict[str, float]):
    tensors = Checkpoint.open(ckpt_dir).tensors
    for tensor, value in values.items():
        info = tensors[tensor]
        with open(info.file, "r+b") as f:
            f.seek(info.start)
            f.write(struct.pack("<f", value))


def test_scale_mismatch_between_gate_and_up(s35):
    _poke_scalars(s35, {"model.language_model.layers.5.mlp.experts.17.up_proj.weight_scale_2": 123.0})
    rep = inspect_checkpoint(s35)
    assert codes(rep) == ["scale-mismatch"]
    assert "layers.5.mlp.experts.17.gate_proj" in rep["problems"][0]["message"]


def test_uncalibrated_kv_scales_are_reported(s35):
    ck = Checkpoint.open(s35)
    _poke_scalars(s35, {n: 1.0 for n in ck.tensors if n.endswith(("k_proj.k_scale", "v_proj.v_scale"))})
    rep = inspect_checkpoint(s35)
    assert rep["kv_scales"]["calibrated"] is False and rep["problems"] == []


def test_config_disagreement_and_bf16_not_ignored(s35):
    cfg = json.loads((s35 / "config.json").read_text())
    cfg["quantization_config"]["ignore"] = [p for p in cfg["quantization_config"]["ignore"] if "shared_expert" not in p]
    (s35 / "config.json").write_text(json.dumps(cfg, indent=2))
    rep = inspect_checkpoint(s35)
    assert "config-disagreement" in codes(rep)
    bf16 = [p for p in rep["problems"] if p["code"] == "bf16-but-not-ignored"]
    assert bf16 and all("shared_expert" in p["message"] for p in bf16)


def test_quantized_but_ignored(s35):
    for name in ("config.json", "hf_quant_config.json"):
        obj = json.loads((s35 / name).read_text())
        lst = obj["quantization_config"]["ignore"] if name == "config.json" else obj["quantization"]["exclude_modules"]
        lst.append("*.layers.2.mlp.experts*")
        (s35 / name).write_text(json.dumps(obj, indent=2))
    rep = inspect_checkpoint(s35)
    assert codes(rep) == ["quantized-but-ignored"]
    assert "layers.2.mlp.experts" in rep["problems"][0]["message"]


def test_missing_quant_tensor(s35):
    # drop one weight_scale from the index and header view: rewrite index without it and check error
    ck = Checkpoint.open(s35)
    name = "model.language_model.layers.1.mlp.experts.3.down_proj.weight_scale"
    assert name in ck.tensors
    # A header can't lose a tensor cheaply; instead re-label it, which is what a bad export looks like.
    info = ck.tensors[name]
    with open(info.file, "rb") as f:
        raw = f.read(8)
    (n,) = struct.unpack("<Q", raw)
    with open(info.file, "r+b") as f:
        f.seek(8)
        header = f.read(n)
        new = header.replace(f'"{name}"'.encode(), f'"{name[:-1]}x"'.encode())
        f.seek(8)
        f.write(new)
    idx = json.loads((s35 / "model.safetensors.index.json").read_text())
    idx["weight_map"][name[:-1] + "x"] = idx["weight_map"].pop(name)
    (s35 / "model.safetensors.index.json").write_text(json.dumps(idx))
    rep = inspect_checkpoint(s35)
    assert "missing-quant-tensor" in codes(rep)


def test_cli_json_is_one_object(s35):
    r = subprocess.run([sys.executable, "-m", "qtool", "inspect", str(s35), "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    obj = json.loads(r.stdout)
    for key in (
        "architecture",
        "num_layers",
        "layer_types",
        "groups",
        "expert_layout",
        "mtp",
        "vision",
        "kv_scales",
        "quantization",
        "problems",
    ):
        assert key in obj
    r = subprocess.run([sys.executable, "-m", "qtool", "inspect", str(s35)], capture_output=True, text=True)
    assert r.returncode == 0 and "problems: none" in r.stdout and "expert layout  per_expert" in r.stdout


def test_kv_cache_only_bf16_checkpoint_is_clean(tmp_path):
    """llm-compressor's KV-cache-only form (format dense, config_groups {}) quantizes no Linear, so
    BF16 modules missing from `ignore` are not a problem."""
    ck = build_sparse(tmp_path / "kvonly", model="35b", flavour="bf16-per-expert", kv_scales=True, vision=False)
    rep = inspect_checkpoint(ck)
    assert rep["quantization"]["quant_method"] == "compressed-tensors"
    assert rep["kv_scales"]["naming"] == "compressed-tensors" and rep["kv_scales"]["calibrated"]
    assert rep["problems"] == []
