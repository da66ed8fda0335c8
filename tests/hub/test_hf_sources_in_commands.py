"""Every command that takes a checkpoint accepts `hf:ORG/NAME[@REV]`; assemble hybrid's BF16 side is
range-fetched (only the tensors the plan can take)."""

from __future__ import annotations

import hashlib
import json

from qtool.cli.main import main
from qtool.io.checkpoint import Checkpoint


def test_inspect_and_verify_take_hub_sources(hub, tiny_nvfp4_modelopt_nomtp, capsys):
    hub.add_dir("org/nv", tiny_nvfp4_modelopt_nomtp)
    assert main(["inspect", "hf:org/nv", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["architecture"] == "Qwen3_5MoeForConditionalGeneration"
    assert rep["groups"]["routed_experts"]["format"] == "nvfp4"
    assert main(["verify", "hf:org/nv", "--tp", "1", "--json"]) in (0, 3)
    assert "findings" in json.loads(capsys.readouterr().out)


def test_patch_config_refuses_a_hub_source(hub, tiny_nvfp4_modelopt_nomtp, capsys):
    hub.add_dir("org/nv", tiny_nvfp4_modelopt_nomtp)
    assert main(["patch-config", "hf:org/nv", "--fix", "router-ignore"]) == 1
    assert "qtool download" in capsys.readouterr().err


def test_assemble_fetches_only_what_the_plan_needs(hub, tiny_nvfp4_modelopt_nomtp, tiny_bf16, tmp_path, capsys):
    hub.add_dir("org/nv", tiny_nvfp4_modelopt_nomtp)
    hub.add_dir("org/bf16", tiny_bf16)
    out = tmp_path / "hybrid"
    rc = main(
        [
            "assemble",
            "hybrid",
            "--nvfp4",
            "hf:org/nv",
            "--bf16",
            "hf:org/bf16",
            "-o",
            str(out),
            "--bf16-expert-layers",
            "0",
            "--json",
            "--quiet",
        ]
    )
    assert rc == 0, capsys.readouterr()
    ck = Checkpoint.open(out)
    bf = Checkpoint.open(tiny_bf16)
    shared = [n for n in bf.tensors if ".mlp.shared_expert." in n]
    assert shared and all(ck.tensors[n].dtype == "BF16" for n in shared)
    # BF16 bytes served: the shared experts, layer 0's experts and the MTP head, not the whole model
    wanted = sum(
        t.nbytes
        for n, t in bf.tensors.items()
        if ".mlp.shared_expert" in n or ".layers.0.mlp.experts." in n or n.startswith("mtp.")
    )
    shas = {hashlib.sha256(p.read_bytes()).hexdigest() for p in tiny_bf16.glob("*.safetensors")}
    served = sum(r.body_bytes for r in hub.requests("GET", "/cdn/") if r.path.rsplit("/", 1)[-1] in shas)
    total = bf.total_bytes()
    assert served < total, (served, total)
    assert served >= wanted


def test_eval_kld_takes_hub_checkpoints(hub, tiny_bf16, tiny_nvfp4_modelopt_nomtp, capsys):
    hub.add_dir("org/bf16", tiny_bf16)
    hub.add_dir("org/nv", tiny_nvfp4_modelopt_nomtp)
    rc = main(
        [
            "eval",
            "kld",
            "--ref",
            "hf:org/bf16",
            "--test",
            "hf:org/nv",
            "--windows",
            "1",
            "--seq-len",
            "16",
            "--json",
            "--quiet",
        ]
    )
    assert rc == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["positions"] == 16 and rep["mean"] > 0
