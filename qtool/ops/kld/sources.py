"""Where log-probs come from: a checkpoint run in-process (layer-streamed), an engine dump directory, or a
compact reference written by `--save-ref`. Every source gives, per window, `rows(w)` positions; row r is
the next-token distribution after tokens 0..r of the window.

Checkpoint (in-process): the text decoder layers run layer-streamed (qtool.stream.layer_stream, as
calibrate-kv: one layer's dequantized weights resident at a time) over all windows; the final hidden
states stay in a HiddenStore (RAM, or two files on disk when larger than `ram_limit`). Log-probs are then
made `chunk` positions at a time: final RMSNorm, lm_head (embed_tokens when tie_word_embeddings), float32
log_softmax -- so neither model, nor any [L, V] window, has to fit at once.

Dump (engine): `<dir>/<i>.safetensors`, i = 0, 1, ... in request order, one tensor `log_probs`
[positions, vocab] (float32; float16/bfloat16 accepted) -- the format of the upstream SGLang capture
(voipmonitor/rtx6kpro/patches/sglang-kld-logit-capture.py + rtx6kpro/scripts/sglang_kld_eval.py), which qtool's
patches in patches/sglang and patches/vllm write too. vLLM dumps have L-1 rows (prompt logprobs exist for
positions 0..L-2), SGLang ones L; the evaluation compares the rows both sides have.

Compact (`--save-ref`): `<dir>/meta.json` + `<dir>/<i>.safetensors` with the CompactChunk tensors.
"""

from __future__ import annotations

import json
import re
import tempfile
from enum import Enum
from pathlib import Path

from qtool.dist import planned_ranks
from qtool.errors import CheckpointError, PlanError, UsageError
from qtool.ops.kld.compact import CompactChunk
from qtool.stream.dequant import load_param, stored_dense
from qtool.stream.hidden_store import DiskStore, MemoryStore
from qtool.stream.layer_stream import LayerStreamer, compute_itemsize
from qtool.stream.memory_plan import need

DUMP_KEY = "log_probs"  # upstream SGLang capture (rtx6kpro/patches/sglang-kld-logit-capture.py)
META = "meta.json"
RAM_LIMIT = 8 << 30
HEAD_READ = "head"  # the LayerStreamer's read-ahead key for the final norm and the lm_head


class Kind(str, Enum):
    CHECKPOINT = "checkpoint"
    DUMP = "dump"
    COMPACT = "compact"


def detect(path: str | Path) -> Kind:
    p = Path(path)
    if not p.is_dir():
        raise UsageError(
            "not a directory",
            path=p,
            hint="pass a checkpoint directory, an engine dump directory or a --save-ref directory",
        )
    meta = p / META
    if meta.is_file() and json.loads(meta.read_text()).get("format") == "qtool-kld-compact":
        return Kind.COMPACT
    if (p / "config.json").is_file():
        return Kind.CHECKPOINT
    if _numbered(p):
        return Kind.DUMP
    raise UsageError(
        "directory is neither a checkpoint, a log-prob dump nor a compact reference",
        path=p,
        hint="a dump directory holds 0.safetensors, 1.safetensors, ...",
    )


def _numbered(p: Path) -> list[Path]:
    files = [f for f in p.glob("*.safetensors") if re.fullmatch(r"\d+", f.stem)]
    return sorted(files, key=lambda f: int(f.stem))


