from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fake_hub import FakeHub, make_repo_dir, point_hf_at  # noqa: E402


@pytest.fixture
def hub(monkeypatch, tmp_path):
    with FakeHub(page_size=3) as h:
        point_hf_at(monkeypatch, h, tmp_path)
        yield h


@pytest.fixture
def repo_dir(tmp_path) -> Path:
    return make_repo_dir(tmp_path / "src")
