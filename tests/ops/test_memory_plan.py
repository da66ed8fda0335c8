"""The memory plan of the layer-streamed jobs at the 397B's real layer size (sparse real headers): what
quantize / calibrate-kv hold on the host and the GPU, and the dry run's fit verdict for this machine."""

from __future__ import annotations

import pytest

from qtool.fixtures.sparse import build_sparse
from qtool.ops import calibrate_kv, quantize
from qtool.recipes import load_recipe
from qtool.stream import layer_stream, memory_plan

GiB = 2**30


@pytest.fixture(scope="module")
def real_bf16(tmp_path_factory):
    return build_sparse(tmp_path_factory.mktemp("m") / "bf16", model="397b", flavour="bf16-per-expert", mtp=False)


@pytest.fixture(scope="module")
def real_nvfp4(tmp_path_factory):
    return build_sparse(tmp_path_factory.mktemp("m") / "nvfp4", model="397b", flavour="modelopt-nvfp4", mtp=False,
                        kv_scales=False)


def _quantize_plan(src, tmp_path, device):
    return quantize.plan(quantize.QuantizeOptions(src, out=tmp_path / "q", recipe=load_recipe("qwen35-nvfp4-experts"),
                                                  samples=2, seq_len=2048, device=device))


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
    assert 0 < kept <= layer_stream.HIDDEN_ON_DEVICE_MAX
    assert gpu.layers_in_flight == (2 if gpu.memory_need(2).fits is not False else 1)
    assert gpu.memory.gpu_bytes == (1 + gpu.layers_in_flight) * sp.max_layer_bytes + sp.max_stored_layer_bytes + gpu.stream.activation_bytes + kept
    assert gpu.memory.host_bytes < 4 * GiB  # staging buffers + the embedding table, not the layer


def test_calibrate_kv_holds_one_dense_layer_and_the_next_as_stored(real_nvfp4, tmp_path):
    p = calibrate_kv.plan(calibrate_kv.CalibrateKvOptions(real_nvfp4, out=tmp_path / "kv", samples=2, seq_len=2048,
                                                          device="cuda"))
    sp = p.stream
    assert 3 * GiB < sp.max_stored_layer_bytes < 4 * GiB  # an NVFP4 layer (~3.9 GB)
    assert p.memory.gpu_bytes == sp.max_layer_bytes + sp.max_stored_layer_bytes + sp.activation_bytes \
        + 2 * sp.hidden_bytes  # the hidden states kept on the GPU


def test_hidden_states_too_large_for_the_gpu_stay_on_disk_only(real_nvfp4):
    """A calibration set whose two hidden-state sets would pass HIDDEN_ON_DEVICE_MAX is not kept on the
    GPU: the plan counts none there (the store reads the files); a smaller one is counted twice."""
    from qtool.stream.layer_stream import LayerStreamer

    streamer = LayerStreamer(real_nvfp4, device="cuda")
    big, small = streamer.plan(160, 2048), streamer.plan(16, 2048)
    assert 2 * big.hidden_bytes > layer_stream.HIDDEN_ON_DEVICE_MAX >= 2 * small.hidden_bytes
    assert not layer_stream.hidden_on_device("cuda", big.hidden_bytes)
    assert not layer_stream.hidden_on_device("cpu", small.hidden_bytes)
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
