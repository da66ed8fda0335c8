"""Issue 25: the findings of the adversarial sweep at 2636062, each reproduced the way it was found (same
command, same kill point, same input) and asserting what the user relies on: their files untouched, the
bytes and the manifest right, a clear error instead of a hang or a traceback."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from in_process import run_cli
from killpoint import run_killed, run_qtool
from test_output_contract import KV, copy_of, tree_sha

TIMEOUT = 120  # a FIFO case that hangs fails here instead of hanging the suite


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def same_size_edit(f: Path, offset: int) -> None:
    """Flip one byte of `f` at `offset` and put its mtime back (what the sweep did)."""
    st = f.stat()
    data = bytearray(f.read_bytes())
    data[offset] ^= 0x01
    f.write_bytes(bytes(data))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))


def unsampled_offset(f: Path) -> int:
    """A byte of the tensor data that the journal's identity sample (qtool.io.identity) does not read."""
    from qtool.io.identity import SAMPLE_BLOCK, SAMPLE_BLOCKS

    size = f.stat().st_size
    with open(f, "rb") as fh:
        head = 8 + int.from_bytes(fh.read(8), "little")
    step = max(SAMPLE_BLOCK, (size - head) // SAMPLE_BLOCKS)
    return head + (SAMPLE_BLOCKS - 2) * step + step // 2


def biggest_shard(root: Path) -> Path:
    return max(root.glob("*.safetensors"), key=lambda p: p.stat().st_size)


# ---- data loss: every writing option goes through the output contract ---------------------------------


def test_save_ref_onto_or_inside_the_reference_is_refused(tiny_nvfp4_modelopt, tmp_path):
    """Found as: `eval kld --ref A --save-ref A --force` replaced the reference checkpoint A by the compact
    reference (exit 0); `--save-ref A/sub` wrote inside the input."""
    ref = copy_of(tiny_nvfp4_modelopt, tmp_path / "A")
    before = tree_sha(ref, skip=())
    for target in (ref, ref / "sub"):
        p = run_cli(
            [
                "eval",
                "kld",
                "--ref",
                ref,
                "--save-ref",
                target,
                "--force",
                "--windows",
                "1",
                "--seq-len",
                "8",
                "--json",
            ],
            timeout=TIMEOUT,
        )
        assert p.returncode == 2, p.stdout + p.stderr
        assert "overlaps an input" in json.loads(p.stdout)["message"]
    assert tree_sha(ref, skip=()) == before and not (ref / "sub").exists()
    # (review) a local dataset is an input too, and --emit-windows may not lie inside --save-ref
    r1 = tmp_path / "R1"
    r1.mkdir()
    (r1 / "data.jsonl").write_text('{"text": "one two three"}\n' * 50)
    for extra in (["--dataset", r1 / "data.jsonl"], ["--emit-windows", r1 / "w.jsonl"]):
        p = run_cli(
            [
                "eval",
                "kld",
                "--ref",
                ref,
                "--windows",
                "1",
                "--seq-len",
                "8",
                "--save-ref",
                r1,
                "--force",
                *extra,
                "--json",
            ],
            timeout=TIMEOUT,
        )
        assert p.returncode == 2, p.stdout + p.stderr
    assert (r1 / "data.jsonl").exists() and not (r1 / "w.jsonl").exists()


def test_report_never_replaces_a_users_file_nor_writes_into_a_source(tiny_nvfp4_modelopt, tmp_path):
    """Found as: `report S -o user.html --force` replaced a user's own HTML file; `report S -o
    S/report.html` wrote into the source (both exit 0)."""
    src = copy_of(tiny_nvfp4_modelopt, tmp_path / "S")
    mine = tmp_path / "user.html"
    mine.write_text("<html>my notes</html>")
    p = run_cli(["report", src, "--tp", "1", "-o", mine, "--force"], timeout=TIMEOUT)
    assert p.returncode == 1 and "not written by qtool" in p.stderr, p.stderr
    assert mine.read_text() == "<html>my notes</html>"
    p = run_cli(["report", src, "--tp", "1", "-o", src / "report.html"], timeout=TIMEOUT)
    assert p.returncode == 2 and "inside an input" in p.stderr, p.stderr
    assert not (src / "report.html").exists()
    # qtool's own report: replaced with --force only
    ours = tmp_path / "r.html"
    assert run_cli(["report", src, "--tp", "1", "-o", ours], timeout=TIMEOUT).returncode == 0
    p = run_cli(["report", src, "--tp", "1", "-o", ours], timeout=TIMEOUT)
    assert p.returncode == 1 and "--force" in p.stderr
    assert run_cli(["report", src, "--tp", "1", "-o", ours, "--force"], timeout=TIMEOUT).returncode == 0


@pytest.mark.parametrize("manifest", ["empty", "foreign", "in-place-compact", "files-missing"])
def test_force_never_replaces_a_directory_whose_manifest_does_not_prove_qtool_made_it(
    manifest, tiny_nvfp4_modelopt, tmp_path
):
    """Found as: a user directory holding an empty qtool-manifest.json, or a user's checkpoint that qtool
    once patched in place (its manifest later re-serialised compactly), was deleted whole by
    `convert ... -o DIR --force`."""
    d = tmp_path / "DIR"
    if manifest == "in-place-compact":
        d = copy_of(tiny_nvfp4_modelopt, d)
        p = run_cli(["patch-config", d, "--sampling-defaults"], timeout=TIMEOUT)
        assert p.returncode == 0, p.stderr
        m = json.loads((d / "qtool-manifest.json").read_text())
        assert m["created_by_qtool"] is False
        (d / "qtool-manifest.json").write_text(json.dumps(m, separators=(",", ":")))
    elif manifest == "files-missing":
        p = run_cli(["convert", tiny_nvfp4_modelopt, "--to", "compressed-tensors", "-o", d, "--quiet"], timeout=TIMEOUT)
        assert p.returncode == 0, p.stderr
        m = json.loads((d / "qtool-manifest.json").read_text())
        for rel in m["files"]:
            (d / rel).unlink()  # a user who kept only qtool's manifest and put their own files there
        (d / "mine.txt").write_text("mine")
    else:
        d.mkdir()
        (d / "mine.txt").write_text("mine")
        (d / "qtool-manifest.json").write_text("" if manifest == "empty" else '{"files": {"mine.txt": {}}}')
    before = tree_sha(d, skip=())
    p = run_cli(
        ["convert", tiny_nvfp4_modelopt, "--to", "compressed-tensors", "-o", d, "--force", "--quiet"], timeout=TIMEOUT
    )
    assert p.returncode == 1 and "not made by qtool" in p.stderr, p.stderr
    if manifest == "in-place-compact":
        assert "changed this checkpoint in place" in p.stderr  # not "(no qtool-manifest.json)"
    assert tree_sha(d, skip=()) == before


def test_force_replaces_a_qtool_output_whose_user_removed_a_side_file(tiny_nvfp4_modelopt, tmp_path):
    """Found by the review: after `rm OUT/tokenizer.json` a qtool output could never be replaced again."""
    out = tmp_path / "out"
    args = ["convert", tiny_nvfp4_modelopt, "--to", "compressed-tensors", "-o", out, "--quiet"]
    assert run_cli(args, timeout=TIMEOUT).returncode == 0
    ref = tree_sha(out)
    (out / "tokenizer.json").unlink()
    p = run_cli([*args, "--force"], timeout=TIMEOUT)
    assert p.returncode == 0, p.stderr
    assert tree_sha(out) == ref


# ---- wrong bytes or a wrong manifest with exit 0 -------------------------------------------------------


def test_a_same_size_edit_with_the_mtime_put_back_gets_its_new_sha256(
    tiny_nvfp4_modelopt, tiny_bf16, tmp_path, monkeypatch
):
    """Found as: the sha256 cache (keyed by path, size, mtime, inode) gave a new assemble output whose
    manifest carried the old sha256 of an edited source shard."""
    monkeypatch.setenv("QTOOL_CACHE_DIR", str(tmp_path / "cache"))
    src = copy_of(tiny_nvfp4_modelopt, tmp_path / "src")
    base = ["assemble", "hybrid", "--nvfp4", src, "--bf16", tiny_bf16, "--quiet"]
    assert run_cli([*base, "-o", tmp_path / "o1"], timeout=TIMEOUT).returncode == 0
    shard = biggest_shard(src)
    same_size_edit(shard, shard.stat().st_size // 2)
    shutil.rmtree(tmp_path / "o1")  # (review) removing the old output's links must not bring the old digest back
    assert run_cli([*base, "-o", tmp_path / "o2"], timeout=TIMEOUT).returncode == 0
    m = json.loads((tmp_path / "o2" / "qtool-manifest.json").read_text())
    recorded = m["sources"]["nvfp4"]["files"][shard.name]["sha256"]
    assert recorded == sha(shard)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["convert", "assemble", "calibrate-kv", "quantize"])
def test_resume_after_an_edit_before_the_inputs_were_hashed_uses_the_new_bytes(
    command, tiny_nvfp4_modelopt, tiny_bf16, tmp_path
):
    """Found as: killed before the full input hash was recorded, then a same-size edit (mtime put back)
    outside the sampled blocks: --resume mixed old and new data, exit 0, and verify --deep said ok. Then
    (CI, a slow machine) --resume was refused after any kill that came before every input was hashed.
    Now nothing is journaled before the bytes it rests on are on record, so such a resume has nothing to
    keep: it makes the output from the new bytes, as a fresh run does."""
    src = copy_of(tiny_nvfp4_modelopt, tmp_path / "src")
    bf = copy_of(tiny_bf16, tmp_path / "bf")
    args = {
        "convert": ["convert", src, "--to", "compressed-tensors"],
        "assemble": ["assemble", "hybrid", "--nvfp4", src, "--bf16", bf],
        "calibrate-kv": ["calibrate-kv", src, *KV, "--replace-scales"],
        "quantize": ["quantize", bf, "--recipe", "qwen35-nvfp4-experts", *KV],
    }[command]
    out = tmp_path / "out"
    # the journal's head is written before any input is hashed: the kill lands there
    p = run_killed("qtool.io.identity:Journal.__init__", 1, [*args, "-o", out, "--quiet"])
    assert p.returncode == -9, p.stderr
    edited = biggest_shard(bf if command == "quantize" else src)
    same_size_edit(edited, unsampled_offset(edited))  # unseen by the journal's identity check
    p = run_cli([*args, "-o", out, "--quiet", "--resume"], timeout=TIMEOUT)
    assert p.returncode == 0, p.stdout + p.stderr
    m = json.loads((out / "qtool-manifest.json").read_text())
    digests = {
        f.get("sha256") for s in m["sources"].values() if isinstance(s, dict) for f in (s.get("files") or {}).values()
    }
    assert sha(edited) in digests
    fresh = tmp_path / "fresh"
    p = run_cli([*args, "-o", fresh, "--quiet"], timeout=TIMEOUT)
    assert p.returncode == 0, p.stderr
    assert tree_sha(out) == tree_sha(fresh)


def _flip_byte(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x20
    p.write_bytes(bytes(data))


def test_verify_deep_checks_every_file_the_manifest_lists(tiny_nvfp4_modelopt, tiny_bf16, tmp_path):
    """Found as: `verify --deep` ignored the recorded sha256 of non-shard files (config.json, tokenizer
    files, chat_template.jinja, generation_config.json: 61 of 170 flips passed), and in-place outputs
    recorded `sha256: null` for unchanged shards, so their flips passed too."""
    out = tmp_path / "out"
    p = run_cli(
        [
            "assemble",
            "hybrid",
            "--nvfp4",
            tiny_nvfp4_modelopt,
            "--bf16",
            tiny_bf16,
            "-o",
            out,
            "--quiet",
            "--link",
            "copy",
        ],
        timeout=TIMEOUT,
    )
    assert p.returncode == 0, p.stderr
    files = json.loads((out / "qtool-manifest.json").read_text())["files"]
    side = sorted(f for f in files if not f.endswith(".safetensors"))
    assert "tokenizer_config.json" in side and "config.json" in side
    for name in ("tokenizer_config.json", "generation_config.json"):
        if name not in files:
            continue
        keep = (out / name).read_bytes()
        _flip_byte(out / name)
        p = run_cli(["verify", out, "--deep", "--tp", "1", "--json"], timeout=TIMEOUT)
        assert p.returncode == 3, (name, p.stdout[-2000:])
        assert "hash-mismatch" in p.stdout and name in p.stdout
        (out / name).write_bytes(keep)
    # in place: every file gets its sha256, so a flip in an unchanged shard is caught
    ck = copy_of(tiny_nvfp4_modelopt, tmp_path / "ck")
    assert run_cli(["patch-config", ck, "--sampling-defaults"], timeout=TIMEOUT).returncode == 0
    m = json.loads((ck / "qtool-manifest.json").read_text())
    assert all(isinstance(f["sha256"], str) for f in m["files"].values()), m["files"]
    shard = biggest_shard(ck)
    _flip_byte(shard)
    p = run_cli(["verify", ck, "--deep", "--tp", "1", "--json"], timeout=TIMEOUT)
    assert p.returncode == 3 and "hash-mismatch" in p.stdout


@pytest.mark.parametrize(
    "file,path,value",
    [
        ("config.json", ["quantization_config", "kv_cache_scheme"], "fp8"),
        ("config.json", ["quantization_config", "config_groups"], "x"),
        ("config.json", ["quantization_config", "quant_algo"], 4),
        ("config.json", ["quantization_config", "quant_method"], 5),
        ("config.json", ["text_config", "layer_types"], 5),
        ("config.json", ["text_config", "num_hidden_layers"], None),
        ("config.json", ["text_config", "num_key_value_heads"], 0),
        ("config.json", ["text_config", "hidden_size"], "4096"),
        ("hf_quant_config.json", ["quantization", "exclude_modules"], 5),
        ("hf_quant_config.json", ["quantization", "quant_algo"], 7),
        ("model.safetensors.index.json", ["metadata"], "oops"),
        ("config.json", ["text_config", "rope_parameters"], "yarn"),  # (review) tracebacks in serve-config, patch
        ("config.json", ["text_config", "max_position_embeddings"], "4096"),
        ("config.json", ["text_config", "tie_word_embeddings"], "false"),
    ],
)
def test_wrong_typed_config_fields_are_named_errors(file, path, value, tiny_nvfp4_modelopt, tmp_path):
    """Found as: wrong-typed quantization configs gave verify "ok" and were carried into outputs; other
    wrong types were tracebacks (ZeroDivisionError in calibrate-kv and eval kld, report's quant_algo)."""
    ck = copy_of(tiny_nvfp4_modelopt, tmp_path / "ck")
    obj = json.loads((ck / file).read_text())
    at = obj
    for k in path[:-1]:
        at = at.setdefault(k, {})
    at[path[-1]] = value
    (ck / file).write_text(json.dumps(obj))
    key = ".".join(path)
    for cmd in (
        ["verify", ck, "--tp", "1"],
        ["calibrate-kv", ck, *KV, "-o", tmp_path / "kv", "--dry-run"],
        ["report", ck, "--tp", "1", "-o", tmp_path / "r.html"],
    ):
        p = run_cli(cmd, timeout=TIMEOUT)
        # verify reports an unreadable checkpoint as its finding (exit 3); the others are errors (exit 1)
        assert p.returncode == (3 if cmd[0] == "verify" else 1), (cmd[0], p.stdout, p.stderr)
        said = p.stdout + p.stderr
        assert "Traceback" not in p.stderr and key in said and file in said, (cmd[0], said)
    assert not (tmp_path / "kv").exists() and not (tmp_path / "r.html").exists()


def test_a_hidden_size_that_disagrees_with_the_tensors_is_named(tiny_nvfp4_modelopt, tmp_path):
    """Found as: a bad hidden_size read as "cannot load the checkpoint's tokenizer" (and, with a tokenizer, a
    shape error deep in the forward)."""
    ck = copy_of(tiny_nvfp4_modelopt, tmp_path / "ck")
    cfg = json.loads((ck / "config.json").read_text())
    cfg["text_config"]["hidden_size"] += 1
    (ck / "config.json").write_text(json.dumps(cfg))
    for cmd in (
        ["calibrate-kv", ck, *KV, "--replace-scales", "-o", tmp_path / "kv", "--dry-run"],
        ["eval", "kld", "--ref", ck, "--windows", "1", "--seq-len", "8", "--save-ref", tmp_path / "ref"],
    ):
        p = run_cli(cmd, timeout=TIMEOUT)
        assert p.returncode == 1, p.stderr
        assert "hidden_size does not match" in p.stderr and "Traceback" not in p.stderr, p.stderr
        assert "tokenizer" not in p.stderr


@pytest.mark.parametrize("how", ["fifo", "directory", "dev-zero", "symlink-loop", "missing", "truncated"])
def test_patch_config_copy_with_a_broken_shard_is_refused(how, tiny_nvfp4_modelopt, tmp_path):
    """Found as: `patch-config -o` on a checkpoint whose shard is a FIFO, a directory, /dev/zero or a
    symlink loop, or is missing or truncated, exited 0 with the shard absent from the output."""
    ck = copy_of(tiny_nvfp4_modelopt, tmp_path / "ck")
    shard = biggest_shard(ck)
    if how == "truncated":
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size - 100)
    else:
        shard.unlink()
        if how == "fifo":
            os.mkfifo(shard)
        elif how == "directory":
            shard.mkdir()
        elif how == "dev-zero":
            shard.symlink_to("/dev/zero")
        elif how == "symlink-loop":
            shard.symlink_to(shard.name)
    out = tmp_path / "out"
    p = run_qtool(["patch-config", ck, "--sampling-defaults", "-o", out], timeout=TIMEOUT)
    assert p.returncode == 1, p.stdout + p.stderr
    assert shard.name in p.stderr and "Traceback" not in p.stderr
    assert not out.exists()


# ---- secrets, hangs, tracebacks, leftovers -------------------------------------------------------------


def test_a_mistyped_flag_next_to_a_token_never_prints_the_token(tmp_path):
    """Found as: `qtool inspect hf:org/x --token hf_...` -> "unrecognized argument(s): --token (did you mean
    --json?), hf_..."."""
    secret = "hf_" + "Ab3" * 10
    for args in (
        ["inspect", "hf:org/x", "--token", secret],
        ["inspect", "hf:org/x", f"--token={secret}"],
        ["inspect", "hf:org/x", "--tokn", "s3cr3t-value"],
        ["inspect", "hf:org/x", "--json", "--token", secret],
        ["--token", "s3cr3t-value", "inspect", "hf:org/x"],
    ):  # (review) the flag before the command
        p = run_cli(args, timeout=TIMEOUT)
        assert p.returncode == 2, p.stderr
        assert secret not in p.stderr + p.stdout and "s3cr3t-value" not in p.stderr + p.stdout, p.stderr


@pytest.mark.parametrize("where", ["indexed", "unindexed"])
def test_a_fifo_named_like_a_shard_is_an_error_not_a_hang(where, tiny_nvfp4_modelopt, tmp_path):
    """Found as: a FIFO named like a shard hung inspect, verify, verify --deep, convert, assemble and
    calibrate-kv --dry-run."""
    ck = copy_of(tiny_nvfp4_modelopt, tmp_path / "ck")
    if where == "unindexed":
        (ck / "model.safetensors.index.json").unlink()
        for s in ck.glob("*.safetensors"):
            s.unlink()
        fifo = ck / "model.safetensors"
    else:
        fifo = biggest_shard(ck)
        fifo.unlink()
    os.mkfifo(fifo)
    for cmd in (
        ["inspect", ck],
        ["verify", ck, "--tp", "1"],
        ["verify", ck, "--deep", "--tp", "1"],
        ["convert", ck, "--to", "compressed-tensors", "-o", tmp_path / "c"],
        ["assemble", "hybrid", "--nvfp4", ck, "--bf16", ck, "-o", tmp_path / "a"],
        ["calibrate-kv", ck, *KV, "-o", tmp_path / "kv", "--dry-run"],
    ):
        p = run_qtool(cmd, timeout=TIMEOUT)
        assert p.returncode == (3 if cmd[0] == "verify" else 1), (cmd[0], p.stderr)
        assert "FIFO" in p.stdout + p.stderr and "Traceback" not in p.stderr, (cmd[0], p.stdout, p.stderr)


def test_report_with_fifos_is_an_error_not_a_hang(tiny_nvfp4_modelopt, tmp_path):
    """Found as: `report --kld FIFO` and `report -o FIFO.html` hung."""
    fifo = tmp_path / "k.json"
    os.mkfifo(fifo)
    p = run_qtool(
        ["report", tiny_nvfp4_modelopt, "--tp", "1", "--kld", fifo, "-o", tmp_path / "r.html"], timeout=TIMEOUT
    )
    assert p.returncode == 1 and "FIFO" in p.stderr, p.stderr
    out = tmp_path / "FIFO.html"
    os.mkfifo(out)
    p = run_qtool(["report", tiny_nvfp4_modelopt, "--tp", "1", "-o", out, "--force"], timeout=TIMEOUT)
    assert p.returncode == 1 and "FIFO" in p.stderr, p.stderr


@pytest.mark.slow
def test_a_kill_right_after_the_commit_rename_leaves_a_clean_output(tiny_nvfp4_modelopt, tmp_path):
    """Found as: kill -9 right after the commit rename left `.qtool-partial` inside the published OUT and
    the lock file; `--resume` then exited 1."""
    out = tmp_path / "out"
    args = ["convert", tiny_nvfp4_modelopt, "--to", "compressed-tensors", "-o", out, "--quiet"]
    ref = tmp_path / "ref"
    assert run_cli([*args[:-3], "-o", ref, "--quiet"], timeout=TIMEOUT).returncode == 0
    p = run_killed("os:rename", 1, args)
    assert p.returncode == -9
    assert out.is_dir() and not (tmp_path / "out.partial").exists()
    assert not (out / ".qtool-partial").exists()
    assert tree_sha(out) == tree_sha(ref)
    # the resume the user tries next is told the truth, and the stale lock file is no obstacle
    p = run_cli([*args, "--resume"], timeout=TIMEOUT)
    assert p.returncode == 1 and "already complete" in p.stderr, p.stderr
    p = run_cli([*args, "--force"], timeout=TIMEOUT)
    assert p.returncode == 0, p.stderr
    assert tree_sha(out) == tree_sha(ref) and not (out / ".qtool-partial").exists()
    assert not list(tmp_path.glob(".out.qtool-lock"))


@pytest.mark.slow
def test_a_kill_between_the_marker_removal_and_the_rename_is_cleaned_up(tiny_nvfp4_modelopt, tmp_path):
    out = tmp_path / "out"
    args = ["convert", tiny_nvfp4_modelopt, "--to", "compressed-tensors", "-o", out, "--quiet"]
    for extra in (["--resume"], []):
        p = run_killed("qtool.io.output:unmark", 1, args)
        assert p.returncode == -9
        assert not out.exists() and (tmp_path / "out.partial").is_dir()
        assert not (tmp_path / "out.partial" / ".qtool-partial").exists()
        p = run_cli([*args, *extra], timeout=TIMEOUT)
        assert p.returncode == 0, p.stderr
        assert not (tmp_path / "out.partial").exists()
        shutil.rmtree(out)


def test_killing_the_launcher_kills_its_ranks(tiny_bf16, tmp_path):
    """Found as: killing only the --nproc launcher left its ranks running, and they published."""
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "qtool",
        "quantize",
        str(tiny_bf16),
        "--recipe",
        "qwen35-nvfp4-experts",
        *KV,
        "-o",
        str(out),
        "--quiet",
        "--nproc",
        "2",
    ]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    ranks: list[int] = []
    while time.time() < deadline and len(ranks) < 2:
        ranks = [
            int(x)
            for x in subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()
        ]
        time.sleep(0.2)
    assert len(ranks) == 2
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.time() + 30
    while time.time() < deadline and any(os.path.exists(f"/proc/{r}") and _alive(r) for r in ranks):
        time.sleep(0.2)
    assert not any(os.path.exists(f"/proc/{r}") and _alive(r) for r in ranks)
    time.sleep(1)
    assert not out.exists()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def test_outputs_inside_a_hugging_face_cache_are_refused(tiny_nvfp4_modelopt, tmp_path):
    """Found as: `download -o` inside a Hugging Face cache snapshot was accepted (and, the review found,
    `patch-config -o` / `convert -o` wrote a fake snapshot there)."""
    snap = tmp_path / "hub" / "models--org--x" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    for cmd in (
        ["download", "hf:org/x"],
        ["patch-config", tiny_nvfp4_modelopt, "--sampling-defaults"],
        ["convert", tiny_nvfp4_modelopt, "--to", "compressed-tensors"],
    ):
        p = run_cli([*cmd, "-o", snap / "sub", "--json"], timeout=TIMEOUT)
        assert p.returncode == 2, p.stdout + p.stderr
        assert "Hugging Face cache" in json.loads(p.stdout)["message"]
        assert not (snap / "sub").exists()


