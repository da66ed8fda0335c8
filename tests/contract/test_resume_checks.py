"""Issue 52: what `--resume` keeps is checked, reproduced the way it was found. A finished shard left in
OUT.partial whose bytes changed since it was written (same size) is written again; `sensitivity --resume`
after a same-size edit of an input (mtime put back) refuses as assemble and calibrate-kv do; its table is
the same bytes from every run; its numeric and device flags are checked before any work."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from in_process import run_cli
from killpoint import run_killed
from test_no_data_loss import same_size_edit, sha
from test_output_contract import copy_of, tree_sha

from qtool.io.checkpoint import Checkpoint
from qtool.io.identity import JOURNAL_NAME, SAMPLE_BLOCK, SAMPLE_BLOCKS

TIMEOUT = 300
SENS = ["--samples", "4", "--seq-len", "32", "--batch-tokens", "64"]


def journaled(partial: Path) -> list[dict]:
    return [json.loads(line) for line in (partial / JOURNAL_NAME).read_text().splitlines()[1:]]


def test_a_kept_shard_whose_bytes_changed_is_written_again(tiny_nvfp4_modelopt, tiny_bf16, tmp_path):
    """Found as: killed after a rebuilt shard was journaled, 256 bytes of it changed in OUT.partial (same
    size); --resume kept it by its size, exit 0, and `verify --deep` said ok (the manifest was computed over
    the damaged file)."""
    src = copy_of(tiny_nvfp4_modelopt, tmp_path / "src")
    args = ["assemble", "hybrid", "--nvfp4", src, "--bf16", tiny_bf16]
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert run_cli([*args, "-o", ref, "--quiet"], timeout=TIMEOUT).returncode == 0
    p = run_killed("qtool.io.identity:Journal.record", 6, [*args, "-o", out, "--quiet"])
    assert p.returncode == -9, p.stderr
    partial = tmp_path / "out.partial"
    written = [r["unit"] for r in journaled(partial) if (partial / r["unit"]).stat().st_nlink == 1]
    assert written, journaled(partial)  # a shard qtool wrote (not a link to an input)
    shard = partial / written[0]
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 256] = bytes(b ^ 0xFF for b in data[middle : middle + 256])
    shard.write_bytes(bytes(data))
    p = run_cli([*args, "-o", out, "--resume"], timeout=TIMEOUT)  # (not --quiet: the notice is for the user)
    assert p.returncode == 0, p.stderr
    assert written[0] in p.stderr and "written again" in p.stderr  # the user is told which and why
    assert tree_sha(out) == tree_sha(ref)
    p = run_cli(["verify", out, "--deep", "--tp", "1"], timeout=TIMEOUT)
    assert p.returncode == 0, p.stdout + p.stderr


# ---- sensitivity ------------------------------------------------------------------------------------------


def unsampled_byte(ck: Checkpoint, tag: str) -> tuple[Path, int]:
    """A file and a byte of a tensor named with `tag` there that the journal's identity sample
    (qtool.io.identity) does not read."""
    for info in sorted((i for n, i in ck.tensors.items() if tag in n), key=lambda i: (i.file, i.start)):
        f = Path(info.file)
        size = f.stat().st_size
        with open(f, "rb") as fh:
            head = 8 + int.from_bytes(fh.read(8), "little")
        step = max(SAMPLE_BLOCK, (size - head) // SAMPLE_BLOCKS)
        sampled = [(0, head), (size - SAMPLE_BLOCK, size)] + [(o, o + SAMPLE_BLOCK) for o in range(head, size, step)]
        for o in range(info.start, info.end):
            if not any(a <= o < b for a, b in sampled):
                return f, o
    raise AssertionError(f"every byte of the {tag} tensors is sampled")


@pytest.mark.slow
def test_sensitivity_resume_refuses_an_input_edited_with_its_mtime_put_back(tiny_bf16, tiny_nvfp4_ct, tmp_path):
    """Found as: `sensitivity --resume` after a kill and a same-size edit of a layer-0 weight (mtime put
    back) returned the old input's table (layer 0 effect 6.9e-05; a fresh run on the edited input: 1.0):
    its journal was keyed by the sampled identity and its manifest hashed nothing."""
    bf = copy_of(tiny_bf16, tmp_path / "bf")
    args = ["sensitivity", bf, tiny_nvfp4_ct, *SENS, "--quiet"]
    out = tmp_path / "out"
    killed = run_killed("qtool.io.jsonio:write_json", 4, [*args, "-o", out])  # layers 0-2 journaled
    assert killed.returncode == -9, killed.stderr
    f, offset = unsampled_byte(Checkpoint.open(bf), ".layers.0.mlp.experts.")
    same_size_edit(f, offset)  # unseen by the journal's identity check
    p = run_cli([*args, "-o", out, "--resume", "--json"], timeout=TIMEOUT)
    assert p.returncode == 1, p.stdout + p.stderr
    err = json.loads(p.stdout)
    assert "changed since the interrupted run" in err["message"]
    assert f.name in json.dumps(err)  # the error names the edited file
    assert not out.exists()


@pytest.mark.slow
def test_sensitivity_tables_are_the_same_bytes_from_every_run(tiny_bf16, tiny_nvfp4_ct, tmp_path):
    """Found as: sensitivity.json embedded the wall-clock timing, so two uninterrupted runs differed and a
    resumed run could not give the same bytes; the timing is the manifest's run section now."""
    args = ["sensitivity", tiny_bf16, tiny_nvfp4_ct, *SENS, "--quiet"]
    one, two, out = tmp_path / "one", tmp_path / "two", tmp_path / "out"
    for d in (one, two):
        assert run_cli([*args, "-o", d], timeout=TIMEOUT).returncode == 0
    assert (one / "sensitivity.json").read_bytes() == (two / "sensitivity.json").read_bytes()
    assert run_killed("qtool.io.jsonio:write_json", 4, [*args, "-o", out]).returncode == -9
    p = run_cli([*args, "-o", out, "--resume"], timeout=TIMEOUT)
    assert p.returncode == 0, p.stderr
    assert (out / "sensitivity.json").read_bytes() == (one / "sensitivity.json").read_bytes()
    manifest = json.loads((out / "qtool-manifest.json").read_text())
    assert manifest["run"]["timing"]["resumed_from_layer"] == 3
    assert manifest["files"]["sensitivity.json"]["sha256"] == sha(out / "sensitivity.json")
    # the checkpoints' digests, as every command's manifest records its inputs'
    bf_files = manifest["sources"]["bf16"]["files"]
    assert bf_files and all(e["sha256"] == sha(Path(tiny_bf16) / rel) for rel, e in bf_files.items())


