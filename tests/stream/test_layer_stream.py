"""The layer-streamed forward reproduces transformers' full text model (hidden states after the last
layer, final norm applied), with the hidden states in RAM or on disk."""

from __future__ import annotations

import time

import pytest
import torch
from full_model import dense_text_model, fixture_dir

from qtool.stream.calib_data import build_calib_set
from qtool.stream.hidden_store import DiskStore, MemoryStore
from qtool.stream.layer_run import LayerRun, LayerStage
from qtool.stream.layer_stream import LayerStreamer


def _final(streamer, store):
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm

    from qtool.stream.dequant import load_param

    norm = Qwen3_5MoeRMSNorm(streamer.hidden_size, eps=streamer.hf_config.rms_norm_eps)
    norm.weight.data = load_param(streamer.model_map, streamer.prefix + "norm.weight", torch.bfloat16)
    with torch.no_grad():
        return norm(store.read(0, store.shape[0]))


def test_streamed_forward_equals_full_model(request, tmp_path):
    ckpt = fixture_dir(request, "tiny_nvfp4_ct")
    ids = build_calib_set(ckpt, "builtin", 3, 16).ids
    s = LayerStreamer(ckpt)
    mem = MemoryStore.empty((3, 16, s.hidden_size), s.dtype)
    s.embed_into(ids, mem, 2)
    s.run(mem, 16, batch=2)
    disk = DiskStore(tmp_path, (3, 16, s.hidden_size), s.dtype)
    s.embed_into(ids, disk, 3)
    s.run(disk, 16, stop=4, batch=3)  # in two legs, as --resume does
    disk = DiskStore(tmp_path, (3, 16, s.hidden_size), s.dtype, current=disk.current)  # a new process
    s.run(disk, 16, start=4, batch=3)
    with torch.no_grad():
        full = dense_text_model(ckpt)(input_ids=ids).last_hidden_state
    assert torch.equal(_final(s, mem), full)
    assert torch.equal(disk.read(0, 3), mem.read(0, 3))


def test_a_stage_is_called_at_each_event_and_its_writes_commit_in_layer_order(request):
    """A method plugs into the one layer loop as a stage: called at each event of each layer, its layer
    writes run behind the forward and commit in layer order even when a later one is written first."""
    ckpt = fixture_dir(request, "tiny_nvfp4_ct")
    ids = build_calib_set(ckpt, "builtin", 2, 16).ids
    s = LayerStreamer(ckpt)
    store = MemoryStore.empty((2, 16, s.hidden_size), s.dtype)
    s.embed_into(ids, store, 1)
    events: list[tuple] = []

    class Write:
        behind = True

        def __init__(self, idx: int) -> None:
            self.idx = idx

        def prepare(self) -> None:
            events.append(("prepare", self.idx))

        def write(self, keep_pace: bool) -> int:
            if self.idx == 0:
                time.sleep(0.5)  # layer 1 is written first: it still commits after layer 0
            return self.idx

        def commit(self, shares: list) -> None:
            events.append(("commit", self.idx, shares))
            run.layer_done(self.idx, "")

    class Recorder(LayerStage):
        sees_batches = True

        def before_forward(self, run, idx, layer) -> None:
            events.append(("forward", idx))

        def on_batch(self, b0: int) -> None:
            events.append(("batch", b0))

        def after_forward(self, run, idx, layer) -> None:
            events.append(("after-forward", idx))

        def code(self, run, idx, layer) -> Write:
            return Write(idx)

    run = LayerRun(s, store, 16, 1, [0, 1, 2], [Recorder()], layers_in_flight=2)
    s.run_layers(run)
    s.close()
    assert events[:5] == [("forward", 0), ("batch", 0), ("batch", 1), ("after-forward", 0), ("prepare", 0)]
    assert [e[1:] for e in events if e[0] == "commit"] == [(0, [0]), (1, [1]), (2, [2])]
    assert len(s.clock["layers_done"]) == 3


