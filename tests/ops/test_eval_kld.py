"""`qtool eval kld`: in-process (layer-streamed) numbers against a full transformers forward of both
models, dump mode against in-process, sliding windows, identical windows to calibrate-kv, --emit-windows."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from full_model import dense_text_model, fixture_dir

from qtool.cli.main import main
from qtool.errors import PlanError, UsageError
from qtool.ops.kld import RESULT_KEYS, KldOptions, run
from qtool.ops.kld.windows import token_windows
from qtool.stream.calib_data import build_calib_set

N, L = 2, 24


def oracle_logprobs(ckpt, ids):
    """Full-model forward (transformers Qwen3_5MoeTextModel, all layers resident) + lm_head, float32
    log_softmax: [N, L, V]."""
    from qtool.stream.dequant import load_param
    from qtool.stream.layer_stream import LayerStreamer

    model = dense_text_model(ckpt)
    w = load_param(LayerStreamer(ckpt).model_map, "lm_head.weight", torch.bfloat16)
    with torch.no_grad():
        h = model(input_ids=ids).last_hidden_state
        return torch.log_softmax((h @ w.T).float(), dim=-1)


def direct_stats(lp, lq):
    """The reported statistics computed directly: torch full-vocabulary KL per position."""
    kl = (
        F.kl_div(lq.reshape(-1, lq.shape[-1]), lp.reshape(-1, lp.shape[-1]), log_target=True, reduction="none")
        .sum(-1)
        .double()
    )
    top1 = (lp.argmax(-1) == lq.argmax(-1)).reshape(-1)
    return {
        "mean": kl.mean().item(),
        "median": kl.quantile(0.5).item(),
        "p95": kl.quantile(0.95).item(),
        "p99": kl.quantile(0.99).item(),
        "max": kl.max().item(),
        "top1_agreement": top1.double().mean().item(),
        "positions": kl.numel(),
    }


def assert_stats_close(got: dict, want: dict, rel=1e-4):
    assert got["positions"] == want["positions"]
    assert got["top1_agreement"] == pytest.approx(want["top1_agreement"], abs=1e-12)
    for k in ("mean", "median", "p95", "p99", "max"):
        assert got[k] == pytest.approx(want[k], rel=rel, abs=1e-12), k


def write_dump(dir_, logp, rows=None):
    """Dump in the upstream SGLang capture format: <i>.safetensors with `log_probs` [positions, vocab]."""
    from safetensors.torch import save_file

    dir_.mkdir(parents=True, exist_ok=True)
    for i in range(logp.shape[0]):
        t = logp[i] if rows is None else logp[i, :rows]
        save_file({"log_probs": t.contiguous()}, str(dir_ / f"{i}.safetensors"))
    return dir_


@pytest.fixture(scope="module")
def pair(request):
    ref = fixture_dir(request, "tiny_bf16")
    test = fixture_dir(request, "tiny_nvfp4_modelopt")
    ids = build_calib_set(ref, "builtin", N, L).ids
    return ref, test, ids, oracle_logprobs(ref, ids), oracle_logprobs(test, ids)


@pytest.fixture(scope="module")
def inproc(pair):
    ref, test, *_ = pair
    return run(str(ref), str(test), opts=KldOptions(windows=N, seq_len=L, chunk=10))


def test_windows_identical_to_calibrate_kv(pair):
    ref, _test, ids, *_ = pair
    assert torch.equal(token_windows(ref, "builtin", N, L), ids)
    # sliding: the same token stream, cut every `stride` tokens; window 0 = calibrate-kv's window 0
    stream = build_calib_set(ref, "builtin", 1, 3 * 7 + L).ids[0]
    sl = token_windows(ref, "builtin", 4, L, stride=7)
    assert sl.shape == (4, L)
    for i in range(4):
        assert torch.equal(sl[i], stream[7 * i : 7 * i + L])
    assert torch.equal(sl[0], ids[0])
    with pytest.raises(PlanError, match="at stride"):
        token_windows(ref, "builtin", 10**6, L, stride=7)


def test_inprocess_equals_full_transformers_forward(pair, inproc):
    *_, lp, lq = pair
    assert set(inproc.result) == set(RESULT_KEYS)
    want = direct_stats(lp, lq)
    assert want["mean"] > 0 and want["top1_agreement"] < 1.0  # the pair really differs
    assert_stats_close(inproc.result, want)
    assert inproc.windows == N and inproc.token_digest
    for side in (inproc.ref, inproc.test):  # on a CPU: transformers' own kernels, hence its numbers exactly
        assert side["kernels"] == {"gated_deltanet": "torch", "routed_experts": "eager"}


def test_inprocess_same_model_is_zero(pair):
    ref, *_ = pair
    rep = run(str(ref), str(ref), opts=KldOptions(windows=1, seq_len=L))
    assert rep.result["max"] == 0.0 and rep.result["top1_agreement"] == 1.0


def test_dump_mode_equals_inprocess(pair, inproc, tmp_path):
    *_, lp, lq = pair
    rd = write_dump(tmp_path / "ref", lp)
    td = write_dump(tmp_path / "test", lq)
    rep = run(str(rd), str(td), opts=KldOptions())
    assert rep.ref["kind"] == "dump" and rep.test["kind"] == "dump"
    assert_stats_close(rep.result, inproc.result)
    # mixed: checkpoint reference against a dumped test
    mixed = run(str(pair[0]), str(td), opts=KldOptions(windows=N, seq_len=L))
    assert_stats_close(mixed.result, inproc.result)
    # float16 dumps (the older upstream capture) are read too
    h = write_dump(tmp_path / "ref16", lp.half())
    assert run(str(h), str(td)).result["positions"] == N * L


def test_vllm_style_dump_has_one_row_less(pair, tmp_path):
    *_, lp, lq = pair
    td = write_dump(tmp_path / "test", lq, rows=L - 1)  # vLLM prompt logprobs: positions 0..L-2
    rep = run(str(pair[0]), str(td), opts=KldOptions(windows=N, seq_len=L))
    assert rep.result["positions"] == N * (L - 1)
    assert rep.warnings and "first 23" in rep.warnings[0]
    assert_stats_close(rep.result, direct_stats(lp[:, : L - 1], lq[:, : L - 1]))


def test_sliding_windows_inprocess(pair):
    ref, test, *_ = pair
    ids = token_windows(ref, "builtin", 3, 16, stride=5)
    rep = run(str(ref), str(test), opts=KldOptions(windows=3, seq_len=16, stride=5))
    assert_stats_close(rep.result, direct_stats(oracle_logprobs(ref, ids), oracle_logprobs(test, ids)))


def test_dump_window_count_mismatch(pair, tmp_path):
    *_, lp, lq = pair
    rd = write_dump(tmp_path / "ref", lp)
    td = write_dump(tmp_path / "test", lq[:1])
    with pytest.raises(PlanError, match="numbers of windows"):
        run(str(rd), str(td))
    (tmp_path / "bad").mkdir()
    write_dump(tmp_path / "bad", lq)
    (tmp_path / "bad" / "0.safetensors").unlink()
    with pytest.raises(Exception, match="numbered 0..N-1"):
        run(str(rd), str(tmp_path / "bad"))


def test_emit_windows(pair, tmp_path):
    ref, _test, ids, *_ = pair
    out = tmp_path / "req.jsonl"
    rc = main(
        [
            "eval",
            "kld",
            "--tokenizer",
            str(ref),
            "--windows",
            str(N),
            "--seq-len",
            str(L),
            "--emit-windows",
            str(out),
            "--model-name",
            "m",
            "--json",
        ]
    )
    assert rc == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["prompt"] for x in lines] == ids.tolist()
    assert lines[0]["max_tokens"] == 1 and lines[0]["echo"] is True and lines[0]["logprobs"] == 1
    assert lines[0]["model"] == "m"


def test_cli_json_and_usage_errors(pair, tmp_path, capsys):
    *_, lp, lq = pair
    rd = write_dump(tmp_path / "ref", lp)
    td = write_dump(tmp_path / "test", lq)
    assert main(["eval", "kld", "--ref", str(rd), "--test", str(td), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert tuple(got) == RESULT_KEYS
    assert_stats_close(got, direct_stats(lp, lq))
    assert main(["eval", "kld", "--ref", str(rd)]) == 2  # nothing to do
    assert main(["eval", "kld", "--ref", str(tmp_path / "nope"), "--test", str(td)]) == 2
    with pytest.raises(UsageError):
        run(str(rd), str(tmp_path / "nope"))


def test_dry_run_plans_without_running(pair, capsys):
    ref, test, *_ = pair
    assert (
        main(
            [
                "eval",
                "kld",
                "--ref",
                str(ref),
                "--test",
                str(test),
                "--windows",
                str(N),
                "--seq-len",
                str(L),
                "--dry-run",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["result"] is None and out["windows"] == N
    mem = out["plan"]["ref"]["memory"]
    assert mem["num_layers"] == 8 and mem["hidden_bytes"] == N * L * 64 * 2 and mem["hidden_in_ram"]
    assert mem["head_bytes"] >= 1024 * 64 * 2


@pytest.mark.gpu
def test_inprocess_on_cuda_equals_the_cpu_path(request, tmp_path):
    """On CUDA the hidden states stay on the device: the statistics are the CPU path's (itself checked
    against transformers above), up to CUDA's BF16 GEMM rounding. The test side is qtool's own NVFP4 of the
    tiny model (the GPU machine has no peer library to make the others)."""
    from qtool.fixtures.tiny import _calib_ids
    from qtool.ops.quantize import run as quantize
    from qtool.recipes import load_recipe

    ref = fixture_dir(request, "tiny_bf16")
    test = tmp_path / "nvfp4"
    quantize(ref, out=test, recipe=load_recipe("qwen35-nvfp4-experts"), calib_ids=_calib_ids(ref, None), device="cpu")
    cpu = run(str(ref), str(test), opts=KldOptions(windows=N, seq_len=L, chunk=10))
    gpu = run(str(ref), str(test), opts=KldOptions(windows=N, seq_len=L, chunk=10, device="cuda"))
    assert gpu.result["positions"] == cpu.result["positions"] and cpu.result["mean"] > 0
    # Hopper and newer run torch's grouped matmul: eval kld's routed experts on CUDA (qtool.stream.experts)
    assert gpu.ref["kernels"]["routed_experts"] == gpu.test["kernels"]["routed_experts"] == "grouped_mm"
    assert gpu.result["top1_agreement"] == pytest.approx(cpu.result["top1_agreement"], abs=0.05)
    # the tiny model's KLD is ~1.5e-5, near BF16's rounding: on one H200 machine (2026-12-05) CUDA's GEMMs
    # moved the mean by 8.6% (1.535e-5 on the CPU, 1.403e-5 on CUDA, with the lm_head read ahead or not)
    for k, rel in (("mean", 0.15), ("median", 0.15), ("p95", 0.15)):
        assert gpu.result[k] == pytest.approx(cpu.result[k], rel=rel), k


def test_the_head_is_read_with_the_last_layer_not_after_it(pair, monkeypatch):
    """The final norm and the lm_head are read while the last layer computes (the read-ahead's turn, the
    reader is idle then), not by the main thread after the layers; the log-probs are the oracle's."""
    from qtool.ops.kld.sources import CheckpointSource
    from qtool.stream.dequant import TensorSource

    ref, _test, ids, lp_ref, _ = pair
    after: list[str] = []
    real_get = TensorSource.get
    monkeypatch.setattr(TensorSource, "get", lambda self, info: after.append(info.name) or real_get(self, info))
    src = CheckpointSource(ref)
    try:
        src.prepare(ids)
        assert src.streamer._reader._key == "head"  # being read, or read, during the last layer
        got = torch.stack([src.logprobs(w, 0, L) for w in range(N)])
    finally:
        src.close()
    assert not [n for n in after if n.endswith(("lm_head.weight", "model.language_model.norm.weight"))], after
    torch.testing.assert_close(got, lp_ref, rtol=1e-4, atol=1e-4)
