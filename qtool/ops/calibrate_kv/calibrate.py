"""calibrate-kv: the layer-streamed forward and its K/V statistics."""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qtool.dist import Group
from qtool.errors import PlanError
from qtool.formats.fp8 import kv_scale_from_amax
from qtool.io.identity import input_identity, tensor_list_text
from qtool.io.stream_digest import NO_DIGESTS, DigestSink
from qtool.io.writer import FileRange
from qtool.ops.calibrate_kv.plan import JOURNAL, OUTLIER_RATIO, KvPlan
from qtool.ops.calibrate_kv.write import Span
from qtool.stream.calib_data import token_digest
from qtool.stream.hidden_store import DiskStore, MemoryStore
from qtool.stream.layer_journal import LayerJournal
from qtool.stream.layer_run import LayerRun, LayerStage
from qtool.stream.layer_stream import LayerStreamer, attention_tap, kv_amax_tap

if TYPE_CHECKING:
    import torch

# ---- calibrate -------------------------------------------------------------------------------------


@dataclass
class LayerStat:
    layer: int
    k_amax: float
    v_amax: float
    tokens: int

    @property
    def k_scale(self) -> float:
        return _scale(self.k_amax)

    @property
    def v_scale(self) -> float:
        return _scale(self.v_amax)

    def to_json(self) -> dict:
        return {
            "layer": self.layer,
            "k_amax": self.k_amax,
            "v_amax": self.v_amax,
            "k_scale": self.k_scale,
            "v_scale": self.v_scale,
            "tokens": self.tokens,
        }


def _scale(amax: float) -> float:
    """float32(amax) / 448 in float32, as ModelOpt computes it (qtool.formats.fp8.kv_scale_from_amax); a
    zero amax gives 1.0 (no information)."""
    return 1.0 if amax <= 0 else float(kv_scale_from_amax(amax))


class KvStage(LayerStage):
    """calibrate-kv's stage of the layer loop: the K/V amax of each calibrated layer's full attention, taken
    at the attention kernel's inputs during the forward and reduced over the ranks after it. `feeder`: the
    layers' reads of the shards the output rewrites (--replace-scales), kept with each layer and handed to
    their writer (the input is read once)."""

    def __init__(
        self, layers: list[int], stats: dict[int, LayerStat], group: Group, feeder: ShardFeeder | None = None
    ) -> None:
        self.group = group
        self.layers = set(layers)
        self.stats = stats
        self.feeder = feeder

    def keep_bytes(self, run: LayerRun, idx: int) -> dict[str, FileRange]:
        return self.feeder.wanted(idx) if self.feeder is not None else {}

    def before_forward(self, run: LayerRun, idx: int, layer: torch.nn.Module) -> None:
        if self.feeder is not None:
            # the bytes read for the shards being rewritten go to their writer, not through the forward
            self.feeder.took(idx, layer.qtool_bytes)
            layer.qtool_bytes = {}
        if idx not in self.layers:
            return
        self.stats[idx] = LayerStat(idx, 0.0, 0.0, 0)
        attention_tap(layer, kv_amax_tap(self.stats[idx]))

    def after_forward(self, run: LayerRun, idx: int, layer: torch.nn.Module) -> None:
        attention_tap(layer, None)
        if idx in self.layers:
            reduce_kv(self.stats[idx], self.group)

    def journal_entry(self) -> dict:
        return {"stats": [s.to_json() for s in sorted(self.stats.values(), key=lambda s: s.layer)]}


class ShardFeeder:
    """Hands each rewritten shard's bytes that the layer pass reads to the output executor
    (ProducedShards.feed), once the last layer it takes bytes from is loaded: the shard is written from them
    while the pass goes on. `wanted(idx)` is what the stage asks the loop to keep of layer idx's read;
    `took(idx, views)` gets what it kept (uint8 views of the read, on the job's device)."""

    def __init__(self, spans: list[Span], feed: Callable[[str, Callable[[], dict]], None]) -> None:
        self.feed = feed
        self.by_layer: dict[int, list[tuple[str, Span]]] = {}
        self.last: dict[str, int] = {}
        for k, sp in enumerate(spans):
            self.by_layer.setdefault(sp.layer, []).append((f"{sp.shard}#{k}", sp))
            self.last[sp.shard] = max(self.last.get(sp.shard, -1), sp.layer)
        # a shard's spans until its last layer is loaded; a resumed pass that starts after some of its
        # layers feeds it without them, and one that starts after all never: those are copied
        self.parts: dict[str, list] = {s: [] for s in self.last}

    def wanted(self, idx: int) -> dict[str, FileRange]:
        return {key: sp.source for key, sp in self.by_layer.get(idx, ()) if sp.shard in self.parts}

    def took(self, idx: int, views: dict[str, torch.Tensor]) -> None:
        for key, sp in self.by_layer.get(idx, ()):
            view = views.get(key)
            if sp.shard in self.parts and view is not None:
                # a span of a layer before the shard's last one leaves the device now, not a layer later
                self.parts[sp.shard].append((view if self.last[sp.shard] == idx else view.cpu(), sp))
        for shard in [s for s in self.parts if self.last[s] == idx]:
            self.feed(shard, _given(self.parts.pop(shard)))


