"""qtool patch-config: each fix in each schema, idempotence, dry-run, atomic writes, CLI."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from in_process import run_cli

from qtool.fixtures.sparse import build_sparse
from qtool.ops import patch_config as pc
from qtool.ops.inspect import inspect_checkpoint

ROUTER = pc.ROUTER_GLOB


def _copy(src, dst):
    shutil.copytree(src, dst, copy_function=lambda a, b: subprocess.run(["cp", "--sparse=always", a, b], check=True))
    return dst


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    base = tmp_path_factory.mktemp("patch")
    return {
        "modelopt": build_sparse(base / "mo", model="35b", flavour="modelopt-nvfp4"),
        "ct": build_sparse(base / "ct", model="35b", flavour="ct-nvfp4"),
        "modelopt-nomtp": build_sparse(base / "nomtp", model="35b", flavour="modelopt-nvfp4", mtp=False),
    }


@pytest.fixture()
def ckpt(sources, tmp_path, request):
    return _copy(sources[request.param], tmp_path / "ckpt")


def _cfg(ck):
    return json.loads((ck / "config.json").read_text())


def _hq(ck):
    return json.loads((ck / "hf_quant_config.json").read_text())


def _qtool(*args):
    return run_cli(list(args))


@pytest.mark.slow
@pytest.mark.parametrize("ckpt", ["modelopt"], indirect=True)
def test_router_ignore_in_both_schemas_and_idempotent(ckpt):
    before_cfg = (ckpt / "config.json").read_text()
    plan = pc.plan(pc.PatchOptions(ckpt, fixes=[pc.Fix.ROUTER_IGNORE]))
    assert plan.results[0].applied and plan.changed
    added = [
        line
        for line in plan.files["config.json"].diff().splitlines()
        if line.startswith("+") and not line.startswith("+++")
    ]
    assert any(f'"{ROUTER}"' in line for line in added)
    assert (ckpt / "config.json").read_text() == before_cfg  # planning writes nothing
    assert sorted(pc.apply(plan)) == ["config.json", "hf_quant_config.json"]
    assert _cfg(ckpt)["quantization_config"]["ignore"][-1] == ROUTER
    assert _hq(ckpt)["quantization"]["exclude_modules"][-1] == ROUTER  # ModelOpt native schema
    assert "ignore" not in _hq(ckpt)
    after = (ckpt / "config.json").read_text()
    again = pc.plan(pc.PatchOptions(ckpt, fixes=[pc.Fix.ROUTER_IGNORE]))
    assert not again.changed and not again.results[0].applied
    assert pc.apply(again) == [] and (ckpt / "config.json").read_text() == after
    # key order of the untouched keys is preserved
    assert list(_cfg(ckpt)) == list(json.loads(before_cfg))


@pytest.mark.slow
@pytest.mark.parametrize("ckpt", ["modelopt"], indirect=True)
def test_flat_hf_quant_schema_is_kept_flat(ckpt):
    flat = {"quant_algo": "NVFP4", "ignore": ["lm_head"]}
    (ckpt / "hf_quant_config.json").write_text(json.dumps(flat, indent=4) + "\n")
    pc.apply(pc.plan(pc.PatchOptions(ckpt, fixes=[pc.Fix.ROUTER_IGNORE])))
    text = (ckpt / "hf_quant_config.json").read_text()
    assert json.loads(text) == {"quant_algo": "NVFP4", "ignore": ["lm_head", ROUTER]}
    assert text.startswith('{\n    "quant_algo"')  # the file's 4-space indent survives


@pytest.mark.slow
@pytest.mark.parametrize("ckpt", ["ct"], indirect=True)
def test_compressed_tensors_gets_regex_patterns(ckpt):
    pc.apply(pc.plan(pc.PatchOptions(ckpt, fixes=[pc.Fix.ROUTER_IGNORE, pc.Fix.MTP_IGNORE])))
    ignore = _cfg(ckpt)["quantization_config"]["ignore"]
    assert pc.ROUTER_REGEX in ignore
    assert all(p.startswith("re:") or "." not in p or p == "lm_head" for p in ignore)


@pytest.mark.slow
@pytest.mark.parametrize("ckpt", ["modelopt"], indirect=True)
def test_mtp_ignore_when_mtp_is_bf16(ckpt):
    for name in ("config.json", "hf_quant_config.json"):
        obj = json.loads((ckpt / name).read_text())
        lst = obj["quantization_config"]["ignore"] if name == "config.json" else obj["quantization"]["exclude_modules"]
        lst[:] = [p for p in lst if not p.startswith("mtp")]
        (ckpt / name).write_text(json.dumps(obj, indent=2))
    assert any(p["code"] == "bf16-but-not-ignored" for p in inspect_checkpoint(ckpt)["problems"])
    plan = pc.plan(pc.PatchOptions(ckpt, fixes=[pc.Fix.MTP_IGNORE]))
    assert plan.results[0].applied and "whole MTP head" in plan.results[0].message
    pc.apply(plan)
    assert "mtp*" in _cfg(ckpt)["quantization_config"]["ignore"]
    assert inspect_checkpoint(ckpt)["problems"] == []


@pytest.mark.parametrize("ckpt", ["modelopt-nomtp"], indirect=True)
def test_fix_that_does_not_apply_changes_nothing(ckpt):
    plan = pc.plan(pc.PatchOptions(ckpt, fixes=[pc.Fix.MTP_IGNORE]))
    assert not plan.results[0].applied and "no MTP head" in plan.results[0].message
    assert not plan.changed


@pytest.mark.slow
@pytest.mark.parametrize("ckpt", ["modelopt"], indirect=True)
def test_ignore_from_tensors_repairs_a_wrong_list(ckpt):
    cfg = _cfg(ckpt)
    cfg["quantization_config"]["ignore"] = ["lm_head", "*.layers.1.mlp.experts*"]  # wrong both ways
    (ckpt / "config.json").write_text(json.dumps(cfg, indent=2))
    assert inspect_checkpoint(ckpt)["problems"]
    plan = pc.plan(pc.PatchOptions(ckpt, fixes=[pc.Fix.IGNORE_FROM_TENSORS]))
    assert plan.results[0].applied
    pc.apply(plan)
    ignore = _cfg(ckpt)["quantization_config"]["ignore"]
    assert ignore == _hq(ckpt)["quantization"]["exclude_modules"]
    assert len(ignore) < 20  # compact patterns, not one entry per module
    assert inspect_checkpoint(ckpt)["problems"] == []


@pytest.mark.slow
@pytest.mark.parametrize("ckpt", ["modelopt"], indirect=True)
def test_ignore_add_and_remove(ckpt):
    pc.apply(pc.plan(pc.PatchOptions(ckpt, ignore_add=["foo*"])))
    assert "foo*" in _cfg(ckpt)["quantization_config"]["ignore"]
    assert "foo*" in _hq(ckpt)["quantization"]["exclude_modules"]
    pc.apply(pc.plan(pc.PatchOptions(ckpt, ignore_remove=["foo*"])))
    assert "foo*" not in _cfg(ckpt)["quantization_config"]["ignore"]
    plan = pc.plan(pc.PatchOptions(ckpt, ignore_remove=["never-there"]))
    assert not plan.changed and not plan.results[0].applied


@pytest.mark.slow
@pytest.mark.parametrize("ckpt", ["modelopt"], indirect=True)
def test_yarn_keeps_mrope_and_is_idempotent(ckpt):
    before = _cfg(ckpt)["text_config"]["rope_parameters"]
    pc.apply(pc.plan(pc.PatchOptions(ckpt, yarn=4)))
    tc = _cfg(ckpt)["text_config"]
    rp = tc["rope_parameters"]
    assert rp["rope_type"] == "yarn" and rp["factor"] == 4.0
    assert rp["original_max_position_embeddings"] == 262144
    assert tc["max_position_embeddings"] == 262144 * 4
    for k in ("mrope_interleaved", "mrope_section", "rope_theta", "partial_rotary_factor"):
        assert rp[k] == before[k], k
    assert not pc.plan(pc.PatchOptions(ckpt, yarn=4)).changed


@pytest.mark.slow
@pytest.mark.parametrize("ckpt", ["modelopt"], indirect=True)
def test_sampling_defaults(ckpt):
    (ckpt / "generation_config.json").unlink(missing_ok=True)
    pc.apply(pc.plan(pc.PatchOptions(ckpt, sampling_defaults=True)))
    gen = json.loads((ckpt / "generation_config.json").read_text())
    assert gen["temperature"] == 0.6 and gen["top_p"] == 0.95 and gen["top_k"] == 20 and gen["min_p"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("ckpt", ["modelopt"], indirect=True)
def test_cli_dry_run_json_and_errors(ckpt):
    before = {p.name: p.read_bytes() for p in ckpt.glob("*.json")}
    r = _qtool("patch-config", str(ckpt), "--fix", "router-ignore", "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["dry_run"] and out["written"] == [] and out["files"]["config.json"]["changed"]
    assert {p.name: p.read_bytes() for p in ckpt.glob("*.json")} == before
    r = _qtool("patch-config", str(ckpt), "--fix", "router-ignore")
    assert r.returncode == 0 and "+" in r.stdout and "written: config.json, hf_quant_config.json" in r.stdout
    assert _qtool("patch-config", str(ckpt)).returncode == 2  # no fix given
    (ckpt / "config.json").write_text("{broken")
    r = _qtool("patch-config", str(ckpt), "--fix", "router-ignore")
    assert r.returncode == 1 and "config.json" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("ckpt", ["modelopt"], indirect=True)
def test_router_ignore_protects_the_router_in_old_vllm(ckpt):
    """vLLM before PR 35156 decides the router by the ignore list; after the fix it is excluded in
    every modelled release of both engines, and nothing quantized is."""
    from qtool.engines import sglang, vllm

    for name in ("config.json", "hf_quant_config.json"):
        obj = json.loads((ckpt / name).read_text())
        lst = obj["quantization_config"]["ignore"] if name == "config.json" else obj["quantization"]["exclude_modules"]
        lst[:] = [p for p in lst if not p.endswith("mlp.gate")]
        (ckpt / name).write_text(json.dumps(obj, indent=2))
    router = "model.language_model.layers.5.mlp.gate"
    ignore = _cfg(ckpt)["quantization_config"]["ignore"]
    assert not vllm.is_excluded(router, ignore, version="vllm@0.16")
    # the field report's literal does not help (it matches no mapped module name)
    assert not vllm.is_excluded(router, ignore + [pc.SEED_ROUTER_LITERAL], version="vllm@0.16")
    pc.apply(pc.plan(pc.PatchOptions(ckpt, fixes=[pc.Fix.ROUTER_IGNORE])))
    ignore = _cfg(ckpt)["quantization_config"]["ignore"]
    assert vllm.is_excluded(router, ignore, version="vllm@0.16")
    assert sglang.is_excluded(router, ignore)
    assert inspect_checkpoint(ckpt)["problems"] == []


@pytest.mark.parametrize("ckpt", ["ct"], indirect=True)
def test_compressed_tensors_checkpoint_inspects_clean(ckpt):
    # vLLM's compressed-tensors path never quantizes lm_head (ParallelLMHead is not a LinearBase)
    assert inspect_checkpoint(ckpt)["problems"] == []


def test_output_flag_writes_a_patched_copy_and_leaves_the_input_alone(tiny_nvfp4_modelopt, tmp_path):
    """patch-config takes the same -o/--force/--resume as every writing command: a patched copy whose
    unchanged files are links, the input byte-identical, the manifest listing every file."""
    import hashlib

    from qtool.cli.main import main

    def tree(d):
        return {
            p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*"))
            if p.is_file()
        }

    src = _copy(tiny_nvfp4_modelopt, tmp_path / "src")
    before = tree(src)
    out = tmp_path / "out"
    assert main(["patch-config", str(src), "--fix", "router-ignore", "--sampling-defaults", "-o", str(out)]) == 0
    assert tree(src) == before
    got = tree(out)
    assert {n for n in got if got[n] != before.get(n)} == {
        "config.json",
        "hf_quant_config.json",
        "generation_config.json",
        "qtool-manifest.json",
    }
    man = json.loads((out / "qtool-manifest.json").read_text())
    assert man["operation"] == "patch-config" and set(man["files"]) == set(got) - {"qtool-manifest.json"}
    assert all(man["files"][n]["sha256"] == got[n] for n in man["files"])
    assert "*.mlp.gate" in json.dumps(json.loads((out / "hf_quant_config.json").read_text()))
    assert main(["patch-config", str(src), "--fix", "router-ignore", "-o", str(out)]) == 1  # exists
    assert main(["patch-config", str(src), "--fix", "router-ignore", "-o", str(out), "--force"]) == 0
    assert main(["patch-config", str(src), "--fix", "router-ignore", "-o", str(src / "sub")]) == 2  # inside SRC
    assert tree(src) == before
