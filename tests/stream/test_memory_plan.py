"""The memory plan of the layer-streamed jobs at the 397B's real layer size (sparse real headers): what
quantize / calibrate-kv hold on the host and the GPU, and the dry run's fit verdict for this machine."""

from __future__ import annotations

import pytest

from qtool.fixtures.sparse import build_sparse
from qtool.ops import calibrate_kv, quantize
from qtool.recipes import load_recipe
from qtool.stream import hidden_store, memory_plan

GiB = 2**30


@pytest.fixture(scope="module")
def real_bf16(tmp_path_factory):
    return build_sparse(tmp_path_factory.mktemp("m") / "bf16", model="397b", flavour="bf16-per-expert", mtp=False)


@pytest.fixture(scope="module")
def real_nvfp4(tmp_path_factory):
    return build_sparse(
        tmp_path_factory.mktemp("m") / "nvfp4", model="397b", flavour="modelopt-nvfp4", mtp=False, kv_scales=False
    )


def _quantize_plan(src, tmp_path, device):
    return quantize.plan(
        quantize.QuantizeOptions(
            src, out=tmp_path / "q", recipe=load_recipe("qwen35-nvfp4-experts"), samples=2, seq_len=2048, device=device
        )
    )


def test_quantize_holds_the_layers_in_flight_and_one_read_ahead(real_bf16, tmp_path):
    """The layer running and the finished ones written behind it (two where they fit) dense, the next one
    as stored."""
    cpu = _quantize_plan(real_bf16, tmp_path, "cpu")
    sp = cpu.stream
    assert 12 * GiB < sp.max_layer_bytes < 13 * GiB  # one 397B decoder layer in BF16 (~13.1 GB)
    assert sp.max_stored_layer_bytes == pytest.approx(sp.max_layer_bytes, rel=0.01)  # a BF16 source
    assert cpu.memory.gpu_bytes is None
    assert cpu.memory.host_bytes >= (1 + cpu.layers_in_flight) * sp.max_layer_bytes + sp.max_stored_layer_bytes
    gpu = _quantize_plan(real_bf16, tmp_path, "cuda")
    kept = 2 * gpu.stream.hidden_bytes  # the layer's input and output hidden states, kept on the GPU
    assert 0 < kept <= hidden_store.HIDDEN_ON_DEVICE_MAX
    assert gpu.layers_in_flight == (2 if gpu.memory_need(2).fits is not False else 1)
    assert (
        gpu.memory.gpu_bytes
        == (1 + gpu.layers_in_flight) * sp.max_layer_bytes
        + sp.max_stored_layer_bytes
        + gpu.stream.activation_bytes
        + kept
    )
    assert gpu.memory.host_bytes < 4 * GiB  # staging buffers + the embedding table, not the layer


def test_calibrate_kv_holds_one_dense_layer_and_the_next_as_stored(real_nvfp4, tmp_path):
    p = calibrate_kv.plan(
        calibrate_kv.CalibrateKvOptions(real_nvfp4, out=tmp_path / "kv", samples=2, seq_len=2048, device="cuda")
    )
    sp = p.stream
    assert 3 * GiB < sp.max_stored_layer_bytes < 4 * GiB  # an NVFP4 layer (~3.9 GB)
    assert (
        p.memory.gpu_bytes == sp.max_layer_bytes + sp.max_stored_layer_bytes + sp.activation_bytes + 2 * sp.hidden_bytes
    )  # the hidden states kept on the GPU


def test_hidden_states_too_large_for_the_gpu_stay_on_disk_only(real_nvfp4):
    """A calibration set whose two hidden-state sets would pass HIDDEN_ON_DEVICE_MAX is not kept on the
    GPU: the plan counts none there (the store reads the files); a smaller one is counted twice."""
    from qtool.stream.layer_stream import LayerStreamer

    streamer = LayerStreamer(real_nvfp4, device="cuda")
    big, small = streamer.plan(160, 2048), streamer.plan(16, 2048)
    assert 2 * big.hidden_bytes > hidden_store.HIDDEN_ON_DEVICE_MAX >= 2 * small.hidden_bytes
    assert not hidden_store.hidden_on_device("cuda", big.hidden_bytes)
    assert not hidden_store.hidden_on_device("cpu", small.hidden_bytes)
    fixed = big.max_layer_bytes + big.max_stored_layer_bytes
    assert memory_plan.need(big, device="cuda").gpu_bytes == fixed + big.activation_bytes
    assert memory_plan.need(small, device="cuda").gpu_bytes == fixed + small.activation_bytes + 2 * small.hidden_bytes