def test_build_into_the_current_directory(tmp_path):
    """Found by the review: `build demo-tiny -o .` was a traceback (`PosixPath('.') has an empty name`)."""
    here = tmp_path / "here"
    here.mkdir()
    p = run_cli(["build", "demo-tiny", "-o", ".", "--quiet"], cwd=here, timeout=600)
    assert p.returncode == 0, p.stderr
    assert (here / "qtool-manifest.json").is_file() and (tmp_path / "here.build").is_dir()


def test_build_onto_a_foreign_directory_or_a_file_is_refused_before_any_step(tmp_path):
    """Found as: build --force onto a foreign directory, or -o an existing file, failed only after every
    step ran ("I/O error: Not a directory")."""
    d = tmp_path / "d"
    d.mkdir()
    (d / "mine.txt").write_text("mine")
    f = tmp_path / "file"
    f.write_text("mine")
    for out in (d, f):
        p = run_cli(["build", "demo-tiny", "-o", out, "--force", "--json"], timeout=TIMEOUT)
        assert p.returncode == 1, p.stdout + p.stderr
        assert not (tmp_path / (out.name + ".build")).exists()  # no step ran
    assert (d / "mine.txt").read_text() == "mine" and f.read_text() == "mine"


def test_interpreter_shutdown_is_quiet(tiny_nvfp4_modelopt):
    p = run_qtool(["inspect", tiny_nvfp4_modelopt], timeout=TIMEOUT)  # the interpreter's own end: a process
    assert p.returncode == 0 and "Traceback" not in p.stderr


