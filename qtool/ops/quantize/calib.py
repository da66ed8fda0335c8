"""Per-layer calibration statistics gathered during the layer-streamed forward.

Routed experts: transformers' `Qwen3_5MoeExperts.forward` (models/qwen3_5_moe/modeling_qwen3_5_moe.py)
is replaced on the layer instance by the same computation that also records, per expert, the tokens
routed to it, amax of its gate/up input (the routed hidden states) and of its down_proj input
(act(gate) * up), and, for AWQ, up to `keep_rows` rows of the down_proj input. The math and the op order
are those of transformers' loop, so the layer's output (which feeds the next layer) is unchanged.

Full attention: K/V amax via qtool.stream.layer_stream.attention_tap (same as calibrate-kv).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ExpertStats:
    n_experts: int
    tokens: torch.Tensor = None  # int64 [E]
    in_amax: torch.Tensor = None  # float32 [E]
    mid_amax: torch.Tensor = None  # float32 [E]
    keep_rows: int = 0
    mid_rows: list = field(default_factory=list)  # per expert: list of [n, I] tensors (AWQ)
    hooks: list = field(default_factory=list)  # fn(e, x, mid) per routed batch (peer observers)
    batch_hooks: list = field(default_factory=list)  # fn(hidden_states) per forward of the experts module

    def __post_init__(self):
        e = self.n_experts
        self.tokens = torch.zeros(e, dtype=torch.int64)
        self.in_amax = torch.zeros(e, dtype=torch.float32)
        self.mid_amax = torch.zeros(e, dtype=torch.float32)
        self.mid_rows = [[] for _ in range(e)]
        self._kept = [0] * e

    def rows(self, e: int) -> torch.Tensor:
        if not self.mid_rows[e]:
            return torch.empty(0)
        return torch.cat(self.mid_rows[e])

    def record(self, e: int, x: torch.Tensor, mid: torch.Tensor) -> None:
        self.tokens[e] += x.shape[0]
        self.in_amax[e] = max(float(self.in_amax[e]), float(x.abs().amax().float()))
        self.mid_amax[e] = max(float(self.mid_amax[e]), float(mid.abs().amax().float()))
        room = self.keep_rows - self._kept[e]
        if room > 0:
            take = mid[:room].detach().float().cpu()
            self.mid_rows[e].append(take)
            self._kept[e] += take.shape[0]
        for hook in self.hooks:
            hook(e, x, mid)

    def to_json(self) -> dict:
        return {
            "tokens_per_expert": [int(t) for t in self.tokens],
            "experts_without_tokens": [i for i, t in enumerate(self.tokens.tolist()) if t == 0],
            "gate_up_input_amax": float(self.in_amax.max()),
            "down_input_amax": float(self.mid_amax.max()),
        }


def install_expert_stats(experts, stats: ExpertStats) -> None:
    """Replace `experts.forward` (instance attribute) by the recording twin of transformers' loop."""
    import torch.nn.functional as F

    def forward(hidden_states, top_k_index, top_k_weights):
        for hook in stats.batch_hooks:
            hook(hidden_states)
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = F.one_hot(top_k_index, num_classes=experts.num_experts).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for idx in hit:
            e = int(idx[0])
            top_k_pos, token_idx = torch.where(mask[e])
            cur = hidden_states[token_idx]
            gate, up = F.linear(cur, experts.gate_up_proj[e]).chunk(2, dim=-1)
            mid = experts.act_fn(gate) * up
            stats.record(e, cur, mid)
            out = F.linear(mid, experts.down_proj[e]) * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, out.to(final.dtype))
        return final

    experts.forward = forward


def remove_expert_stats(experts) -> None:
    experts.__dict__.pop("forward", None)


@dataclass
class KvStat:
    k_amax: float = 0.0
    v_amax: float = 0.0
    tokens: int = 0
