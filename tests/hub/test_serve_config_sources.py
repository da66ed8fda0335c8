"""serve-config prints launch configs a user can paste: hf: sources by repo id and commit, absolute
binds, the modelled engine image, YaRN once, remote code only when the checkpoint ships it."""

from __future__ import annotations

import json

from qtool.cli.main import main


def test_launch_configs_a_user_can_paste(hub, tiny_nvfp4_modelopt_nomtp, tmp_path, monkeypatch, capsys):
    """Found as: serve-config on hf: printed a path inside qtool's cache and `--served-model-name files`;
    compose wrote `demo-out:/model:ro` (a named volume) and `:latest` images; --yarn on a checkpoint
    patch-config had already given YaRN applied it twice; --trust-remote-code was always on."""
    import shutil

    commit = hub.add_dir("Qwen/tiny-nvfp4", tiny_nvfp4_modelopt_nomtp)
    assert main(["serve-config", "hf:Qwen/tiny-nvfp4", "--engine", "vllm", "--tp", "2", "--json"]) == 0
    argv = json.loads(capsys.readouterr().out)["argv"]
    assert argv[:5] == ["vllm", "serve", "Qwen/tiny-nvfp4", "--revision", commit]
    assert argv[argv.index("--served-model-name") + 1] == "tiny-nvfp4" and "--trust-remote-code" not in argv
    assert main(["serve-config", "hf:Qwen/tiny-nvfp4", "--engine", "sglang", "--tp", "2", "--json"]) == 0
    argv = json.loads(capsys.readouterr().out)["argv"]
    assert argv[argv.index("--model-path") + 1 : argv.index("--model-path") + 4] == [
        "Qwen/tiny-nvfp4",
        "--revision",
        commit,
    ]
    # compose from a relative path: an absolute bind mount, the modelled engine version
    ck = tmp_path / "demo-out"
    shutil.copytree(tiny_nvfp4_modelopt_nomtp, ck)
    monkeypatch.chdir(tmp_path)
    assert main(["serve-config", "demo-out", "--engine", "sglang", "--tp", "2", "--format", "compose"]) == 0
    text = capsys.readouterr().out
    assert f'      - "{ck}:/model:ro"' in text and '"lmsysorg/sglang:v0.5.23"' in text
    # YaRN already in the config: skipped with a note, not applied twice
    assert main(["patch-config", str(ck), "--yarn", "4"]) == 0
    capsys.readouterr()
    assert main(["serve-config", str(ck), "--engine", "vllm", "--tp", "2", "--yarn", "4", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert "--hf-overrides" not in rep["argv"] and any("already has YaRN" in n for n in rep["notes"])
    # remote code: only when the checkpoint has an auto_map, and verify warns about it
    cfg = json.loads((ck / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_x.X"}
    (ck / "config.json").write_text(json.dumps(cfg))
    (ck / "modeling_x.py").write_text("")
    assert main(["serve-config", str(ck), "--engine", "vllm", "--tp", "2", "--json"]) == 0
    assert "--trust-remote-code" in json.loads(capsys.readouterr().out)["argv"]
    assert main(["verify", str(ck), "--tp", "2", "--json"]) in (0, 3)
    codes = {f["code"]: f for f in json.loads(capsys.readouterr().out)["findings"]}
    assert codes["remote-code"]["severity"] == "warning" and "modeling_x.py" in codes["remote-code"]["message"]
