"""quantize's stage of the layer loop (qtool.stream.layer_run): the NVFP4 / AWQ / BF16 coding of a layer.

forward:       per-expert statistics hooks (token counts, input amaxes, AWQ's kept rows) and the K/V tap;
               a peer backend (qtool.ops.quantize.backends) first runs its own calibration of the layer
after-forward: hooks out, statistics settled and reduced over the ranks (each rank then holds the rows of
               the experts it codes: layer.Share); with GPTQ or local_hessian every rank ran every window
               (every_window) and holds them complete: nothing to reduce
code:          a LayerShardWrite: the experts coded from the weights in memory (the source is read once)
               and the layer's shard written (layer.write_layer_shard), behind the next layer's forward
commit:        the shard named and hashed for the manifest (ProducedShards.finished), its report entry,
               then the run's journal entry (LayerRun.layer_done)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from qtool.dist import Group
from qtool.io.files import tmp_path
from qtool.io.writer import FileRange
from qtool.lazy import lazy_module
from qtool.ops.calibrate_kv.calibrate import reduce_kv
from qtool.ops.quantize import backends, coverage, gptq_layer, hessians, local_hessian
from qtool.ops.quantize import layer as layer_module
from qtool.ops.quantize.calib import (
    ExpertStats,
    KvStat,
    install_expert_stats,
    keep_owned_rows,
    reduce_expert_stats,
    remove_expert_stats,
)
from qtool.ops.quantize.gptq_layer import GptqLayer
from qtool.ops.quantize.layer import CHUNK_EXPERTS, Share, copied_whole, create_layer_tmp, release_dense_experts
from qtool.ops.quantize.plan import LayerPlan, QuantizePlan
from qtool.ops.quantize.schemes import install_linear_amax, remove_linear_amax
from qtool.recipes import Scheme
from qtool.stream.hidden_store import DiskStore
from qtool.stream.layer_run import LayerRun, LayerStage
from qtool.stream.layer_stream import attention_tap, kv_amax_tap

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")


class FinishedShards(Protocol):
    """Where a committed layer's shard is announced (qtool.io.apply.ProducedShards or a wrapper of it)."""

    def finished(self, name: str, sha256: Any = None) -> None: ...


