"""Edits of a checkpoint copy that tests in several folders make (a bad export, as a user meets it)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from qtool.io.checkpoint import Checkpoint
from qtool.io.writer import FileRange, OutTensor, write_shard


def drop_tensors(root: Path, drop) -> None:
    """Rewrite `root`'s shards without the tensors for which `drop(name)` is true (index updated)."""
    ck = Checkpoint.open(root)
    idx_path = root / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    for shard, h in ck.headers.items():
        gone = [n for n in h.tensors if drop(n)]
        if not gone:
            continue
        keep = sorted((t for n, t in h.tensors.items() if not drop(n)), key=lambda t: t.start)
        tmp = root / (shard + ".new")
        write_shard(tmp, [OutTensor(t.name, t.dtype, tuple(t.shape), FileRange(t.file, t.start, t.end)) for t in keep])
        os.replace(tmp, root / shard)
        for n in gone:
            del idx["weight_map"][n]
    idx_path.write_text(json.dumps(idx, indent=2))
