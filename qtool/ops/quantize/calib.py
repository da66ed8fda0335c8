"""Per-layer calibration statistics gathered during the layer-streamed forward.

Routed experts: transformers' `Qwen3_5MoeExperts.forward` (models/qwen3_5_moe/modeling_qwen3_5_moe.py)
is replaced on the layer instance by the same computation that also records, per expert, the tokens
routed to it, amax of its gate/up input (the routed hidden states) and of its down_proj input
(act(gate) * up), and, for AWQ, up to `keep_rows` rows of the down_proj input. The math and the op order
are those of transformers' loop, so the layer's output (which feeds the next layer) is unchanged.

Full attention: K/V amax via qtool.stream.layer_stream.attention_tap (same as calibrate-kv).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from qtool.lazy import lazy_module
from qtool.ops.quantize.coverage import coverage_json
from qtool.stream import experts as routed
from qtool.stream.every_token import every_token_hook

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch")

if TYPE_CHECKING:
    from qtool.dist import Group
    from qtool.stream.experts import Recorder


@dataclass
class ExpertStats:
    n_experts: int
    tokens: torch.Tensor = field(init=False)  # int64 [E]
    in_amax: torch.Tensor = field(init=False)  # float32 [E]
    mid_amax: torch.Tensor = field(init=False)  # float32 [E]
    keep_rows: int = 0
    # per expert: list of [n, I] tensors (AWQ)
    mid_rows: list[list[torch.Tensor]] = field(default_factory=list)
    hooks: list[Recorder] = field(default_factory=list)  # fn(e, x, mid) per routed batch (peer observers)
    # fn(hidden_states) per forward of the experts module
    batch_hooks: list[Callable[[torch.Tensor], None]] = field(default_factory=list)
    min_tokens: int = 1  # an expert that saw fewer takes the fallback rule (qtool.ops.quantize.coverage)
    every_token: bool = False  # every expert's statistics from every token (recipe calibration.experts: all)
    local_hessians: Any = None  # local_hessian.LocalHessians (recipe nvfp4.weight_scale: local_hessian)

    def __post_init__(self) -> None:
        n_experts = self.n_experts
        self.tokens = torch.zeros(n_experts, dtype=torch.int64)
        self.in_amax = torch.zeros(n_experts, dtype=torch.float32)
        self.mid_amax = torch.zeros(n_experts, dtype=torch.float32)
        self.mid_rows = [[] for _ in range(n_experts)]
        # the micro-batch (first window) of each kept piece
        self._row_batches: list[list[int]] = [[] for _ in range(n_experts)]
        self._kept = [0] * n_experts
        self.batch = 0  # the micro-batch being run (LayerStreamer.forward_layer's on_batch)
        # [E, keep_rows, I] page-locked, in the rows' dtype: their home (CUDA)
        self._pinned: torch.Tensor | None = None
        self._pending: set[torch.device] = set()  # the devices whose copies into it are still in flight

    def set_batch(self, first_window: int) -> None:
        self.batch = first_window

    def rows(self, expert: int) -> torch.Tensor:
        """Expert `expert`'s kept rows [n, I] in the forward's dtype (on the host: settle() first where they were
        kept on CUDA). The AWQ search computes in float32 from them (awq_search.awq_down_scales)."""
        pieces = self.mid_rows[expert]
        if not pieces:
            return torch.empty(0)
        if len(pieces) == 1:
            return pieces[0]
        home = None if self._pinned is None else self._pinned.untyped_storage().data_ptr()
        if home is not None and all(p.untyped_storage().data_ptr() == home for p in pieces):
            # kept back to back from row 0 (_keep): the buffer's own rows, still page-locked (a `cat`
            # would give pageable memory, whose upload to the GPU waits for the host)
            assert self._pinned is not None  # (home is its storage)
            return self._pinned[expert, : sum(p.shape[0] for p in pieces)]
        return torch.cat(pieces)

    def _keep(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        """A host copy of `rows`. From CUDA: into one page-locked buffer for the layer, without waiting
        (a `.cpu()` here would sync the host with the GPU once per expert hit, 512 times a micro-batch at
        the 397B's size); `settle` waits once for all of them. Kept in their own dtype: the forward's bf16
        values are exact in it, and half the size of float32 (256 MiB a 397B layer, not 512)."""
        if rows.device.type != "cuda":
            return rows.clone()  # not a view: that would keep the whole batch's activations alive
        if self._pinned is None:
            self._pinned = torch.empty(
                (self.n_experts, self.keep_rows, rows.shape[-1]), dtype=rows.dtype, pin_memory=True
            )
        dst = self._pinned[e, self._kept[e] : self._kept[e] + rows.shape[0]]
        dst.copy_(rows, non_blocking=True)
        self._pending.add(rows.device)
        return dst

    def record(self, expert: int, routed: torch.Tensor, mid: torch.Tensor) -> None:
        """Called per expert hit (`routed`: the hidden states routed to it, `mid`: its down_proj input): no
        host sync (the amaxes stay on the inputs' device until `settle`)."""
        if self.in_amax.device != routed.device:
            self.in_amax = self.in_amax.to(routed.device)
            self.mid_amax = self.mid_amax.to(routed.device)
        self.tokens[expert] += routed.shape[0]
        torch.maximum(self.in_amax[expert], routed.abs().amax().float(), out=self.in_amax[expert])
        torch.maximum(self.mid_amax[expert], mid.abs().amax().float(), out=self.mid_amax[expert])
        room = self.keep_rows - self._kept[expert]
        if room > 0:
            take = self._keep(expert, mid[:room].detach())
            self.mid_rows[expert].append(take)
            self._row_batches[expert].append(self.batch)
            self._kept[expert] += take.shape[0]
        for hook in self.hooks:
            hook(expert, routed, mid)

    def too_few(self, e: int) -> bool:
        """Expert e saw fewer tokens than the floor: every method codes it by the fallback rule, not from
        statistics of its own (qtool.ops.quantize.coverage). Valid once the stats are reduced over ranks."""
        return int(self.tokens[e]) < self.min_tokens

    def below_floor(self) -> torch.Tensor:
        """bool [E]: too_few of every expert."""
        return self.tokens < self.min_tokens

    def settle(self) -> None:
        """The layer's forward is done: the statistics to the host (one copy each)."""
        self.in_amax = self.in_amax.cpu()
        self.mid_amax = self.mid_amax.cpu()
        for device in self._pending:
            torch.cuda.synchronize(device)  # the kept rows' copies (see _keep)
        self._pending.clear()

    def to_json(self) -> dict[str, object]:
        return {
            "tokens_per_expert": [int(t) for t in self.tokens],
            "experts_without_tokens": [i for i, t in enumerate(self.tokens.tolist()) if t == 0],
            "gate_up_input_amax": float(self.in_amax.max()),
            "down_input_amax": float(self.mid_amax.max()),
            **coverage_json(self),
        }


def reduce_expert_stats(stats: ExpertStats, group: Group, owner: Callable[[int], int]) -> None:
    """The layer's statistics over all ranks, exactly as one process gathers them: token counts summed,
    amaxes maxed, and the AWQ rows of each expert merged in window order and cut to keep_rows (each
    rank kept the first keep_rows of its own windows, which holds every row of the merged first ones).
    The rows go to the rank that codes the expert only (`owner(e)`: layer.Share.owner), and the others
    drop theirs: at 397B size a rank holds up to 256 MB of them (bf16), N times that if every rank took all."""
    if group.world == 1:
        return
    group.sum_(stats.tokens)
    group.max_(stats.in_amax)
    group.max_(stats.mid_amax)
    if not stats.keep_rows:
        return
    _gather_rows(stats, group, owner)
    keep_owned_rows(stats, group.rank, owner)


def keep_owned_rows(stats: ExpertStats, rank: int, owner: Callable[[int], int]) -> None:
    """Drop the AWQ rows of the experts another rank codes (`owner(e)`: layer.Share.owner)."""
    for e in range(stats.n_experts):
        if owner(e) != rank:
            stats.mid_rows[e], stats._row_batches[e], stats._kept[e] = [], [], 0  # another rank codes it


def _gather_rows(stats: ExpertStats, group: Group, owner: Callable[[int], int]) -> None:
    """Each expert's AWQ rows from every rank to its owner, merged in window order, cut to keep_rows."""
    for dst in range(group.world):
        # clones: a piece is a view of the layer's page-locked buffer, which pickling would send whole
        mine = {
            e: [(b, t.clone()) for b, t in zip(stats._row_batches[e], stats.mid_rows[e], strict=True)]
            for e in range(stats.n_experts)
            if owner(e) == dst
        }
        every = group.gather_to(mine, dst)
        if every is None:
            continue
        for e in mine:
            pieces = sorted(((b, t) for rank in every for b, t in rank[e]), key=lambda bt: bt[0])
            if pieces:
                rows = torch.cat([t for _, t in pieces])[: stats.keep_rows]
                stats.mid_rows[e], stats._row_batches[e] = [rows], [0]
                stats._kept[e] = rows.shape[0]


def install_expert_stats(experts: torch.nn.Module, stats: ExpertStats) -> None:
    """Route the experts through qtool.stream.experts (transformers' eager math) recording the stats: of the
    routed tokens, or (every_token) of all of them (qtool.stream.every_token), the output routed either way."""
    if stats.every_token:
        routed.install(experts, None, [*stats.batch_hooks, every_token_hook(experts, stats.record)])
        return
    routed.install(experts, stats.record, stats.batch_hooks)


def remove_expert_stats(experts: torch.nn.Module) -> None:
    routed.install(experts)


@dataclass
class KvStat:
    k_amax: float = 0.0
    v_amax: float = 0.0
    tokens: int = 0