class CheckpointSource:
    kind = Kind.CHECKPOINT

    def __init__(
        self,
        path,
        *,
        device: str = "cpu",
        dtype: str | None = None,
        work_dir=None,
        ram_limit: int = RAM_LIMIT,
        batch_tokens: int | None = None,
    ):
        self.path = Path(path)
        # the grouped matmul on a GPU that runs it: both sides the same way (qtool.stream.experts)
        self.streamer = LayerStreamer(
            path, device=device, dtype=dtype, batch_tokens=batch_tokens, routed_experts="grouped_mm"
        )
        self.device = device
        self.work_dir = work_dir
        self.ram_limit = ram_limit
        self.store = None
        self._tmp = None
        self._head = None
        tc = self.streamer.text_cfg_dict
        head = self.streamer.ckpt.tensors.get("lm_head.weight")
        self.vocab = int(head.shape[0]) if head is not None else int(tc.get("vocab_size") or 0)
        self.windows = 0
        self.seq_len = 0

    def plan(self, windows: int, seq_len: int, chunk: int = 256) -> dict:
        """Memory of the in-process forward (headers only): one decoder layer + activations, the final
        hidden states (RAM or disk), one chunk of log-probs."""

        sp = self.streamer.plan(windows, seq_len)
        in_ram = sp.hidden_bytes <= self.ram_limit
        item = sp.itemsize
        # after the layers: lm_head + a chunk of logits/log-probs (float32, ~3 copies) of both sides
        head = self.vocab * sp.hidden_size * item + chunk * self.vocab * 4 * 3

        m = need(sp, device=self.device, hidden_in_ram=in_ram, ranks=planned_ranks())
        if m.gpu_bytes is None:
            m.host_bytes = max(m.host_bytes, head + (sp.hidden_bytes if in_ram else 0))
        else:
            m.gpu_bytes = max(m.gpu_bytes, head)
        return {**sp.to_json(), "hidden_in_ram": in_ram, "head_bytes": head, "need": m.to_json()}

    def prepare(self, ids, *, progress=None, head_ahead: bool = True) -> None:
        """Run all decoder layers over the windows `ids` [N, L]; keeps the final hidden states.
        `head_ahead`: read the final norm and lm_head while the last layer runs (only for the source
        prepared last: another's layers would run with them held)."""
        s = self.streamer
        n, seq = int(ids.shape[0]), int(ids.shape[1])
        shape = (n, seq, s.hidden_size)
        nbytes = n * seq * s.hidden_size * compute_itemsize(s.dtype_name)
        if nbytes <= self.ram_limit:
            self.store = MemoryStore.empty(shape, s.dtype, s.device)
        else:
            base = Path(self.work_dir) if self.work_dir else None
            self._tmp = tempfile.TemporaryDirectory(prefix="qtool-kld-", dir=base)
            self.store = DiskStore(Path(self._tmp.name), shape, s.dtype, device=s.device)
        batch = s.batch_windows(seq)
        head = self._head_tensors()
        stored = s.layer_sizes()[1]
        if head_ahead and head and sum(i.nbytes for i in head) <= max(stored, default=0):
            s.read_after_layers(HEAD_READ, head)  # in the next layer's read-ahead's place: within the plan
        s.prefetch(0)  # the first layer is read while the windows are embedded
        s.embed_into(ids, self.store, batch)
        s.run(self.store, seq, batch=batch, progress=progress)
        self.windows = n
        self.seq_len = seq

    def _head_name(self) -> str:
        s = self.streamer
        name = "lm_head.weight"
        if name not in s.ckpt.tensors:
            if not s.text_cfg_dict.get("tie_word_embeddings") and not (s.ckpt.config or {}).get("tie_word_embeddings"):
                raise PlanError(
                    "checkpoint has no lm_head.weight and does not tie word embeddings", path=s.ckpt.root, tensor=name
                )
            name = s.prefix + "embed_tokens.weight"  # tied (transformers PreTrainedModel.tie_weights)
        return name

    def _head_tensors(self) -> list:
        """The final norm's and the lm_head's tensors where both are stored dense (read ahead with the
        layers); [] otherwise (a quantized head is dequantized by load_param after the layers)."""
        s = self.streamer
        names = [s.prefix + "norm.weight", self._head_name()]
        if not all(stored_dense(s.model_map, n) for n in names):
            return []
        return [s.ckpt.tensors[n] for n in names]

    def _load_head(self) -> None:
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm

        s = self.streamer
        read = s.take_read(HEAD_READ)  # None where it was not read ahead
        try:
            norm = Qwen3_5MoeRMSNorm(s.hidden_size, eps=s.hf_config.rms_norm_eps)
            norm.weight.data = load_param(s.model_map, s.prefix + "norm.weight", s.dtype, self.device, read=read)
            norm = norm.to(self.device)
            w = load_param(s.model_map, self._head_name(), s.dtype, self.device, read=read)
        finally:
            if read is not None:
                read.close()  # the tensors above keep what they view
        self.vocab = int(w.shape[0])
        self._head = (norm, w)

    def rows(self, w: int) -> int:
        return self.seq_len

    def logprobs(self, w: int, r0: int, r1: int):
        import torch

        if self._head is None:
            self._load_head()
        norm, weight = self._head
        with torch.inference_mode():
            h = self.store.read(w, w + 1)[0, r0:r1].to(self.device, self.streamer.dtype)
            logits = norm(h) @ weight.T
            return torch.log_softmax(logits.float(), dim=-1)

    def close(self) -> None:
        self._head = None
        self.store = None
        self.streamer.close()  # a read ahead not taken (an error before the log-probs) ends here
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


