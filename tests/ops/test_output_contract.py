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
from killpoint import run_killed, run_qtool

from qtool.io.checkpoint import Checkpoint
from qtool.io.output import lock_for
from qtool.io.writer import FileRange, OutTensor, write_shard

KV = ["--samples", "2", "--seq-len", "16"]


def tree_sha(d: Path, skip=("qtool-manifest.json",)) -> dict[str, str]:
    return {p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file() and p.name not in skip}


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
    write_shard(dst / "model.safetensors",
                [OutTensor(t.name, t.dtype, tuple(t.shape), FileRange(t.file, t.start, t.end)) for t in tensors])
    return dst


# ---- calibrate-kv ----------------------------------------------------------------------------------


def test_calibrate_kv_resume_after_kill_in_placing_never_truncates_the_input(tiny_nvfp4_modelopt, tmp_path):
    """Found as: killed after a shard was hard-linked into OUT.partial, `--resume` truncated the INPUT
    shards to 0 bytes through the shared inode and exited 0."""
    src = copy_of(tiny_nvfp4_modelopt, tmp_path / "src")
    before = tree_sha(src)
    ref, out = tmp_path / "ref", tmp_path / "out"
    args = ["calibrate-kv", src, *KV, "--replace-scales", "--quiet"]
    assert run_qtool([*args, "-o", ref]).returncode == 0
    p = run_killed("qtool.io.output:Placer.place", 2, [*args, "-o", out])
    assert p.returncode == -9 and not out.exists() and (tmp_path / "out.partial").exists()
    p = run_qtool([*args, "-o", out, "--resume"])
    assert p.returncode == 0, p.stderr
    assert tree_sha(src) == before
    assert tree_sha(out) == tree_sha(ref)


def test_in_place_unindexed_kill_leaves_a_checkpoint_that_opens(tiny_nvfp4_modelopt, tmp_path):
    """Found as: `--in-place --overwrite` on an unindexed checkpoint killed after model-nokv.safetensors
    appeared left a checkpoint that no longer opened ("tensor appears in two shards")."""
    ref = unindexed(tiny_nvfp4_modelopt, tmp_path / "ref")
    work = tmp_path / "work"
    shutil.copytree(ref, work)
    before = tree_sha(work)
    args = [*KV, "--replace-scales", "--in-place", "--quiet"]
    assert run_qtool(["calibrate-kv", ref, *args]).returncode == 0
    for n in (1, 2):  # after the first shard written, after the second (the KV shard)
        p = run_killed("qtool.io.writer:write_shard", n, ["calibrate-kv", work, *args])
        assert p.returncode == -9
        assert tree_sha(work) == before  # untouched until the swap
        Checkpoint.open(work)
    p = run_qtool(["calibrate-kv", work, *args, "--resume"])
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
    p = run_qtool(["calibrate-kv", src, "-o", out, *KV, "--replace-scales", "--force", "--json"])
    assert p.returncode == 2, p.stdout + p.stderr
    assert "overlaps an input" in json.loads(p.stdout)["message"]
    assert tree_sha(parent) == before


def test_resume_refuses_an_input_edited_with_its_mtime_put_back(tiny_nvfp4_modelopt, tmp_path):
    """Found as: --resume after the input's bytes changed (same size, mtime restored) kept the old layers
    and wrote the new file's sha256 into the manifest."""
    src = copy_of(tiny_nvfp4_modelopt, tmp_path / "src")
    out = tmp_path / "out"
    args = ["calibrate-kv", src, "-o", out, *KV, "--replace-scales", "--quiet"]
    p = run_killed("qtool.ops.layer_stream:LayerStreamer.load_layer", 2, args)
    assert p.returncode == -9
    shard = Checkpoint.open(src).shard_of("model.language_model.layers.0.linear_attn.in_proj_qkv.weight")
    f = src / shard
    st = f.stat()
    data = bytearray(f.read_bytes())
    data[-100] ^= 0x01  # the last tensor's bytes
    f.write_bytes(bytes(data))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    p = run_qtool([*args, "--resume", "--json"])
    assert p.returncode == 1
    assert "journal was written for other inputs" in json.loads(p.stdout)["message"]
    assert not out.exists()


def test_a_second_run_on_a_locked_output_is_refused(tiny_nvfp4_modelopt, tmp_path):
    out = tmp_path / "out"
    with lock_for(out):  # as a running qtool holds it
        p = run_qtool(["calibrate-kv", tiny_nvfp4_modelopt, "-o", out, *KV, "--replace-scales", "--json"])
    assert p.returncode == 1
    err = json.loads(p.stdout)
    assert f"pid {os.getpid()}" in err["message"] and err["path"] == str(out)
    assert not out.exists() and not (tmp_path / "out.partial").exists()


def test_force_replaces_only_directories_qtool_made(tiny_nvfp4_modelopt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    p = run_qtool(["calibrate-kv", tiny_nvfp4_modelopt, "-o", out, *KV, "--replace-scales", "--force"])
    assert p.returncode == 1 and "not made by qtool" in p.stderr
    assert (out / "thesis.tex").read_text() == "years of work"


def test_concurrent_assemble_runs_publish_one_complete_output(tiny_nvfp4_modelopt, tiny_bf16, tmp_path):
    """Found as: two assemble runs on one OUT a second apart published an OUT missing the index and 7
    shards, exit 0."""
    ref, out = tmp_path / "ref", tmp_path / "out"
    base = ["assemble", "hybrid", "--nvfp4", tiny_nvfp4_modelopt, "--bf16", tiny_bf16, "--quiet", "--link", "copy"]
    assert run_qtool([*base, "-o", ref]).returncode == 0
    cmd = [sys.executable, "-m", "qtool", *map(str, base), "-o", str(out)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [(p.wait(), p.stderr.read()) for p in procs]
    assert sum(rc == 0 for rc, _ in results) >= 1
    for rc, err in results:
        assert rc == 0 or ("another qtool run" in err or "already exists" in err), err
    assert tree_sha(out) == tree_sha(ref)
