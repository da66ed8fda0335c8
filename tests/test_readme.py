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
    assert "qtool build demo-tiny" in demo and demo.startswith("bash scripts/install.sh")
    # the whole suite, spread over the machine's cores by pytest-xdist (its [test] extra)
    assert tests == "bash scripts/install.sh && .venv/bin/python -m pytest -q -n auto"
    # CI runs a newcomer's run: these two commands as the README writes them
    assert "bash scripts/newcomer.sh" in (ROOT / ".ci/run").read_text()
    printed = subprocess.run(
        ["bash", str(ROOT / "scripts/newcomer.sh"), "--print"], capture_output=True, text=True, check=True
    ).stdout
    assert printed.splitlines() == [demo, tests]
    assert (ROOT / "qtool/data/recipes/build/demo-tiny.yaml").exists() and (
        ROOT / "recipes/build/demo-tiny.yaml"
    ).exists()


def test_the_readme_demo_runs_and_verifies_as_the_readme_runs_it(tmp_path):
    """Found as: the README's demo built an artifact that the README's own `qtool verify demo-out` failed."""
    import sys

    text = (ROOT / "README.md").read_text()
    demo = re.findall(r"```\n(.*?)\n```", text.split("## Set-up: two commands", 1)[1], flags=re.S)[0]
    steps = [c.strip() for c in demo.split("&&")][1:]  # after install.sh: the qtool commands
    assert steps and all(c.startswith(".venv/bin/qtool ") for c in steps)
    for c in steps:
        argv = c.split()[1:]
        p = subprocess.run([sys.executable, "-m", "qtool", *argv], cwd=tmp_path, capture_output=True, text=True)
        assert p.returncode == 0, (c, p.stdout[-2000:], p.stderr[-2000:])
    assert "ok" in p.stdout.splitlines()[-1]