def test_plan_counts_one_dense_layer(request):
    s = LayerStreamer(fixture_dir(request, "tiny_nvfp4_modelopt"))
    plan = s.plan(4, 64)
    layer = s.load_layer(3)
    dense = sum(p.numel() * p.element_size() for p in layer.parameters())
    assert plan.layer_bytes[3] == dense
    assert plan.hidden_bytes == 4 * 64 * s.hidden_size * 2


def _experts_and_routing():
    """transformers' eager routed experts (hidden 64, 24 experts, top 4) and 300 tokens' routing that
    leaves experts 20..23 unhit."""
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeExperts

    cfg = Qwen3_5MoeTextConfig(hidden_size=64, moe_intermediate_size=32, num_experts=24, num_experts_per_tok=4)
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    mod = Qwen3_5MoeExperts(cfg).to(torch.bfloat16)
    for p in mod.parameters():
        p.data.normal_(0, 0.05)
    x = torch.randn(300, 64, dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(20)[:4] for _ in range(300)])
    w = torch.softmax(torch.randn(300, 4), -1).to(torch.bfloat16)
    return mod, x, idx, w


def test_routed_forward_is_transformers_eager_bit_for_bit():
    """qtool.stream.experts drops eager's per-expert host sync, not its numerics: same output bytes,
    and the recorder sees each expert's rows in eager's order (experts hit, missed, all top-k slots)."""
    from qtool.stream import experts as routed

    mod, x, idx, w = _experts_and_routing()
    with torch.no_grad():
        want = mod(x, idx, w)
        seen = {}
        got = routed.routed_forward(mod, x, idx, w, lambda e, cur, mid: seen.setdefault(e, cur.clone()))
    assert torch.equal(got, want)
    assert sorted(seen) == list(range(20))
    mask = torch.nn.functional.one_hot(idx, 24).permute(2, 1, 0)
    for e, cur in seen.items():
        assert torch.equal(cur, x[torch.where(mask[e])[1]])


def test_grouped_experts_match_the_loop_to_rounding(monkeypatch):
    """eval kld's grouped matmul (qtool.stream.experts.grouped_forward, run here by torch's CPU kernel)
    gives the eager loop's output to bf16 rounding, chunk by chunk, the same bytes on every call; it is
    chosen only on a GPU that runs it, at widths it takes, unless QTOOL_ROUTED_EXPERTS=eager."""
    from qtool.stream import experts as routed

    mod, x, idx, w = _experts_and_routing()
    want = routed.routed_forward(mod, x, idx, w)
    got = routed.grouped_forward(mod, x, idx, w)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)  # bf16: a few ulps where sums differ
    assert not torch.equal(routed.grouped_forward(mod, x, idx, w.flip(-1)), got)  # the weights matter
    monkeypatch.setattr(routed, "GROUPED_TOKENS", 128)  # 3 chunks, the last one short
    assert torch.equal(routed.grouped_forward(mod, x, idx, w), got)

    monkeypatch.setattr(routed, "_grouped_mm_runs", lambda device: True)  # a GPU whose torch runs it
    assert routed.choose(routed.GROUPED, "cuda", 64, 32) == routed.GROUPED
    assert routed.choose(routed.GROUPED, "cpu", 64, 32) == routed.EAGER  # CPU: transformers' numbers exactly
    assert routed.choose(routed.EAGER, "cuda", 64, 32) == routed.EAGER
    assert routed.choose(routed.GROUPED, "cuda", 64, 36) == routed.EAGER  # 72-byte rows: not for the kernel
    assert routed.choose(routed.GROUPED, "cuda", 64, 32, "float32") == routed.EAGER  # a float32 run
    assert routed.choose(routed.GROUPED, "cuda", 64, 0) == routed.EAGER  # a config without moe_intermediate_size
    monkeypatch.setenv("QTOOL_ROUTED_EXPERTS", "eager")
    assert routed.choose(routed.GROUPED, "cuda", 64, 32) == routed.EAGER


