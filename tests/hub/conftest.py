from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fake_hub import make_repo_dir  # noqa: E402


@pytest.fixture
def repo_dir(tmp_path) -> Path:
    return make_repo_dir(tmp_path / "src")
