"""calibrate-kv: scales vs a full transformers forward with hooks, vs ModelOpt's own FP8 KV calibration,
output conventions and configs, in-place atomic writes, --overwrite, --resume, --dry-run, the CLI."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from full_model import capture_kv_full_model, dense_text_model, fixture_dir

from qtool.errors import PlanError
from qtool.ops import calibrate_kv as ck
from qtool.stream.calib_data import build_calib_set, read_documents, windows_from_ids

N, L = 2, 32


def _ids(ckpt):
    return build_calib_set(ckpt, "builtin", N, L).ids


def _calibrate(ckpt, tmp_path, **kw):
    p = ck.plan(ck.CalibrateKvOptions(ckpt, out=tmp_path / "out", samples=N, seq_len=L, **kw))
    stats, _ = ck.calibrate(p, _ids(ckpt), hidden="memory")
    return p, stats


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


# ---- calibration data ------------------------------------------------------------------------------


def test_windows_are_first_consecutive_tokens_without_specials(request, tmp_path):
    from transformers import AutoTokenizer

    ckpt = fixture_dir(request, "tiny_bf16")
    tok = AutoTokenizer.from_pretrained(ckpt)
    text = read_documents("builtin")[0]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    cs = build_calib_set(ckpt, "builtin", 3, 16, tokenizer=tok)
    assert cs.ids.flatten().tolist() == ids[:48]
    assert cs.digest == build_calib_set(ckpt, "builtin", 3, 16, tokenizer=tok).digest
    # jsonl: documents concatenated in order
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"text": t}) for t in ("alpha beta", "gamma delta " * 20)) + "\n")
    js = build_calib_set(ckpt, str(f), 1, 8, tokenizer=tok)
    want = (
        tok("alpha beta", add_special_tokens=False)["input_ids"]
        + tok("gamma delta " * 20, add_special_tokens=False)["input_ids"]
    )
    assert js.ids.flatten().tolist() == want[:8]
    with pytest.raises(PlanError, match="tokens"):
        windows_from_ids(list(range(10)), 2, 8)


# ---- scales vs oracles -----------------------------------------------------------------------------


def test_bf16_scales_equal_full_forward_hooks(request, tmp_path):
    """Streamed per-layer forward == transformers' full model (loaded by from_pretrained) with hooks."""
    from transformers import AutoModelForImageTextToText

    ckpt = fixture_dir(request, "tiny_bf16")
    p, stats = _calibrate(ckpt, tmp_path)
    assert p.layers == [3, 7] and p.convention is ck.Convention.COMPRESSED_TENSORS
    model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
    with capture_kv_full_model() as (rec, attach), torch.no_grad():
        attach(model.model.language_model.layers)
        model(input_ids=_ids(ckpt))
    assert sorted(rec) == [3, 7]
    for i in p.layers:
        assert _rel(stats[i].k_amax, rec[i][0]) <= 0.01 and _rel(stats[i].v_amax, rec[i][1]) <= 0.01
        assert stats[i].tokens == N * L
        assert stats[i].k_scale == pytest.approx(stats[i].k_amax / 448, rel=1e-6)


@pytest.mark.parametrize("name", ["tiny_nvfp4_modelopt", "tiny_nvfp4_ct"])
def test_nvfp4_scales_equal_full_forward_of_dequantized_model(request, tmp_path, name):
    ckpt = fixture_dir(request, name)
    p, stats = _calibrate(ckpt, tmp_path, replace_scales=True)
    model = dense_text_model(ckpt)
    with capture_kv_full_model() as (rec, attach), torch.no_grad():
        attach(model.layers)
        model(input_ids=_ids(ckpt))
    for i in p.layers:
        assert _rel(stats[i].k_amax, rec[i][0]) <= 0.01, (i, stats[i], rec[i])
        assert _rel(stats[i].v_amax, rec[i][1]) <= 0.01, (i, stats[i], rec[i])