def test_a_non_utf8_shard_name_and_a_shard_symlink_loop_are_named_errors(tiny_nvfp4_modelopt, tmp_path):
    """Found as: tracebacks in convert and assemble for a shard symlink loop and a non-UTF-8 shard name."""
    ck = copy_of(tiny_nvfp4_modelopt, tmp_path / "ck")
    (ck / "model.safetensors.index.json").unlink()
    shards = sorted(ck.glob("*.safetensors"))
    commands = (
        ["convert", ck, "--to", "compressed-tensors", "-o", tmp_path / "c"],
        ["assemble", "hybrid", "--nvfp4", ck, "--bf16", tiny_nvfp4_modelopt, "-o", tmp_path / "a"],
    )
    os.rename(bytes(shards[0]), bytes(shards[0].parent) + b"/m\xff.safetensors")
    for cmd in commands:
        p = run_cli(cmd, timeout=TIMEOUT)
        assert p.returncode == 1 and "not UTF-8" in p.stderr and "Traceback" not in p.stderr, p.stderr
    os.rename(bytes(shards[0].parent) + b"/m\xff.safetensors", bytes(shards[0]))
    shards[1].unlink()
    shards[1].symlink_to(shards[1].name)
    for cmd in commands:
        p = run_cli(cmd, timeout=TIMEOUT)
        assert p.returncode == 1 and "symlink loop" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "c").exists() and not (tmp_path / "a").exists()
    shutil.rmtree(ck)


