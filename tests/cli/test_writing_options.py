"""Every option of the CLI that names a path to write is run against the output contract's three refusals
(issue 25): an output inside its input, a user's existing file or directory (even with --force), and a FIFO
at that name (refused at once, never a hang). The table is checked against the parser, so a new writing
option (or command) fails here until it is added, and with it these cases."""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import stat
from pathlib import Path

import pytest
from killpoint import run_qtool

ROOT = Path(__file__).resolve().parents[2]
KV = ["--samples", "2", "--seq-len", "16"]
DIR, FILE = "directory", "file"

# (command, option) -> (what it writes, argv before the option's value given the inputs, the input it reads)
WRITERS = {
    ("patch-config", "-o"): (DIR, lambda i: ["patch-config", i["ck"], "--sampling-defaults"], "ck"),
    ("assemble hybrid", "-o"): (DIR, lambda i: ["assemble", "hybrid", "--nvfp4", i["ck"], "--bf16", i["bf"]], "ck"),
    ("calibrate-kv", "-o"): (DIR, lambda i: ["calibrate-kv", i["ck"], *KV, "--replace-scales"], "ck"),
    ("quantize", "-o"): (DIR, lambda i: ["quantize", i["bf"], "--recipe", "qwen35-nvfp4-experts", *KV], "bf"),
    ("convert", "-o"): (DIR, lambda i: ["convert", i["ck"], "--to", "compressed-tensors"], "ck"),
    ("download", "-o"): (DIR, lambda i: ["download", "hf:org/x"], "hub_cache"),
    ("build", "-o"): (
        DIR,
        lambda i: [
            "build",
            ROOT / "recipes" / "build" / "demo-tiny.yaml",
            "--source",
            f"nvfp4={i['ck']}",
            "--source",
            f"bf16={i['bf']}",
        ],
        "ck",
    ),
    ("report", "-o"): (FILE, lambda i: ["report", i["ck"], "--tp", "1"], "ck"),
    ("eval kld", "--save-ref"): (
        DIR,
        lambda i: ["eval", "kld", "--ref", i["ck"], "--windows", "1", "--seq-len", "8"],
        "ck",
    ),
    ("sensitivity", "-o"): (DIR, lambda i: ["sensitivity", i["bf"], i["ck"], *KV], "ck"),
    # (the checkpoints are the ones the table names: -o inside them is refused without --quantized)
    ("plan hybrid", "-o"): (FILE, lambda i: ["plan", "hybrid", "--sensitivity", _table(i), "--tp", "1"], "ck"),
    ("eval kld", "--emit-windows"): (
        FILE,
        lambda i: ["eval", "kld", "--ref", i["ck"], "--windows", "1", "--seq-len", "8"],
        "ck",
    ),
}
# options whose help says "write" but that name no path to write
NOT_OUTPUTS = {("download", "--tensors"), ("plan hybrid", "--formats")}
SUFFIX = {"report": ".html", "eval kld": ".jsonl", "plan hybrid": ".yaml"}


def _table(i: dict) -> Path:
    """A real sensitivity table of the inputs (plan hybrid must refuse its -o before reading it)."""
    from qtool.cli.main import main

    out = i["ck"].parent / "sens"
    if not out.exists():
        assert main(["sensitivity", str(i["bf"]), str(i["ck"]), "-o", str(out), *KV, "--quiet"]) == 0
    return out


def _parsers():
    from qtool.cli.main import COMMANDS, build_parser

    for name in COMMANDS:
        top = build_parser(name)
        stack = [(name, next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices[name])]
        while stack:
            cmd, p = stack.pop()
            subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
            for s in subs:
                stack += [(f"{cmd} {k}", v) for k, v in s.choices.items()]
            if not subs:
                yield cmd, p


def test_every_writing_option_is_covered():
    found = set()
    for cmd, p in _parsers():
        for a in p._actions:
            if not a.option_strings or a.nargs == 0:
                continue
            if a.dest == "output" or "write" in (a.help or "").lower():
                found.add((cmd, a.option_strings[0]))
    assert found - NOT_OUTPUTS == set(WRITERS)


def tree(d: Path) -> dict[str, str]:
    return {
        p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def inputs(hub, tiny_nvfp4_modelopt, tiny_bf16, tmp_path):
    from fake_hub import make_repo_dir

    hub.add_dir("org/x", make_repo_dir(tmp_path / "repo"))
    ck = tmp_path / "ck"
    shutil.copytree(tiny_nvfp4_modelopt, ck)
    bf = tmp_path / "bf"
    shutil.copytree(tiny_bf16, bf)
    cache = Path(os.environ["HF_HUB_CACHE"]) / "models--org--x"
    cache.mkdir(parents=True)
    return {"ck": ck, "bf": bf, "hub_cache": cache}


@pytest.mark.parametrize("case", ["inside-the-input", "a-users-own", "a-fifo"])
@pytest.mark.parametrize("writer", sorted(WRITERS), ids=lambda w: f"{w[0]} {w[1]}")
def test_writing_option_refuses(writer, case, inputs, tmp_path):
    kind, argv, source = WRITERS[writer]
    cmd, option = writer
    name = "out" + SUFFIX.get(cmd, "") if kind is FILE else "out"
    src = inputs[source]
    if case == "inside-the-input":
        out = src / name
    else:
        out = tmp_path / "place" / name
        out.parent.mkdir()
        if case == "a-fifo":
            os.mkfifo(out)
        elif kind is FILE:
            out.write_text("my own notes\n")
        else:
            out.mkdir()
            (out / "notes.txt").write_text("my own notes\n")
    # (the Hub cache is huggingface_hub's to fill: a download's listing adds its refs there)
    before = {k: tree(inputs[k]) for k in ("ck", "bf")}
    mine = tree(out) if out.is_dir() else None
    p = run_qtool([*argv(inputs), option, out, "--force", "--quiet"], timeout=180)
    assert p.returncode in (1, 2), (p.returncode, p.stdout[-1500:], p.stderr[-1500:])
    assert "Traceback" not in p.stderr, p.stderr
    assert {k: tree(inputs[k]) for k in ("ck", "bf")} == before  # the inputs are untouched
    if case == "inside-the-input":
        assert not os.path.lexists(out)
    elif case == "a-fifo":
        assert stat.S_ISFIFO(os.lstat(out).st_mode)
    elif kind is FILE:
        assert out.read_text() == "my own notes\n"
    else:
        assert tree(out) == mine
    assert not any(p.name.endswith(".partial") for p in out.parent.iterdir())
