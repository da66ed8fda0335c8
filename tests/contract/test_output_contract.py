"""The output transaction's promises, command by command, reproduced the way the failures were found
(issue 12): kill -9 at a named moment then --resume, an -o that overlaps the input, two runs at once, a
same-size edit of an input with its mtime put back, a flipped byte in a rebuilt shard, --token in the
manifest. Every test checks the inputs byte for byte (sha256 before and after)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoint_edits import drop_tensors
from in_process import run_cli
from killpoint import run_killed

from qtool.io.checkpoint import Checkpoint
from qtool.io.output import lock_for
from qtool.io.writer import FileRange, OutTensor, write_shard

KV = ["--samples", "2", "--seq-len", "16"]


def tree_sha(d: Path, skip=("qtool-manifest.json",)) -> dict[str, str]:
    return {
        p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file() and p.name not in skip
    }


def copy_of(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def unindexed(src: Path, dst: Path) -> Path:
    """`src` as ONE model.safetensors without an index (what small checkpoints look like)."""
    ck = Checkpoint.open(src)
    dst.mkdir()
    for p in src.iterdir():
        if p.suffix != ".safetensors" and p.name != "model.safetensors.index.json":
            shutil.copy(p, dst / p.name)
    tensors = sorted(ck.tensors.values(), key=lambda t: t.name)
    write_shard(
        dst / "model.safetensors",
        [OutTensor(t.name, t.dtype, tuple(t.shape), FileRange(t.file, t.start, t.end)) for t in tensors],
    )
    return dst


# ---- calibrate-kv ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_calibrate_kv_resume_after_kill_in_placing_never_truncates_the_input(tiny_nvfp4_modelopt, tmp_path):
    """Found as: killed after a shard was hard-linked into OUT.partial, `--resume` truncated the INPUT
    shards to 0 bytes through the shared inode and exited 0."""
    src = copy_of(tiny_nvfp4_modelopt, tmp_path / "src")
    before = tree_sha(src)
    ref, out = tmp_path / "ref", tmp_path / "out"
    args = ["calibrate-kv", src, *KV, "--replace-scales", "--quiet"]
    assert run_cli([*args, "-o", ref]).returncode == 0
    p = run_killed("qtool.io.files:Placer.place", 2, [*args, "-o", out])
    assert p.returncode == -9 and not out.exists() and (tmp_path / "out.partial").exists()
    p = run_cli([*args, "-o", out, "--resume"])
    assert p.returncode == 0, p.stderr
    assert tree_sha(src) == before
    assert tree_sha(out) == tree_sha(ref)


@pytest.mark.slow
def test_in_place_unindexed_kill_leaves_a_checkpoint_that_opens(tiny_nvfp4_modelopt, tmp_path):
    """Found as: `--in-place --overwrite` on an unindexed checkpoint killed after model-nokv.safetensors
    appeared left a checkpoint that no longer opened ("tensor appears in two shards")."""
    ref = unindexed(tiny_nvfp4_modelopt, tmp_path / "ref")
    work = tmp_path / "work"
    shutil.copytree(ref, work)
    before = tree_sha(work)
    args = [*KV, "--replace-scales", "--in-place", "--quiet"]
    assert run_cli(["calibrate-kv", ref, *args]).returncode == 0
    for n in (1, 2):  # after the first shard written, after the second (the KV shard)
        p = run_killed("qtool.io.writer:write_shard", n, ["calibrate-kv", work, *args])
        assert p.returncode == -9
        assert tree_sha(work) == before  # untouched until the swap
        Checkpoint.open(work)
    p = run_cli(["calibrate-kv", work, *args, "--resume"])
    assert p.returncode == 0, p.stderr
    assert tree_sha(work) == tree_sha(ref)
    assert Checkpoint.open(work).tensors.keys() == Checkpoint.open(ref).tensors.keys()
    assert sorted(x.name for x in tmp_path.iterdir()) == ["ref", "work"]


@pytest.mark.parametrize("where", ["same", "parent", "symlink"])
def test_calibrate_kv_output_overlapping_the_input_is_refused(tiny_nvfp4_modelopt, tmp_path, where):
    """Found as: `calibrate-kv P/model -o P --overwrite` deleted the inputs and everything else in P."""
    parent = tmp_path / "P"
    src = copy_of(tiny_nvfp4_modelopt, parent / "model")
    (parent / "notes.txt").write_text("keep me")
    out = {"same": src, "parent": parent, "symlink": tmp_path / "link"}[where]
    if where == "symlink":
        out.symlink_to(src)
    before = tree_sha(parent)
    p = run_cli(["calibrate-kv", src, "-o", out, *KV, "--replace-scales", "--force", "--json"])
    assert p.returncode == 2, p.stdout + p.stderr
    assert "overlaps an input" in json.loads(p.stdout)["message"]
    assert tree_sha(parent) == before


@pytest.mark.slow
def test_resume_refuses_an_input_edited_with_its_mtime_put_back(tiny_nvfp4_modelopt, tmp_path):
    """Found as: --resume after the input's bytes changed (same size, mtime restored) kept the old layers
    and wrote the new file's sha256 into the manifest."""
    src = copy_of(tiny_nvfp4_modelopt, tmp_path / "src")
    out = tmp_path / "out"
    args = ["calibrate-kv", src, "-o", out, *KV, "--replace-scales", "--quiet"]
    p = run_killed("qtool.stream.layer_stream:LayerStreamer.load_layer", 2, args)
    assert p.returncode == -9
    shard = Checkpoint.open(src).shard_of("model.language_model.layers.0.linear_attn.in_proj_qkv.weight")
    f = src / shard
    st = f.stat()
    data = bytearray(f.read_bytes())
    data[-100] ^= 0x01  # the last tensor's bytes
    f.write_bytes(bytes(data))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    p = run_cli([*args, "--resume", "--json"])
    assert p.returncode == 1
    err = json.loads(p.stdout)
    assert "changed since the interrupted run" in err["message"]
    assert shard in json.dumps(err)  # the error names the edited file
    assert not out.exists()


