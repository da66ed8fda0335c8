"""The README is what users run first: its two set-up commands and its generated sections must be current."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_is_generated_from_docs(tmp_path):
    before = (ROOT / "README.md").read_text()
    subprocess.run(["bash", str(ROOT / "scripts/make-readme.sh")], check=True, cwd=ROOT)
    assert (ROOT / "README.md").read_text() == before, "run scripts/make-readme.sh and commit README.md"


def test_readme_has_exactly_the_two_setup_commands_and_ci_runs_the_test_one():
    text = (ROOT / "README.md").read_text()
    setup = text.split("## Set-up: two commands", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```\n(.*?)\n```", setup, flags=re.S)
    assert len(commands) == 2
    demo, tests = commands
    assert "qtool build recipes/build/demo-tiny.yaml" in demo and demo.startswith("bash scripts/install.sh")
    assert tests == "bash scripts/install.sh && .venv/bin/python -m pytest -q"
    ci = (ROOT / ".ci/run").read_text()
    assert "bash scripts/install.sh" in ci and ".venv/bin/python -m pytest -q" in ci
    assert (ROOT / "recipes/build/demo-tiny.yaml").exists()
