"""Layer-streamed forward of a Qwen3.5-MoE text model: one decoder layer's weights resident at a time.

Shared by calibrate-kv (KV-cache scales), and meant for quantize (per-layer activation statistics) and
eval kld (final norm + lm_head on the streamed hidden states).

How (docs/formats.md §9, checked with transformers 5.17): transformers' own
`Qwen3_5MoeDecoderLayer(text_config, layer_idx)` built alone, loaded with that layer's weights
(dequantized to the compute dtype by qtool.stream.dequant, whatever the storage format), called on the
hidden states with `position_embeddings` from `Qwen3_5MoeTextRotaryEmbedding` (position ids [3, batch,
seq], the same positions in all three mrope rows for text) and no attention mask: with the `sdpa`
attention a missing mask means causal (transformers/integrations/sdpa_attention.py), and the GDN layers
need a mask only for padding. This reproduces the full model's forward exactly, GDN layers included.

Memory: the layer is built on the meta device and its parameters are assigned from tensors read (and
dequantized) one module at a time, routed experts one expert at a time straight into the fused
[E, 2I, H] / [E, H, I] buffers transformers uses. The calibration set's hidden states live in a
HiddenStore (qtool.stream.hidden_store).

Taps: `attention_tap(layer, fn)` makes the full-attention module call fn(module, key, value) with
exactly the key/value tensors the attention kernel receives (after k_proj, k_norm and the rotary
embedding; after v_proj) -- what an engine writes into its KV cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qtool import dist
from qtool.arch.model_map import ModelMap, build_map
from qtool.arch.qwen35 import Group, layer_prefix, text_prefix
from qtool.errors import PlanError
from qtool.io.checkpoint import Checkpoint
from qtool.io.safetensors_header import TensorInfo
from qtool.io.stream_digest import NO_DIGESTS, DigestSink
from qtool.io.tensor_table import file_of
from qtool.io.writer import FileRange
from qtool.quiet import transformers_errors_only
from qtool.stream import experts, warm_import
from qtool.stream.dequant import (
    dense_numel,
    embedding_rows,
    layer_state_dict,
    layer_tensors,
    missing_layer,
    modules_by_layer,
)
from qtool.stream.hidden_store import DiskStore, HiddenStore
from qtool.stream.kernels import select_gdn_kernel
from qtool.stream.layer_read import Prefetcher
from qtool.stream.layer_run import LayerRun, LayerStage, WriteBehind, write_behind

if TYPE_CHECKING:
    import torch

TAP_ATTENTION = "qtool_tap_sdpa"
# what an attention tap is called with: the attention module, and the key and value its kernel receives
Tap = Callable[["torch.nn.Module", "torch.Tensor", "torch.Tensor"], None]
_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


# ---- attention tap ---------------------------------------------------------------------------------


def _register_tap() -> None:
    """Register an attention function that reports (key, value) to the module's tap and then runs sdpa.
    The function is looked up by name in transformers' AttentionInterface from `config._attn_implementation`
    (transformers/modeling_utils.py AttentionInterface; models/qwen3_5_moe Qwen3_5MoeAttention.forward)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if TAP_ATTENTION in AttentionInterface._global_mapping:
        return

    def tapped(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        tap = getattr(module, "_qtool_tap", None)
        if tap is not None:
            tap(module, key, value)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(TAP_ATTENTION, tapped)


def kv_amax_tap(st: Any) -> Tap:
    """The one K/V statistics tap (calibrate-kv and quantize): running amax of the key and value that
    reach the attention kernel (after k_norm and RoPE, i.e. what the KV cache holds) and the tokens seen,
    into `st` (any object with k_amax, v_amax and tokens). key/value: [batch, kv_heads, seq, head_dim]."""

    def tap(module: torch.nn.Module, key: torch.Tensor, value: torch.Tensor) -> None:
        st.k_amax = max(st.k_amax, float(key.detach().abs().amax().float()))
        st.v_amax = max(st.v_amax, float(value.detach().abs().amax().float()))
        st.tokens += int(key.shape[0] * key.shape[2])

    return tap


def attention_tap(layer: torch.nn.Module, fn: Tap | None) -> None:
    """Set (or clear, fn=None) the K/V tap of a decoder layer's full attention (no-op for GDN layers)."""
    attn = getattr(layer, "self_attn", None)
    if attn is not None:
        attn._qtool_tap = fn


# ---- the streamer ----------------------------------------------------------------------------------


def compute_itemsize(dtype_name: str) -> int:
    """Bytes an element of the streamed compute dtype takes (float32, else bfloat16 / float16)."""
    return 4 if dtype_name == "float32" else 2


@dataclass
class StreamPlan:
    num_layers: int
    layer_types: list[str]
    hidden_size: int
    compute_dtype: str
    layer_bytes: list[int]  # dense bytes of each decoder layer in the compute dtype
    embed_bytes: int
    hidden_bytes: int  # the calibration set's hidden states, one copy
    batch_windows: int
    activation_bytes: int  # rough per-micro-batch activation peak
    seq_len: int = 0
    stored_layer_bytes: list[int] | None = None  # each decoder layer's bytes as stored (what is read ahead)

    @property
    def itemsize(self) -> int:
        return compute_itemsize(self.compute_dtype)

    @property
    def max_layer_bytes(self) -> int:
        return max(self.layer_bytes) if self.layer_bytes else 0

    @property
    def max_stored_layer_bytes(self) -> int:
        return max(self.stored_layer_bytes) if self.stored_layer_bytes else 0

    def to_json(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "compute_dtype": self.compute_dtype,
            "max_layer_bytes": self.max_layer_bytes,
            "max_stored_layer_bytes": self.max_stored_layer_bytes,
            "embed_bytes": self.embed_bytes,
            "hidden_bytes": self.hidden_bytes,
            "batch_windows": self.batch_windows,
            "activation_bytes": self.activation_bytes,
        }


def streamed_files(ckpt: Checkpoint, model_map: ModelMap | None = None) -> set[str]:
    """The shard files a layer-streamed job reads (its decoder layers' and the embedding's): what it hashes
    from its own reads (qtool.io.apply.input_hasher's hash_from_reads). `model_map`: the plan's map of `ckpt`.
    The layers' modules are those `layer_tensors` reads, found in one pass (per layer, over the 397B's ~95k
    modules and with a TensorInfo per tensor, it took seconds)."""
    if model_map is None or model_map.ckpt is not ckpt:
        model_map = build_map(ckpt)
    files: set[str] = set()
    for i, mods in enumerate(modules_by_layer(model_map)):
        if not mods:
            raise missing_layer(model_map, i)  # as layer_tensors
        for m in mods:
            if m.group is not Group.KV_SCALE:  # as layer_tensors
                files.update(m.param_file(p) for p in m.param_names)
    embed = text_prefix(model_map.naming) + "embed_tokens.weight"
    return files | ({file_of(ckpt.tensors, embed)} if embed in ckpt.tensors else set())


class LayerStreamer:
    """Streams a checkpoint's text decoder layers. Construct from a Checkpoint or path."""

    def __init__(
        self,
        ckpt: Checkpoint | str | Path,
        *,
        device: str = "cpu",
        dtype: str | None = None,
        batch_tokens: int | None = None,
        model_map: ModelMap | None = None,
        routed_experts: str = "eager",
        digests: DigestSink = NO_DIGESTS,
    ) -> None:
        self.group = dist.current()  # data parallel: this rank computes its share of the micro-batches
        self.batch_tokens = batch_tokens  # tokens per micro-batch (default: 4096 on CPU, 32768 on GPU)
        self.ckpt = ckpt if isinstance(ckpt, Checkpoint) else Checkpoint.open(ckpt, require_config=True)
        # model_map: the map a plan already built of this same checkpoint object (the 397B's: ~1 s to build again)
        if model_map is None or model_map.ckpt is not self.ckpt:
            model_map = build_map(self.ckpt)
        self.model_map: ModelMap = model_map
        tc = self.ckpt.text_config
        if not tc or "hidden_size" not in tc:
            raise PlanError("config.json has no text config with hidden_size", path=self.ckpt.root)
        self.text_cfg_dict = tc
        self.device = device
        want = dtype or tc.get("dtype") or tc.get("torch_dtype") or (self.ckpt.config or {}).get("dtype") or "bfloat16"
        self.dtype_name = _DTYPES.get(str(want), "bfloat16")
        self.prefix = text_prefix(self.model_map.naming)
        embed = self.ckpt.tensors.get(self.prefix + "embed_tokens.weight")
        if embed is not None and (len(embed.shape) != 2 or embed.shape[1] != int(tc["hidden_size"])):
            # a config that disagrees with the tensors fails here by name, not as a shape error mid-forward
            raise PlanError(
                "config.json's hidden_size does not match the embedding's width",
                path=self.ckpt.root / "config.json",
                tensor=embed.name,
                expected=f"hidden_size {embed.shape[-1]}",
                got=f"hidden_size {tc['hidden_size']}",
                hint="restore config.json from the checkpoint's source repository",
            )
        self._hf_config = None
        self._layer_sizes: tuple[list[int], list[int]] | None = None
        self._rotary: Any = None  # transformers' rotary embedding, made on first use
        self.digests = digests  # the job's inputs hashed from this streamer's reads (qtool.io.stream_digest)
        self._reader = Prefetcher(device, digests)
        # wall-clock times (epoch seconds) for benchmarks: when the first layer began loading, when each
        # layer was done (the op appends: quantize once its shard is written); reported, never in manifests
        self.clock: dict = {"first_layer_start": None, "layers_done": []}
        self.gdn_kernel: str | None = None  # qtool.stream.kernels: set when the first layer is built
        # qtool.stream.experts: what the op asks for ("grouped_mm": eval kld) and, from the first layer, runs
        self._routed_wanted = routed_experts
        self.experts_kernel: str | None = None
        self._after_layers: tuple | None = None  # (key, tensors) read while the last layer runs

    # -- config ---------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype_name)

    @property
    def hf_config(self) -> Any:
        """transformers' Qwen3_5MoeTextConfig from the checkpoint's text config, attention = the tap."""
        if self._hf_config is None:
            warm_import.join()
            from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

            _register_tap()
            d = {k: v for k, v in self.text_cfg_dict.items() if k not in ("architectures", "model_type")}
            cfg = Qwen3_5MoeTextConfig(**d)
            cfg._attn_implementation = TAP_ATTENTION
            self._hf_config = cfg
        return self._hf_config

    @property
    def num_layers(self) -> int:
        return len(self.model_map.layer_types)

    @property
    def hidden_size(self) -> int:
        return int(self.text_cfg_dict["hidden_size"])

    # -- plan -----------------------------------------------------------------------------------
    def layer_tensor_names(self, idx: int) -> list[str]:
        p = layer_prefix(idx, self.model_map.naming)
        return [n for n in self.ckpt.tensors if n.startswith(p)]

    def layer_bytes(self, idx: int) -> int:
        return self.layer_sizes()[0][idx]

    def layer_sizes(self) -> tuple[list[int], list[int]]:
        """Per decoder layer: (dense bytes in the compute dtype, bytes as stored: what is read), in one
        pass over the modules (a 397B NVFP4 map has ~90k of them), made once (the plan and eval kld's
        prepare both ask)."""
        if self._layer_sizes is not None:
            return list(self._layer_sizes[0]), list(self._layer_sizes[1])  # callers' own lists
        item = compute_itemsize(self.dtype_name)
        dense, stored = [0] * self.num_layers, [0] * self.num_layers
        for i, mods in enumerate(modules_by_layer(self.model_map)):
            for mod in mods:
                if mod.group is Group.KV_SCALE:
                    continue
                dense[i] += dense_numel(mod) * item
                stored[i] += mod.nbytes()  # from the tensor table's columns, like dense_numel: no TensorInfo
        self._layer_sizes = (list(dense), list(stored))
        return dense, stored

    def plan(self, samples: int, seq_len: int, *, tokens_per_batch: int | None = None) -> StreamPlan:
        tc = self.text_cfg_dict
        item = compute_itemsize(self.dtype_name)
        h = self.hidden_size
        bw = min(max(1, samples), self.batch_windows(seq_len, tokens_per_batch))
        dense, stored = self.layer_sizes()
        toks = bw * seq_len
        embed = self.ckpt.tensors.get(self.prefix + "embed_tokens.weight")
        inter = max(
            int(tc.get("num_attention_heads", 1)) * int(tc.get("head_dim", 128)) * 2,
            int(tc.get("linear_num_value_heads", 1)) * int(tc.get("linear_value_head_dim", 1)) * 3,
            int(tc.get("num_experts", 1)),
            int(tc.get("shared_expert_intermediate_size", 0)) * 2,
        )
        # float32 copies of the widest intermediates; x2 fitted to the peaks measured on an H200 at the
        # 397B's layer size (32k tokens a micro-batch: 48 GB calibrate-kv, 70 GB quantize; issue 13 notes)
        act = toks * (6 * h + 3 * inter) * 4 * 2
        return StreamPlan(
            num_layers=self.num_layers,
            layer_types=list(self.model_map.layer_types),
            hidden_size=h,
            compute_dtype=self.dtype_name,
            layer_bytes=dense,
            embed_bytes=(embed.numel * item) if embed is not None else 0,
            hidden_bytes=samples * seq_len * h * item,
            batch_windows=bw,
            activation_bytes=act,
            seq_len=seq_len,
            stored_layer_bytes=stored,
        )

    def batch_windows(self, seq_len: int, tokens_per_batch: int | None = None) -> int:
        tokens_per_batch = tokens_per_batch or self.batch_tokens
        if tokens_per_batch is None:
            tokens_per_batch = 4096 if self.device == "cpu" else 32768
        return max(1, tokens_per_batch // seq_len)

    # -- pieces ---------------------------------------------------------------------------------
    def embed_into(self, ids: torch.Tensor, store: HiddenStore, batch: int) -> None:
        """Embed token windows [N, L] into the store (as the input of layer 0)."""
        import torch

        mine = self.my_batches(ids.shape[0], batch)
        used = torch.cat([ids[b0:b1].reshape(-1) for b0, b1 in mine]) if mine else ids[:0]
        embed = self.prefix + "embed_tokens.weight"
        w, lookup = embedding_rows(self.model_map, embed, used, self.dtype, every_id=ids, digests=self.digests)
        for b0, b1 in mine:
            x = w[lookup[ids[b0:b1]]]
            if isinstance(store, DiskStore):
                store.write_current(b0, b1, x)
            else:
                store.write(b0, b1, x)
        del w
        if isinstance(store, DiskStore):
            store.settle_current()  # durable before the caller's journal names them as layer 0's input
        self.group.barrier()  # every rank's windows are in the store before the journal says layer 0

    def my_batches(self, n: int, batch: int) -> list[tuple[int, int]]:
        """The window ranges [b0, b1) of the micro-batches this rank computes (all of them alone): the
        same micro-batches whatever the number of ranks (qtool.dist)."""
        spans = every_batch(n, batch)
        return [spans[k] for k in self.group.mine(len(spans))]

    def position_embeddings(self, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        self.hf_config  # noqa: B018 -- after the background import (warm_import.join)
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding

        if self._rotary is None:
            self._rotary = Qwen3_5MoeTextRotaryEmbedding(self.hf_config).to(self.device)
        pos = torch.arange(seq_len, device=self.device).view(1, 1, -1).expand(3, batch, -1)
        x = torch.empty(0, dtype=self.dtype, device=self.device)
        return self._rotary(x, pos)

    def load_layer(self, idx: int, keep_bytes: dict[str, FileRange] | None = None) -> torch.nn.Module:
        """transformers' decoder layer `idx` with this checkpoint's weights, dense, on self.device.
        keep_bytes: output tensor name -> the source's byte range (a FileRange) it copies unchanged (quantize's
        copied tensors, whole tensors or one expert's slice of a fused one): kept as uint8 views of the
        bytes read, where they were read to (the device), in `layer.qtool_bytes` (name -> tensor), not read
        from the file again. Views, not host copies: a layer kept in BF16 copies all its experts (~13 GB
        at the 397B), whose `.cpu()` here took 9 s of the main thread and as much host memory; the writer
        takes them down in pieces behind the next layer's forward."""
        if self.clock["first_layer_start"] is None:
            self.clock["first_layer_start"] = time.time()
        import torch

        cfg = self.hf_config  # after the background import (warm_import.join)
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer

        if self.gdn_kernel is None:
            self.gdn_kernel = select_gdn_kernel(self.device)

        with torch.device("meta"), transformers_errors_only():
            layer = Qwen3_5MoeDecoderLayer(cfg, idx)
        want = {n: (tuple(p.shape), p.dtype) for n, p in layer.state_dict().items()}
        read = self._reader.take(idx) or self._reader.read_now(layer_tensors(self.model_map, idx))
        try:
            kept = {
                name: view
                for name, src in (keep_bytes or {}).items()
                if (view := read.span(src.file, src.start, src.end)) is not None
            }
            sd = layer_state_dict(self.model_map, idx, self.dtype, self.device, want, src=read)
        finally:
            read.close()  # what the layer keeps (views of BF16 weights) stays alive through it
        layer.load_state_dict(sd, strict=True, assign=True)
        del sd
        if self.experts_kernel is None:
            tc = self.text_cfg_dict
            self.experts_kernel = experts.choose(
                self._routed_wanted,
                self.device,
                self.hidden_size,
                int(tc.get("moe_intermediate_size") or 0),
                self.dtype_name,
            )
        experts.install(layer.mlp.experts, kind=self.experts_kernel)  # no host sync per expert
        layer.qtool_bytes = kept
        return layer.eval()

    @property
    def kernels(self) -> dict:
        """What the manifest and reports record of the kernels that computed the hidden states (two kernels
        round differently): the Gated-DeltaNet mixer's and the routed experts'."""
        return {"gated_deltanet": self.gdn_kernel, "routed_experts": self.experts_kernel}

    def inputs_hashed(self, idx: int) -> None:
        """Wait until the input bytes layer `idx` used (its tensors and the embedding) are hashed, where the
        job hashes its inputs from its reads (qtool.io.stream_digest): call before journaling the layer."""
        if self.digests is NO_DIGESTS:
            return
        ends: dict[str, int] = {}
        embed = self.ckpt.tensors.get(self.prefix + "embed_tokens.weight")
        for i in layer_tensors(self.model_map, idx) + ([embed] if embed is not None else []):
            ends[i.file] = max(ends.get(i.file, 0), i.end)
        self.digests.covered(ends)

    def prefetch(self, idx: int) -> None:
        """Start reading layer `idx`'s bytes in the background (qtool.stream.layer_read): the next
        `load_layer(idx)` takes them instead of reading. A no-op past the last layer."""
        if 0 <= idx < self.num_layers:
            warm_import.start()  # transformers' decoder module, while this layer is read
            self._reader.start(idx, layer_tensors(self.model_map, idx))

    def read_after_layers(self, key: Hashable, infos: list[TensorInfo]) -> None:
        """Have `infos` read while `run`'s last layer computes, in the read-ahead's place (the reader is
        idle then), for `take_read(key)` after the run: eval kld's final norm and lm_head (a 397B's lm_head
        is 2 GB: read on the main thread after the layers, then uploaded, it took 0.8 s on the H200)."""
        self._after_layers = (key, infos)

    def take_read(self, key: Hashable) -> Any:
        """What `read_after_layers(key, ...)` read (a LayerBytes on the device), or None."""
        return self._reader.take(key)

    def close(self) -> None:
        self._reader.close()
        self._note_gpu_peak()

    def _note_gpu_peak(self) -> None:
        """Into the clock: the most torch's allocator handed out against the most it held (nvidia-smi's
        figure); the difference is its cache and fragmentation (benchmarks read it from the report)."""
        if self.device.startswith("cuda"):
            import torch

            dev = torch.device(self.device)
            self.clock["gpu_peak"] = {
                "allocated": torch.cuda.max_memory_allocated(dev),
                "reserved": torch.cuda.max_memory_reserved(dev),
            }

    def forward_layer(
        self,
        layer: torch.nn.Module,
        store: HiddenStore,
        seq_len: int,
        batch: int,
        on_batch: Callable[[int], None] | None = None,
        every_window: bool = False,
    ) -> None:
        """Run this rank's micro-batches through `layer`; on_batch(b0) before each (AWQ keeps rows in
        window order). `every_window`: every micro-batch, in order, as one process runs them (a stage's
        every_window), each rank writing the outputs of its own only (the others compute the same values).
        Returns once every rank's outputs of the layer are committed."""
        import torch

        n = store.shape[0]
        mine = self.my_batches(n, batch)
        batches = every_batch(n, batch) if every_window else mine
        pe = {}
        with torch.inference_mode():
            for b0, b1 in batches:
                if on_batch is not None:
                    on_batch(b0)
                # another rank's windows: written by it in the layer before (a committed store, then a barrier)
                x = store.read(b0, b1).to(self.device, self.dtype)
                if (b1 - b0) not in pe:
                    pe[b1 - b0] = self.position_embeddings(b1 - b0, seq_len)
                y = layer(x, position_embeddings=pe[b1 - b0], attention_mask=None)
                if (b0, b1) in mine:
                    store.write(b0, b1, y)
        store.commit()
        self.group.barrier()  # a journal written after this point finds every rank's windows durable

    def run(
        self,
        store: HiddenStore,
        seq_len: int,
        *,
        start: int = 0,
        stop: int | None = None,
        stages: list[LayerStage] | None = None,
        batch: int | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        """Run layers start..stop-1 over the store (which holds layer `start`'s input), with `stages` and
        no journal (run_layers takes a whole LayerRun)."""
        stop = self.num_layers if stop is None else stop
        batch = batch or self.batch_windows(seq_len)
        self.run_layers(
            LayerRun(self, store, seq_len, batch, list(range(start, stop)), list(stages or []), None, progress)
        )

    def run_layers(self, run: LayerRun) -> None:
        """The one layer loop: each of `run.layers` loaded (the next one read meanwhile), run forward over the
        store and handed to the stages at the events of qtool.stream.layer_run; a layer a stage writes is
        committed by its writer, in order, any other at once."""
        try:
            with write_behind(run):
                for k, idx in enumerate(run.layers):
                    self._layer(run, idx, run.layers[k + 1] if k + 1 < len(run.layers) else None)
        except BaseException:
            self._reader.close()  # an error mid-run: no read left going on behind the caller's back
            raise
        finally:
            self._note_gpu_peak()

    def _layer(self, run: LayerRun, idx: int, next_idx: int | None) -> None:
        keep: dict[str, FileRange] = {}
        for stage in run.stages:
            keep.update(stage.keep_bytes(run, idx))
        layer = self.load_layer(idx, keep_bytes=keep)
        if next_idx is not None:
            self.prefetch(next_idx)  # read while this layer computes (and is written)
        elif self._after_layers is not None:
            self._reader.start(*self._after_layers)
        for stage in run.stages:
            stage.before_forward(run, idx, layer)
        run.every_window = run.group.world > 1 and any(stage.every_window(run, idx) for stage in run.stages)
        on_batch = _batch_callback(run.stages)
        self.forward_layer(layer, run.store, run.seq_len, run.batch, on_batch=on_batch, every_window=run.every_window)
        for stage in run.stages:
            stage.after_forward(run, idx, layer)
        current = run.store.current if isinstance(run.store, DiskStore) else ""
        writes = [w for stage in run.stages if (w := stage.code(run, idx, layer)) is not None]
        if writes:
            if run.writes is None:
                run.writes = WriteBehind(self.device, self.group, run.layers_in_flight)
            for write in writes:
                run.writes.hand_over(write, last=idx == run.layers[-1])
            del layer  # (its writer holds it while it codes)
            return
        run.layer_done(idx, current)
        # the other ranks wait for rank 0's journal entry: the next layer writes the file it names
        self.group.barrier()
        del layer  # no cycles: freed here (gc.collect costs seconds on a busy machine)
        if self.device != "cpu":
            import torch

            torch.cuda.empty_cache()


def every_batch(n: int, batch: int) -> list[tuple[int, int]]:
    """The window ranges [b0, b1) of the micro-batches of `batch` windows that `n` windows are cut into."""
    return [(b0, min(n, b0 + batch)) for b0 in range(0, n, batch)]


def _batch_callback(stages: list[LayerStage]) -> Callable[[int], None] | None:
    """The stages' on_batch, for forward_layer (None where no stage sees the micro-batches)."""
    seeing = [stage.on_batch for stage in stages if stage.sees_batches]
    if len(seeing) <= 1:
        return seeing[0] if seeing else None

    def each(b0: int) -> None:
        for fn in seeing:
            fn(b0)

    return each