def test_batched_expert_dequant_is_the_per_expert_one(request):
    """NVFP4 experts (both namings) dequantized in one batched call: the same values as one matrix at a
    time; an expert whose shape disagrees with the config is named."""
    import pytest

    from qtool.arch.model_map import build_map
    from qtool.errors import PlanError
    from qtool.io.checkpoint import Checkpoint
    from qtool.stream.dequant import TensorSource, _dense_experts, dense_weight

    for name in ("tiny_nvfp4_modelopt", "tiny_nvfp4_ct"):
        mm = build_map(Checkpoint.open(fixture_dir(request, name)))
        mods = sorted(
            (
                m
                for m in mm.modules.values()
                if m.layer == 1 and m.name.endswith(".down_proj") and ".mlp.experts." in m.name
            ),
            key=lambda m: int(m.name.split(".mlp.experts.")[1].split(".")[0]),
        )
        src = TensorSource()
        one = torch.stack([dense_weight(m, torch.bfloat16, "cpu", src) for m in mods])
        assert torch.equal(_dense_experts(mods, torch.bfloat16, "cpu", src, tuple(one.shape[1:])), one)
        with pytest.raises(PlanError, match="expert weight shape differs") as e:
            _dense_experts(mods, torch.bfloat16, "cpu", src, (one.shape[1], one.shape[2] * 2))
        assert e.value.tensor == mods[0].name
        src.close()


@pytest.mark.gpu
def test_hidden_states_kept_on_cuda_are_the_files(request, tmp_path):
    """On CUDA the stores keep the hidden states on the device (reads served from there): the streamed
    forward gives the same hidden states as on the CPU path's files, the files hold the same bytes (what
    --resume reads), a store reopened on a resume reads them, and a caller's read is its own copy."""
    ckpt = fixture_dir(request, "tiny_bf16")  # made by transformers alone (the GPU machine has no peer library)
    ids = build_calib_set(ckpt, "builtin", 3, 16).ids
    s = LayerStreamer(ckpt, device="cuda")
    shape = (3, 16, s.hidden_size)
    (tmp_path / "kept").mkdir()
    (tmp_path / "files").mkdir()
    disk = DiskStore(tmp_path / "kept", shape, s.dtype, write_behind=True, device="cuda")
    assert disk.keep_on == "cuda"
    s.embed_into(ids, disk, 2)
    s.run(disk, 16, stop=3, batch=2)
    disk.drain()
    reopened = DiskStore(tmp_path / "kept", shape, s.dtype, current=disk.current)  # a resumed run: no copy kept
    assert reopened.keep_on is None
    kept = disk.read(0, 2)  # a micro-batch as written (windows 0-1): from the device
    assert kept.device.type == "cuda"
    assert torch.equal(kept.cpu(), reopened.read(0, 2))  # the file holds what the device copy holds
    assert disk.read(2, 3).device.type == "cuda"
    assert disk.read(0, 3).device.type == "cpu"  # across two kept micro-batches: read from the file
    kept.zero_()
    assert not torch.equal(disk.read(0, 2).cpu(), kept.cpu())  # the caller's copy, not the store's
    s.run(disk, 16, start=3, batch=2)

    plain = DiskStore(tmp_path / "files", shape, s.dtype, device="cpu")  # the file path, same device compute
    s.embed_into(ids, plain, 2)
    s.run(plain, 16, batch=2)
    assert plain.keep_on is None
    assert torch.equal(disk.read(0, 3).cpu(), plain.read(0, 3))
    mem = MemoryStore.empty(shape, s.dtype, "cuda")
    assert mem.t.device.type == "cuda"
    s.embed_into(ids, mem, 2)
    s.run(mem, 16, batch=2)
    assert torch.equal(mem.read(0, 3).cpu(), plain.read(0, 3))
    disk.close()
