"""Session-wide test setup: the tiny Qwen3.5-MoE fixture checkpoints and marker auto-skips.

Fixtures (built once per session under a pytest temp dir, on first use, by qtool.fixtures.tiny):
  tiny_bf16                  BF16, routed experts per expert, with the mtp.* head
  tiny_bf16_fused            BF16, fused experts (gate_up_proj / down_proj), with mtp.*
  tiny_nvfp4_modelopt        ModelOpt NVFP4 (routed experts) + FP8 KV scales, mtp.* grafted
  tiny_nvfp4_modelopt_nomtp  the same export without mtp.*
  tiny_nvfp4_ct              compressed-tensors NVFP4 (llm-compressor), no KV scales, mtp.* carried
Treat them as read-only: copy before modifying (shutil.copytree).

Markers: `gpu` tests are skipped without CUDA; `engines` tests are skipped unless QTOOL_ENGINES_PYTHON
names the Python of a venv with vLLM/SGLang; `slow` (over 5 s) is left out of the fast tier (`-m "not slow"`).
Under pytest-xdist (`-n auto`) the tests are spread over the workers by `--dist loadgroup` (set here).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/fake_hub.py, tests/killpoint.py


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A fake Hugging Face Hub on 127.0.0.1 (tests/fake_hub.py) that huggingface_hub and datasets talk to."""
    from fake_hub import FakeHub, point_hf_at

    with FakeHub(page_size=3) as h:
        point_hf_at(monkeypatch, h, tmp_path)
        yield h


def pytest_configure(config: pytest.Config) -> None:
    # `-n N` (pytest-xdist) alone hands out tests one by one; the `xdist_group` marks (the tests that measure
    # a process's reads or memory, run one after another on one worker) hold only under --dist loadgroup
    if getattr(config.option, "dist", "no") == "load":
        config.option.dist = "loadgroup"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [i for i in items if i.get_closest_marker("gpu") is not None]
    if gpu_items:
        try:
            import torch

            has_cuda = torch.cuda.is_available()
        except ImportError:
            has_cuda = False
        if not has_cuda:
            skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
            for item in gpu_items:
                item.add_marker(skip)
    if not os.environ.get("QTOOL_ENGINES_PYTHON"):
        skip = pytest.mark.skip(reason="needs QTOOL_ENGINES_PYTHON (the vLLM/SGLang oracle venv's python)")
        for item in items:
            if item.get_closest_marker("engines") is not None:
                item.add_marker(skip)
    items[:] = _slow_modules_first(items)


def _slow_modules_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """The modules that hold a `slow` test first, each module's tests together and in their order (a module
    fixture is still built once per worker). pytest-xdist hands the tests out in this order: the minutes-long
    tests then start while the other workers still have work, rather than one of them running alone at the
    end of the run while the other cores wait."""
    slow = {item.nodeid.split("::", 1)[0] for item in items if item.get_closest_marker("slow") is not None}
    return sorted(items, key=lambda item: item.nodeid.split("::", 1)[0] not in slow)


_CACHE = None


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory, worker_id: str):
    """The session's qtool.fixtures.tiny.FixtureCache (builds each fixture on first use). Under pytest-xdist
    each worker has its own (see qtool_cache_of_the_worker: one worker's hard links into a shared fixture
    would move its ctime under another's running job)."""
    global _CACHE
    from qtool.fixtures.tiny import FixtureCache

    _CACHE = FixtureCache(tmp_path_factory.mktemp("tiny"))
    return _CACHE


@pytest.fixture(scope="session", autouse=True)
def qtool_cache_of_the_worker(tmp_path_factory: pytest.TempPathFactory, worker_id: str):
    """Under pytest-xdist each worker has qtool's cache folder (the builtin fixtures, digests) to itself, as
    it has its own tiny fixtures (tiny_cache). Shared, one worker's hard links into a fixture (assemble,
    build) move the files' ctime while another worker's job reads them, and that job then rightly refuses
    an input that changed under it."""
    if worker_id == "master":
        yield
        return
    before = os.environ.get("QTOOL_CACHE_DIR")
    os.environ["QTOOL_CACHE_DIR"] = str(tmp_path_factory.mktemp("qtool-cache"))
    yield
    if before is None:
        os.environ.pop("QTOOL_CACHE_DIR", None)
    else:
        os.environ["QTOOL_CACHE_DIR"] = before


@pytest.fixture(scope="session")
def worker_id(request: pytest.FixtureRequest) -> str:
    """pytest-xdist's worker name (gw0, gw1, ...), or "master" without it (xdist's own fixture of that name
    overrides this one when it is installed)."""
    return getattr(request.config, "workerinput", {}).get("workerid", "master")


@pytest.fixture(scope="session")
def tiny_bf16(tiny_cache) -> Path:
    return tiny_cache.path("bf16")


@pytest.fixture(scope="module")
def calib_ids(tiny_bf16):
    """The tiny model's calibration windows: the ones build_nvfp4_modelopt calibrated on (the quantize
    tests' default; a module's own tensors, as each of them had)."""
    from qtool.fixtures.tiny import _calib_ids

    return _calib_ids(tiny_bf16, None)


@pytest.fixture
def inputs_hashed(monkeypatch) -> list[str]:
    """The input files the job reads to hash them (qtool.io.manifest's pool) or hashes from its own reads
    (qtool.io.stream_digest), as they are taken on: a job that finds every digest on record adds none."""
    from qtool.io import stream_digest
    from qtool.io.manifest import InputHasher

    hashed: list[str] = []
    real_hash, real_add = InputHasher._hash, stream_digest.StreamDigests.add
    monkeypatch.setattr(
        InputHasher, "_hash", lambda self, path, real: hashed.append(real) or real_hash(self, path, real)
    )
    monkeypatch.setattr(
        stream_digest.StreamDigests,
        "add",
        lambda self, real, *a, **k: hashed.append(real) or real_add(self, real, *a, **k),
    )
    return hashed


@pytest.fixture(scope="session")
def tiny_bf16_fused(tiny_cache) -> Path:
    return tiny_cache.path("bf16_fused")


@pytest.fixture(scope="session")
def tiny_nvfp4_modelopt(tiny_cache) -> Path:
    return tiny_cache.path("nvfp4_modelopt")


@pytest.fixture(scope="session")
def tiny_nvfp4_modelopt_nomtp(tiny_cache) -> Path:
    return tiny_cache.path("nvfp4_modelopt_nomtp")


@pytest.fixture(scope="session")
def tiny_nvfp4_ct(tiny_cache) -> Path:
    return tiny_cache.path("nvfp4_ct")


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if _CACHE is not None and _CACHE.timings:
        parts = ", ".join(f"{k} {v:.1f}s" for k, v in _CACHE.timings.items())
        total = sum(_CACHE.timings.values())
        terminalreporter.write_line(f"tiny fixture builds: {parts} (total {total:.1f}s)")