class QuantizeStage(LayerStage):
    """The coding of each layer of `plan`: results into `layer_reports` (the journal keeps them), shards
    announced to `shards` (None on a rank other than 0)."""

    sees_batches = True  # AWQ keeps rows in window order

    def __init__(
        self, plan: QuantizePlan, shards: FinishedShards | None, layer_reports: list[dict], group: Group
    ) -> None:
        self.plan = plan
        self.shards = shards
        self.layer_reports = layer_reports
        self.group = group
        # GPTQ: a rank codes whole solve groups (gptq_layer), each from the Hessians it summed itself
        unit = hessians.SOLVE_EXPERTS if plan.recipe.gptq.enabled else CHUNK_EXPERTS
        self.share = Share(group.rank, group.world, unit)
        self.layer_plans = {layer_plan.index: layer_plan for layer_plan in plan.layers}
        # the layer between its forward and its code
        self._stats: ExpertStats | None = None
        self._kv: KvStat | None = None
        self._backend: backends.LayerCoder | None = None

    def keep_bytes(self, run: LayerRun, idx: int) -> dict[str, FileRange]:
        """The copied tensors' source bytes (whole tensors, or one expert's slice of a fused source): written
        from memory, not read again."""
        if self.share.rank != 0:
            return {}
        return {s.name: s.source for s in self.layer_plans[idx].specs if s.source is not None}

    def before_forward(self, run: LayerRun, idx: int, layer: torch.nn.Module) -> None:
        layer_plan = self.layer_plans[idx]
        keep_rows = self.plan.awq_rows if layer_plan.scheme is Scheme.W4A16 else 0
        stats = ExpertStats(self.plan.n_experts, keep_rows=keep_rows, **coverage.stats_options(self.plan.recipe))
        kv = KvStat()
        backend: backends.LayerCoder | None = None
        if layer_plan.scheme is Scheme.NVFP4:
            peer = backends.for_layer(self.plan)
            if peer is not None:
                peer.calibrate(layer, run.streamer, run.store, run.seq_len, run.batch)
                stats.hooks += peer.hooks
                stats.batch_hooks += peer.batch_hooks
                backend = peer
            else:
                # the experts' input second moments, if asked
                local_hessian.attach(stats, self.plan.recipe, self._codes)
        if layer_plan.scheme is not Scheme.BF16 and self.plan.recipe.gptq.enabled:
            # coded on the loop's thread right after this forward: hessians.py bounds the memory so
            gptq = GptqLayer(self.plan.recipe, stats, self.plan.inter, layer.mlp.experts, self._codes)
            stats.hooks += gptq.hooks
            backend = gptq
        install_expert_stats(layer.mlp.experts, stats)
        install_linear_amax(layer, list(layer_plan.fp8))  # the fp8 linears' static input scales
        if layer_plan.full_attention:
            attention_tap(layer, kv_amax_tap(kv))
        self._stats, self._kv, self._backend = stats, kv, backend

    def _codes(self, expert: int) -> bool:
        """Whether this rank codes `expert` (layer.Share)."""
        return self.share.owner(expert, self.plan.n_experts) == self.share.rank

    def every_window(self, run: LayerRun, idx: int) -> bool:
        """Per-expert sums of x xᵀ (GPTQ, local_hessian): one process adds them window by window in float32,
        so every rank runs every window and sums those of its own experts, never a sum over ranks."""
        return isinstance(self._backend, GptqLayer) or (
            self._stats is not None and self._stats.local_hessians is not None
        )

    def on_batch(self, b0: int) -> None:
        assert self._stats is not None  # between before_forward and code
        self._stats.set_batch(b0)

    def after_forward(self, run: LayerRun, idx: int, layer: torch.nn.Module) -> None:
        attention_tap(layer, None)
        remove_expert_stats(layer.mlp.experts)
        remove_linear_amax(layer)
        assert self._stats is not None and self._kv is not None  # set by before_forward
        self._stats.settle()
        # data parallel: every rank now holds the layer's stats (the AWQ rows of the experts it codes)
        n_experts = self.plan.n_experts

        def owner(e: int) -> int:
            return self.share.owner(e, n_experts)

        if run.every_window:  # every rank saw every window: its statistics are one process's already
            keep_owned_rows(self._stats, self.share.rank, owner)
            return
        reduce_expert_stats(self._stats, self.group, owner)
        reduce_kv(self._kv, self.group)

    def code(self, run: LayerRun, idx: int, layer: torch.nn.Module) -> LayerShardWrite:
        assert self._stats is not None and self._kv is not None  # set by before_forward
        write = LayerShardWrite(self, run, self.layer_plans[idx], layer, self._stats, self._kv, self._backend)
        self._stats, self._kv, self._backend = None, None, None
        return write

    def journal_entry(self) -> dict[str, Any]:
        return {"layers": self.layer_reports}

    def commit(
        self,
        run: LayerRun,
        layer_plan: LayerPlan,
        stats: ExpertStats,
        kv_stat: KvStat,
        current: str,
        awq: list[dict],
        sha256: Any,
        gptq: dict | None = None,
        plain_mse: list[int] | None = None,
    ) -> None:
        """Rank 0, once the layer's shard is whole on disk: named, hashed and journaled."""
        partial = run.partial
        assert partial is not None  # quantize's run writes into OUT.partial
        if self.group.world > 1:
            os.replace(tmp_path(partial / layer_plan.shard), partial / layer_plan.shard)
        if self.shards is not None:
            # hashed as it was written; or (several ranks) now, while the next layer runs
            self.shards.finished(layer_plan.shard, sha256)
        self.layer_reports.append(layer_entry(layer_plan, stats, kv_stat, awq, gptq, plain_mse))
        run.layer_done(layer_plan.index, current)


