"""Calibration data a real run needs: Hub datasets through `datasets` (chat `messages` rendered with the
checkpoint's own chat template), local .jsonl/.parquet of the same shapes, counted by the plan."""

from __future__ import annotations

import json
import shutil

import pytest
from fake_hub import chat_dataset_files
from in_process import run_cli
from killpoint import run_failing

from qtool.io.checkpoint import Checkpoint


def _expected_digest(ckpt, files: dict[str, bytes], samples: int, seq_len: int) -> str:
    """The token windows computed here the long way: parquet rows -> the tokenizer's chat template ->
    ids -> the first samples x seq_len."""
    import io

    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from qtool.stream.calib_data import windows_from_ids

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    rows = pq.read_table(io.BytesIO(next(v for k, v in files.items() if k.endswith(".parquet")))).to_pylist()
    ids: list[int] = []
    for r in rows:
        ids += tok(tok.apply_chat_template(r["messages"], tokenize=False), add_special_tokens=False)["input_ids"]
    return windows_from_ids(ids, samples, seq_len).digest


def test_calibrate_kv_on_a_hub_chat_dataset(hub, tiny_nvfp4_modelopt, tmp_path):
    files = chat_dataset_files(40)
    commit = hub.add_dataset("org/chat", files)
    out = tmp_path / "out"
    p = run_cli(
        [
            "calibrate-kv",
            tiny_nvfp4_modelopt,
            "-o",
            out,
            "--dataset",
            "hf:org/chat:train_sft",
            "--samples",
            "2",
            "--seq-len",
            "64",
            "--replace-scales",
            "--json",
            "--quiet",
        ]
    )
    assert p.returncode == 0, p.stderr
    cal = json.loads(p.stdout)["calibration"]
    assert cal["dataset"] == "hf:org/chat:train_sft" and cal["revision"] == commit
    assert cal["digest"] == _expected_digest(tiny_nvfp4_modelopt, files, 2, 64)  # the chat template was used
    man = json.loads((out / "qtool-manifest.json").read_text())
    assert man["summary"]["calibration"]["revision"] == commit
    assert man["summary"]["calibration"]["digest"] == cal["digest"]
    # the same rows as a local .parquet and .jsonl give the same windows
    pq_file = tmp_path / "chat.parquet"
    pq_file.write_bytes(next(v for k, v in files.items() if k.endswith(".parquet")))
    import pyarrow.parquet as pq

    jl = tmp_path / "chat.jsonl"
    jl.write_text("".join(json.dumps(r) + "\n" for r in pq.read_table(pq_file).to_pylist()))
    for local in (pq_file, jl):
        d = run_cli(
            [
                "calibrate-kv",
                tiny_nvfp4_modelopt,
                "-o",
                tmp_path / local.suffix[1:],
                "--dataset",
                local,
                "--samples",
                "2",
                "--seq-len",
                "64",
                "--replace-scales",
                "--dry-run",
                "--json",
            ]
        )
        assert d.returncode == 0, d.stderr
        assert json.loads(d.stdout)["plan"]["calibration"]["digest"] == cal["digest"], local


@pytest.mark.slow
def test_a_too_small_dataset_is_refused_before_any_weight_is_read(hub, tiny_nvfp4_modelopt, tmp_path):
    """Found as: the shipped recipes asked for 16 x 2048 tokens of a dataset giving 5,804: a real run failed
    after loading, and --dry-run did not notice."""
    hub.add_dataset("org/chat", chat_dataset_files(5))
    args = [
        "calibrate-kv",
        tiny_nvfp4_modelopt,
        "-o",
        tmp_path / "o",
        "--dataset",
        "hf:org/chat:train_sft",
        "--samples",
        "16",
        "--seq-len",
        "2048",
        "--replace-scales",
        "--json",
    ]
    for extra in (["--dry-run"], []):
        # a weight read would raise EIO: the refusal must come first
        p = run_failing("qtool.stream.layer_stream:LayerStreamer.load_layer", 1, "EIO", [*args, *extra])
        assert p.returncode == 1, p.stderr
        err = json.loads(p.stdout)
        assert "tokens" in err["message"] and "32768 needed" in err["message"] and "--seq-len" in err["hint"]
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


@pytest.mark.slow
def test_the_shipped_397b_recipes_plan_against_their_dataset(hub, tmp_path):
    """The shipped 397B recipes name a real dataset and token budget; a build --dry-run counts what the
    dataset gives before any weight is read (here the dataset is the fake Hub's stand-in of ultrachat_200k)."""
    from qtool.fixtures.sparse import build_sparse

    hub.add_dataset("HuggingFaceH4/ultrachat_200k", chat_dataset_files(400, words=240))
    ct = build_sparse(tmp_path / "ct", model="397b", flavour="ct-nvfp4")
    p = run_cli(
        ["build", "qwen35-397b-sehyo-kv", "-o", tmp_path / "o", "--dry-run", "--json", "--source", f"nvfp4={ct}"]
    )
    assert p.returncode == 0, p.stdout + p.stderr
    kv = next(s for s in json.loads(p.stdout)["steps"] if s["id"] == "kv")
    assert kv["validation"]["status"] == "planned", kv
    assert Checkpoint.open(ct).total_bytes() > 200e9
    shutil.rmtree(ct)