@pytest.mark.parametrize("value", ["0", "-5"])
def test_sensitivity_batch_tokens_below_one_is_a_usage_error(value, tiny_bf16, tiny_nvfp4_ct, tmp_path, capsys):
    """Found as: `sensitivity --batch-tokens 0` and `-5` ran."""
    from qtool.cli.main import main

    rc = main(
        [
            "sensitivity",
            str(tiny_bf16),
            str(tiny_nvfp4_ct),
            "-o",
            str(tmp_path / "out"),
            f"--batch-tokens={value}",
            "--json",
        ]
    )
    assert rc == 2
    err = json.loads(capsys.readouterr().out)
    assert "--batch-tokens" in err["message"]
    assert not os.path.lexists(tmp_path / "out") and not os.path.lexists(tmp_path / "out.partial")


def test_sensitivity_dry_run_checks_the_cuda_device(tiny_bf16, tiny_nvfp4_ct, tmp_path, capsys, monkeypatch):
    """Found as: `sensitivity --device cuda:99 --dry-run` passed on a machine without CUDA."""
    import torch

    from qtool.cli.main import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # one GPU: cuda:0 only
    rc = main(
        [
            "sensitivity",
            str(tiny_bf16),
            str(tiny_nvfp4_ct),
            "-o",
            str(tmp_path / "out"),
            "--device",
            "cuda:99",
            "--dry-run",
            "--json",
        ]
    )
    assert rc == 2
    err = json.loads(capsys.readouterr().out)
    assert "cuda:99" in err["message"] and "1 CUDA device" in err["message"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    for device in ("cuda", "cuda:0"):
        # a machine without CUDA runs nothing there: a usage error at once
        rc = main(
            [
                "sensitivity",
                str(tiny_bf16),
                str(tiny_nvfp4_ct),
                "-o",
                str(tmp_path / "out"),
                "--device",
                device,
                "--json",
            ]
        )
        assert rc == 2
        assert "no CUDA device" in json.loads(capsys.readouterr().out)["message"]
        # but it may plan a GPU job for another machine (the README's walkthrough does): said, not refused
        rc = main(
            [
                "sensitivity",
                str(tiny_bf16),
                str(tiny_nvfp4_ct),
                "-o",
                str(tmp_path / "out"),
                "--device",
                device,
                "--dry-run",
                "--json",
            ]
        )
        said = capsys.readouterr()
        assert rc == 0 and "this machine has no CUDA device" in said.err
    assert not os.path.lexists(tmp_path / "out")
