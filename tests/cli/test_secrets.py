"""A Hub token never leaves the process: not the value of a --token spelled any way a user may type it
(case, `_`, abbreviations, near misses), not an `hf_`-shaped string in a path. Each test runs the command
as the user did and greps stdout, stderr and every file written for the secret (issue 52, item 2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from qtool.cli.main import main
from qtool.redact import command_line

VALUE = "s3cretValue42"  # not hf_-shaped: only knowing it came after a token flag hides it
PATH_TOKEN = "hf_AbCdEfGh12345678"
SPELLINGS = ["--TOKEN", "--Token", "--hf_token", "--HF-TOKEN", "--tok", "--hf-tok", "--tokne", "--hf-tokn"]


def _everything_written(root: Path) -> str:
    return "".join(p.read_bytes().decode("utf-8", "replace") for p in sorted(root.rglob("*")) if p.is_file())


@pytest.mark.parametrize("form", ["separate", "equals"])
@pytest.mark.parametrize("flag", SPELLINGS)
@pytest.mark.parametrize("json_out", [False, True], ids=["text", "json"])
def test_a_mistyped_token_flag_never_echoes_its_value(tiny_nvfp4_modelopt, flag, form, json_out, capsys):
    given = [flag, VALUE] if form == "separate" else [f"{flag}={VALUE}"]
    argv = ["verify", str(tiny_nvfp4_modelopt), *given, *(["--json"] if json_out else [])]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert VALUE not in out + err and "***" in out + err


@pytest.mark.parametrize("flag", SPELLINGS + ["--token", "--hf-token"])
def test_a_recorded_command_line_hides_every_token_spelling(flag):
    for argv in (["qtool", "build", "r.yaml", flag, VALUE], ["qtool", "build", "r.yaml", f"{flag}={VALUE}"]):
        line = command_line(argv)
        assert VALUE not in line and "***" in line


def test_qtools_own_flags_near_token_are_not_taken_for_it():
    from qtool.cli.main import _option_strings, build_parser
    from qtool.redact import learn_from_argv

    learn_from_argv([], set().union(*(_option_strings(build_parser(c)) for c in ("convert", "eval", "sensitivity"))))
    line = command_line(["qtool", "x", "--to", "fp8", "--tokenizer", "tok/dir", "--topk", "8", "--batch-tokens", "9"])
    assert "***" not in line


def test_a_token_in_a_path_is_in_no_message_and_no_file(tiny_nvfp4_modelopt, tmp_path, capsys):
    home = tmp_path / PATH_TOKEN
    home.mkdir()
    ck = home / "ck"
    shutil.copytree(tiny_nvfp4_modelopt, ck)
    out = home / "out"
    assert main(["patch-config", str(ck), "--fix", "router-ignore", "-o", str(out)]) == 0
    assert main(["verify", str(out), "--tp", "2"]) in (0, 3)
    assert main(["verify", str(out), "--tp", "2", "--json"]) in (0, 3)
    assert main(["verify", str(home / "missing")]) == 1  # an error's `file:` line
    assert main(["verify", str(home / "missing"), "--json"]) == 1
    printed = "".join(capsys.readouterr())
    assert PATH_TOKEN not in printed and "***" in printed
    manifest = json.loads((out / "qtool-manifest.json").read_text())
    assert manifest["sources"], manifest
    assert PATH_TOKEN not in _everything_written(out)