def _given(parts: list) -> Callable[[], dict[str, memoryview]]:
    def given() -> dict[str, memoryview]:
        """tensor name -> its bytes (on the writer's thread: a device's bytes come to the host there)."""
        out = {}
        for view, sp in parts:
            host = memoryview(view.cpu().numpy())
            for name, off, n in sp.tensors:
                out[name] = host[off : off + n]
        return out

    return given


def reduce_kv(st, group) -> None:
    """`st` (k_amax, v_amax, tokens) over all ranks, exactly: max of the amaxes (float64 holds each
    float32 amax exactly), sum of the tokens."""
    if group.world == 1:
        return
    import torch

    amax = group.max_(torch.tensor([st.k_amax, st.v_amax], dtype=torch.float64))
    st.k_amax, st.v_amax = float(amax[0]), float(amax[1])
    st.tokens = int(group.sum_(torch.tensor([st.tokens], dtype=torch.int64))[0])


def _journal_key(p: KvPlan, digest: str, dtype: str) -> str:
    h = hashlib.sha256(tensor_list_text(p.ckpt.tensors))
    h.update(json.dumps(p.ckpt.text_config, sort_keys=True).encode())
    h.update(f"{digest}|{dtype}|{p.samples}|{p.seq_len}".encode())
    # what the forward reads: a same-size edit of a shard with its mtime put back changes the key
    h.update(json.dumps(input_identity(h_.path for h_ in p.ckpt.headers.values())).encode())
    return h.hexdigest()[:32]


def calibrate(
    p: KvPlan,
    ids,
    *,
    resume: bool = False,
    hidden: str = "disk",
    dtype: str | None = None,
    progress=None,
    digests: DigestSink = NO_DIGESTS,
    feeder: ShardFeeder | None = None,
) -> tuple[dict[int, LayerStat], dict]:
    """Run the layer-streamed forward on token windows `ids` [N, L]; returns per-layer stats and timing.
    hidden="disk" keeps the hidden states in the work dir (resumable), "memory" in RAM. digests: the job's
    inputs hashed from the streamer's reads (its output transaction's input hasher's). feeder: hands the
    layers' reads of the shards the output rewrites to their writer (ShardFeeder)."""
    opts = p.options
    streamer = LayerStreamer(
        p.ckpt,
        device=p.device,
        dtype=dtype or (opts.dtype if opts else None),
        batch_tokens=opts.batch_tokens if opts else None,
        model_map=p.mm,
        digests=digests,
    )
    g = streamer.group
    n, seq = int(ids.shape[0]), int(ids.shape[1])
    shape = (n, seq, streamer.hidden_size)
    batch = streamer.batch_windows(seq)
    key = _journal_key(p, token_digest(ids), f"{streamer.dtype_name}|{batch}")
    journal = LayerJournal(p.work_dir / JOURNAL, key, g, enabled=hidden == "disk").open(
        resume=resume,
        what="calibrate-kv journal",
        job="the calibration job (inputs, data, settings)",
        inputs="checkpoint, data or settings",
    )
    start = journal.next_layer
    stats: dict[int, LayerStat] = {}
    for s in journal.saved.get("stats", []):
        stats[s["layer"]] = LayerStat(s["layer"], s["k_amax"], s["v_amax"], s["tokens"])
    if hidden == "disk":
        # write-behind of the hidden states in one process (the ranks' journal needs every rank's writes
        # durable at the layer's barrier, so they write synchronously)
        store = DiskStore(
            p.work_dir,
            shape,
            streamer.dtype,
            current=journal.current(),
            write_behind=g.world == 1,
            device=streamer.device,
        )
    else:
        if start:
            raise PlanError("--resume needs the hidden states on disk")
        store = MemoryStore.empty(shape, streamer.dtype, streamer.device)
    t0 = time.perf_counter()
    stage = KvStage(p.layers, stats, g, feeder)
    run = LayerRun(streamer, store, seq, batch, list(range(start, p.run_layers)), [stage], journal, progress)
    if start < p.run_layers:
        streamer.prefetch(start)  # the first layer is read while the embeddings are made
    if start == 0:
        run.embed(ids)
    try:
        streamer.run_layers(run)
    except BaseException:
        if hidden == "disk":
            store.close(quiet=True)  # what was queued is still valid; the error that brought us here is raised
        raise
    if hidden == "disk":
        store.close()  # the last journal entry and writes (an error of theirs is raised here)
    elapsed = time.perf_counter() - t0
    layers_run = p.run_layers - start
    timing = {
        "seconds": elapsed,
        "layers_run": layers_run,
        "resumed_from_layer": start,
        "tokens_per_s": (n * seq * layers_run / p.run_layers) / elapsed if elapsed > 0 else None,
        **streamer.clock,
        "kernels": streamer.kernels,
    }
    return {i: stats[i] for i in p.layers}, timing


def outlier_warnings(stats: dict[int, LayerStat]) -> list[str]:
    out = []
    for what in ("k", "v"):
        vals = {i: getattr(s, f"{what}_scale") for i, s in stats.items()}
        if len(vals) < 3:
            continue
        med = statistics.median(vals.values())
        for i, v in vals.items():
            if med > 0 and (v > OUTLIER_RATIO * med or v < med / OUTLIER_RATIO):
                out.append(f"layer {i}: {what}_scale {v:.4g} is {v / med:.3g}x the median {med:.4g}")
    for i, s in stats.items():
        if s.k_amax <= 0 or s.v_amax <= 0 or s.tokens == 0:
            out.append(f"layer {i}: no K/V seen (amax 0); scale set to 1.0")
    return out