def test_matches_modelopt_fp8_kv_calibration(request, tmp_path):
    """ModelOpt's own FP8 KV calibration (mtq FP8_KV_CFG, max algorithm) on the BF16 model, same windows:
    its k_bmm_quantizer / v_bmm_quantizer amax equal ours (and so do the exported amax/448 scales)."""
    mtq = pytest.importorskip("modelopt.torch.quantization")
    from transformers import AutoModelForImageTextToText

    ckpt = fixture_dir(request, "tiny_bf16")
    p, stats = _calibrate(ckpt, tmp_path)
    ids = _ids(ckpt)
    model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        mtq.quantize(
            model,
            {"quant_cfg": list(mtq.FP8_KV_CFG["quant_cfg"]), "algorithm": "max"},
            forward_loop=lambda m: m(input_ids=ids),
        )
    for i in p.layers:
        attn = model.model.language_model.layers[i].self_attn
        k, v = float(attn.k_bmm_quantizer.amax.float()), float(attn.v_bmm_quantizer.amax.float())
        assert _rel(stats[i].k_amax, k) <= 0.01 and _rel(stats[i].v_amax, v) <= 0.01, (i, stats[i], k, v)


# ---- outputs ---------------------------------------------------------------------------------------


def test_modelopt_output_convention_configs_and_links(request, tmp_path):
    from qtool.io.checkpoint import Checkpoint
    from qtool.ops.inspect import inspect_checkpoint

    src = fixture_dir(request, "tiny_nvfp4_modelopt")
    out = tmp_path / "out"
    with pytest.raises(PlanError, match="already has"):
        ck.run(src, out=out, samples=N, seq_len=L)
    rep = ck.run(src, out=out, samples=N, seq_len=L, replace_scales=True)
    ckpt = Checkpoint.open(out)
    for i in (3, 7):
        for n in (
            f"model.language_model.layers.{i}.self_attn.k_proj.k_scale",
            f"model.language_model.layers.{i}.self_attn.v_proj.v_scale",
        ):
            info = ckpt.tensors[n]
            assert info.dtype == "F32" and tuple(info.shape) == ()
            assert ckpt.shard_of(n) == ck.KV_SHARD
    got = {s["layer"]: s for s in rep["layers"]}
    from qtool.io.reader import read_scalar

    assert read_scalar(ckpt.tensors["model.language_model.layers.7.self_attn.k_proj.k_scale"]) == pytest.approx(
        got[7]["k_scale"], rel=1e-7
    )
    r = inspect_checkpoint(out)
    assert r["kv_scales"]["calibrated"] is True and r["kv_scales"]["naming"] == "modelopt"
    assert r["kv_scales"]["layers"] == [3, 7]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["kv_cache_scheme"] == {"dynamic": False, "num_bits": 8, "type": "float"}
    hq = json.loads((out / "hf_quant_config.json").read_text())
    assert hq["quantization"]["kv_cache_quant_algo"] == "FP8"
    # untouched shards are hardlinks of the source's; the source is unchanged
    for shard in Checkpoint.open(src).headers:
        if shard not in rep["plan"]["rewrites_shards"] and (out / shard).exists():
            assert os.stat(out / shard).st_ino == os.stat(src / shard).st_ino
    assert not (tmp_path / "out.partial").exists()


