"""qtool quantize on a CUDA GPU: the NVFP4 weights (Triton kernel) agree with the CPU path up to the last
bit of the global scale (CUDA division, as in ModelOpt on CUDA), the activation-derived scales agree to float
tolerance, and ModelOpt's MSE backend (Triton-only in ModelOpt)
runs per layer. Skipped without CUDA (conftest)."""

from __future__ import annotations

import pytest
import torch

from qtool.io.checkpoint import Checkpoint
from qtool.io.reader import read_tensor
from qtool.recipes import load_recipe

pytestmark = pytest.mark.gpu

WEIGHT_PARAMS = ("weight", "weight_scale", "weight_scale_2")


def _tensors(root):
    ts = {n: read_tensor(i) for n, i in Checkpoint.open(root).tensors.items()}
    return {n: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for n, t in ts.items()}


def test_cuda_quantize_matches_cpu(tiny_bf16, calib_ids, tmp_path):
    from qtool.ops.quantize import run

    recipe = load_recipe("qwen35-nvfp4-experts")
    cpu = run(tiny_bf16, out=tmp_path / "cpu", recipe=recipe, calib_ids=calib_ids, device="cpu")
    gpu = run(tiny_bf16, out=tmp_path / "gpu", recipe=recipe, calib_ids=calib_ids, device="cuda")
    assert cpu["output"]["problems"] == [] and gpu["output"]["problems"] == []
    a, b = _tensors(tmp_path / "cpu"), _tensors(tmp_path / "gpu")
    assert set(a) == set(b)
    differing = total = 0
    for name in a:
        param = name.rsplit(".", 1)[1]
        if ".mlp.experts." in name and param == "weight_scale_2":
            # amax / 2688: torch on CUDA divides by a Python scalar through its rounded reciprocal (as
            # ModelOpt on CUDA does), so the global scale may differ from the CPU's in the last bit
            torch.testing.assert_close(a[name], b[name], rtol=2.5e-7, atol=0)
        elif ".mlp.experts." in name and param in WEIGHT_PARAMS:
            differing += int((a[name] != b[name]).sum())
            total += a[name].numel()
        elif name.endswith(("input_scale", "k_scale", "v_scale")):
            torch.testing.assert_close(a[name].float(), b[name].float(), rtol=0.02, atol=0)
        else:
            assert torch.equal(a[name], b[name]), name  # carried over unchanged
    print(f"codes/block scales differing CPU vs CUDA: {differing} of {total}")
    # a last-bit change of the global scale moves a code only where a value sits on a rounding boundary
    assert total > 0 and differing / total < 1e-3, (differing, total)


def test_modelopt_mse_backend_runs_on_cuda(tiny_bf16, calib_ids, tmp_path):
    pytest.importorskip("modelopt", reason="the quant extra (nvidia-modelopt) is not installed")
    from qtool.ops.quantize import run
    from qtool.recipes import Backend

    rep = run(
        tiny_bf16,
        out=tmp_path / "mse",
        recipe=load_recipe("qwen35-nvfp4-experts-mse"),
        backend=Backend.MODELOPT,
        calib_ids=calib_ids,
        device="cuda",
    )
    assert rep["output"]["problems"] == []


def test_cuda_awq_quantize_runs_and_keeps_the_int4_layout(tiny_bf16, calib_ids, tmp_path):
    """`quantize --recipe qwen35-awq-int4 --device cuda` (the AWQ search ran on host rows against GPU
    weights and failed with a device mismatch): the same tensors, dtypes and shapes as the CPU run, and
    the search on the GPU never worse than plain RTN on the calibration rows (alpha 0 is in its grid; the
    chosen alpha may differ from the CPU's on near-ties)."""
    from qtool.ops.quantize import run

    recipe = load_recipe("qwen35-awq-int4")
    cpu = run(tiny_bf16, out=tmp_path / "cpu", recipe=recipe, calib_ids=calib_ids, device="cpu")
    gpu = run(tiny_bf16, out=tmp_path / "gpu", recipe=recipe, calib_ids=calib_ids, device="cuda")
    assert cpu["output"]["problems"] == [] and gpu["output"]["problems"] == []
    a, b = _tensors(tmp_path / "cpu"), _tensors(tmp_path / "gpu")
    assert {n: (t.dtype, t.shape) for n, t in a.items()} == {n: (t.dtype, t.shape) for n, t in b.items()}
    awq = [lay["awq"] for lay in gpu["layers"] if "awq" in lay]
    assert awq and all(r["down_mse"] <= r["down_mse_rtn"] for r in awq)
    # layer 0 is kept in BF16 (the recipe's override): its experts are written from the bytes read to the
    # GPU, taken down in pieces by the writer; the source's bytes exactly
    src = _tensors(tiny_bf16)
    kept = [n for n in b if ".layers.0.mlp.experts." in n]
    assert kept and all(torch.equal(b[n], src[n]) for n in kept)


def test_awq_rows_kept_on_cuda_are_the_cpu_rows():
    """ExpertStats keeps AWQ rows from CUDA in one page-locked buffer without a sync per expert hit: after
    settle() they are exactly the rows a CPU run keeps, over several micro-batches, cut at keep_rows; an
    expert's rows stay page-locked (their upload to the GPU does not wait for the host)."""
    from qtool.ops.quantize.calib import ExpertStats

    g = torch.Generator().manual_seed(0)
    batches = [[torch.randn(n, 32, generator=g).to(torch.bfloat16) for n in (5, 0, 9)] for _ in range(3)]
    kept = {}
    for dev in ("cpu", "cuda"):
        st = ExpertStats(3, keep_rows=12)
        for b, mids in enumerate(batches):
            st.set_batch(b)
            for e, mid in enumerate(mids):
                if mid.shape[0]:
                    mid = mid.to(dev)
                    st.record(e, mid, mid)
        st.settle()
        kept[dev] = [st.rows(e) for e in range(3)]
    for e in range(3):
        assert torch.equal(kept["cpu"][e], kept["cuda"][e]), e
    assert kept["cuda"][0].shape == (12, 32) and kept["cuda"][1].numel() == 0 and kept["cuda"][2].shape == (12, 32)
    assert kept["cuda"][0].is_pinned() and kept["cuda"][2].is_pinned()
    assert kept["cuda"][0].dtype == torch.bfloat16  # the forward's dtype: half of float32's pinned memory
