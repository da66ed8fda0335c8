"""The engine logit-capture patches in patches/: they apply to the engine versions they name, the patched
files compile, and the hook code they add writes dumps that `eval kld` reads back exactly."""

from __future__ import annotations

import glob
import shutil
import subprocess
import types
from pathlib import Path

import pytest
import torch

from qtool.ops.kld.sources import DumpSource, Kind, detect

ROOT = Path(__file__).resolve().parents[2]
PATCHES = {
    "sglang": ROOT / "patches/sglang/0.5.23/0001-kld-logprob-capture.patch",
    "vllm": ROOT / "patches/vllm/0.33.0/0001-kld-prompt-logprob-capture.patch",
}
TARGET = {  # vLLM: the V1 runner and Model Runner V2 (the default in 0.33.0 where supported)
    "sglang": ["sglang/srt/layers/logprob_processor.py"],
    "vllm": ["vllm/v1/worker/gpu_model_runner.py", "vllm/v1/worker/gpu/sample/prompt_logprob.py"],
}
SITE = sorted(glob.glob("/work/engines-venv/lib/python*/site-packages"))


def hook_namespace(engine: str, file_no: int = 0) -> dict:
    """Execute the module-level code the patch adds to its `file_no`-th file (that file's first hunk)."""
    text = PATCHES[engine].read_text()
    per_file = text.split("\n--- a/")
    hunks = per_file[file_no].split("\n@@ ")[1:]
    added = [ln[1:] for ln in hunks[0].splitlines()[1:] if ln.startswith("+")]
    ns: dict = {"torch": torch}
    exec(compile("\n".join(added), str(PATCHES[engine]), "exec"), ns)  # noqa: S102 - our own patch text
    return ns


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_patch_applies_to_the_installed_engine(engine, tmp_path):
    if not SITE or not all((Path(SITE[0]) / f).is_file() for f in TARGET[engine]) or shutil.which("patch") is None:
        pytest.skip("engine sources (/work/engines-venv) or `patch` not available")
    for f in TARGET[engine]:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(SITE[0]) / f, tmp_path / f)
    r = subprocess.run(
        ["patch", "-p1", "-d", str(tmp_path), "-i", str(PATCHES[engine])], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr
    for f in TARGET[engine]:
        text = (tmp_path / f).read_text()
        compile(text, str(tmp_path / f), "exec")
        assert text.count("_qtool_kld_capture(") == 2  # defined and called
        assert engine == "sglang" or text.count("_qtool_kld_flush(") == 2


def test_sglang_hook_writes_upstream_format(tmp_path, monkeypatch):
    ns = hook_namespace("sglang")
    monkeypatch.setenv("QTOOL_KLD_DUMP_DIR", str(tmp_path))
    vocab, pad = 50, 14  # TP padding columns beyond the vocabulary are dropped
    logits = torch.randn(7 + 5, vocab + pad)
    meta = types.SimpleNamespace(extend_logprob_pruned_lens_cpu=[7, 5])  # two requests in one batch
    ns["_qtool_kld_capture"](logits[:8], vocab, meta, False)  # two logprob chunks
    ns["_qtool_kld_capture"](logits[8:], vocab, meta, True)
    assert detect(tmp_path) is Kind.DUMP
    d = DumpSource(tmp_path)
    assert d.windows == 2 and d.vocab == vocab and d.rows(0) == 7 and d.rows(1) == 5
    want = torch.log_softmax(logits[:, :vocab].float(), -1)
    assert torch.equal(d.logprobs(0, 0, 7), want[:7]) and torch.equal(d.logprobs(1, 0, 5), want[7:])
    ns["_qtool_kld_capture"](logits[:3], vocab, types.SimpleNamespace(extend_logprob_pruned_lens_cpu=[3]), True)
    assert DumpSource(tmp_path).windows == 3


@pytest.mark.parametrize("runner", [0, 1], ids=["v1-runner", "model-runner-v2"])
def test_vllm_hook_joins_chunked_prefill(runner, tmp_path, monkeypatch):
    ns = hook_namespace("vllm", runner)
    monkeypatch.setenv("QTOOL_KLD_DUMP_DIR", str(tmp_path))
    logits = torch.randn(9, 40)
    ns["_qtool_kld_capture"]("r1", logits[:4])  # chunked prefill: two steps
    ns["_qtool_kld_capture"]("r1", logits[4:])
    ns["_qtool_kld_capture"]("r2", None)  # non-driver rank with gather: no logits
    ns["_qtool_kld_flush"]("r1")
    ns["_qtool_kld_flush"]("r2")
    d = DumpSource(tmp_path)
    assert d.windows == 1 and d.rows(0) == 9
    assert torch.equal(d.logprobs(0, 0, 9), torch.log_softmax(logits, -1))


def test_hooks_are_off_without_the_env(tmp_path, monkeypatch):
    monkeypatch.delenv("QTOOL_KLD_DUMP_DIR", raising=False)
    ns = hook_namespace("vllm")
    ns["_qtool_kld_capture"]("r", torch.randn(2, 5))
    ns["_qtool_kld_flush"]("r")
    assert ns["_qtool_kld_parts"] == {}
    sg = hook_namespace("sglang")
    sg["_qtool_kld_capture"](torch.randn(2, 5), 5, types.SimpleNamespace(extend_logprob_pruned_lens_cpu=[2]), True)
    assert sg["_qtool_kld_rows"] == []
