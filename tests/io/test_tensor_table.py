"""The column-stored header table behaves as the name -> TensorInfo dict it replaces."""

from __future__ import annotations

import pytest

from qtool.io.checkpoint import Checkpoint
from qtool.io.safetensors_header import read_header
from qtool.io.tensor_table import TensorInfo, TensorTable, tensor_rows

INFOS = [
    TensorInfo("a.weight", "/m/s1.safetensors", "U8", (4, 8), 100, 132),
    TensorInfo("a.weight_scale", "/m/s1.safetensors", "F8_E4M3", (4, 1), 132, 136),
    TensorInfo("b.weight", "/m/s2.safetensors", "BF16", (3,), 8, 14),
    TensorInfo("c", "/m/s2.safetensors", "F32", (), 14, 18),
]


def test_table_is_the_dict_it_replaces():
    t = TensorTable.from_infos(INFOS)
    d = {i.name: i for i in INFOS}
    assert len(t) == len(d) and list(t) == list(d) and list(t.keys()) == list(d)
    assert dict(t) == d and list(t.items()) == list(d.items()) and list(t.values()) == list(d.values())
    assert len(t.values()) == 4 and len(t.items()) == 4
    assert t["b.weight"] == d["b.weight"] and t["b.weight"].nbytes == 6 and t["c"].numel == 1
    assert "c" in t and "missing" not in t and t.get("missing") is None and t.get("missing", 7) == 7
    with pytest.raises(KeyError):
        t["missing"]
    assert t.total_bytes() == sum(i.nbytes for i in INFOS)
    # distinct values are stored once
    assert t.files == ["/m/s1.safetensors", "/m/s2.safetensors"] and len(t.dtypes) == 4


def test_slice_is_one_shards_view():
    t = TensorTable.from_infos(INFOS)
    s2 = t.slice(range(2, 4))
    assert list(s2) == ["b.weight", "c"] and len(s2) == 2
    assert "a.weight" not in s2 and s2.get("a.weight") is None
    with pytest.raises(KeyError):
        s2["a.weight"]
    assert s2["c"] == INFOS[3] and dict(s2.items()) == {"b.weight": INFOS[2], "c": INFOS[3]}
    assert [i.start for i in s2.values()] == [8, 14]


def test_extend_remaps_value_tables():
    first = TensorTable.from_infos(INFOS[2:])  # BF16/F32 and s2 first: other value indexes
    rows = first.extend(TensorTable.from_infos(INFOS[:2]))
    assert rows == range(2, 4)
    for i in INFOS:
        assert first[i.name] == i
    assert first.slice(rows)["a.weight_scale"] == INFOS[1]


def test_add_again_repoints_the_name():
    t = TensorTable.from_infos(INFOS)
    t.add("c", "/m/s3.safetensors", "F32", (), 8, 12)
    assert len(t) == 4 and t["c"].file == "/m/s3.safetensors"
    assert list(t) == ["a.weight", "a.weight_scale", "b.weight", "c"]
    assert [i.file for i in t.values()][-1] == "/m/s3.safetensors"
    assert t.total_bytes() == sum(i.nbytes for i in t.values())  # the name's old row not counted


def test_rows_from_the_columns():
    t = TensorTable.from_infos(INFOS)
    want = [(i.name, i.file, i.dtype, i.shape) for i in INFOS]
    assert list(t.rows()) == want
    assert list(tensor_rows(t)) == want and list(tensor_rows({i.name: i for i in INFOS})) == want
    t.add("a.weight", "/m/s3.safetensors", "BF16", (2,), 0, 4)  # re-pointed: once, at its new row
    assert list(t.rows()) == [(n, i.file, i.dtype, i.shape) for n, i in t.items()]


def test_checkpoint_headers_are_views_of_one_table(tiny_nvfp4_modelopt):
    ck = Checkpoint.open(tiny_nvfp4_modelopt)
    assert isinstance(ck.tensors, TensorTable)
    seen = 0
    for rel, h in ck.headers.items():
        own = read_header(tiny_nvfp4_modelopt / rel)  # the shard read alone
        assert dict(h.tensors.items()) == dict(own.tensors.items())
        seen += len(h.tensors)
        for name in h.tensors:
            assert ck.shard_of(name) == rel
    assert seen == len(ck.tensors)
    assert "weight_map" not in ck.index  # the table holds that information


def test_each_makes_other_tuples_from_the_columns():
    t = TensorTable.from_infos(INFOS)
    assert t.each(range(4), TensorInfo) == INFOS
    assert t.each([3, 0], lambda n, f, d, s, a, b: (n, b - a)) == [("c", 4), ("a.weight", 32)]