def test_an_edited_published_build_shard_is_republished_and_the_cache_is_intact(tmp_path):
    """Found as: `qtool build` tracked published files by size and mtime only, and a published shard shared
    its inode with the step cache: an in-place edit with the mtime restored was "up to date" and had
    corrupted the cache too."""
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "build" / "demo-tiny.yaml"
    out = tmp_path / "out"
    assert run_cli(["build", recipe, "-o", out, "--quiet"], timeout=600).returncode == 0
    shard = biggest_shard(out)
    clean = sha(shard)
    cache = {p: sha(p) for p in (tmp_path / "out.build").rglob("*.safetensors")}
    assert all(os.stat(p).st_ino != shard.stat().st_ino for p in cache)  # its own inode (reflink or copy)
    with open(shard, "r+b") as f:  # in place, as an editor or a script does; the mtime put back
        st = os.fstat(f.fileno())
        f.seek(st.st_size // 2)
        b = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([b[0] ^ 1]))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert {p: sha(p) for p in cache} == cache  # the step cache is not the artifact
    p = run_cli(["build", recipe, "-o", out, "--json"], timeout=600)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["published"] is True
    assert sha(shard) == clean


@pytest.mark.slow
def test_a_build_paused_between_steps_while_another_runs_lets_only_one_publish(tmp_path):
    """Found as: a build paused between steps while another build of the same OUT ran: both exited 0."""
    from killpoint import start_paused

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "build" / "demo-tiny.yaml"
    out, marker = tmp_path / "out", tmp_path / "pause"
    first = start_paused("qtool.ops.pipeline.run:_mark", 1, marker, ["build", recipe, "-o", out, "--quiet"])
    try:
        deadline = time.time() + 180
        while not Path(str(marker) + ".paused").exists():
            assert first.poll() is None, first.communicate()
            assert time.time() < deadline
            time.sleep(0.2)
        p = run_cli(["build", recipe, "-o", out, "--quiet"], timeout=TIMEOUT)
        assert p.returncode == 1 and "another qtool run" in p.stderr, p.stderr
        assert not out.exists()
    finally:
        Path(str(marker) + ".go").touch()
    assert first.wait(timeout=300) == 0, first.communicate()
    assert (out / "qtool-manifest.json").is_file()


