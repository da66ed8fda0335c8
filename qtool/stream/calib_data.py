"""Calibration token windows: deterministic, from the checkpoint's own tokenizer.

The rule (shared by calibrate-kv and later quantize / eval kld):
  1. read the documents: `builtin` = qtool/data/calib_builtin.txt as ONE document (prose, code, a
     tool-call transcript, several languages; original text written for qtool); FILE.txt = the whole
     file as one document; FILE.jsonl / FILE.parquet / `hf:ORG/NAME[@REV][:SPLIT]` (a Hub dataset, through
     the `datasets` library: its cache, token and offline mode) = one document per row, in order: its
     `text` column, or its chat `messages` column rendered with the checkpoint's own chat template (the
     text an engine would feed the model for that conversation);
  2. tokenize each document with the checkpoint's tokenizer WITHOUT special tokens
     (`add_special_tokens=False`) and concatenate the token ids, documents in order, nothing in between;
  3. take the first N consecutive, non-overlapping windows of L tokens: window i = ids[i*L:(i+1)*L].
Too few tokens for N x L is an error that says how many windows the dataset can give.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qtool.errors import CheckpointError, PlanError, UsageError
from qtool.stream import token_cache
from qtool.stream.calib_sources import BUILTIN, TOKENIZER_FILES, builtin_path, parse_hub_dataset

if TYPE_CHECKING:
    import torch

    from qtool.io.checkpoint import Checkpoint


def dataset_revision(dataset: str) -> str | None:
    """The commit a Hub dataset resolves to (recorded in manifests and pinned for loading); None for local
    data; offline (HF_HUB_OFFLINE=1) the revision as given (the datasets cache answers)."""
    if not dataset.startswith("hf:"):
        return None
    from huggingface_hub import HfApi

    from qtool.hub.resolve import HubSpec, hub_errors, hub_offline, is_commit

    repo, rev, _ = parse_hub_dataset(dataset)
    if is_commit(rev) or hub_offline():
        return rev
    with hub_errors(HubSpec(repo, rev)):
        return HfApi().dataset_info(repo, revision=rev).sha


def _rows(dataset: str) -> Iterator[Any]:
    """The rows of a .parquet file or a Hub dataset split, as dicts, one at a time (a caller that has the
    tokens it needs stops reading: ultrachat_200k's train_sft split is 200k conversations)."""
    if dataset.startswith("hf:"):
        from qtool.extras import require

        require("datasets", f"the dataset {dataset}")
        import datasets

        from qtool.hub.resolve import HubSpec, hub_errors, hub_offline

        repo, rev, split = parse_hub_dataset(dataset)
        with hub_errors(HubSpec(repo, rev)):
            try:
                # streaming: rows arrive as they are read (range requests on the parquet files), so a run
                # that needs 262k tokens reads a few MB of a multi-GB split, in bounded memory
                ds = datasets.load_dataset(
                    repo, revision=dataset_revision(dataset), split=split, streaming=not hub_offline()
                )
            except (ValueError, FileNotFoundError) as e:  # unknown split, no data files, not cached offline
                raise UsageError(
                    f"cannot load the dataset ({type(e).__name__}: {str(e).splitlines()[0]})",
                    path=dataset,
                    hint="check ORG/NAME, @REVISION and :SPLIT (e.g. hf:HuggingFaceH4/ultrachat_200k:train_sft)",
                ) from None
        with hub_errors(HubSpec(repo, rev)):  # a network error while rows stream in: named, no traceback
            yield from ds
        return
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    for batch in pq.ParquetFile(dataset).iter_batches(batch_size=256):
        yield from batch.to_pylist()


def _document(row: Any, i: int, where: str | Path, tokenizer: Any) -> str:
    """A row's text: its `text`, or its chat `messages` rendered by the checkpoint's chat template."""
    if isinstance(row, dict) and isinstance(row.get("text"), str):
        return row["text"]
    msgs = row.get("messages") if isinstance(row, dict) else None
    if isinstance(msgs, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in msgs):
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise UsageError(
                "the dataset is chat `messages`, and the checkpoint's tokenizer has no chat template",
                path=where,
                hint="copy tokenizer_config.json / chat_template.jinja from the original model",
            )
        return tokenizer.apply_chat_template(msgs, tokenize=False)
    raise UsageError(f"row {i} has neither a string `text` nor a chat `messages` list", path=where)


def _read_utf8(path: Path) -> str:
    """A dataset file's text; a named error for a file that is not UTF-8 (with where its first bad byte is)."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise UsageError(
            f"the dataset file is not UTF-8 text (byte 0x{data[e.start]:02x} at line {line})",
            path=path,
            hint="convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8 FILE > FILE.utf8)",
        ) from None


def read_documents(dataset: str, tokenizer: Any = None) -> Iterable[str]:
    """The dataset's documents in order (an iterable: Hub datasets and parquet files are read lazily)."""
    if dataset == BUILTIN:
        return [builtin_path().read_text(encoding="utf-8")]
    if dataset.startswith("hf:"):
        return (_document(r, i, dataset, tokenizer) for i, r in enumerate(_rows(dataset), 1))
    p = Path(dataset)
    if not p.is_file():
        raise CheckpointError(
            "dataset file not found",
            path=p,
            hint="pass `builtin`, a .txt / .jsonl / .parquet file, or hf:ORG/NAME[:SPLIT]",
        )
    if p.suffix == ".jsonl":
        docs = []
        for i, line in enumerate(_read_utf8(p).splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"line {i} is not JSON ({e.msg})", path=p) from None
            docs.append(_document(obj, i, p, tokenizer))
        return docs
    if p.suffix == ".parquet":
        return (_document(r, i, p, tokenizer) for i, r in enumerate(_rows(str(p)), 1))
    if p.suffix in (".txt", ".md", ""):
        return [_read_utf8(p)]
    raise UsageError("unsupported dataset file type", path=p, expected=".txt, .jsonl or .parquet", got=p.suffix)


@dataclass
class CalibSet:
    """`ids` is a LongTensor [N, L]; `digest` identifies the token ids (journal key for --resume)."""

    ids: torch.Tensor
    dataset: str
    available_tokens: int
    revision: str | None = None  # a Hub dataset's commit

    def to_json(self) -> dict:
        """What plans, reports and manifests record: the dataset, its revision, the tokens it gives, the
        token ids' digest."""
        return {
            "dataset": self.dataset,
            "revision": self.revision,
            "samples": self.samples,
            "seq_len": self.seq_len,
            "tokens": self.tokens,
            "available_tokens": self.available_tokens,
            "available_windows": self.available_tokens // self.seq_len,
            "digest": self.digest,
        }

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


def token_digest(ids: torch.Tensor) -> str:
    import torch

    t = ids.to(torch.int64).contiguous()
    return hashlib.sha256(t.detach().cpu().numpy().tobytes() + str(tuple(t.shape)).encode()).hexdigest()[:16]


def windows_from_ids(
    ids: list[int], samples: int, seq_len: int, *, dataset: str = "?", at_most: bool = False
) -> CalibSet:
    """`samples` windows of `seq_len` tokens; `at_most`: fewer when the dataset gives fewer (at least one)."""
    import torch

    if samples < 1 or seq_len < 1:
        raise UsageError("--samples and --seq-len must be positive", got=(samples, seq_len))
    if at_most and len(ids) >= seq_len:
        samples = min(samples, len(ids) // seq_len)
    need = samples * seq_len
    if not ids:
        raise PlanError(
            "the dataset gave no tokens at all (empty documents, or a tokenizer that yields none)",
            path=dataset,
            expected=need,
            got=0,
            hint="check the dataset's text column and the checkpoint's tokenizer.json",
        )
    if len(ids) < need:
        raise PlanError(
            f"the dataset gives {len(ids)} tokens, {need} needed for {samples} x {seq_len}",
            expected=need,
            got=len(ids),
            hint=(
                (
                    f"use at most --samples {len(ids) // seq_len} at --seq-len {seq_len}, a shorter --seq-len, "
                    "or a larger --dataset"
                )
                if len(ids) >= seq_len
                else (f"the dataset gives less than one window: --seq-len {len(ids)} at most, or a larger --dataset")
            )
            + (
                f"; `{BUILTIN}` is a short sample for smoke runs: for a real calibration pass e.g. --dataset "
                "hf:HuggingFaceH4/ultrachat_200k:train_sft (what the shipped 397B recipes use)"
                if dataset == BUILTIN
                else ""
            ),
        )
    t = torch.tensor(ids[:need], dtype=torch.long).view(samples, seq_len)
    return CalibSet(t, dataset, len(ids))


def load_tokenizer(ckpt_dir: str | Path) -> Any:
    """The checkpoint's tokenizer (its side files already checked by the caller, build_calib_set)."""
    from qtool.stream.warm_import import join, skip_unused_imports

    join()  # the decoder module's background import, where the job started it before planning
    skip_unused_imports()  # the job's first transformers import: without what it never runs
    from transformers import AutoTokenizer

    from qtool.quiet import transformers_errors_only

    if Path(ckpt_dir).is_dir() and not any((Path(ckpt_dir) / f).is_file() for f in TOKENIZER_FILES):
        # AutoTokenizer would otherwise build an empty tokenizer from the processor configs: 0 tokens
        raise PlanError(
            "the checkpoint has no tokenizer (no tokenizer.json or vocabulary file): the calibration text "
            "cannot be tokenized",
            path=ckpt_dir,
            expected=" or ".join(TOKENIZER_FILES),
            hint="copy tokenizer.json and tokenizer_config.json from the original model into the checkpoint "
            "(e.g. hf download Qwen/Qwen3.5-397B-A17B tokenizer.json tokenizer_config.json --local-dir CKPT)",
        )

    try:
        with transformers_errors_only():
            return AutoTokenizer.from_pretrained(str(ckpt_dir))
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds
        raise PlanError(
            f"cannot load the checkpoint's tokenizer ({type(e).__name__}: {e})",
            path=ckpt_dir,
            hint="copy tokenizer.json / tokenizer_config.json from the original model into the checkpoint",
        ) from None


def plan_calibration(ckpt: Checkpoint, dataset: str, samples: int, seq_len: int, *, at_most: bool = False) -> CalibSet:
    """The calibration windows of a plan (before any weight is read): the dataset read and tokenized with
    the checkpoint's tokenizer; too few tokens, or ids past the model's vocab, refuse here (`at_most`:
    fewer windows than `samples` where the dataset gives fewer)."""
    revision = dataset_revision(dataset)
    calib = build_calib_set(ckpt.root, dataset, samples, seq_len, at_most=at_most, revision=revision)
    vocab = int(ckpt.text_config.get("vocab_size", 1 << 62))
    if int(calib.ids.max()) >= vocab:
        raise PlanError(
            "the tokenizer gives ids beyond the model's vocab_size",
            expected=f"< {vocab}",
            got=int(calib.ids.max()),
            hint="the tokenizer does not belong to this checkpoint",
        )
    calib.revision = revision
    return calib


def _tokenize(tok: Any, dataset: str, need: int, stop: threading.Event | None = None) -> list[int]:
    """The dataset's token ids, documents in order, until `need` of them (or the data's end); once `stop`
    is set (the job was interrupted while this ran on another thread), Interrupted at the next document."""
    from qtool.errors import Interrupted
    from qtool.quiet import transformers_errors_only

    ids: list[int] = []
    with transformers_errors_only():  # a whole document is longer than model_max_length on purpose
        for doc in read_documents(dataset, tok):
            if stop is not None and stop.is_set():
                raise Interrupted("tokenizing the calibration data")
            ids.extend(tok(doc, add_special_tokens=False)["input_ids"])
            if len(ids) >= need:
                break
    return ids


def build_calib_set(
    ckpt_dir: str | Path,
    dataset: str,
    samples: int,
    seq_len: int,
    *,
    tokenizer: Any = None,
    at_most: bool = False,
    revision: str | None = None,
) -> CalibSet:
    """The windows of `dataset` tokenized with the tokenizer of `ckpt_dir` (or `tokenizer`). The ids come from
    qtool's token cache where this tokenizer already tokenized this data (qtool.stream.token_cache;
    `revision`: a Hub dataset's resolved commit, part of the key)."""
    need = samples * seq_len
    key = None
    if tokenizer is None:
        if Path(ckpt_dir).is_dir():
            from qtool.io.plan import checkpoint_files

            # a FIFO or a dangling symlink at tokenizer.json is named as such (not "no tokenizer"), hit or not
            checkpoint_files(Path(ckpt_dir))
        key = token_cache.key(ckpt_dir, dataset, need, revision)
        ids = token_cache.load(key)
        if ids is not None:
            return windows_from_ids(ids, samples, seq_len, dataset=dataset, at_most=at_most)
    if tokenizer is not None:
        ids = _tokenize(tokenizer, dataset, need)
    else:
        from qtool.stream import warm_import

        # in the background import's thread, before it imports the decoder module (which then overlaps the
        # rest of the job's plan), where a streamed job started it; else here
        ids = warm_import.before_decoder(lambda stop: _tokenize(load_tokenizer(ckpt_dir), dataset, need, stop))
    if key is not None and ids:
        token_cache.save(key, ids)
    return windows_from_ids(ids, samples, seq_len, dataset=dataset, at_most=at_most)