def test_a_second_run_on_a_locked_output_is_refused(tiny_nvfp4_modelopt, tmp_path):
    out = tmp_path / "out"
    with lock_for(out):  # as a running qtool holds it
        p = run_cli(["calibrate-kv", tiny_nvfp4_modelopt, "-o", out, *KV, "--replace-scales", "--json"])
    assert p.returncode == 1
    err = json.loads(p.stdout)
    assert f"pid {os.getpid()}" in err["message"] and err["path"] == str(out)
    assert not out.exists() and not (tmp_path / "out.partial").exists()


def test_force_replaces_only_directories_qtool_made(tiny_nvfp4_modelopt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    p = run_cli(["calibrate-kv", tiny_nvfp4_modelopt, "-o", out, *KV, "--replace-scales", "--force"])
    assert p.returncode == 1 and "not made by qtool" in p.stderr
    assert (out / "thesis.tex").read_text() == "years of work"


def test_concurrent_assemble_runs_publish_one_complete_output(tiny_nvfp4_modelopt, tiny_bf16, tmp_path):
    """Found as: two assemble runs on one OUT a second apart published an OUT missing the index and 7
    shards, exit 0."""
    ref, out = tmp_path / "ref", tmp_path / "out"
    base = ["assemble", "hybrid", "--nvfp4", tiny_nvfp4_modelopt, "--bf16", tiny_bf16, "--quiet", "--link", "copy"]
    assert run_cli([*base, "-o", ref]).returncode == 0
    cmd = [sys.executable, "-m", "qtool", *map(str, base), "-o", str(out)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [(p.wait(), p.stderr.read()) for p in procs]
    assert sum(rc == 0 for rc, _ in results) >= 1
    for rc, err in results:
        assert rc == 0 or ("another qtool run" in err or "already exists" in err), err
    assert tree_sha(out) == tree_sha(ref)


# ---- validation before execution -------------------------------------------------------------------


def test_incomplete_bf16_mtp_head_is_refused_before_writing(tiny_nvfp4_modelopt_nomtp, tiny_bf16, tmp_path):
    """Found as: assemble noticed a BF16 MTP head without mtp.layers.0.* only after writing every shard."""
    bf = copy_of(tiny_bf16, tmp_path / "bf")
    drop_tensors(bf, lambda n: n.startswith("mtp.layers.0."))
    out = tmp_path / "out"
    p = run_cli(["assemble", "hybrid", "--nvfp4", tiny_nvfp4_modelopt_nomtp, "--bf16", bf, "-o", out, "--json"])
    assert p.returncode == 1
    err = json.loads(p.stdout)
    assert "MTP head is incomplete" in err["message"] and "mtp.layers.0.self_attn.q_proj" in err["message"]
    assert not out.exists() and not (tmp_path / "out.partial").exists()


def test_non_string_shard_metadata_is_a_clear_error(tiny_nvfp4_modelopt, tmp_path):
    """Found as: a source whose __metadata__ had non-string values gave an output safetensors refused,
    while assemble printed "checks passed"."""
    nv = copy_of(tiny_nvfp4_modelopt, tmp_path / "nv")
    shard = sorted(nv.glob("*.safetensors"))[0]
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    head = json.loads(raw[8 : 8 + n])
    head["__metadata__"] = {"format": 5}  # shorter than the original {"format": "pt"}
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (n - len(text))
    assert len(text) == n
    shard.write_bytes(raw[:8] + text + raw[8 + n :])
    p = run_cli(["inspect", nv, "--json"])
    assert p.returncode == 1
    err = json.loads(p.stdout)
    assert err["path"] == str(shard) and err["tensor"] == "__metadata__.format"


# ---- integrity ---------------------------------------------------------------------------------------


def test_verify_deep_catches_a_flipped_byte_in_a_rebuilt_shard(tiny_nvfp4_modelopt, tiny_bf16, tmp_path):
    """Found as: the manifest recorded sha256 only for inputs and linked shards, so a flipped byte in a
    rebuilt or new shard passed `verify --deep`."""
    out = tmp_path / "out"
    assert (
        run_cli(
            [
                "assemble",
                "hybrid",
                "--nvfp4",
                tiny_nvfp4_modelopt,
                "--bf16",
                tiny_bf16,
                "-o",
                out,
                "--bf16-expert-layers",
                "0",
                "--quiet",
            ]
        ).returncode
        == 0
    )
    man = json.loads((out / "qtool-manifest.json").read_text())
    assert set(man["files"]) == {p.name for p in out.iterdir()} - {"qtool-manifest.json"}
    for rel, f in man["files"].items():
        assert f["sha256"] == hashlib.sha256((out / rel).read_bytes()).hexdigest(), rel
    assert run_cli(["verify", out, "--deep", "--tp", "1"]).returncode == 0
    rebuilt = [s for s, e in man["shards"].items() if e["action"] != "link"]
    victim = out / rebuilt[0]
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0x40
    victim.write_bytes(bytes(data))
    p = run_cli(["verify", out, "--deep", "--tp", "1", "--json"])
    assert p.returncode == 3
    codes = {(f["code"], f["module"]) for f in json.loads(p.stdout)["findings"]}
    assert ("hash-mismatch", rebuilt[0]) in codes


def test_every_writing_command_writes_one_manifest_schema(tiny_nvfp4_modelopt, tiny_bf16, tmp_path):
    """Found as: calibrate-kv -o and convert wrote no qtool-manifest.json; three manifest schemas."""
    runs = {
        "assemble": ["assemble", "hybrid", "--nvfp4", tiny_nvfp4_modelopt, "--bf16", tiny_bf16],
        "calibrate-kv": ["calibrate-kv", tiny_nvfp4_modelopt, *KV, "--replace-scales"],
        "convert": ["convert", tiny_nvfp4_modelopt, "--to", "compressed-tensors"],
    }
    for name, args in runs.items():
        out = tmp_path / name
        p = run_cli([*args, "-o", out, "--quiet"])
        assert p.returncode == 0, p.stderr
        man = json.loads((out / "qtool-manifest.json").read_text())
        assert {"qtool_version", "operation", "command", "libraries", "sources", "summary", "checks", "files"} <= set(
            man
        ), name
        assert man["libraries"]["safetensors"] and man["command"].startswith("qtool ")
        assert set(man["files"]) == {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} - {
            "qtool-manifest.json"
        }, name
        for src_name, src in man["sources"].items():
            # assemble's BF16 donor files: the digest of the bytes taken from them (not of all of each file)
            key = "taken_sha256" if (name, src_name) == ("assemble", "bf16") else "sha256"
            assert src["files"] and all(len(f[key]) == 64 for f in src["files"].values()), (name, src_name)


def test_rewritten_shards_keep_metadata_and_files_share_one_mode(tiny_nvfp4_modelopt, tmp_path):
    """Found as: rewritten shards dropped the source's __metadata__; linked (0600) and rebuilt (0644)
    shards had different modes."""
    from qtool.io.safetensors_header import read_header

    src = copy_of(tiny_nvfp4_modelopt, tmp_path / "src")
    for f in src.iterdir():
        os.chmod(f, 0o600)
    out = tmp_path / "out"
    p = run_cli(["convert", src, "-o", out, "--to", "compressed-tensors", "--json"])
    assert p.returncode == 0, p.stderr
    rewritten = json.loads(p.stdout)["rewritten_shards"]
    assert rewritten
    for s in rewritten:
        assert read_header(out / s).metadata == read_header(src / s).metadata != {}
    assert {f.stat().st_mode & 0o777 for f in out.iterdir()} == {0o600}


def test_convert_round_trip_is_byte_identical(tiny_nvfp4_modelopt, tmp_path):
    """Found as: convert re-indented hf_quant_config.json."""
    ct, back = tmp_path / "ct", tmp_path / "back"
    assert run_cli(["convert", tiny_nvfp4_modelopt, "-o", ct, "--to", "compressed-tensors"]).returncode == 0
    assert run_cli(["convert", ct, "-o", back, "--to", "modelopt"]).returncode == 0
    want = tree_sha(tiny_nvfp4_modelopt)
    got = tree_sha(back, skip=("qtool-manifest.json", "qtool-convert.json"))
    assert got == want


# ---- the build's published artifact ---------------------------------------------------------------


DEMO = Path(__file__).resolve().parents[2] / "recipes" / "build" / "demo-tiny.yaml"


def test_build_token_never_reaches_the_manifest_and_an_edited_artifact_is_noticed(tmp_path):
    """Found as: `qtool build --token hf_...` wrote the token into every manifest; editing the published
    config.json in place edited the step cache and the next build said "up to date"."""
    out = tmp_path / "demo"
    token = "hf_" + "Q" * 30
    p = run_cli(["build", DEMO, "-o", out, "--token", token, "--quiet", "--json"])
    assert p.returncode == 0, p.stderr
    for f in [*out.rglob("*"), *(tmp_path / "demo.build").rglob("*")]:
        if f.is_file():
            assert token.encode() not in f.read_bytes(), f
    cache = {f.name: f for f in (tmp_path / "demo.build").rglob("config.json")}
    before = {k: v.read_bytes() for k, v in cache.items()}
    cfg = out / "config.json"
    with open(cfg, "r+") as f:  # an in-place edit, as an editor or a script does
        text = f.read()
        f.seek(0)
        f.write(text.replace('"model_type"', '"model_type_edited"', 1))
    assert {k: v.read_bytes() for k, v in cache.items()} == before  # the cache is not the artifact
    p = run_cli(["build", DEMO, "-o", out, "--quiet", "--json"])
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert rep["published"] is True and rep["ran"] == []
    assert "model_type_edited" not in cfg.read_text()
    p = run_cli(["build", DEMO, "-o", out, "--quiet", "--json"])
    assert json.loads(p.stdout)["published"] is False


# ---- exit codes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,code",
    [
        (["verify", "/nonexistent"], 1),
        (["inspect", "/nonexistent"], 1),
        (["build", "missing.yaml"], 2),  # an unknown recipe is a usage error in every command (as quantize --recipe)
        (["verify", "CKPT", "--engine", "vlm"], 2),
        (["assemble", "hybrid", "--nvfp4", "CKPT", "--bf16", "CKPT", "-o", "OUT", "--froce"], 2),
        (["calibrate-kv", "CKPT"], 2),
        (["convert", "CKPT", "--to", "modelopt", "-o", "OUT"], 2),
    ],
)
def test_exit_codes(args, code, tiny_nvfp4_modelopt, tmp_path):
    args = [str(tiny_nvfp4_modelopt) if a == "CKPT" else str(tmp_path / "o") if a == "OUT" else a for a in args]
    p = run_cli(args)
    assert p.returncode == code, p.stderr
    assert "Traceback" not in p.stderr


def test_eval_save_ref_over_an_existing_output_is_an_output_error(tiny_nvfp4_modelopt, tmp_path):
    (tmp_path / "ref").mkdir()
    (tmp_path / "ref" / "x").write_text("mine")
    p = run_cli(
        [
            "eval",
            "kld",
            "--ref",
            tiny_nvfp4_modelopt,
            "--save-ref",
            tmp_path / "ref",
            "--windows",
            "1",
            "--seq-len",
            "8",
        ]
    )
    assert p.returncode == 1 and "not made by qtool" in p.stderr


def test_typo_in_a_flag_says_did_you_mean(tmp_path):
    p = run_cli(["calibrate-kv", tmp_path, "--in-place", "--replace-scale", "--resum"])
    assert p.returncode == 2
    assert "usage: qtool calibrate-kv" in p.stderr and "did you mean --resume" in p.stderr


# ---- environment failures: a clear error, nothing lost ----------------------------------------------


@pytest.mark.parametrize(
    "target,errno_name,fix",
    [
        ("qtool.io.files:copy_range", "ENOSPC", "free disk space"),  # the disk fills while a shard is written
        ("qtool.io.writer:write_shard", "EROFS", "not writable"),  # a read-only output filesystem
    ],
)
def test_calibrate_kv_disk_failures_are_clear_errors(tiny_nvfp4_modelopt, tmp_path, target, errno_name, fix):
    """Found as: ENOSPC in calibrate-kv and read-only output dirs gave tracebacks."""
    from killpoint import run_failing

    src = copy_of(tiny_nvfp4_modelopt, tmp_path / "src")
    before = tree_sha(src, skip=())
    out = tmp_path / "out"
    # the input's hash from the job's reads lags the job (as sha256 does behind a fast disk): CI once saw
    # this run abort at exit (-6, "terminate called without an active exception") from that hash's daemon
    # thread, still running into the interpreter's teardown
    slow = {**os.environ, "KILLPOINT_SLOW": "qtool.io.stream_digest:FileDigest._update:0.1"}
    p = run_failing(
        target, 1, errno_name, ["calibrate-kv", src, "-o", out, *KV, "--replace-scales", "--quiet"], env=slow
    )
    assert p.returncode == 1, p.stderr
    assert "alive at exit" not in p.stderr
    assert "Traceback" not in p.stderr and fix in p.stderr and "error:" in p.stderr
    assert tree_sha(src, skip=()) == before and not out.exists()
    p = run_cli(["calibrate-kv", src, "-o", out, *KV, "--replace-scales", "--quiet", "--resume"])
    assert p.returncode == 0, p.stderr  # and the partial output resumes once the disk is fine again


@pytest.mark.parametrize(
    "command", ["quantize", "convert", "assemble", "calibrate-kv", "patch-config", "calibrate-kv --in-place"]
)
def test_a_disk_too_small_refuses_the_run_and_leaves_no_partial(
    command, tiny_nvfp4_modelopt, tiny_bf16, tmp_path, monkeypatch, capsys
):
    """Found as: `qtool quantize SRC -o OUT` on a disk too small for OUT was refused (rightly) but left an
    empty OUT.partial/ behind; so did every command that writes through the output executor (and
    calibrate-kv --in-place its hard-linked `.CKPT.qtool-inplace/`)."""
    import qtool.io.apply as apply
    from qtool.cli.main import main

    ck = copy_of(tiny_nvfp4_modelopt, tmp_path / "ck")
    before = tree_sha(ck, skip=())
    out = tmp_path / "out"
    args = {
        "quantize": ["quantize", tiny_bf16, "--recipe", "qwen35-nvfp4-experts", *KV, "-o", out],
        "convert": ["convert", ck, "--to", "compressed-tensors", "-o", out],
        "assemble": ["assemble", "hybrid", "--nvfp4", ck, "--bf16", tiny_bf16, "-o", out],
        "calibrate-kv": ["calibrate-kv", ck, *KV, "--replace-scales", "-o", out],
        "patch-config": ["patch-config", ck, "--fix", "router-ignore", "-o", out],
        "calibrate-kv --in-place": ["calibrate-kv", ck, *KV, "--replace-scales", "--in-place"],
    }[command]
    monkeypatch.setattr(apply, "free_space", lambda p: 1000)
    assert main([*map(str, args), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "not enough free disk space" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no OUT, no partial, no lock
    named = ck if "--in-place" in args else out  # the output the user named (its partial is gone), and the fix
    fix = "more on the checkpoint's filesystem" if "--in-place" in args else "more on /"
    assert f"file:     {named}\n" in err and "fix:      free " in err and fix in err, err
    assert tree_sha(ck, skip=()) == before


def _shard_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.glob("*.safetensors"))


@pytest.mark.parametrize("command", ["assemble", "calibrate-kv", "patch-config"])
def test_an_output_of_links_fits_a_disk_with_room_for_what_it_writes(
    command, tiny_nvfp4_modelopt, tiny_bf16, tmp_path, monkeypatch, capsys
):
    """Found as: an output on its input's filesystem, whose unchanged shards are hard links (no new space),
    was refused on a nearly full disk: the check asked for 64 MiB more than the files it writes."""
    from qtool.cli.main import main
    from qtool.io import apply

    ck = copy_of(tiny_nvfp4_modelopt, tmp_path / "ck")
    out = tmp_path / "out"
    args = {
        "assemble": ["assemble", "hybrid", "--nvfp4", ck, "--bf16", tiny_bf16, "-o", out],
        "calibrate-kv": ["calibrate-kv", ck, *KV, "--replace-scales", "-o", out],
        "patch-config": ["patch-config", ck, "--fix", "router-ignore", "-o", out],
    }[command]
    room = _shard_bytes(ck)  # the output's shards alone would not fit if its links took space
    monkeypatch.setattr(apply, "free_space", lambda p: room)
    assert main([*map(str, args), "--quiet"]) == 0, capsys.readouterr().err
    assert _shard_bytes(out) + len((out / "qtool-manifest.json").read_bytes()) > room


def _refusal(err: str) -> dict[str, str]:
    """The refusal's fields as the CLI prints them (`name:     value` lines)."""
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in err.splitlines()) if v}


