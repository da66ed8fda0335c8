"""The README's 397B walkthrough (docs/_walkthrough.md) runs as written: every `qtool` line of its code
blocks, against real-scale sparse stand-ins of the 397B (real headers, configs and tokenizer; holes for the
data) served by the fake Hub under their real names, with the fake Hub's stand-in of the dataset the
README names. Writing jobs run as `--dry-run` (they need the real bytes, and some a GPU); the rest run
as written.

Found as: step 3 failed twice as written ("already has 30 KV-scale tensor(s)", then "the dataset gives
5804 tokens, 32768 needed"), and the multi-GPU examples the same way."""

from __future__ import annotations

import hashlib
import re
import shlex
from pathlib import Path

import pytest
from fake_hub import chat_dataset_files
from in_process import run_cli

from qtool.io.manifest import write_manifest
from qtool.io.output import MANIFEST_NAME

ROOT = Path(__file__).resolve().parents[2]
WRITERS = {"download", "assemble", "calibrate-kv", "quantize", "eval", "sensitivity"}  # run as --dry-run


def walkthrough_commands() -> list[str]:
    """The `qtool ...` command lines of the walkthrough's code blocks (continuations joined, comments cut)."""
    text = (ROOT / "docs" / "_walkthrough.md").read_text()
    out = []
    for block in re.findall(r"```\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #", 1)[0].strip()
            if line.startswith("qtool "):
                out.append(line)
    return out


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> dict[str, Path]:
    from qtool.fixtures.sparse import build_sparse

    d = tmp_path_factory.mktemp("walk")
    nvfp4 = build_sparse(d / "nvfp4", model="397b", flavour="modelopt-nvfp4")
    bf16 = build_sparse(d / "bf16", model="397b", flavour="bf16-fused")
    # the hybrid after step 2 (the NVFP4 export's shared experts are BF16 already, as the splice leaves them)
    hybrid = build_sparse(d / "hybrid", model="397b", flavour="modelopt-nvfp4")
    record_as_calibrate_kv_output(hybrid)
    # what step 7 writes (its dry run writes nothing): the pair's units from the headers, stand-in effects
    from sensitivity_stand_in import write_stand_in_table

    write_stand_in_table(bf16, nvfp4, d / "sens")
    return {"nvfp4": nvfp4, "bf16": bf16, "hybrid": hybrid, "sens": d / "sens", "root": d}


def record_as_calibrate_kv_output(checkpoint: Path) -> None:
    """The walkthrough's /models/hybrid-kv is what step 3's calibrate-kv wrote: a qtool output whose manifest
    records every file's sha256, which step 4's in-place patch-config takes for the files it keeps. The
    stand-in's digests are declared, as the fake Hub declares its sparse files' (sha256 of the first MiB and
    the size): hashing the 234 GB of holes would take minutes, and nothing here checks the bytes."""
    files = {}
    for f in sorted(p for p in checkpoint.iterdir() if p.is_file()):
        size = f.stat().st_size
        with open(f, "rb") as fh:
            declared = hashlib.sha256(fh.read(1 << 20) + str(size).encode()).hexdigest()
        files[f.name] = {"sha256": declared, "bytes": size}
    command = "qtool calibrate-kv /models/hybrid -o /models/hybrid-kv --replace-scales"
    write_manifest(
        checkpoint / MANIFEST_NAME,
        kind="calibrate-kv",
        command=command,
        sources={},
        summary={},
        checks={},
        files=files,
    )


def test_the_walkthrough_has_its_steps():
    cmds = walkthrough_commands()
    verbs = [shlex.split(c)[1] for c in cmds]
    assert {
        "download",
        "assemble",
        "calibrate-kv",
        "patch-config",
        "verify",
        "serve-config",
        "report",
        "quantize",
        "eval",
        "sensitivity",
        "plan",
    } <= set(verbs), verbs


@pytest.mark.slow
def test_the_walkthrough_runs_as_written(hub, stand_ins, tmp_path):
    hub.add_sparse_dir("nvidia/Qwen3.5-397B-A17B-NVFP4", stand_ins["nvfp4"])
    hub.add_sparse_dir("Qwen/Qwen3.5-397B-A17B", stand_ins["bf16"])
    # enough text for the walkthrough's largest calibration (64 x 4096 tokens)
    hub.add_dataset("HuggingFaceH4/ultrachat_200k", chat_dataset_files(1200, words=240))
    paths = {
        "/models/nvfp4": stand_ins["nvfp4"],
        "/models/bf16-parts": stand_ins["bf16"],
        "/models/bf16": stand_ins["bf16"],
        "/models/hybrid-kv": stand_ins["hybrid"],
        "/models/hybrid": stand_ins["hybrid"],
        "/models/awq": tmp_path / "awq",
        "hybrid-vs-nvidia.html": tmp_path / "report.html",
        "CKPT": stand_ins["bf16"],
        "OUT": tmp_path / "out",
        "/models/sens": stand_ins["sens"],
        "planned.yaml": tmp_path / "planned.yaml",
    }
    ran = set()  # the command lines run, as run (writers as --dry-run)
    for line in walkthrough_commands():
        args = shlex.split(line)[1:]
        args = [str(paths.get(a, a)) for a in args]
        if args[0] in WRITERS and "--dry-run" not in args:
            args.append("--dry-run")
        if tuple(args) in ran:  # step 2's `assemble --dry-run`, then `assemble` (here --dry-run too): once
            continue
        ran.add(tuple(args))
        if args[0] == "download":  # its -o would be the stand-in itself: a fresh directory instead
            args[args.index("-o") + 1] = str(tmp_path / f"dl-{len(list(tmp_path.iterdir()))}")
        elif args[0] in WRITERS and args[0] != "eval" and "-o" in args:
            args[args.index("-o") + 1] = str(tmp_path / f"o-{len(list(tmp_path.iterdir()))}")
        p = run_cli(args)
        assert p.returncode == 0, (line, p.stdout[-3000:], p.stderr[-3000:])
    assert (tmp_path / "report.html").stat().st_size > 10_000
