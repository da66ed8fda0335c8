"""verify knows what the engines refuse in a config: quant algorithms, KV-cache bit widths, weight types and
layer types outside what vLLM 0.33 / SGLang 0.5.23 load (qtool/engines/accepts.py) exit 3 naming the key and
the engine. Each case is a tiny checkpoint with one config value edited, as a user's hand edit or a foreign
exporter would leave it; the engines' own lists are checked in tests/engines/test_accepts_oracle.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from qtool.cli.main import main

ENGINES = ("vllm@0.33.0", "sglang@0.5.23")


def _edited(src: Path, tmp_path: Path, edit_config, edit_hf_quant=None) -> Path:
    ck = tmp_path / "ck"
    shutil.copytree(src, ck)
    cfg = json.loads((ck / "config.json").read_text())
    edit_config(cfg)
    (ck / "config.json").write_text(json.dumps(cfg, indent=2))
    hq = ck / "hf_quant_config.json"
    if edit_hf_quant is not None and hq.exists():
        body = json.loads(hq.read_text())
        edit_hf_quant(body["quantization"])
        hq.write_text(json.dumps(body, indent=2))
    return ck


def _rejections(ck: Path, capsys) -> list[dict]:
    """verify's exit code must be 3; the findings that name an engine refusing the config."""
    code = main(["verify", str(ck), "--tp", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 3, [f for f in out["findings"] if f["severity"] == "error"]
    return [f for f in out["findings"] if f["code"] == "engine-rejects-config" and f["severity"] == "error"]


def _assert_names(found: list[dict], key: str, engines=ENGINES) -> None:
    assert {f["engine"] for f in found if key in f["message"]} == set(engines), found
    for f in found:
        assert f["fix"], f


def _set_weights(**spec):
    def edit(cfg):
        for group in cfg["quantization_config"]["config_groups"].values():
            group["weights"].update(spec)

    return edit


def test_an_unknown_modelopt_quant_algo_is_refused_by_both_engines(tiny_nvfp4_modelopt, tmp_path, capsys):
    ck = _edited(
        tiny_nvfp4_modelopt,
        tmp_path,
        lambda c: c["quantization_config"].update(quant_algo="INT3"),
        lambda q: q.update(quant_algo="INT3"),
    )
    found = _rejections(ck, capsys)
    _assert_names(found, "quant_algo", ENGINES)
    assert all("INT3" in f["message"] for f in found)


@pytest.mark.parametrize("fixture", ["tiny_nvfp4_modelopt", "tiny_nvfp4_ct"])
def test_a_4_bit_kv_cache_scheme_is_refused(fixture, request, tmp_path, capsys):
    src = request.getfixturevalue(fixture)
    scheme = {"type": "float", "num_bits": 4, "dynamic": False, "strategy": "tensor", "symmetric": True}
    ck = _edited(src, tmp_path, lambda c: c["quantization_config"].update(kv_cache_scheme=scheme))
    _assert_names(_rejections(ck, capsys), "kv_cache_scheme")


def test_a_4_bit_kv_cache_quant_algo_in_hf_quant_config_is_refused(tiny_nvfp4_modelopt, tmp_path, capsys):
    """hf_quant_config.json is what the engines read when config.json has no quantization_config."""

    def drop_qc(cfg):
        del cfg["quantization_config"]

    ck = _edited(tiny_nvfp4_modelopt, tmp_path, drop_qc, lambda q: q.update(kv_cache_quant_algo="INT4"))
    _assert_names(_rejections(ck, capsys), "kv_cache_quant_algo")


@pytest.mark.parametrize(
    ("fixture", "spec"),
    [
        ("tiny_nvfp4_modelopt", {"num_bits": 8}),
        ("tiny_nvfp4_modelopt", {"type": "int"}),
        ("tiny_nvfp4_modelopt", {"type": "int", "num_bits": 8}),
        # compressed-tensors: int weights under float4 activations have no scheme in either engine (8-bit float
        # weights do: vLLM's MXFP8 and SGLang's W8A16 take any activations)
        ("tiny_nvfp4_ct", {"type": "int"}),
        ("tiny_nvfp4_ct", {"type": "int", "num_bits": 8}),
    ],
)
def test_weights_of_another_type_than_the_engines_build_are_refused(fixture, spec, request, tmp_path, capsys):
    ck = _edited(request.getfixturevalue(fixture), tmp_path, _set_weights(**spec))
    _assert_names(_rejections(ck, capsys), "config_groups.group_0.weights")


def test_a_layer_type_vllm_does_not_build_is_refused_for_vllm_only(tiny_nvfp4_modelopt, tmp_path, capsys):
    """SGLang builds layers by full_attention_interval and never reads layer_types."""

    def edit(cfg):
        cfg["text_config"]["layer_types"][1] = "sliding_attention"

    ck = _edited(tiny_nvfp4_modelopt, tmp_path, edit)
    found = _rejections(ck, capsys)
    _assert_names(found, "layer_types[1]", engines=("vllm@0.33.0",))
    assert all("sliding_attention" in f["message"] for f in found)


def test_every_value_the_fixtures_use_is_accepted(tiny_nvfp4_modelopt, tiny_nvfp4_ct, capsys):
    for ck in (tiny_nvfp4_modelopt, tiny_nvfp4_ct):
        assert main(["verify", str(ck), "--tp", "2", "--json"]) == 0
        capsys.readouterr()