def test_a_refusal_for_space_says_how_much_more_where_and_what_copying_costs(
    tiny_nvfp4_modelopt, tiny_bf16, tmp_path, monkeypatch, capsys
):
    """The refusal names the numbers and the filesystem, and a fix the user has not already applied: not
    "put the output on the source's filesystem" when it is there; `--link copy` named as what costs the space."""
    from qtool.cli.main import main
    from qtool.io import apply
    from qtool.io.files import Placer, mount_point

    ck = copy_of(tiny_nvfp4_modelopt, tmp_path / "ck")
    out = tmp_path / "out"
    monkeypatch.setattr(apply, "free_space", lambda p: 1000)
    assert main(["patch-config", str(ck), "--fix", "router-ignore", "-o", str(out), "--quiet"]) == 1
    err = capsys.readouterr().err
    fields = _refusal(err)
    need = int(fields["expected"].split()[0])
    assert 1000 < need < 1 << 20  # its rewritten config and the manifest, not the linked shards
    assert fields["got"] == f"1000 bytes (1.0 KiB) free on {mount_point(tmp_path)}", err
    assert fields["fix"].startswith(f"free {need - 1000} bytes (") and f"more on {mount_point(tmp_path)}" in err
    assert "source's filesystem" not in err and "--link" not in err and "Traceback" not in err
    # --link copy: the unchanged shards are copies, and the refusal says so, with their bytes
    room = _shard_bytes(ck)  # what the same command without --link copy needs (the test above)
    monkeypatch.setattr(apply, "free_space", lambda p: room)
    assert (
        main(
            [
                "assemble",
                "hybrid",
                "--nvfp4",
                str(ck),
                "--bf16",
                str(tiny_bf16),
                "-o",
                str(out),
                "--link",
                "copy",
                "--quiet",
            ]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert "not enough free disk space" in err and "--link copy copies the " in err, err
    assert not out.exists() and not (tmp_path / "out.partial").exists()
    # an output on another filesystem than its input: its unchanged shards are copies, and the fix says where
    with monkeypatch.context() as m:
        m.setattr(Placer, "expect_new_bytes", lambda self, src, out_dir: True)
        assert (
            main(["assemble", "hybrid", "--nvfp4", str(ck), "--bf16", str(tiny_bf16), "-o", str(out), "--quiet"]) == 1
        )
    err = capsys.readouterr().err
    assert (
        f"of the files are copies of unchanged input files: an -o on the input's filesystem ({mount_point(ck)})" in err
    ), err
    assert (
        main(["assemble", "hybrid", "--nvfp4", str(ck), "--bf16", str(tiny_bf16), "-o", str(out), "--quiet"]) == 0
    )  # linked, the same output fits


def test_a_disk_too_small_for_a_resumed_run_keeps_the_interrupted_runs_work(
    tiny_nvfp4_modelopt, tmp_path, monkeypatch, capsys
):
    """The refusal withdraws only a partial output it made: a --resume's is the interrupted run's work."""
    import qtool.io.apply as apply
    from qtool.cli.main import main

    out = tmp_path / "ct"
    args = ["convert", tiny_nvfp4_modelopt, "-o", out, "--to", "compressed-tensors", "--quiet"]
    assert run_killed("qtool.io.apply:_journal_if_on_record", 1, args).returncode == -9
    partial = tmp_path / "ct.partial"
    kept = tree_sha(partial, skip=())
    assert any(name.endswith(".safetensors") for name in kept)
    with monkeypatch.context() as m:
        m.setattr(apply, "free_space", lambda p: 1000)
        assert main([*map(str, args), "--resume"]) == 1
    assert "not enough free disk space" in capsys.readouterr().err
    assert tree_sha(partial, skip=()) == kept and not out.exists()
    assert main([*map(str, args), "--resume"]) == 0  # and it resumes once there is room


@pytest.mark.slow
def test_a_disk_too_small_for_a_resumed_in_place_run_keeps_its_scratch(
    tiny_nvfp4_modelopt, tmp_path, monkeypatch, capsys
):
    """The same for `--in-place`: its scratch beside the checkpoint is the interrupted run's work (review)."""
    import qtool.io.apply as apply
    from qtool.cli.main import main

    work = copy_of(tiny_nvfp4_modelopt, tmp_path / "work")
    args = ["calibrate-kv", work, *KV, "--replace-scales", "--in-place", "--quiet"]
    assert run_killed("qtool.io.identity:Journal.record", 1, args).returncode == -9
    journal = tmp_path / ".work.qtool-inplace" / ".qtool-journal.jsonl"
    kept = journal.read_text()
    assert kept
    with monkeypatch.context() as m:
        m.setattr(apply, "free_space", lambda p: 1000)
        assert main([*map(str, args), "--resume"]) == 1
    err = capsys.readouterr().err
    assert "not enough free disk space" in err and "checkpoint's filesystem" in err
    assert journal.read_text() == kept  # (a resumed in-place run links its unjournaled files afresh)


@pytest.mark.parametrize("case", ["convert X -o X", "quantize P/bf -o P", "assemble -o inside the BF16 source"])
def test_outputs_overlapping_an_input_are_refused_for_every_command(case, tiny_nvfp4_modelopt, tiny_bf16, tmp_path):
    """Found as: `convert X -o X --force` and `quantize P/bf -o P --force` deleted or replaced the inputs."""
    P = tmp_path / "P"
    nv = copy_of(tiny_nvfp4_modelopt, P / "nv")
    bf = copy_of(tiny_bf16, P / "bf")
    before = tree_sha(P, skip=())
    args = {
        "convert X -o X": ["convert", nv, "-o", nv, "--to", "compressed-tensors"],
        "quantize P/bf -o P": ["quantize", bf, "-o", P, "--recipe", "qwen35-nvfp4-experts", *KV],
        "assemble -o inside the BF16 source": ["assemble", "hybrid", "--nvfp4", nv, "--bf16", bf, "-o", bf / "out"],
    }[case]
    p = run_cli([*args, "--force", "--json"])
    assert p.returncode == 2, p.stdout + p.stderr
    assert "overlaps" in json.loads(p.stdout)["message"]
    assert tree_sha(P, skip=()) == before


def test_a_second_quantize_on_the_same_output_is_refused(tiny_bf16, tmp_path):
    """Found as: two quantize runs sharing `.quantize/hidden.*` published wrong input scales."""
    out = tmp_path / "q"
    with lock_for(out):
        p = run_cli(["quantize", tiny_bf16, "-o", out, "--recipe", "qwen35-nvfp4-experts", *KV])
    assert p.returncode == 1 and "another qtool run" in p.stderr and not (tmp_path / "q.partial").exists()


# ---- found by review: names and links a user may have --------------------------------------------


def test_a_users_backup_named_like_qtools_scratch_is_never_removed(tiny_nvfp4_modelopt, tmp_path):
    """`convert m.old -o m --force` removed the input m.old (commit parked OUT at OUT.old); patch-config
    removed a user's `ck.old` backup and `ck.partial`."""
    m_old = copy_of(tiny_nvfp4_modelopt, tmp_path / "m.old")
    before = tree_sha(m_old, skip=())
    args = ["convert", m_old, "-o", tmp_path / "m", "--to", "compressed-tensors", "--quiet"]
    assert run_cli(args).returncode == 0
    assert run_cli([*args, "--force"]).returncode == 0
    assert tree_sha(m_old, skip=()) == before
    ck = copy_of(tiny_nvfp4_modelopt, tmp_path / "ck")
    copy_of(ck, tmp_path / "ck.old")
    (tmp_path / "ck.partial").mkdir()
    (tmp_path / "ck.partial" / "mine").write_text("x")
    for _ in range(2):  # a change, then nothing to change
        assert run_cli(["patch-config", ck, "--fix", "router-ignore"]).returncode == 0
    assert (tmp_path / "ck.old" / "config.json").exists() and (tmp_path / "ck.partial" / "mine").exists()
    p = run_cli(["convert", tiny_nvfp4_modelopt, "-o", tmp_path / "ck", "--to", "compressed-tensors"])
    assert p.returncode == 1 and "not made by qtool" in p.stderr  # ck: a checkpoint qtool did not make


def test_in_place_through_a_symlink_and_with_a_symlinked_directory(tiny_nvfp4_modelopt, tmp_path):
    """In-place on a symlinked checkpoint replaced the link by a directory and left its target unchanged;
    a symlinked directory inside the checkpoint vanished."""
    real = copy_of(tiny_nvfp4_modelopt, tmp_path / "real")
    (tmp_path / "assets").mkdir()
    (real / "assets").symlink_to(tmp_path / "assets")
    link = tmp_path / "link"
    link.symlink_to(real)
    assert run_cli(["patch-config", link, "--fix", "router-ignore"]).returncode == 0
    assert link.is_symlink() and "*.mlp.gate" in (real / "config.json").read_text()
    assert (real / "assets").is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["assets", "link", "real"]


def test_build_publishing_keeps_the_sources_permissions_and_refuses_a_source_as_output(tiny_nvfp4_modelopt, tmp_path):
    """Publishing chmod-ed hard links shared with the user's --source files read-only; `build -o SRC`
    replaced the source."""
    import stat as st

    src = copy_of(tiny_nvfp4_modelopt, tmp_path / "src")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"name: r\nsources:\n  nv: {{path: {src}}}\nsteps:\n"
        "  - {id: p, op: patch-config, input: nv, with: {fixes: [router-ignore]}}\n"
    )
    modes = {f.name: st.S_IMODE(f.stat().st_mode) for f in src.iterdir()}
    assert run_cli(["build", recipe, "-o", tmp_path / "out", "--quiet"]).returncode == 0, "build"
    assert {f.name: st.S_IMODE(f.stat().st_mode) for f in src.iterdir()} == modes
    before = tree_sha(src, skip=())
    p = run_cli(["build", recipe, "-o", src, "--force", "--json"])
    assert p.returncode == 2 and "overlaps" in json.loads(p.stdout)["message"]
    assert tree_sha(src, skip=()) == before


@pytest.mark.slow
def test_resume_names_the_input_either_way_and_in_place_resume_takes_the_current_files(tiny_nvfp4_modelopt, tmp_path):
    """--resume with ./src instead of /abs/src was refused as "14 input files changed"; an in-place resume
    brought back a side file edited or deleted since the kill."""
    src = copy_of(tiny_nvfp4_modelopt, tmp_path / "src")
    out = tmp_path / "out"
    args = [*KV, "--replace-scales", "--quiet"]
    assert (
        run_killed(
            "qtool.stream.layer_stream:LayerStreamer.load_layer", 2, ["calibrate-kv", src, "-o", out, *args]
        ).returncode
        == -9
    )
    p = run_cli(["calibrate-kv", "src", "-o", "out", *args, "--resume"], cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    work = copy_of(tiny_nvfp4_modelopt, tmp_path / "work")
    assert run_killed("qtool.io.writer:write_shard", 1, ["calibrate-kv", work, *args, "--in-place"]).returncode == -9
    (work / "generation_config.json").write_text('{"edited": true}\n')
    (work / "video_preprocessor_config.json").unlink()
    assert run_cli(["calibrate-kv", work, *args, "--in-place", "--resume"]).returncode == 0
    assert (work / "generation_config.json").read_text() == '{"edited": true}\n'
    assert not (work / "video_preprocessor_config.json").exists()


# ---- found by the second review ------------------------------------------------------------------


def test_a_two_rename_swap_killed_midway_is_put_back(tiny_nvfp4_modelopt, tmp_path, monkeypatch):
    """Without RENAME_EXCHANGE a kill between the two renames left the checkpoint parked under qtool's
    hidden name; every later command said "checkpoint not found"."""
    import qtool.io.in_place as ip
    from qtool.hub.resolve import require_local
    from qtool.io.jsonio import write_json

    ck = copy_of(tiny_nvfp4_modelopt, tmp_path / "ck")
    tx = ip.InPlaceDir(ck).begin()
    write_json(tx.partial / "generation_config.json", {"new": True})
    monkeypatch.setattr(ip, "exchange_paths", lambda a, b: False)
    real_rename, calls = os.rename, []

    def rename_then_die(a, b):
        calls.append(a)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the process dies between the two renames
        real_rename(a, b)

    monkeypatch.setattr(ip.os, "rename", rename_then_die)
    with pytest.raises(KeyboardInterrupt):
        tx.commit()
    monkeypatch.setattr(ip.os, "rename", real_rename)
    tx.lock.release()
    assert not ck.exists()
    require_local(ck)  # what every in-place command does first
    assert json.loads((ck / "generation_config.json").read_text()) == {"new": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_users_directories_at_qtools_hidden_names_and_a_symlinked_lock_are_refused(tiny_nvfp4_modelopt, tmp_path):
    ck = copy_of(tiny_nvfp4_modelopt, tmp_path / "ck")
    mine = tmp_path / ".ck.qtool-inplace"
    mine.mkdir()
    (mine / "n").write_text("x")
    p = run_cli(["patch-config", ck, "--fix", "router-ignore"])
    assert p.returncode == 1 and "not made by qtool" in p.stderr and (mine / "n").exists()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / ".o.qtool-lock").symlink_to(victim)
    p = run_cli(["convert", tiny_nvfp4_modelopt, "-o", tmp_path / "o", "--to", "compressed-tensors"])
    assert p.returncode == 1 and "Traceback" not in p.stderr and victim.read_text() == "precious"


def test_in_place_keeps_the_directory_mode_and_a_refused_patch_leaves_nothing(tiny_nvfp4_modelopt, tmp_path):
    from qtool.errors import WriteError
    from qtool.ops import patch_config as pc

    ck = copy_of(tiny_nvfp4_modelopt, tmp_path / "ck")
    os.chmod(ck, 0o2770)
    assert run_cli(["patch-config", ck, "--fix", "router-ignore"]).returncode == 0
    assert os.stat(ck).st_mode & 0o7777 == 0o2770
    plan = pc.plan(pc.PatchOptions(ck, ignore_add=("foo*",)))
    assert plan.changed
    (ck / "config.json").write_text((ck / "config.json").read_text().replace("}", ', "x": 1}', 1))
    with pytest.raises(WriteError, match="changed while this run was planning"):
        pc.apply(plan)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_output_dot_and_build_over_a_source_refused_before_any_step(tiny_nvfp4_modelopt, tmp_path):
    here = tmp_path / "here"
    here.mkdir()
    p = run_cli(["convert", tiny_nvfp4_modelopt, "-o", ".", "--to", "compressed-tensors", "--quiet"], cwd=here)
    assert p.returncode == 0, p.stderr
    assert (here / "qtool-manifest.json").exists()
    src = copy_of(tiny_nvfp4_modelopt, tmp_path / "nv")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"name: r\nsources:\n  nv: {{path: {src}}}\nsteps:\n"
        "  - {id: p, op: patch-config, input: nv, with: {fixes: [router-ignore]}}\n"
    )
    p = run_cli(["build", recipe, "-o", src, "--force"])
    assert p.returncode == 2 and "overlaps" in p.stderr
    assert not (tmp_path / "nv.build").exists()


def test_two_concurrent_patch_config_runs_lose_no_change(tiny_nvfp4_modelopt, tmp_path):
    """Found as: two patch-config runs on one checkpoint, the second planned before the first committed:
    the second's swap published its own configs and the first run's change was lost."""
    import time

    from killpoint import start_paused

    ck = copy_of(tiny_nvfp4_modelopt, tmp_path / "ck")
    marker = tmp_path / "a"
    a = start_paused("qtool.ops.patch_config:plan", 1, marker, ["patch-config", ck, "--ignore-add", "first*", "--json"])
    deadline = time.time() + 120
    while not (tmp_path / "a.paused").exists():
        assert a.poll() is None and time.time() < deadline, a.communicate()
        time.sleep(0.05)
    # run B plans and commits while run A sits between its plan and its lock
    b = run_cli(["patch-config", ck, "--ignore-add", "second*"])
    assert b.returncode == 0, b.stderr
    (tmp_path / "a.go").touch()
    out, err = a.communicate(timeout=120)
    assert a.returncode == 1, err
    assert "changed while this run was planning" in json.loads(out)["message"]
    cfg = (ck / "config.json").read_text()
    assert "second*" in cfg and "first*" not in cfg  # B's change kept, A's refused (not half-applied)
    assert run_cli(["patch-config", ck, "--ignore-add", "first*"]).returncode == 0  # run again: both
    cfg = (ck / "config.json").read_text()
    assert "second*" in cfg and "first*" in cfg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.go", "a.paused", "ck"]


@pytest.mark.slow
def test_in_place_resume_keeps_the_shards_its_journal_finished(tiny_nvfp4_modelopt, tmp_path):
    """Found in review: `calibrate-kv --in-place --resume` killed after its first journaled shard re-linked
    the checkpoint's files over the finished work and published the OLD kv-scales shard (same size), with
    the new statistics in the manifest."""
    src = copy_of(tiny_nvfp4_modelopt, tmp_path / "src")
    base = ["calibrate-kv", "--replace-scales", "--in-place", "--samples", "2", "--seq-len", "32", "--quiet"]
    other = tmp_path / "other.txt"
    other.write_text("a different corpus: numbers 0123456789 and words " * 40)  # other scales, same shard size
    assert run_cli([base[0], src, *base[1:], "--dataset", other]).returncode == 0
    ref = copy_of(src, tmp_path / "ref")
    assert run_cli([base[0], ref, *base[1:]]).returncode == 0
    work = copy_of(src, tmp_path / "work")
    p = run_killed("qtool.io.identity:Journal.record", 1, [base[0], work, *base[1:]])
    assert p.returncode == -9
    assert run_cli([base[0], work, *base[1:], "--resume"]).returncode == 0
    assert tree_sha(src)["model-kv-scales.safetensors"] != tree_sha(ref)["model-kv-scales.safetensors"]
    assert tree_sha(work) == tree_sha(ref)


def test_a_kill_in_the_in_place_commit_before_the_swap_is_cleaned_up(tiny_nvfp4_modelopt, tmp_path):
    """Found in review: a kill after the commit removed its building marker, before the swap, left qtool's
    own work directory unmarked, and every later in-place command refused it as a user's directory."""
    ck = copy_of(tiny_nvfp4_modelopt, tmp_path / "ck")
    before = tree_sha(ck, skip=())
    p = run_killed("qtool.io.in_place:fsync_path", 1, ["patch-config", ck, "--yarn", "2"])
    assert p.returncode == -9
    assert tree_sha(ck, skip=()) == before  # the checkpoint is untouched
    p = run_cli(["patch-config", ck, "--yarn", "2"])
    assert p.returncode == 0, p.stderr
    assert '"yarn"' in (ck / "config.json").read_text()
    assert sorted(q.name for q in tmp_path.iterdir()) == ["ck"]


def test_new_outputs_keep_the_side_files_in_sub_folders(tiny_nvfp4_modelopt, tmp_path):
    """Found in review: calibrate-kv -o (and convert, quantize) copied only the top level: a checkpoint's
    `original/params.json` or `assets/` were silently dropped."""
    src = copy_of(tiny_nvfp4_modelopt, tmp_path / "src")
    (src / "original").mkdir()
    (src / "original" / "params.json").write_text('{"dim": 64}\n')
    out = tmp_path / "kv"
    assert run_cli(["calibrate-kv", src, "-o", out, *KV, "--replace-scales", "--quiet"]).returncode == 0
    assert (out / "original" / "params.json").read_text() == '{"dim": 64}\n'
    out2 = tmp_path / "ct"
    assert run_cli(["convert", src, "-o", out2, "--to", "compressed-tensors", "--quiet"]).returncode == 0
    assert (out2 / "original" / "params.json").read_text() == '{"dim": 64}\n'
    man = json.loads((out2 / "qtool-manifest.json").read_text())
    assert "original/params.json" in man["files"]


@pytest.mark.slow
def test_a_failed_swap_leaves_markers_the_next_run_understands(tiny_nvfp4_modelopt, tmp_path):
    """The moment between marking the old state and the swap itself (here the swap fails with EIO): the next
    in-place run removes the unused new state instead of refusing it as a user's directory."""
    from killpoint import run_failing

    ck = copy_of(tiny_nvfp4_modelopt, tmp_path / "ck")
    before = tree_sha(ck)
    args = ["calibrate-kv", ck, "--in-place", "--replace-scales", *KV, "--quiet"]
    p = run_failing("qtool.io.in_place:exchange_paths", 1, "EIO", args)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert tree_sha(ck) == before
    p = run_cli(args)
    assert p.returncode == 0, p.stderr
    assert sorted(q.name for q in tmp_path.iterdir()) == ["ck"]


@pytest.mark.slow
@pytest.mark.parametrize("debug", [False, True])
def test_a_job_that_fails_before_its_layers_leaves_no_import_running_at_exit(tiny_bf16, tmp_path, debug):
    """Found as: calibrate-kv's full-disk run aborted at exit in CI (-6, "terminate called without an active
    exception"): a daemon thread still in torch's code when the interpreter tears down (pytorch#38228). The
    background import of transformers (qtool.stream.warm_import) runs until the first layer; a job that
    fails before it (here the output's free-space check) must not exit beside it, with QTOOL_DEBUG's
    traceback too."""
    from killpoint import run_failing

    slow = {**os.environ, "KILLPOINT_SLOW": "qtool.stream.warm_import:skip_unused_imports:3"}
    if debug:
        slow["QTOOL_DEBUG"] = "1"
    p = run_failing(
        "qtool.io.apply:check_space",
        1,
        "ENOSPC",
        ["quantize", tiny_bf16, "-o", tmp_path / "q", "--recipe", "qwen35-nvfp4-experts", *KV],
        env=slow,
    )
    assert p.returncode == 1 and "No space left on device" in p.stderr, p.stderr
    assert "alive at exit" not in p.stderr


def test_a_failed_write_stops_the_hashes_of_the_shards_written_before_it(tiny_nvfp4_modelopt, tmp_path):
    """Found in review: when the journal's write failed (a full disk) after some shards were written, their
    sha256 threads (handed to no one yet) read on to each file's end, into the interpreter's exit."""
    from killpoint import run_failing

    slow = {**os.environ, "KILLPOINT_SLOW": "qtool.io.hashed_writes:HashedWrites._run:2"}
    p = run_failing(
        "qtool.io.apply:_journal_if_on_record",
        1,
        "ENOSPC",
        ["convert", tiny_nvfp4_modelopt, "-o", tmp_path / "ct", "--to", "compressed-tensors"],
        env=slow,
    )
    assert p.returncode == 1 and "No space left on device" in p.stderr, p.stderr
    assert "alive at exit" not in p.stderr


@pytest.mark.slow
def test_a_failed_early_shard_stops_quantize_at_its_next_layer(tiny_bf16, tmp_path):
    """The shards that need no layer (embeddings, lm_head, vision tower) are copied while the layers run. When
    that copy failed (EIO on one file), quantize still computed every layer before it said so: at the 397B,
    minutes of work after the error. It now stops at the next layer it finishes; the partial output resumes."""
    import json

    from killpoint import run_failing

    out = tmp_path / "q"
    args = ["quantize", tiny_bf16, "-o", out, "--recipe", "qwen35-nvfp4-experts", *KV, "--quiet"]
    p = run_failing("qtool.io.files:copy_range", 1, "EIO", args)
    assert p.returncode == 1 and "Input/output error" in p.stderr, p.stderr
    assert "alive at exit" not in p.stderr
    journal = json.loads((tmp_path / "q.partial/.quantize/journal.json").read_text())
    layers = json.loads((tiny_bf16 / "config.json").read_text())["text_config"]["num_hidden_layers"]
    assert journal["next_layer"] <= 2 < layers
    p = run_cli([*args, "--resume"])
    assert p.returncode == 0, p.stderr


@pytest.mark.slow
def test_a_failed_early_shard_stops_calibrate_kv_at_its_next_layer(tiny_nvfp4_modelopt, tmp_path):
    """calibrate-kv, like quantize, writes the shards that need no scale while its layers run (the shards it
    rewrites without the old scales, from the layers' reads); a failed write (EIO) stops it at the next
    layer it finishes, not after every layer; the partial output resumes."""
    import json

    from killpoint import run_failing

    out = tmp_path / "kv"
    args = ["calibrate-kv", tiny_nvfp4_modelopt, "-o", out, *KV, "--replace-scales", "--quiet"]
    # the copy fails at once, and each layer takes a moment: the error is there before the job's end
    slow = {**os.environ, "KILLPOINT_SLOW": "qtool.stream.layer_stream:LayerStreamer.load_layer:0.2"}
    p = run_failing("qtool.io.writer:write_shard", 1, "EIO", args, env=slow)
    assert p.returncode == 1 and "Input/output error" in p.stderr, p.stderr
    assert "alive at exit" not in p.stderr
    journal = json.loads(next((tmp_path / "kv.partial").glob("**/journal.json")).read_text())
    layers = json.loads((tiny_nvfp4_modelopt / "config.json").read_text())["text_config"]["num_hidden_layers"]
    assert journal["next_layer"] < layers  # (a fed shard is written once its last layer is read)
    p = run_cli([*args, "--resume"])
    assert p.returncode == 0, p.stderr
