"""The one resume record of a layer-streamed job (quantize, calibrate-kv, sensitivity).

After each layer the journal says which layer runs next, which hidden-state file (qtool.stream.hidden_store
DiskStore.current) holds that layer's input, and what the job's stages have gathered so far (their
`journal_entry`). It is keyed by the job's inputs and settings: a --resume whose key differs is refused by
name. Each entry is written once the layer's hidden states are on disk (DiskStore.when_durable), so a crash
at any point leaves a journal that names intact hidden states.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qtool.dist import Group
from qtool.errors import PlanError
from qtool.io.jsonio import load_json, write_json
from qtool.stream.hidden_store import DiskStore

JOURNAL = "journal.json"


class LayerJournal:
    """`path` (in the job's work dir), written by rank 0 only (`group`'s leader) where `enabled`.

    open(): the group agrees on the job's `key` (its inputs and settings) and every rank reads the previous
    journal on --resume (refused when its key differs: `inputs` names what the key covers); `saved` is
    then that journal ({} for a new run) and `next_layer` where the run starts."""

    def __init__(self, path: Path, key: str, group: Group, *, enabled: bool = True) -> None:
        self.path = Path(path)
        self.key = key
        self.group = group
        self.enabled = enabled
        self.saved: dict[str, Any] = {}

    @staticmethod
    def peek(path: Path) -> int:
        """The next layer the journal at `path` names, unchecked (0 without one, or one not to resume from:
        open() says which): where a resumed run may begin reading before its key is known."""
        try:
            return int(json.loads(Path(path).read_text()).get("next_layer", 0))
        except (OSError, ValueError, TypeError, AttributeError):
            return 0

    @property
    def keeps(self) -> bool:
        """Whether this process writes the journal."""
        return self.enabled and self.group.leader

    @property
    def next_layer(self) -> int:
        return int(self.saved.get("next_layer", 0))

    def current(self, default: str = "a") -> str:
        """The hidden-state file holding the next layer's input, as the journal says."""
        return str(self.saved.get("current", default))

    def open(self, *, resume: bool, what: str, job: str, inputs: str) -> LayerJournal:
        """Agree on the key across ranks and read the journal of the run a --resume continues. `what`: the
        job as the journal is named in errors ("quantize journal"); `job`: as the ranks' agreement names it;
        `inputs`: what a differing key means, for the refusal."""
        self.group.barrier()  # rank 0 has opened the output transaction (the work dir's parent exists)
        self.group.agree(job, self.key)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume and self.path.exists():
            saved, _ = load_json(self.path, what=what)
            if saved.get("key") != self.key:
                raise PlanError(
                    f"--resume: the journal was written for other inputs ({inputs})",
                    path=self.path,
                    hint="run again without --resume to start over",
                )
            self.saved = saved
        self.group.barrier()  # every rank has read the journal before rank 0 writes the next one
        return self

    def save(self, next_layer: int, current: str, entry: dict[str, Any], store: DiskStore) -> None:
        """Record that the run goes on at `next_layer` from hidden-state file `current`, with the stages'
        `entry`, once everything the store was given so far is on disk."""
        if not self.keeps:
            return
        journal = {"key": self.key, "next_layer": next_layer, "current": current, **entry}
        store.when_durable(lambda: write_json(self.path, journal))