def test_in_place_ct_then_overwrite_then_resume(request, tmp_path):
    from qtool.io.checkpoint import Checkpoint
    from qtool.ops.inspect import inspect_checkpoint
    from qtool.stream.layer_stream import LayerStreamer

    work = tmp_path / "ct"
    shutil.copytree(fixture_dir(request, "tiny_nvfp4_ct"), work)
    before = {p.name: p.stat().st_mtime_ns for p in work.glob("model-0*.safetensors")}
    rep = ck.run(work, out=None, samples=N, seq_len=L)
    ckpt = Checkpoint.open(work)
    assert "model.language_model.layers.3.self_attn.k_scale" in ckpt.tensors
    assert {p.name: p.stat().st_mtime_ns for p in work.glob("model-0*.safetensors")} == before
    r = inspect_checkpoint(work)
    assert r["kv_scales"]["calibrated"] is True and r["kv_scales"]["naming"] == "compressed-tensors"
    qc = json.loads((work / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"]["type"] == "float" and qc["kv_cache_scheme"]["num_bits"] == 8
    assert qc["kv_cache_scheme"]["dynamic"] is False and qc["format"] == "nvfp4-pack-quantized"
    assert not any(p.name.endswith(".partial") for p in tmp_path.iterdir())
    with pytest.raises(PlanError, match="already has"):
        ck.run(work, out=None, samples=N, seq_len=L)

    # --overwrite with a crash in layer 5, then --resume: same scales as the uninterrupted run.
    real = LayerStreamer.load_layer

    def crashing(self, idx, **kwargs):
        if idx == 5:
            raise RuntimeError("simulated crash")
        return real(self, idx, **kwargs)

    LayerStreamer.load_layer = crashing
    try:
        with pytest.raises(RuntimeError, match="simulated"):
            ck.run(work, out=None, samples=N, seq_len=L, replace_scales=True)
    finally:
        LayerStreamer.load_layer = real
    journal = json.loads((tmp_path / ".ct.qtool-inplace" / ".calibrate-kv" / "journal.json").read_text())
    assert journal["next_layer"] == 5 and [s["layer"] for s in journal["stats"]] == [3]
    rep2 = ck.run(work, out=None, samples=N, seq_len=L, replace_scales=True, resume=True)
    assert rep2["timing"]["resumed_from_layer"] == 5
    assert rep2["layers"] == rep["layers"]
    assert Checkpoint.open(work).tensors.keys() == ckpt.tensors.keys()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ct"]


def test_bf16_dry_run_and_cli(request, tmp_path, capsys):
    from qtool.cli.main import main

    src = fixture_dir(request, "tiny_bf16")
    out = tmp_path / "o"
    assert main(["calibrate-kv", str(src), "-o", str(out), "--samples", "2", "--seq-len", "32", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "peak memory    host ~" in text and "fits this machine" in text and "[3, 7]" in text and not out.exists()
    assert main(["calibrate-kv", str(src), "-o", str(out), "--samples", "2", "--seq-len", "32", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [s["layer"] for s in rep["layers"]] == [3, 7]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc == ck.kv_only_quantization_config()
    assert main(["calibrate-kv", str(src), "--samples", "2"]) == 2  # no -o / --in-place
    assert main(["calibrate-kv", str(src), "-o", str(tmp_path / "x"), "--samples", "999", "--json"]) == 1


def test_outlier_warnings():
    s = {i: ck.LayerStat(i, 1.0 + i / 10, 0.5, 10) for i in range(5)}
    assert ck.outlier_warnings(s) == []
    s[9] = ck.LayerStat(9, 50.0, 0.5, 10)
    w = ck.outlier_warnings(s)
    assert len(w) == 1 and "layer 9: k_scale" in w[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_scales_equal_cpu(request, tmp_path):
    ckpt = fixture_dir(request, "tiny_bf16")
    _, cpu = _calibrate(ckpt, tmp_path)
    _, gpu = _calibrate(ckpt, tmp_path, device="cuda")
    for i in cpu:
        assert _rel(gpu[i].k_amax, cpu[i].k_amax) <= 0.01 and _rel(gpu[i].v_amax, cpu[i].v_amax) <= 0.01


KILL_ARGS = ["--replace-scales", "--samples", "4", "--seq-len", "32", "--batch-tokens", "64", "--quiet"]


@pytest.fixture(scope="module")
def uninterrupted_kv(request, tmp_path_factory):
    """(input, output) of one uninterrupted `calibrate-kv` with KILL_ARGS: the bytes every killed and
    resumed run of this module must give (read only)."""
    from in_process import run_cli

    src = fixture_dir(request, "tiny_nvfp4_modelopt")
    clean = tmp_path_factory.mktemp("kv-uninterrupted") / "clean"
    p = run_cli(["calibrate-kv", src, *KILL_ARGS, "-o", clean])
    assert p.returncode == 0, p.stderr[-2000:]
    return src, clean


@pytest.mark.parametrize(
    "point",
    [
        ("qtool.io.files:fsync_path", 3),
        ("qtool.stream.hidden_store:_pwrite_file", 4),
        ("qtool.io.jsonio:write_json", 3),
    ],
)
@pytest.mark.slow
def test_kill_in_the_hidden_state_writer_resumes_to_the_same_scales(uninterrupted_kv, tmp_path, point):
    """The hidden states and the journal are written behind the next layer (one writer thread): a kill
    -9 at its fsync, its write or its journal write leaves a journal that points at intact hidden states;
    --resume gives the bytes of an uninterrupted run."""
    from in_process import run_cli
    from killpoint import run_killed

    src, clean = uninterrupted_kv
    args = ["calibrate-kv", src, *KILL_ARGS]
    out = tmp_path / "out"
    killed = run_killed(*point, [*args, "-o", out])
    assert killed.returncode == -9 and not out.exists()
    journal = json.loads((tmp_path / "out.partial/.calibrate-kv/journal.json").read_text())
    assert journal["next_layer"] >= 0
    p = run_cli([*args, "-o", out, "--resume"])
    assert p.returncode == 0, p.stderr[-2000:]
    for f in clean.glob("*.safetensors"):
        assert (out / f.name).read_bytes() == f.read_bytes(), f.name


@pytest.mark.slow
def test_failed_hidden_state_write_is_never_journaled(uninterrupted_kv, tmp_path):
    """With the writer thread, a failed write of a layer's hidden states stops the queue: neither its
    fsync nor the journal entry that would declare the layer complete runs; --resume recomputes it."""
    from in_process import run_cli
    from killpoint import run_failing

    src, clean = uninterrupted_kv
    args = ["calibrate-kv", src, *KILL_ARGS]
    out = tmp_path / "out"
    # writes: 2 micro-batches of embeddings, then 2 per layer: the 4th is layer 0's last. The input is hashed
    # from the job's reads (a cache of its own: no digests of this input on record), lagging behind them as
    # sha256 does behind a fast disk; none of that hashing may run on into the interpreter's exit
    slow = {
        **os.environ,
        "KILLPOINT_SLOW": "qtool.io.stream_digest:FileDigest._update:1",
        "QTOOL_CACHE_DIR": str(tmp_path / "cache"),
    }
    failed = run_failing("qtool.stream.hidden_store:_pwrite_file", 4, "ENOSPC", [*args, "-o", out], env=slow)
    assert failed.returncode == 1 and "No space left on device" in failed.stderr
    assert "alive at exit" not in failed.stderr
    journal = json.loads((tmp_path / "out.partial/.calibrate-kv/journal.json").read_text())
    assert journal["next_layer"] == 0  # layer 0 not declared done
    p = run_cli([*args, "-o", out, "--resume"])
    assert p.returncode == 0, p.stderr[-2000:]
    for f in clean.glob("*.safetensors"):
        assert (out / f.name).read_bytes() == f.read_bytes(), f.name


def test_journal_key_records_the_tensors_and_the_run_settings(tiny_nvfp4_modelopt, tmp_path):
    """A --resume is refused when what the journal recorded differs: the tensor list (its text kept as
    before, so a run journaled by an earlier qtool resumes), and the compute dtype and micro-batch."""
    import hashlib

    from qtool.io.identity import input_identity, tensor_list_text
    from qtool.ops.calibrate_kv.calibrate import _journal_key

    p = ck.plan(
        ck.CalibrateKvOptions(tiny_nvfp4_modelopt, out=tmp_path / "out", samples=N, seq_len=L, replace_scales=True)
    )
    t = p.ckpt.tensors
    old = "".join(f"{n}|{t[n].dtype}|{list(t[n].shape)}|{os.path.getsize(t[n].file)}\n" for n in sorted(t))
    assert tensor_list_text(t) == old.encode()
    h = hashlib.sha256(old.encode())
    h.update(json.dumps(p.ckpt.text_config, sort_keys=True).encode())
    h.update(f"d|bfloat16|8|{p.samples}|{p.seq_len}".encode())
    h.update(json.dumps(input_identity(x.path for x in p.ckpt.headers.values())).encode())
    assert _journal_key(p, "d", "bfloat16|8") == h.hexdigest()[:32]
    assert len({_journal_key(p, "d", s) for s in ("bfloat16|8", "float32|8", "bfloat16|16")}) == 3