def layer_entry(
    layer_plan: LayerPlan,
    stats: ExpertStats,
    kv_stat: KvStat,
    awq: list[dict],
    gptq: dict | None = None,
    plain_mse: list[int] | None = None,
) -> dict:
    """A layer's entry in the report, the journal and the manifest (`plain_mse`: local_hessian's fallback
    experts, of every rank)."""
    entry = {"layer": layer_plan.index, "routed_experts": layer_plan.scheme.value, **stats.to_json()}
    entry.update(local_hessian.report(plain_mse))
    if gptq is not None:
        entry["gptq"] = gptq
    if layer_plan.full_attention:
        entry["kv"] = {"k_amax": kv_stat.k_amax, "v_amax": kv_stat.v_amax, "tokens": kv_stat.tokens}
    if awq:
        awq = sorted(awq, key=lambda r: r["expert"])  # the ranks' experts, summed in one process's order
        entry["awq"] = {
            "mean_alpha": sum(r["alpha"] for r in awq) / len(awq),
            # None: an expert whose rows held a NaN or an inf (plain RTN); not summed
            "down_mse": sum(r["down_mse"] for r in awq if r["down_mse"] is not None),
            "down_mse_rtn": sum(r["down_mse_rtn"] for r in awq if r["down_mse_rtn"] is not None),
            "experts_not_searched": sum(r["down_mse"] is None for r in awq),
        }
    return entry


class LayerShardWrite:
    """One layer's shard, coded and written (qtool.stream.layer_run.LayerWrite): behind the forward, on a
    writer thread, unless a peer backend codes it (its library state is not thread-safe). With several
    ranks every rank writes its share of the experts (layer.Share) into the one file rank 0 made."""

    def __init__(
        self,
        stage: QuantizeStage,
        run: LayerRun,
        layer_plan: LayerPlan,
        layer: torch.nn.Module,
        stats: ExpertStats,
        kv_stat: KvStat,
        backend: backends.LayerCoder | None,
    ) -> None:
        self.stage = stage
        self.run = run
        self.layer_plan = layer_plan
        self.layer: torch.nn.Module | None = layer
        self.stats = stats
        self.kv = kv_stat
        self.backend = backend
        self.behind = backend is None
        assert isinstance(run.store, DiskStore)  # (execute's; a resume needs the files)
        self.current = run.store.current  # the hidden-state file that holds this layer's output

    @property
    def path(self) -> Path:
        assert self.run.partial is not None  # quantize's run writes into OUT.partial
        return self.run.partial / self.layer_plan.shard

    def prepare(self) -> None:
        group = self.stage.group
        if group.world > 1 and group.leader:
            create_layer_tmp(self.path, self.run.file_mode)  # the file every rank writes its share into
        # the other ranks wait for the previous layer's journal entry: the next layer's forward overwrites the
        # file the previous journal entry names (three files, one layer of lag)
        group.barrier()
        if copied_whole(self.layer_plan):
            release_dense_experts(self.layer)

    def write(self, keep_pace: bool) -> dict:
        """This rank's share of the shard (`keep_pace`: the run's last layer: layer.write_layer_shard)."""
        try:
            report = layer_module.write_layer_shard(
                self.path,
                self.layer_plan,
                self.layer,
                self.stats,
                (self.kv.k_amax, self.kv.v_amax),
                self.stage.plan,
                self.backend,
                self.run.file_mode,
                self.stage.share,
                keep_pace,
            )
            if isinstance(self.backend, GptqLayer):
                report["gptq"] = self.backend.summary()
            report["plain_mse"] = local_hessian.plain_mse(self.stats)  # this rank's experts
            return report
        finally:
            self.layer = self.backend = None  # the dense layer is freed as soon as it is written

    def commit(self, shares: list[dict]) -> None:
        awq = [r for share in shares for r in share["awq"]]
        sha256 = shares[0].get("sha256") if len(shares) == 1 else None
        gptq = gptq_layer.merged([share["gptq"] for share in shares]) if "gptq" in shares[0] else None
        plain_mse = None if shares[0]["plain_mse"] is None else [e for share in shares for e in share["plain_mse"]]
        stage = self.stage
        stage.commit(self.run, self.layer_plan, self.stats, self.kv, self.current, awq, sha256, gptq, plain_mse)
