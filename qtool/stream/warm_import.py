"""Import transformers' Qwen3.5-MoE decoder module in the background while the command plans, hashes its
inputs and reads the first layer.

That import costs ~4-7 s (transformers pulls in torch.distributed.tensor, torch._dynamo and their
custom ops; measured with `python -X importtime`), all before a streamed job can build its first
layer. It is mostly Python work, but the disk reads, hashing and torch kernels that run meanwhile
release the GIL, so it overlaps. The streamer's own `import` of the module simply waits for this one
(Python's per-module import lock), so nothing else changes; an import error is left for that import to
raise where the user sees it.
"""

from __future__ import annotations

import threading

MODULE = "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"
_started: threading.Thread | None = None


def start() -> None:
    """Begin the import once per process (torch first, in the caller's thread: the two threads then
    never import torch's core in opposite orders)."""
    global _started
    if _started is not None:
        return
    import importlib

    import torch  # noqa: F401

    def work() -> None:
        try:
            importlib.import_module(MODULE)
        except Exception:  # noqa: BLE001 -- re-raised by the streamer's own import
            pass

    _started = threading.Thread(target=work, name="qtool-warm-import", daemon=True)
    _started.start()
