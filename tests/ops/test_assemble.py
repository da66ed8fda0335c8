"""`qtool assemble hybrid` on synthetic Qwen3.5-MoE pairs (real names and dtypes, random bytes, tiny dims):
layout, byte identity, flavours, MTP modes, determinism, dry run, resume, and error paths."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from in_process import run_cli
from killpoint import run_killed

from qtool.errors import PlanError, QtoolError, UsageError, WriteError
from qtool.fixtures.synthetic import build_pair
from qtool.io.checkpoint import Checkpoint
from qtool.io.identity import Journal
from qtool.io.reader import read_bytes
from qtool.io.writer import FileRange, OutTensor, write_shard
from qtool.ops.assemble import HybridOptions, LinkMode, MtpMode, execute, plan_hybrid

ROOT = Path(__file__).resolve().parents[2]

LM = "model.language_model."


@pytest.fixture(autouse=True)
def _hash_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QTOOL_CACHE_DIR", str(tmp_path / "hash-cache"))


def pair(tmp_path, **kw):
    return build_pair(tmp_path / "src", **kw)


def run(nv, bf, out, **kw):
    opts = HybridOptions(nvfp4=nv, bf16=bf, out=out, command="test", **kw)
    plan = plan_hybrid(opts)
    return plan, execute(plan)


def files_bytes(d: Path) -> dict[str, bytes]:
    skip = {"qtool-manifest.json"}
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name not in skip}


def test_modelopt_fused_bf16_layer0(tmp_path):
    nv, bf = pair(tmp_path)
    out = tmp_path / "out"
    plan, res = run(nv, bf, out, bf16_expert_layers=(0,))
    assert res.checks["passed"], res.checks
    o, b, n = Checkpoint.open(out), Checkpoint.open(bf), Checkpoint.open(nv)
    # shared experts: BF16 source bytes, no stale NVFP4 tensors
    for layer in range(4):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            name = f"{LM}layers.{layer}.mlp.shared_expert.{proj}.weight"
            assert o.tensors[name].dtype == "BF16"
            assert read_bytes(o.tensors[name]) == read_bytes(b.tensors[name])
    assert not [k for k in o.tensors if ".shared_expert." in k and not k.endswith(".weight")]
    # layer 0 experts unfused from [E, 2I, H] / [E, H, I]
    gu = b.tensors[f"{LM}layers.0.mlp.experts.gate_up_proj"]
    raw = read_bytes(gu)
    mat = 128 * 256 * 2
    assert read_bytes(o.tensors[f"{LM}layers.0.mlp.experts.3.gate_proj.weight"]) == raw[6 * mat : 7 * mat]
    assert read_bytes(o.tensors[f"{LM}layers.0.mlp.experts.3.up_proj.weight"]) == raw[7 * mat : 8 * mat]
    dn = read_bytes(b.tensors[f"{LM}layers.0.mlp.experts.down_proj"])
    assert read_bytes(o.tensors[f"{LM}layers.0.mlp.experts.5.down_proj.weight"]) == dn[5 * mat : 6 * mat]
    assert not [k for k in o.tensors if k.endswith(("gate_up_proj", "experts.down_proj"))]
    assert not [k for k in o.tensors if ".layers.0.mlp.experts." in k and "scale" in k]
    # other routed experts, KV scales: NVFP4 bytes unchanged
    for k in (f"{LM}layers.1.mlp.experts.2.up_proj.weight_scale", f"{LM}layers.3.self_attn.k_proj.k_scale"):
        assert read_bytes(o.tensors[k]) == read_bytes(n.tensors[k])
    # MTP grafted from BF16 (NVFP4 has none), fused MTP experts unfused
    assert "mtp.layers.0.mlp.experts.7.down_proj.weight" in o.tensors
    assert not [k for k in o.tensors if k.startswith("mtp.") and k.endswith("gate_up_proj")]
    # unchanged shards are hardlinks of the source (same filesystem)
    linked = [s for s in plan.shards if s.action.value == "link"]
    assert linked and res.shards_linked == {"hardlink": len(linked)}
    assert os.stat(out / linked[0].name).st_ino == os.stat(nv / linked[0].name).st_ino
    # configs: new patterns in both files, the source's kept
    cfg = json.loads((out / "config.json").read_text())
    ignore = cfg["quantization_config"]["ignore"]
    assert "*.mlp.shared_expert.*" in ignore and "*.layers.0.mlp.experts*" in ignore and "lm_head" in ignore
    hq = json.loads((out / "hf_quant_config.json").read_text())
    assert "*.mlp.shared_expert.*" in hq["quantization"]["exclude_modules"] and "ignore" not in hq
    for f in ("tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert (out / f).read_bytes() == (nv / f).read_bytes()
    # manifest: every output tensor has an origin; sources hashed
    m = json.loads((out / "qtool-manifest.json").read_text())
    assert m["checks"]["passed"] and m["command"] == "test"
    origins = {t: o for s in m["shards"].values() for t, o in s["tensors"].items()}
    assert set(origins) == set(o.tensors)
    assert origins[f"{LM}layers.0.mlp.experts.3.up_proj.weight"]["tensor"].endswith("gate_up_proj")
    assert all(len(v["sha256"]) == 64 for v in m["sources"]["nvfp4"]["files"].values())
    assert set(m["libraries"]) >= {"transformers", "safetensors", "torch", "nvidia-modelopt", "compressed-tensors"}
    assert not Path(str(out) + ".partial").exists()
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no journal / manifest part left


def test_compressed_tensors_per_expert_source(tmp_path):
    nv, bf = pair(tmp_path, flavour="ct", bf16_layout="per_expert")
    out = tmp_path / "out"
    plan, res = run(nv, bf, out, bf16_expert_layers=(1,))
    assert plan.flavour == "compressed-tensors" and res.checks["passed"], res.checks
    o, b = Checkpoint.open(out), Checkpoint.open(bf)
    k = f"{LM}layers.1.mlp.experts.4.gate_proj.weight"
    assert read_bytes(o.tensors[k]) == read_bytes(b.tensors[k])
    assert not [n for n in o.tensors if ".shared_expert." in n and ("global_scale" in n or "packed" in n)]
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    added = plan.ignore_added
    assert added and all(p.startswith("re:") for p in added)
    assert ignore[-len(added) :] == added


@pytest.mark.parametrize(
    "nv_mtp,mode,want",
    [
        (False, MtpMode.AUTO, "graft"),
        (True, MtpMode.AUTO, "keep"),
        (True, MtpMode.FROM_BF16, "from-bf16"),
        (True, MtpMode.DROP, "drop"),
        (True, MtpMode.KEEP, "keep"),
    ],
)
def test_mtp_modes(tmp_path, nv_mtp, mode, want):
    nv, bf = pair(tmp_path, nv_mtp=nv_mtp)
    out = tmp_path / "out"
    plan, res = run(nv, bf, out, mtp=mode)
    assert plan.mtp_action == want and res.checks["passed"], res.checks
    o, b, n = Checkpoint.open(out), Checkpoint.open(bf), Checkpoint.open(nv)
    mtp = [k for k in o.tensors if k.startswith("mtp.")]
    if want == "drop":
        assert not mtp
        return
    assert "mtp.fc.weight" in o.tensors
    src = b if want in ("graft", "from-bf16") else n
    assert read_bytes(o.tensors["mtp.fc.weight"]) == read_bytes(src.tensors["mtp.fc.weight"])
    assert not [k for k in mtp if k.endswith("gate_up_proj")]  # never fused next to per-expert


def test_mtp_from_bf16_without_bf16_mtp(tmp_path):
    nv, bf = pair(tmp_path, bf_mtp=False)
    with pytest.raises(PlanError, match="no mtp"):
        plan_hybrid(HybridOptions(nvfp4=nv, bf16=bf, out=tmp_path / "o", mtp=MtpMode.FROM_BF16))


def test_rerun_byte_identical_any_link_mode(tmp_path):
    nv, bf = pair(tmp_path)
    a, c = tmp_path / "a", tmp_path / "c"
    run(nv, bf, a, bf16_expert_layers=(0, 2))
    run(nv, bf, c, bf16_expert_layers=(0, 2), link=LinkMode.COPY)
    assert files_bytes(a) == files_bytes(c)
    assert all(os.stat(c / p).st_nlink == 1 for p in os.listdir(c))


def test_max_shard_size_moves_additions_to_new_shards(tmp_path):
    nv, bf = pair(tmp_path)
    out = tmp_path / "out"
    plan, res = run(nv, bf, out, max_shard_size=300_000)
    assert res.checks["passed"]
    new = [s for s in plan.shards if s.action.value == "new"]
    assert new and all(s.name.startswith("model-hybrid-") for s in new)
    for s in plan.shards:
        if s.action.value != "link":
            assert s.data_bytes <= 300_000 or len(s.tensors) == 1 or all(t.origin.source == "nvfp4" for t in s.tensors)


def test_dry_run_writes_nothing(tmp_path, capsys):
    from qtool.cli.main import main

    nv, bf = pair(tmp_path)
    out = tmp_path / "out"
    assert (
        main(
            [
                "assemble",
                "hybrid",
                "--nvfp4",
                str(nv),
                "--bf16",
                str(bf),
                "-o",
                str(out),
                "--bf16-expert-layers",
                "0",
                "--dry-run",
                "--json",
            ]
        )
        == 0
    )
    rep = json.loads(capsys.readouterr().out)
    assert rep["dry_run"] and rep["plan"]["bytes"]["new"] > 0 and rep["plan"]["shards"]["link"] > 0
    assert not out.exists() and not Path(str(out) + ".partial").exists()
    assert main(["assemble", "hybrid", "--nvfp4", str(nv), "--bf16", str(bf), "-o", str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "rewritten" in text and "linked" in text and not out.exists()


def test_cli_json_report(tmp_path, capsys):
    from qtool.cli.main import main

    nv, bf = pair(tmp_path)
    out = tmp_path / "out"
    assert main(["assemble", "hybrid", "--nvfp4", str(nv), "--bf16", str(bf), "-o", str(out), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["result"]["checks"]["passed"] and out.exists()
    # existing output refused (exit 1, JSON error), accepted with --force
    assert main(["assemble", "hybrid", "--nvfp4", str(nv), "--bf16", str(bf), "-o", str(out), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["error"] == "WriteError"
    assert main(["assemble", "hybrid", "--nvfp4", str(nv), "--bf16", str(bf), "-o", str(out), "--force"]) == 0


def test_resume_after_injected_failure(tmp_path, monkeypatch):
    nv, bf = pair(tmp_path)
    ref, out = tmp_path / "ref", tmp_path / "out"
    run(nv, bf, ref, bf16_expert_layers=(0,))
    seen = []
    record = Journal.record

    def boom(self, name, **info):
        record(self, name, **info)
        seen.append(name)
        if len(seen) == 3:
            raise RuntimeError("simulated crash")

    monkeypatch.setattr(Journal, "record", boom)
    with pytest.raises(RuntimeError):
        run(nv, bf, out, bf16_expert_layers=(0,))
    assert not out.exists() and Path(str(out) + ".partial").exists()
    monkeypatch.setattr(Journal, "record", record)
    # a different plan refuses to resume
    with pytest.raises(WriteError, match="different plan"):
        run(nv, bf, out, bf16_expert_layers=(1,), resume=True)
    _, res = run(nv, bf, out, bf16_expert_layers=(0,), resume=True)
    assert res.shards_resumed == 3
    assert files_bytes(out) == files_bytes(ref)


def test_resume_after_kill(tmp_path):
    nv, bf = pair(tmp_path)
    ref, out = tmp_path / "ref", tmp_path / "out"
    run(nv, bf, ref)
    args = ["assemble", "hybrid", "--nvfp4", nv, "--bf16", bf, "-o", out, "--quiet"]
    p = run_killed("qtool.io.identity:Journal.record", 4, args)
    assert p.returncode == -9 and not out.exists()
    p = run_cli(args + ["--resume", "--json"])
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["result"]["shards_resumed"] == 4
    assert files_bytes(out) == files_bytes(ref)
    assert not (out / ".qtool-journal.jsonl").exists()


def test_existing_output_refused(tmp_path):
    nv, bf = pair(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    for force in (False, True):  # a directory qtool did not make is never replaced, whatever the flags
        with pytest.raises(WriteError, match="not made by qtool"):
            run(nv, bf, out, force=force)
    assert (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    run(nv, bf, out)  # an empty directory is used
    with pytest.raises(WriteError, match="already exists"):
        run(nv, bf, out)


def _drop_tensor(ckpt_dir: Path, name: str) -> None:
    ck = Checkpoint.open(ckpt_dir)
    shard = ck.shard_of(name)
    keep = sorted((t for t in ck.tensors.values() if t.file.endswith(shard) and t.name != name), key=lambda t: t.start)
    tmp = ckpt_dir / (shard + ".new")
    write_shard(tmp, [OutTensor(t.name, t.dtype, t.shape, FileRange(t.file, t.start, t.end)) for t in keep])
    os.replace(tmp, ckpt_dir / shard)
    idx = json.loads((ckpt_dir / "model.safetensors.index.json").read_text())
    del idx["weight_map"][name]
    (ckpt_dir / "model.safetensors.index.json").write_text(json.dumps(idx))


def test_missing_bf16_tensor(tmp_path):
    nv, bf = pair(tmp_path)
    _drop_tensor(bf, f"{LM}layers.2.mlp.shared_expert.up_proj.weight")
    with pytest.raises(PlanError, match="lacks 1 tensor") as e:
        plan_hybrid(HybridOptions(nvfp4=nv, bf16=bf, out=tmp_path / "o"))
    assert "layers.2.mlp.shared_expert.up_proj" in e.value.tensor


@pytest.mark.parametrize("key", ["hidden_size", "num_experts"])
def test_mismatched_models(tmp_path, key):
    nv, bf = pair(tmp_path, bf16_overrides={key: {"hidden_size": 512, "num_experts": 16}[key]})
    with pytest.raises(PlanError, match="different models") as e:
        plan_hybrid(HybridOptions(nvfp4=nv, bf16=bf, out=tmp_path / "o"))
    assert key in e.value.message


def test_mismatched_shapes_without_config(tmp_path):
    nv, bf = pair(tmp_path, bf16_overrides={"shared_expert_intermediate_size": 64})
    cfg = json.loads((bf / "config.json").read_text())
    cfg["text_config"].pop("shared_expert_intermediate_size")
    (bf / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PlanError, match="wrong shape"):
        plan_hybrid(HybridOptions(nvfp4=nv, bf16=bf, out=tmp_path / "o"))


def test_not_enough_disk(tmp_path, monkeypatch):
    nv, bf = pair(tmp_path)
    monkeypatch.setattr(sys.modules["qtool.io.apply"], "free_space", lambda p: 1000)
    out = tmp_path / "out"
    with pytest.raises(WriteError, match="not enough free disk") as e:
        run(nv, bf, out)
    assert str(e.value.got).startswith("1000 bytes (1.0 KiB) free on ")
    partial = Path(str(out) + ".partial")
    assert not out.exists() and not list(partial.glob("*.safetensors"))


def test_bad_layer_and_overlapping_output(tmp_path):
    nv, bf = pair(tmp_path)
    with pytest.raises(UsageError):
        plan_hybrid(HybridOptions(nvfp4=nv, bf16=bf, out=tmp_path / "o", bf16_expert_layers=(9,)))
    with pytest.raises(UsageError, match="overlaps"):
        plan_hybrid(HybridOptions(nvfp4=nv, bf16=bf, out=nv / "sub"))


def test_inputs_untouched(tmp_path):
    nv, bf = pair(tmp_path)
    before = {p: (p.stat().st_mtime_ns, p.stat().st_size) for d in (nv, bf) for p in d.iterdir()}
    run(nv, bf, tmp_path / "out", bf16_expert_layers=(0,))
    after = {p: (p.stat().st_mtime_ns, p.stat().st_size) for d in (nv, bf) for p in d.iterdir()}
    assert before == after


def test_checks_flag_stale_scales(tmp_path):
    from qtool.ops.checks import run_checks

    nv, bf = pair(tmp_path)
    out = tmp_path / "out"
    run(nv, bf, out)
    assert run_checks(out)["passed"]
    # the source itself: NVFP4 shared experts are fine structurally
    assert run_checks(nv)["checks"][0]["ok"]
    # put a stale weight_scale next to a BF16 shared expert
    ck = Checkpoint.open(out)
    shard = ck.shard_of(f"{LM}layers.1.mlp.shared_expert.up_proj.weight")
    n = Checkpoint.open(nv)
    stale = n.tensors[f"{LM}layers.1.mlp.shared_expert.up_proj.weight_scale"]
    ts = [
        OutTensor(t.name, t.dtype, t.shape, FileRange(t.file, t.start, t.end))
        for t in sorted(ck.tensors.values(), key=lambda t: t.start)
        if t.file.endswith(shard)
    ]
    ts.append(OutTensor(stale.name, stale.dtype, stale.shape, FileRange(stale.file, stale.start, stale.end)))
    os.unlink(out / shard)
    write_shard(out / shard, ts)
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    idx["weight_map"][stale.name] = shard
    (out / "model.safetensors.index.json").write_text(json.dumps(idx))
    res = run_checks(out)
    assert not res["passed"]
    assert any("stale" in p for p in res["checks"][0]["problems"])


def test_checks_started_before_the_data_catch_a_short_shard(tmp_path):
    """assemble runs the header-only checks while shard data is still being copied; finishing them must
    still catch a shard that ended up shorter than its header says."""
    from qtool.errors import CheckpointError
    from qtool.ops.checks import finish_checks, start_checks

    nv, bf = pair(tmp_path)
    out = tmp_path / "out"
    run(nv, bf, out)
    assert finish_checks(start_checks(out, shards_complete=False))["passed"]
    started = start_checks(out, shards_complete=False)
    shard = sorted(out.glob("*.safetensors"))[-1]
    os.truncate(shard, shard.stat().st_size - 2)
    res = finish_checks(started)
    assert not res["passed"]
    assert any(p.startswith(shard.name) and "its header describes" in p for p in res["checks"][0]["problems"])
    with pytest.raises(CheckpointError, match="truncated"):
        start_checks(out)  # a complete open refuses it outright


def test_checks_started_when_only_headers_exist(tmp_path):
    """The header-only checks start as soon as every shard's header is written: they must not read any
    tensor data then (KV scales included), and finishing them once the data is there must pass."""
    import shutil

    from qtool.io.safetensors_header import read_header
    from qtool.ops.checks import finish_checks, start_checks

    nv, bf = pair(tmp_path)
    out, full = tmp_path / "out", tmp_path / "full"
    run(nv, bf, out)
    shutil.copytree(out, full)
    shards = sorted(out.glob("*.safetensors"))
    assert any("k_scale" in n for sh in shards for n in read_header(sh).tensors)
    for sh in shards:
        os.truncate(sh, read_header(sh).data_start)  # header only, as right after write_shard starts
    started = start_checks(out, shards_complete=False)
    for sh in shards:
        shutil.copyfile(full / sh.name, sh)
    res = finish_checks(started)
    assert res["passed"], res
    assert started.mm.kv.values and started.mm.kv.calibrated is not None


def test_problems_the_source_already_had_are_inherited_not_failures(tmp_path):
    """The source's own problems are looked up only when the output has problems (its headers were let
    go during the copy): a NaN KV scale in the NVFP4 source is carried over, reported as inherited, and
    the assembly still passes."""
    import struct as st

    nv, bf = pair(tmp_path)
    n = Checkpoint.open(nv)
    k = n.tensors[f"{LM}layers.3.self_attn.k_proj.k_scale"]
    with open(k.file, "r+b") as f:
        f.seek(k.start)
        f.write(st.pack("<f", float("nan")))
    plan, res = run(nv, bf, tmp_path / "out")
    cons = next(c for c in res.checks["checks"] if c["name"] == "consistency")
    assert res.checks["passed"] and cons["ok"] and not cons["problems"]
    assert any("kv-scale-invalid" in p for p in cons["inherited"]), cons


def test_qtool_error_has_hint(tmp_path):
    nv, bf = pair(tmp_path, bf16_overrides={"num_experts": 16})
    try:
        plan_hybrid(HybridOptions(nvfp4=nv, bf16=bf, out=tmp_path / "o"))
    except QtoolError as e:
        assert e.hint and "expected" in e.describe()


@pytest.mark.parametrize("flag", ["--bf16-expert-layers", "--bf16-shared-experts"])
@pytest.mark.parametrize("text", ["0 1", "1 2", "", ",", "+1", "1_0", "\u0663", "0,,1", "1-3", "-1", "x"])
def test_a_layer_list_is_digits_and_commas_only(flag, text, tmp_path, capsys):
    """Found as: spaces were removed before splitting ("0 1" selected layer 1, "1 2" layer 12 of the 397B);
    "", ",", "+1", "1_0" (10) and "٣" (3) were accepted, as Python's int() reads them."""
    from qtool.cli.main import main

    nv, bf = pair(tmp_path)
    capsys.readouterr()
    rc = main(
        [
            "assemble",
            "hybrid",
            "--nvfp4",
            str(nv),
            "--bf16",
            str(bf),
            "-o",
            str(tmp_path / "out"),
            flag,
            text,
            "--dry-run",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and flag in err and "layer numbers separated by commas" in err, err


@pytest.mark.parametrize("text,layers", [("0,1", [0, 1]), (" 1, 0 ", [0, 1]), ("none", [])])
def test_a_layer_list_in_its_one_spelling_is_read(text, layers, tmp_path, capsys):
    from qtool.cli.main import main

    nv, bf = pair(tmp_path)
    capsys.readouterr()
    assert (
        main(
            [
                "assemble",
                "hybrid",
                "--nvfp4",
                str(nv),
                "--bf16",
                str(bf),
                "-o",
                str(tmp_path / "out"),
                "--bf16-expert-layers",
                text,
                "--bf16-shared-experts",
                text,
                "--dry-run",
                "--json",
            ]
        )
        == 0
    )
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["bf16_expert_layers"] == layers and plan["bf16_shared_expert_layers"] == layers


def test_an_ignore_pattern_that_does_not_compile_is_named(tiny_nvfp4_ct, tiny_bf16, tmp_path, capsys):
    """Found as: an ignore pattern `re:([` in config.json was a re.error traceback in inspect, verify, plan
    hybrid and assemble; it is checked once, where the checkpoint is opened."""
    import shutil

    from qtool.cli.main import main

    ck = tmp_path / "ck"
    shutil.copytree(tiny_nvfp4_ct, ck)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["quantization_config"]["ignore"].append("re:([")
    (ck / "config.json").write_text(json.dumps(cfg))
    for argv, code in (
        (["inspect", ck], 1),
        (["verify", ck, "--tp", "1"], 3),
        (["assemble", "hybrid", "--nvfp4", ck, "--bf16", tiny_bf16, "-o", tmp_path / "out", "--dry-run"], 1),
    ):
        capsys.readouterr()
        assert main([str(a) for a in argv]) == code, argv
        said = capsys.readouterr()
        text = said.out + said.err
        assert "quantization_config.ignore" in text and "not a valid regular expression" in text, text
        assert "config.json" in text