def test_a_ctrl_c_during_interpreter_shutdown_prints_no_traceback(tiny_nvfp4_modelopt):
    """Found as: a KeyboardInterrupt traceback from torch when Ctrl-C landed during interpreter shutdown
    (exit 0). The Ctrl-C is sent from the last exit handler to run, after the command finished."""
    code = (
        "import atexit, os, signal, sys, time\n"
        "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(0.5)))\n"
        f"sys.argv = ['qtool', 'inspect', {str(tiny_nvfp4_modelopt)!r}]\n"
        "import torch  # its own exit handlers, as in a quantize run\n"
        "from qtool.cli.main import console\n"
        "console()\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT)
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr and "KeyboardInterrupt" not in p.stderr, p.stderr


@pytest.mark.slow
def test_a_build_notices_a_same_size_edit_of_a_local_source(tiny_nvfp4_modelopt, tiny_bf16, tmp_path):
    """Found by the review: a build from local sources said "up to date" after a same-size edit of a source
    shard with its mtime put back (the source's identity was sizes and mtimes), and its step cache, hard
    links of the source, then published the edited bytes under the old sha256."""
    src = copy_of(tiny_nvfp4_modelopt, tmp_path / "src")
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "build" / "demo-tiny.yaml"
    args = ["build", recipe, "--source", f"nvfp4={src}", "--source", f"bf16={tiny_bf16}", "--json"]
    out = tmp_path / "out"
    p = run_cli([*args, "-o", out], timeout=600)
    assert p.returncode == 0, p.stderr
    p = run_cli([*args, "-o", out], timeout=600)
    assert json.loads(p.stdout)["ran"] == []  # unchanged: nothing runs
    shard = biggest_shard(src)
    same_size_edit(shard, shard.stat().st_size // 2)
    p = run_cli([*args, "-o", out], timeout=600)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["ran"], "the edited source was taken as unchanged"
    p = run_cli(["verify", out, "--deep", "--tp", "1", "--json"], timeout=TIMEOUT)
    assert "hash-mismatch" not in p.stdout  # the published files are the ones the manifest names


@pytest.mark.parametrize("how", ["fifo", "dangling-symlink"])
@pytest.mark.parametrize("name", ["tokenizer.json", "chat_template.jinja"])
def test_a_side_file_that_is_not_a_regular_file_is_named_not_left_out(
    how, name, tiny_nvfp4_modelopt, tiny_bf16, tmp_path
):
    """Found by the review: a FIFO or a dangling symlink at tokenizer.json / chat_template.jinja was
    silently left out of convert's and patch-config -o's output (exit 0)."""
    ck = copy_of(tiny_nvfp4_modelopt, tmp_path / "ck")
    bf = copy_of(tiny_bf16, tmp_path / "bf")
    for d in (ck, bf):
        (d / name).unlink(missing_ok=True)
        if how == "fifo":
            os.mkfifo(d / name)
        else:
            (d / name).symlink_to(d / "gone")
    for cmd in (
        ["convert", ck, "--to", "compressed-tensors"],
        ["patch-config", ck, "--fix", "router-ignore"],
        ["calibrate-kv", ck, *KV, "--replace-scales"],
        ["quantize", bf, "--recipe", "qwen35-nvfp4-experts", *KV],
    ):
        out = tmp_path / "out"
        p = run_cli([*cmd, "-o", out, "--quiet"], timeout=TIMEOUT)
        assert p.returncode == 1, (cmd[0], p.stdout, p.stderr)
        assert name in p.stderr and "Traceback" not in p.stderr, p.stderr
        # (calibrate-kv and quantize load the tokenizer first: that error names the file to restore)
        assert "not a regular file" in p.stderr or "cannot load the checkpoint's tokenizer" in p.stderr, p.stderr
        assert not out.exists()
        shutil.rmtree(tmp_path / "out.partial", ignore_errors=True)
