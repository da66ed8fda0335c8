"""A calibration dataset's token ids, kept between runs.

Tokenizing the calibration set is the first thing a streamed job does, and with transformers' tokenizer it
costs that job's start ~2.5 s of imports on the main thread (AutoTokenizer pulls in transformers' auto
factory, torch._dynamo and torch.distributed.tensor: `python -X importtime` on the lent GPU machine)
before a single byte of a layer is read. The ids are a pure function of the tokenizer, the data and the
number of tokens asked for, so the same dataset with the same tokenizer (quantize, then calibrate-kv, eval
kld and sensitivity on its output, or a CI rebuild) is tokenized once; the transformers import then happens
behind the first layer's reads (qtool.stream.warm_import).

The key holds everything the ids depend on:
- the tokenizer: the sha256 of each tokenizer file in the checkpoint directory (TOKENIZER_FILES; the chat
  template renders chat datasets), and the config's `model_type` / `tokenizer_class` (AutoTokenizer picks the
  class from them when tokenizer_config.json names none);
- the libraries: transformers' and tokenizers' versions;
- the data: a local file's path, size, mtime and ctime (a rewrite changes the ctime, which no tool sets
  back), the built-in sample's the same way, a Hub dataset's resolved commit and split (no key, so no cache,
  when the commit is not known);
- the number of tokens asked for, and FORMAT (bumped when the tokenization rule in calib_data changes).
A cache entry that cannot be read is ignored; one that cannot be written is skipped.
"""

from __future__ import annotations

import hashlib
import json
import os
from array import array
from pathlib import Path

FORMAT = 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "chat_template.jinja",
                   "chat_template.json")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def _version(dist: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _data_identity(dataset: str, revision: str | None) -> list | None:
    from qtool.stream.calib_data import BUILTIN, builtin_path, parse_hub_dataset

    if dataset.startswith("hf:"):
        if not revision:
            return None
        repo, _rev, split = parse_hub_dataset(dataset)
        return ["hub", repo, revision, split]
    path = builtin_path() if dataset == BUILTIN else Path(dataset)
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError:
        return None  # read_documents names the missing file
    return ["file", real, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def key(ckpt_dir: str | Path, dataset: str, need: int, revision: str | None = None) -> str | None:
    """The cache key of the first `need` tokens of `dataset` with the tokenizer in `ckpt_dir`; None where
    one of its parts cannot be known (then nothing is cached)."""
    root = Path(ckpt_dir)
    data = _data_identity(dataset, revision)
    if data is None or not root.is_dir():
        return None
    tokenizer = {}
    for name in TOKENIZER_FILES:
        p = root / name
        if p.is_file():
            tokenizer[name] = _sha256(p)
    if not tokenizer:
        return None
    try:
        cfg = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    picks = {k: cfg.get(k) for k in ("model_type", "tokenizer_class")} if isinstance(cfg, dict) else {}
    parts = {"format": FORMAT, "need": need, "tokenizer": tokenizer, "config": picks, "data": data,
             "libs": {d: _version(d) for d in ("transformers", "tokenizers")}}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _path(k: str) -> Path:
    from qtool.io.manifest import cache_dir

    return cache_dir() / "tokens" / f"{k}.i32"


def load(k: str | None) -> list[int] | None:
    """The ids saved under `k`, or None."""
    if k is None:
        return None
    try:
        raw = _path(k).read_bytes()
    except OSError:
        return None
    if len(raw) % 4:
        return None  # torn
    ids = array("i")
    ids.frombytes(raw)
    if ids.itemsize != 4:
        return None
    return ids.tolist()


def save(k: str | None, ids: list[int]) -> None:
    if k is None:
        return
    import tempfile

    tmp = None
    try:
        p = _path(k)
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".qtool-tmp", dir=p.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(array("i", ids).tobytes())
        os.replace(tmp, p)  # a reader sees the whole entry or none (runs in parallel fill it alike)
    except (OSError, OverflowError):
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)  # a read-only or full cache dir: the next run tokenizes again
