"""Calibration token windows: deterministic, from the checkpoint's own tokenizer.

The rule (shared by calibrate-kv and later quantize / eval kld):
  1. read the documents: `builtin` = qtool/data/calib_builtin.txt as ONE document (prose, code, a
     tool-call transcript, several languages; original text written for qtool); FILE.txt = the whole
     file as one document; FILE.jsonl = the `text` field of every line, in file order, one document each;
  2. tokenize each document with the checkpoint's tokenizer WITHOUT special tokens
     (`add_special_tokens=False`) and concatenate the token ids, documents in order, nothing in between;
  3. take the first N consecutive, non-overlapping windows of L tokens: window i = ids[i*L:(i+1)*L].
Too few tokens for N x L is an error that says how many windows the dataset can give.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from qtool.errors import CheckpointError, PlanError, UsageError

BUILTIN = "builtin"


def builtin_path() -> Path:
    return Path(__file__).resolve().parent.parent / "data" / "calib_builtin.txt"


def read_documents(dataset: str) -> list[str]:
    if dataset == BUILTIN:
        return [builtin_path().read_text(encoding="utf-8")]
    p = Path(dataset)
    if not p.is_file():
        raise CheckpointError("dataset file not found", path=p, hint="pass `builtin`, a .txt or a .jsonl file")
    if p.suffix == ".jsonl":
        docs = []
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"line {i} is not JSON ({e.msg})", path=p) from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise UsageError(f"line {i} has no string `text` field", path=p)
            docs.append(obj["text"])
        return docs
    if p.suffix in (".txt", ".md", ""):
        return [p.read_text(encoding="utf-8")]
    raise UsageError("unsupported dataset file type", path=p, expected=".txt or .jsonl", got=p.suffix)


@dataclass
class CalibSet:
    """`ids` is a LongTensor [N, L]; `digest` identifies the token ids (journal key for --resume)."""

    ids: object
    dataset: str
    available_tokens: int

    @property
    def samples(self) -> int:
        return int(self.ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.ids.shape[1])

    @property
    def tokens(self) -> int:
        return self.samples * self.seq_len

    @property
    def digest(self) -> str:
        return token_digest(self.ids)


def token_digest(ids) -> str:
    import torch

    t = ids.to(torch.int64).contiguous()
    return hashlib.sha256(t.detach().cpu().numpy().tobytes() + str(tuple(t.shape)).encode()).hexdigest()[:16]


def windows_from_ids(ids: list[int], samples: int, seq_len: int, *, dataset: str = "?") -> CalibSet:
    import torch

    if samples < 1 or seq_len < 1:
        raise UsageError("--samples and --seq-len must be positive", got=(samples, seq_len))
    need = samples * seq_len
    if len(ids) < need:
        raise PlanError(
            f"the dataset gives {len(ids)} tokens, {need} needed for {samples} x {seq_len}",
            expected=need,
            got=len(ids),
            hint=f"use at most --samples {len(ids) // seq_len} at --seq-len {seq_len}, "
            "a shorter --seq-len, or a larger --dataset",
        )
    t = torch.tensor(ids[:need], dtype=torch.long).view(samples, seq_len)
    return CalibSet(t, dataset, len(ids))


def load_tokenizer(ckpt_dir: str | Path):
    from transformers import AutoTokenizer

    from qtool.quiet import transformers_errors_only

    try:
        with transformers_errors_only():
            return AutoTokenizer.from_pretrained(str(ckpt_dir))
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds
        raise PlanError(
            f"cannot load the checkpoint's tokenizer ({type(e).__name__}: {e})",
            path=ckpt_dir,
            hint="copy tokenizer.json / tokenizer_config.json from the original model into the checkpoint",
        ) from None


def build_calib_set(ckpt_dir: str | Path, dataset: str, samples: int, seq_len: int, *, tokenizer=None) -> CalibSet:
    tok = tokenizer if tokenizer is not None else load_tokenizer(ckpt_dir)
    ids: list[int] = []
    need = samples * seq_len
    from qtool.quiet import transformers_errors_only

    with transformers_errors_only():  # a whole document is longer than model_max_length on purpose
        for doc in read_documents(dataset):
            ids.extend(tok(doc, add_special_tokens=False)["input_ids"])
            if len(ids) >= need:
                break
    return windows_from_ids(ids, samples, seq_len, dataset=dataset)
