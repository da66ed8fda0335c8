"""The first layer's input reads only the embedding rows the calibration tokens use (stream/dequant
`embedding_rows`): the same hidden states as a lookup in the whole table, far fewer bytes read, and a
token id the table does not hold is a named error."""

from __future__ import annotations

import pytest
import torch

from qtool.arch.model_map import build_map
from qtool.errors import PlanError
from qtool.io.checkpoint import Checkpoint
from qtool.stream import dequant

NAME = "model.language_model.embed_tokens.weight"


@pytest.fixture
def reads(monkeypatch):
    """Bytes each pread_exact call of the embedding read."""
    from qtool.stream import layer_read

    seen = []
    real = layer_read.pread_exact

    def counting(fd, view, offset, path, tensor=None, **kwargs):
        if tensor == NAME:
            seen.append(len(view))
        return real(fd, view, offset, path, tensor=tensor, **kwargs)

    monkeypatch.setattr(layer_read, "pread_exact", counting)
    return seen


@pytest.mark.parametrize("gap", [1, 256, 1 << 20])
def test_the_rows_used_are_those_of_the_whole_table(tiny_bf16, reads, monkeypatch, gap):
    monkeypatch.setattr(dequant, "EMBED_GAP", gap)
    mm = build_map(Checkpoint.open(tiny_bf16))
    g = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.randint(0, 40, (3, 50), generator=g), torch.randint(900, 1024, (3, 50), generator=g)])
    table, lookup = dequant.embedding_rows(mm, NAME, ids, torch.bfloat16)
    read = sum(reads)
    whole = dequant.load_param(mm, NAME, torch.bfloat16)
    assert torch.equal(table[lookup[ids]], whole[ids])
    row = whole.shape[1] * 2
    if gap < (1 << 20):
        assert read < whole.shape[0] * row  # not the whole table
    if gap == 1:  # rows read one run per run of consecutive ids: exactly the rows used
        assert read == torch.unique(ids).numel() * row


def test_a_token_id_beyond_the_table_is_named(tiny_bf16):
    mm = build_map(Checkpoint.open(tiny_bf16))
    with pytest.raises(PlanError, match="outside the embedding's 1024 rows") as e:
        dequant.embedding_rows(mm, NAME, torch.tensor([[3, 1024]]), torch.bfloat16)
    assert "tokenizer" in e.value.hint


def test_a_bad_id_of_another_ranks_windows_is_named_on_this_rank_too(tiny_bf16):
    """Each rank reads the rows of its own windows, but checks every window's ids: all ranks stop with the
    same error (one rank alone would leave the others waiting at the barrier after the embedding)."""
    mm = build_map(Checkpoint.open(tiny_bf16))
    mine, every = torch.tensor([[3, 4]]), torch.tensor([[3, 4], [5, 4096]])
    with pytest.raises(PlanError, match="token id 4096"):
        dequant.embedding_rows(mm, NAME, mine, torch.bfloat16, every_id=every)
