"""The routed experts' forward for streamed layers: transformers' eager loop, bit for bit, without its
per-expert host synchronisations.

transformers' `Qwen3_5MoeExperts.forward` (eager; models/qwen3_5_moe/modeling_qwen3_5_moe.py) calls
`torch.where(expert_mask[e])` for every expert hit: a device->host sync per expert (512 per micro-batch at
the 397B's size), so the GPU idles while Python waits. Here the routing is sorted once per call (one sync
for the per-expert counts) and each expert takes a slice of it. The stable sort of the flattened
[top_k, token] ids yields, for each expert, exactly the (top_k_pos, token_idx) pairs `torch.where`
yields, in the same order, so every F.linear sees the same rows and `index_add_` adds in the same order:
the output is identical to eager (tested), hence the hidden states, statistics and output bytes too.

A grouped matmul (`grouped_forward`: one `torch._grouped_mm` per projection) drops the Python loop as well:
0.03 s against the loop's 0.21-0.25 s for a 397B layer's 16 x 2048 tokens on an H200
(measured with torch's profiler over one layer). It rounds differently (each expert's rows in one GEMM, the top_k
contributions summed in float32 instead of bf16 `index_add_`), so the calibration statistics would no
longer match the eager transformers model the peers calibrate: quantize and calibrate-kv keep the loop.
eval kld, whose numbers are a distance between two models run the same way, takes it on a GPU that runs
it (`choose`); its report records which one ran.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from qtool.lazy import lazy_module

if TYPE_CHECKING:
    import torch
    import torch.nn.functional as F
else:
    torch = lazy_module("torch")
    F = lazy_module("torch.nn.functional")


# record(e, x, mid): the expert's routed input rows and its down_proj input (act(gate) * up)
Recorder = Callable[[int, "torch.Tensor", "torch.Tensor"], None]  # (quoted: torch is imported on first use)


def routed_forward(
    experts: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    record: Recorder | None = None,
) -> torch.Tensor:
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
        token_idx = token_of[start : start + n]
        top_k_pos = pos_of[start : start + n]
        start += n
        cur = hidden_states[token_idx]
        gate, up = F.linear(cur, experts.gate_up_proj[e]).chunk(2, dim=-1)
        mid = experts.act_fn(gate) * up
        if record is not None:
            record(e, cur, mid)
        out = F.linear(mid, experts.down_proj[e]) * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, out.to(final.dtype))
    return final


# tokens per grouped matmul: bounds its gathered rows and intermediates (~225 KB a token at the 397B's
# shapes, top_k 10) to ~1.8 GB whatever the micro-batch; 8192 x 10 rows keep each expert's GEMM ~160 rows
GROUPED_TOKENS = 8192
EAGER, GROUPED = "eager", "grouped_mm"


def grouped_forward(
    experts: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The routed experts as one grouped matmul per projection, `GROUPED_TOKENS` tokens at a time; no host
    synchronisation. Deterministic: each token's top_k contributions are summed in a fixed order (float32),
    not by atomic adds."""
    out = torch.empty_like(hidden_states)
    with torch.no_grad():
        for s in range(0, hidden_states.shape[0], GROUPED_TOKENS):
            e = s + GROUPED_TOKENS
            out[s:e] = _grouped_rows(experts, hidden_states[s:e], top_k_index[s:e], top_k_weights[s:e])
    return out


def _grouped_rows(
    experts: torch.nn.Module, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    n_tok, top_k = top_k_index.shape
    flat = top_k_index.reshape(-1)  # slot r: token r // top_k, its (r % top_k)-th expert
    grouped, order = torch.sort(flat, stable=True)  # the slots grouped by expert
    # each expert's end in that order (bincount would synchronise with the host on CUDA: it sizes its
    # output from the input's max)
    ends = torch.searchsorted(grouped, torch.arange(experts.num_experts, device=flat.device), right=True)
    ends = ends.to(torch.int32)
    gate, up = torch._grouped_mm(x[order // top_k], experts.gate_up_proj.transpose(1, 2), offs=ends).chunk(2, -1)
    y = torch._grouped_mm(experts.act_fn(gate) * up, experts.down_proj.transpose(1, 2), offs=ends)
    y = y * top_k_weights.reshape(-1)[order, None]
    slots = torch.empty_like(y)
    slots[order] = y  # back to (token, choice) order
    return slots.view(n_tok, top_k, -1).sum(dim=1, dtype=torch.float32).to(x.dtype)


def choose(wanted: str, device: str, hidden: int, intermediate: int, dtype: str = "bfloat16") -> str:
    """The routed experts' implementation a streamer uses: `wanted` GROUPED where `device` is a GPU whose
    torch runs grouped matmuls (probed once) in bf16 on these widths (rows of 16-byte multiples), else
    EAGER. QTOOL_ROUTED_EXPERTS=eager keeps the loop everywhere (to compare, or to reproduce an older
    report)."""
    if wanted != GROUPED or not device.startswith("cuda") or os.environ.get("QTOOL_ROUTED_EXPERTS") == EAGER:
        return EAGER
    if dtype != "bfloat16" or hidden <= 0 or intermediate <= 0 or hidden % 8 or intermediate % 8:
        return EAGER
    return GROUPED if _grouped_mm_runs(device) else EAGER


@functools.cache
def _grouped_mm_runs(device: str) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a = torch.ones(32, 64, dtype=torch.bfloat16, device=device)
        b = torch.ones(2, 32, 64, dtype=torch.bfloat16, device=device)
        ends = torch.tensor([16, 32], dtype=torch.int32, device=device)
        return bool((torch._grouped_mm(a, b.transpose(1, 2), offs=ends) == 64).all())
    except (RuntimeError, AssertionError):  # a GPU or build without the kernel; torch without CUDA
        return False


def install(
    experts: torch.nn.Module,
    record: Recorder | None = None,
    batch_hooks: list[Callable[[torch.Tensor], None]] | None = None,
    kind: str = EAGER,
) -> None:
    """Make `experts` (a Qwen3_5MoeExperts instance) use routed_forward (or grouped_forward, `kind`
    GROUPED, which records nothing); batch_hooks: fn(hidden_states) called once per forward (peer
    observers that see the whole micro-batch)."""

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        for hook in batch_hooks or ():
            hook(hidden_states)
        if kind == GROUPED and record is None:
            return grouped_forward(experts, hidden_states, top_k_index, top_k_weights)
        return routed_forward(experts, hidden_states, top_k_index, top_k_weights, record)

    experts.forward = forward
