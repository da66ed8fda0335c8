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
- the libraries: transformers', tokenizers' and jinja2's (chat templates) versions, and the bytes of
  qtool's own rule that turns rows into text and text into ids (calib_data.py);
- the data: a local file's path, size, mtime and ctime (a rewrite changes the ctime, which no tool sets
  back), the built-in sample's the same way, a Hub dataset's commit and split (no key, so no cache, unless
  the revision is a commit: offline, a branch name would stand for whatever the datasets cache holds);
- the number of tokens asked for.
An entry holds its key, its token count and the sha256 of its ids, written to a temporary file, fsynced and
renamed: a torn, short or foreign entry is a miss. One that cannot be written is skipped. The folder keeps
the KEEP_ENTRIES entries used last (a hit marks its entry used): every new dataset, sample count or
tokenizer adds one (4 MB for 512 x 2048 tokens), and nothing else would ever remove them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from array import array
from pathlib import Path

from qtool.cache import cache_dir
from qtool.errors import WriteError
from qtool.hub.spec import is_commit
from qtool.io.files import TMP_SUFFIX, hash_file, keep_newest
from qtool.io.jsonio import atomic_write_bytes
from qtool.stream.calib_sources import BUILTIN, TOKENIZER_FILES, builtin_path, parse_hub_dataset

MAGIC = b"qtool-tokens 1\n"
KEEP_ENTRIES = 64

# the rule that turns rows into text and text into ids: an edit to it is a new key (named by its path:
# calib_data imports this module to look its ids up)
RULE_FILE = Path(__file__).with_name("calib_data.py")


def _key_files() -> tuple[str, ...]:
    """What AutoTokenizer reads (TOKENIZER_FILES) and the files that shape its output."""
    return TOKENIZER_FILES + (
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "merges.txt",
        "chat_template.jinja",
        "chat_template.json",
    )


def _version(dist: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _data_identity(dataset: str, revision: str | None) -> list | None:
    if dataset.startswith("hf:"):
        if not revision or not is_commit(revision):
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
    for name in _key_files():
        p = root / name
        if p.is_file():
            tokenizer[name] = hash_file(p)
    if not tokenizer:
        return None
    try:
        cfg = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    picks = {k: cfg.get(k) for k in ("model_type", "tokenizer_class")} if isinstance(cfg, dict) else {}
    parts = {
        "magic": MAGIC.decode(),
        "need": need,
        "tokenizer": tokenizer,
        "config": picks,
        "data": data,
        "libs": {d: _version(d) for d in ("transformers", "tokenizers", "jinja2")},
        "rule": hash_file(RULE_FILE),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _path(k: str) -> Path:
    return cache_dir() / "tokens" / f"{k}.i32"


def load(key: str | None) -> list[int] | None:
    """The ids saved under `key`, or None."""
    if key is None:
        return None
    try:
        raw = _path(key).read_bytes()
    except OSError:
        return None
    head = MAGIC + key.encode() + b"\n"
    if not raw.startswith(head) or len(raw) < len(head) + 40:
        return None  # foreign or torn
    count = int.from_bytes(raw[len(head) : len(head) + 8], "little")
    digest, body = raw[len(head) + 8 : len(head) + 40], raw[len(head) + 40 :]
    if len(body) != 4 * count or count == 0 or hashlib.sha256(body).digest() != digest:
        return None  # short or damaged
    ids = array("i")
    ids.frombytes(body)
    with contextlib.suppress(OSError):  # (a read-only cache dir)
        os.utime(_path(key))  # used: the last entry the folder's pruning removes
    return ids.tolist()


def save(key: str | None, ids: list[int]) -> None:
    if key is None:
        return

    try:
        packed = array("i", ids)
        if packed.itemsize != 4:
            return
        body = packed.tobytes()
        p = _path(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        # a reader sees the whole entry or none (runs in parallel fill it alike)
        atomic_write_bytes(
            p, MAGIC + key.encode() + b"\n" + len(ids).to_bytes(8, "little") + hashlib.sha256(body).digest() + body
        )
        _prune(p.parent)
    except (OSError, OverflowError, WriteError):
        pass  # a read-only or full cache dir: the next run tokenizes again


def _prune(folder: Path) -> None:
    """Down to the KEEP_ENTRIES entries used last (by mtime: written or loaded); the temporary files of runs
    killed while saving go once they are a day old (a run saving now has a fresh one)."""
    import time

    for tmp in folder.glob("*" + TMP_SUFFIX):
        try:
            if time.time() - tmp.stat().st_mtime > 86400:
                tmp.unlink(missing_ok=True)
        except OSError:
            pass  # removed meanwhile
    keep_newest(folder, "*.i32", KEEP_ENTRIES)
