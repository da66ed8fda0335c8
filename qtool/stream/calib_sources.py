"""How a calibration dataset and a checkpoint's tokenizer are named: what qtool.stream.calib_data reads and
qtool.stream.token_cache keys its entries by."""

from __future__ import annotations

from pathlib import Path

from qtool.hub.resolve import parse_spec

BUILTIN = "builtin"

# what AutoTokenizer reads (fast tokenizers: tokenizer.json; slow ones: the vocab files)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def builtin_path() -> Path:
    return Path(__file__).resolve().parent.parent / "data" / "calib_builtin.txt"


def parse_hub_dataset(spec: str) -> tuple[str, str | None, str]:
    """`hf:ORG/NAME[@REV][:SPLIT]` -> (repo, revision, split); the split defaults to `train`."""
    body, sep, split = spec.removeprefix("hf:").rpartition(":")
    if not sep:
        body, split = split, ""
    hs = parse_spec("hf:" + body)
    return hs.repo_id, hs.revision, split or "train"
