"""What a layer-streamed job holds at its peak, in host RAM and on each GPU, and whether that fits the
machine it is planned on (quantize, calibrate-kv and eval kld print it; `--dry-run` says fit or not).

The model follows the pipeline of qtool.stream.layer_read / layer_stream (per rank process):
- the layer being run, dense in the compute dtype (`held_layers` of them when a finished layer is still
  being quantized and written behind the next one: quantize's write-behind holds two);
- the next layer's stored bytes, read ahead (Prefetcher: one layer ahead);
- one micro-batch's activations;
- on CUDA, tensors live on the device; the host holds the pinned staging buffers (READERS x 2 x CHUNK),
  the micro-batch of hidden states going to and from the store, and the embedding table while the
  calibration set is embedded (host side, before layer 0); where the calibration set's hidden states
  stay on the device (hidden_store.hidden_on_device), two sets of them are on the GPU and none in RAM;
- on CPU all of it is host RAM;
- and the process itself: the interpreter with torch, transformers and the tokenizer loaded (PROCESS_BYTES).
Op-specific extras (AWQ's kept activation rows, eval kld's lm_head phase) are passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from qtool.stream.hidden_store import hidden_on_device
from qtool.stream.layer_read import CHUNK, READERS

if TYPE_CHECKING:
    from qtool.stream.layer_stream import StreamPlan


# host RAM of a rank process before any tensor of the job: Python with torch, transformers and the tokenizer
# (measured: 375 MiB after the imports, 433 MiB peak for a CPU quantize of the tiny fixture whose tensors
# need ~1 MiB; a plan that left it out said "host ~982 KiB")
PROCESS_BYTES = 512 << 20


@dataclass
class MemoryNeed:
    device: str
    ranks: int
    host_bytes: int  # per rank process
    gpu_bytes: int | None  # per GPU (one rank each); None on CPU
    host_available: int | None = None  # MemAvailable of this machine
    gpu_available: dict[str, int] = field(default_factory=dict)  # free bytes per device, where visible

    @property
    def problems(self) -> list[str]:
        return self.problems_within(1.0)

    def problems_within(self, share: float) -> list[str]:
        """The limits exceeded where only `share` of the available memory may be used."""
        out = []
        host = self.host_bytes * self.ranks
        if self.host_available is not None and host > self.host_available * share:
            each = f" ({self.ranks} ranks x {_gib(self.host_bytes)})" if self.ranks > 1 else ""
            out.append(f"host RAM: needs ~{_gib(host)}{each}, {_gib(self.host_available)} available")
        for dev, free in self.gpu_available.items():
            if self.gpu_bytes is not None and self.gpu_bytes > free * share:
                out.append(f"{dev}: needs ~{_gib(self.gpu_bytes)}, {_gib(free)} free")
        return out

    @property
    def fits(self) -> bool | None:
        """False when a known limit is exceeded; None when no limit could be read (e.g. no GPU here)."""
        if self.problems:
            return False
        known = self.host_available is not None and (self.gpu_bytes is None or bool(self.gpu_available))
        return True if known else None

    def warning(self) -> str | None:
        """For the plan's warnings (printed by a real run too, before hours are spent)."""
        if not self.problems:
            return None
        return (
            "peak memory does not fit this machine: "
            + "; ".join(self.problems)
            + " (fewer --samples / a shorter --seq-len shrink the activations; a GPU takes the layer off the host)"
        )

    def to_json(self) -> dict:
        return {
            "device": self.device,
            "ranks": self.ranks,
            "host_bytes_per_rank": self.host_bytes,
            "gpu_bytes_per_rank": self.gpu_bytes,
            "host_available": self.host_available,
            "gpu_available": self.gpu_available,
            "fits": self.fits,
            "problems": self.problems,
        }


def need(
    stream_plan: StreamPlan,
    *,
    device: str,
    held_layers: int = 1,
    extra_host: int = 0,
    hidden_in_ram: bool = False,
    ranks: int = 1,
    extra_device: int = 0,
) -> MemoryNeed:
    """`stream_plan`: layer_stream.StreamPlan; per rank, on `device` (the fit reads that GPU's free memory).
    `extra_device`: what a stage keeps beside the layer on the forward's device (host memory on a CPU)."""
    dense, stored = stream_plan.max_layer_bytes, stream_plan.max_stored_layer_bytes
    item = stream_plan.itemsize
    on_device = hidden_on_device(device, stream_plan.hidden_bytes)
    hidden = stream_plan.hidden_bytes if hidden_in_ram and not on_device else 0
    if device == "cpu":
        steady = held_layers * dense + stored + stream_plan.activation_bytes
        host = max(stream_plan.embed_bytes + stored, steady) + hidden + extra_host + extra_device
        gpu = None
    else:
        micro = 2 * stream_plan.batch_windows * stream_plan.seq_len * stream_plan.hidden_size * item
        # on the device: a layer's outputs wait in page-locked memory for the file writes behind the forward
        # (torch keeps those pages for reuse); two sets on the GPU (a layer's input and output; eval kld's
        # in-memory store holds one, and the reference's stays there while the test side runs: two)
        host = (
            READERS * 2 * CHUNK
            + max(stream_plan.embed_bytes, micro)
            + hidden
            + extra_host
            + (stream_plan.hidden_bytes if on_device else 0)
        )
        gpu = (
            held_layers * dense
            + stored
            + stream_plan.activation_bytes
            + (2 * stream_plan.hidden_bytes if on_device else 0)
            + extra_device
        )
    return MemoryNeed(
        device, ranks, PROCESS_BYTES + host, gpu, _host_available(), _gpu_free([device]) if gpu is not None else {}
    )


def _host_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _gpu_free(devices: list[str]) -> dict[str, int]:
    """Free memory of each CUDA device named, where torch sees it (a dry run on another machine: none)."""
    if not any(d.startswith("cuda") for d in devices):
        return {}
    try:
        import torch

        if not torch.cuda.is_available():
            return {}
        out = {}
        for d in devices:
            dev = torch.device(d)
            out[d] = int(torch.cuda.mem_get_info(dev.index or 0)[0])
        return out
    except Exception:  # noqa: BLE001 -- a driver that will not answer leaves the fit unknown
        return {}


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"
