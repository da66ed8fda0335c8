"""Every routed expert's statistics from every token of the micro-batch (a recipe's `calibration.experts:
all`; llm-compressor's `moe_calibrate_all_experts`, llmcompressor/modeling/moe/linear_experts.py).

A batch hook of qtool.stream.experts.install: it sees the experts' whole input once per forward and runs
each expert on all of it, for the recorder only. The layer's output is still transformers' routed
computation (the experts' forward, with no recorder), so the hidden states handed to the next layer are
those of `natural` calibration bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from qtool.lazy import lazy_module
from qtool.stream.experts import Recorder

if TYPE_CHECKING:
    import torch
    import torch.nn.functional as F
else:
    torch = lazy_module("torch")
    F = lazy_module("torch.nn.functional")

# tokens per expert call: bounds the [tokens, 2 * I] intermediates (~16 KB a token at the 397B's I = 1024,
# bf16: 128 MB) whatever the micro-batch
EVERY_TOKEN_ROWS = 8192


def every_token_hook(experts: torch.nn.Module, record: Recorder) -> Callable[[torch.Tensor], None]:
    """fn(hidden_states): record(e, x, mid) for every expert e over all rows of hidden_states, in row order;
    mid = act(gate) * up as qtool.stream.experts.routed_forward computes it."""

    def hook(hidden_states: torch.Tensor) -> None:
        with torch.no_grad():
            for e in range(experts.num_experts):
                for r0 in range(0, hidden_states.shape[0], EVERY_TOKEN_ROWS):
                    x = hidden_states[r0 : r0 + EVERY_TOKEN_ROWS]
                    gate, up = F.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
                    record(e, x, experts.act_fn(gate) * up)

    return hook