def test_dry_run_says_whether_it_fits(real_bf16, tmp_path, monkeypatch):
    monkeypatch.setattr(memory_plan, "_host_available", lambda: 16 * GiB)
    small = _quantize_plan(real_bf16, tmp_path, "cpu")
    assert small.memory.fits is False
    assert any("peak memory does not fit this machine: host RAM" in w for w in small.warnings)
    monkeypatch.setattr(memory_plan, "_host_available", lambda: 1024 * GiB)
    assert small.memory_need().fits is True
    # a GPU plan made on a machine without one: the host part is known, the GPU part is not
    small.device = "cuda"
    assert small.memory_need().fits is None
    monkeypatch.setattr(memory_plan, "_gpu_free", lambda devs: {d: 30 * GiB for d in devs})
    m = small.memory_need()
    assert m.fits is False and m.problems[0].startswith("cuda: needs ~")


def _dense_numel_from_shapes(mod) -> int:
    """The dense element count from each tensor's header shape (what a layer's state dict holds)."""
    from math import prod

    from qtool.arch.model_map import Format
    from qtool.stream.dequant import _AUX_PARAMS

    p = dict(mod.params.items())
    plain = sum(
        i.numel
        for n, i in p.items()
        if n not in _AUX_PARAMS and not (n == "weight" and i.dtype in ("U8", "F8_E4M3", "F8_E5M2"))
    )
    if mod.format in (Format.NVFP4, Format.NVFP4_CT):
        w = p.get("weight") or p.get("weight_packed")
        return prod(w.shape) * 2 + plain  # two FP4 values a byte
    if mod.format is Format.INT4_CT:
        return prod(p["weight_packed"].shape) * 8 + plain  # eight INT4 values an int32
    if mod.format is Format.AWQ:
        return prod(p["qweight"].shape) * 8 + plain
    return plain + (p["weight"].numel if mod.format is Format.FP8 else 0)


@pytest.mark.parametrize("flavour", ["bf16-fused", "bf16-per-expert", "modelopt-nvfp4", "ct-nvfp4"])
def test_dense_layer_sizes_from_byte_counts_match_the_shapes(tmp_path, flavour):
    """layer_sizes (the memory plan's per-layer dense and stored bytes) reads byte counts, not shapes (a 397B
    map has ~93k modules; making each tensor's TensorInfo took seconds of a plan): every module's dense size
    equals the one its header shapes give, in each stored format."""
    from qtool.arch.model_map import build_map
    from qtool.io.checkpoint import Checkpoint
    from qtool.stream.dequant import dense_numel

    src = build_sparse(tmp_path / flavour, model="35b", flavour=flavour, mtp=True)
    mm = build_map(Checkpoint.open(src), read_values=False)
    formats = set()
    for mod in mm.modules.values():
        assert dense_numel(mod) == _dense_numel_from_shapes(mod), mod.name
        formats.add(mod.format)
    assert len(formats) >= (3 if "nvfp4" in flavour else 2)  # the quantized, BF16 and matrix-less modules


@pytest.mark.parametrize(
    "fmt,params",
    [
        ("AWQ", [("qweight", "I32", (64, 16)), ("qzeros", "I32", (2, 16)), ("scales", "F16", (2, 128))]),
        (
            "INT4_CT",
            [("weight_packed", "I32", (128, 8)), ("weight_scale", "BF16", (128, 2)), ("weight_shape", "I64", (2,))],
        ),
        ("FP8", [("weight", "F8_E4M3", (128, 64)), ("weight_scale_inv", "F32", (1, 1))]),
        ("BF16", [("weight", "BF16", (128, 64)), ("bias", "BF16", (128,))]),
    ],
)
def test_dense_sizes_of_packed_int4_and_fp8_modules(fmt, params):
    """The formats no sparse fixture stores: AWQ's qweight and compressed-tensors' weight_packed (eight INT4
    values an int32), FP8 with its block scales, and BF16 with a bias."""
    from qtool.arch.model_map import Format, Module, extend_signature
    from qtool.arch.qwen35 import Group
    from qtool.io.dtypes import nbytes_for
    from qtool.io.tensor_table import TensorTable
    from qtool.stream.dequant import dense_numel

    table, sig, start = TensorTable(), (), 0
    for name, dtype, shape in params:
        n = nbytes_for(dtype, shape)
        table.add(f"m.{name}", "shard", dtype, shape, start, start + n)
        sig, start = extend_signature(sig, name, dtype, len(shape)), start + n
    mod = Module(
        "m",
        Group.ROUTED_EXPERTS,
        Group.ROUTED_EXPERTS,
        0,
        0,
        sig,
        None if fmt == "BF16" else Format[fmt],
        tensors=table,
    )
    assert dense_numel(mod) == _dense_numel_from_shapes(mod)
    # the dequantized matrix (its scales, zeros and shape vanish in it), and a bias as it is
    assert dense_numel(mod) == 128 * 64 + (128 if fmt == "BF16" else 0)
