"""The routed experts' forward for streamed layers: transformers' eager loop, bit for bit, without its
per-expert host synchronisations.

transformers' `Qwen3_5MoeExperts.forward` (eager; models/qwen3_5_moe/modeling_qwen3_5_moe.py) calls
`torch.where(expert_mask[e])` for every expert hit: a device->host sync per expert (512 per micro-batch at
the 397B's size), so the GPU idles while Python waits. Here the routing is sorted once per call (one sync
for the per-expert counts) and each expert takes a slice of it. The stable sort of the flattened
[top_k, token] ids yields, for each expert, exactly the (top_k_pos, token_idx) pairs `torch.where`
yields, in the same order, so every F.linear sees the same rows and `index_add_` adds in the same order:
the output is identical to eager (tested), hence the hidden states, statistics and output bytes too.

A grouped matmul (transformers' `grouped_mm` experts implementation) would drop the Python loop as well,
but it changes the rounding (fp32 reduction over top_k instead of bf16 `index_add_`), so the calibration
statistics would no longer match the eager transformers model the peers calibrate; it is not used.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

# record(e, x, mid): the expert's routed input rows and its down_proj input (act(gate) * up)
Recorder = Callable[[int, torch.Tensor, torch.Tensor], None]


def routed_forward(experts, hidden_states, top_k_index, top_k_weights, record: Recorder | None = None):
    """`experts.forward`'s result (transformers eager), calling record(e, x, mid) per expert hit."""
    n_tok, top_k = top_k_index.shape
    final = torch.zeros_like(hidden_states)
    with torch.no_grad():
        flat = top_k_index.t().reshape(-1)  # [top_k * n_tok], (top_k_pos, token) order as torch.where's
        order = torch.sort(flat, stable=True).indices
        counts = torch.bincount(flat, minlength=experts.num_experts).tolist()  # the one sync
        token_of = order % n_tok
        pos_of = order // n_tok
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        token_idx = token_of[start:start + n]
        top_k_pos = pos_of[start:start + n]
        start += n
        cur = hidden_states[token_idx]
        gate, up = F.linear(cur, experts.gate_up_proj[e]).chunk(2, dim=-1)
        mid = experts.act_fn(gate) * up
        if record is not None:
            record(e, cur, mid)
        out = F.linear(mid, experts.down_proj[e]) * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, out.to(final.dtype))
    return final


def install(experts, record: Recorder | None = None, batch_hooks: list | None = None) -> None:
    """Make `experts` (a Qwen3_5MoeExperts instance) use routed_forward; batch_hooks: fn(hidden_states)
    called once per forward (peer observers that see the whole micro-batch)."""

    def forward(hidden_states, top_k_index, top_k_weights):
        for hook in batch_hooks or ():
            hook(hidden_states)
        return routed_forward(experts, hidden_states, top_k_index, top_k_weights, record)

    experts.forward = forward


def uninstall(experts) -> None:
    experts.__dict__.pop("forward", None)