class DumpSource:
    kind = Kind.DUMP

    def __init__(self, path, *, device: str = "cpu"):
        from safetensors import safe_open

        self.path = Path(path)
        self.files = _numbered(self.path)
        if not self.files:
            raise CheckpointError("no <i>.safetensors files in the dump directory", path=self.path)
        idx = [int(f.stem) for f in self.files]
        if idx != list(range(len(idx))):
            missing = sorted(set(range(max(idx) + 1)) - set(idx))[:5]
            raise CheckpointError(
                "dump files are not numbered 0..N-1",
                path=self.path,
                got=f"missing {missing}",
                hint="one file per request, in request order",
            )
        self.device = device
        self.windows = len(self.files)
        self._shapes = []
        for f in self.files:
            with safe_open(str(f), framework="pt") as h:
                key = DUMP_KEY if DUMP_KEY in h.keys() else None  # noqa: SIM118 (safe_open has keys(), not `in`)
                if key is None:
                    raise CheckpointError(f"no `{DUMP_KEY}` tensor in dump file", path=f, got=list(h.keys()))
                shape = h.get_slice(key).get_shape()
            if len(shape) != 2:
                raise CheckpointError("log_probs must be [positions, vocab]", path=f, got=shape)
            self._shapes.append(tuple(shape))
        self.vocab = self._shapes[0][1]

    def rows(self, w: int) -> int:
        return self._shapes[w][0]

    def logprobs(self, w: int, r0: int, r1: int):
        import torch
        from safetensors import safe_open

        with safe_open(str(self.files[w]), framework="pt") as h:
            t = h.get_slice(DUMP_KEY)[r0:r1]
        return t.to(self.device, torch.float32)

    def close(self) -> None:
        pass


class CompactSource:
    kind = Kind.COMPACT

    def __init__(self, path, *, device: str = "cpu"):
        self.path = Path(path)
        self.meta = json.loads((self.path / META).read_text())
        self.windows = int(self.meta["windows"])
        self.vocab = int(self.meta["vocab"])
        self._rows = [int(r) for r in self.meta["rows"]]
        self._cache: tuple[int, CompactChunk] | None = None

    def rows(self, w: int) -> int:
        return self._rows[w]

    def compact(self, w: int, r0: int, r1: int) -> CompactChunk:
        from safetensors.torch import load_file

        if self._cache is None or self._cache[0] != w:
            f = self.path / f"{w}.safetensors"
            if not f.is_file():
                raise CheckpointError("compact reference window file missing", path=f)
            self._cache = (w, CompactChunk.from_tensors(load_file(str(f))))
        return self._cache[1].slice(r0, r1)

    def close(self) -> None:
        self._cache = None


def open_source(path, *, device="cpu", dtype=None, work_dir=None, batch_tokens=None):
    kind = detect(path)
    if kind is Kind.CHECKPOINT:
        return CheckpointSource(path, device=device, dtype=dtype, work_dir=work_dir, batch_tokens=batch_tokens)
    if kind is Kind.DUMP:
        return DumpSource(path, device=device)
    return CompactSource(path, device=device)
