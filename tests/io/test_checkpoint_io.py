"""Header parsing, validation errors, index checks, byte-range shard writing."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from qtool.errors import CheckpointError, HeaderError, Interrupted
from qtool.io.checkpoint import Checkpoint
from qtool.io.reader import read_scalar, read_scalars, read_tensor
from qtool.io.safetensors_header import read_header
from qtool.io.writer import FileRange, InlineBytes, OutTensor, index_json, parse_size, plan_shards, write_shard

ALL_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I32": torch.int32,
    "I64": torch.int64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "BOOL": torch.bool,
}


def _sharded(tmp_path, n_shards=2):
    g = torch.Generator().manual_seed(0)
    weight_map = {}
    for s in range(n_shards):
        tensors = {
            f"model.layers.{s}.a.weight": torch.randn(4, 8, generator=g).to(torch.bfloat16),
            f"model.layers.{s}.b.weight_scale_2": torch.tensor(0.5 + s, dtype=torch.float32),
        }
        name = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file(tensors, tmp_path / name)
        weight_map.update({k: name for k in tensors})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tmp_path


def test_all_dtypes_parse_with_exact_ranges(tmp_path):
    tensors = {k: torch.zeros(3, 4, dtype=v) for k, v in ALL_DTYPES.items()}
    if hasattr(torch, "float8_e8m0fnu"):
        tensors["F8_E8M0"] = torch.zeros(3, 4, dtype=torch.float8_e8m0fnu)
    save_file(tensors, tmp_path / "m.safetensors")
    h = read_header(tmp_path / "m.safetensors")
    with safe_open(tmp_path / "m.safetensors", "pt") as f:
        for name in tensors:
            info = h.tensors[name]
            assert info.dtype == name
            assert info.shape == (3, 4)
            assert info.nbytes == tensors[name].numel() * tensors[name].element_size()
            assert f.get_slice(name).get_dtype() == name


def test_checkpoint_open_indexed_and_lazy_read(tmp_path):
    ck = Checkpoint.open(_sharded(tmp_path))
    assert len(ck.tensors) == 4 and len(ck.headers) == 2
    t = read_tensor(ck.tensors["model.layers.1.a.weight"])
    ref = load_file(tmp_path / "model-00002-of-00002.safetensors")["model.layers.1.a.weight"]
    assert torch.equal(t, ref)
    assert read_scalar(ck.tensors["model.layers.1.b.weight_scale_2"]) == 1.5
    assert read_scalars([ck.tensors["model.layers.0.b.weight_scale_2"]]) == [0.5]


def test_truncated_shard_names_file_and_tensor(tmp_path):
    _sharded(tmp_path)
    shard = tmp_path / "model-00002-of-00002.safetensors"
    os.truncate(shard, shard.stat().st_size - 10)
    with pytest.raises(HeaderError) as e:
        Checkpoint.open(tmp_path)
    assert "truncated" in e.value.message and e.value.path.endswith("model-00002-of-00002.safetensors")
    assert e.value.tensor is not None and e.value.hint


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda raw: raw[:8] + b"{not json" + raw[17:], "not valid JSON"),
        (lambda raw: struct.pack("<Q", 10**12) + raw[8:], "header length"),
        (lambda raw: raw[:3], "too short"),
    ],
)
def test_bad_headers(tmp_path, mutate, needle):
    save_file({"x": torch.zeros(4)}, tmp_path / "m.safetensors")
    p = tmp_path / "m.safetensors"
    p.write_bytes(mutate(p.read_bytes()))
    with pytest.raises(HeaderError, match=needle):
        read_header(p)


def _write_raw_header(path, header: dict, data_len: int):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * data_len)


def test_wrong_byte_length_and_overlap(tmp_path):
    p = tmp_path / "m.safetensors"
    _write_raw_header(p, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, 16)
    with pytest.raises(HeaderError, match="byte length"):
        read_header(p)
    _write_raw_header(
        p,
        {
            "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},
        },
        16,
    )
    with pytest.raises(HeaderError, match="overlap"):
        read_header(p)
    _write_raw_header(p, {"a": {"dtype": "Q9", "shape": [4], "data_offsets": [0, 16]}}, 16)
    with pytest.raises(HeaderError, match="unknown dtype"):
        read_header(p)


def test_index_problems(tmp_path):
    _sharded(tmp_path)
    idx_path = tmp_path / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    # a tensor mapped to a shard that lacks it
    bad = dict(idx, weight_map=dict(idx["weight_map"], **{"ghost.weight": "model-00001-of-00002.safetensors"}))
    idx_path.write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match="does not contain") as e:
        Checkpoint.open(tmp_path)
    assert e.value.tensor == "ghost.weight"
    # a shard name that escapes the directory
    for escape in ["../x.safetensors", "/etc/passwd"]:
        bad = dict(idx, weight_map=dict(idx["weight_map"], **{"model.layers.0.a.weight": escape}))
        idx_path.write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match="outside"):
            Checkpoint.open(tmp_path)
    # a symlink pointing outside
    outside = tmp_path.parent / "outside.safetensors"
    save_file({"z": torch.zeros(1)}, outside)
    os.symlink(outside, tmp_path / "link.safetensors")
    bad = dict(idx, weight_map=dict(idx["weight_map"], z="link.safetensors"))
    idx_path.write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match="symlink"):
        Checkpoint.open(tmp_path)
    # malformed index JSON
    idx_path.write_text("{")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        Checkpoint.open(tmp_path)
    # missing shard
    idx_path.write_text(json.dumps(idx))
    os.unlink(tmp_path / "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpoint.open(tmp_path)


def test_missing_checkpoint_and_empty_dir(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        Checkpoint.open(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        Checkpoint.open(tmp_path)


def test_write_shard_from_ranges_is_loadable_and_identical(tmp_path):
    src = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}
    save_file(src, tmp_path / "src.safetensors")
    h = read_header(tmp_path / "src.safetensors")
    a, b = h.tensors["a"], h.tensors["b"]
    new = torch.full((2,), 7, dtype=torch.int32)
    out = [
        OutTensor("b", "BF16", b.shape, FileRange(b.file, b.start, b.end)),
        OutTensor("a", "F32", a.shape, FileRange(a.file, a.start, a.end)),
        OutTensor("c", "I32", (2,), InlineBytes(new.numpy().tobytes())),
    ]
    write_shard(tmp_path / "out.safetensors", out, metadata={"format": "pt"})
    got = load_file(tmp_path / "out.safetensors")
    assert torch.equal(got["a"], src["a"]) and torch.equal(got["b"], src["b"]) and torch.equal(got["c"], new)
    # deterministic: same inputs -> same bytes
    write_shard(tmp_path / "out2.safetensors", out, metadata={"format": "pt"})
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "out2.safetensors").read_bytes()
    # header is 8-byte aligned like safetensors' own writer
    (n,) = struct.unpack("<Q", (tmp_path / "out.safetensors").read_bytes()[:8])
    assert n % 8 == 0


def test_write_shard_stops_when_asked(tmp_path):
    """assemble sets `stop` when a run fails or is interrupted: shards in flight end within a chunk
    (left short, redone by --resume) instead of being copied to the end."""
    import threading

    from qtool.io import files, writer

    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(3 << 20))
    out = [OutTensor("x", "U8", (3 << 20,), FileRange(str(src), 0, 3 << 20))]
    seen = []
    stop = threading.Event()
    files.COPY_CHUNK, old = 1 << 20, files.COPY_CHUNK
    try:
        with pytest.raises(Interrupted):
            write_shard(tmp_path / "o.safetensors", out, on_header=lambda: (seen.append(1), stop.set()), stop=stop)
    finally:
        files.COPY_CHUNK = old
    assert seen == [1]
    size = (tmp_path / "o.safetensors").stat().st_size
    assert size < writer.shard_size(out)  # header written, data not copied to the end
    full = write_shard(tmp_path / "p.safetensors", out, stop=threading.Event())  # not set: complete
    assert full == writer.shard_size(out)


def test_plan_shards_and_sizes():
    items = [("a", 40), ("b", 40), ("c", 40), ("d", 200), ("e", 1)]
    assert plan_shards(items, 100) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert parse_size("5GB") == 5 * 10**9 and parse_size("4GiB") == 4 * 2**30 and parse_size("300KB") == 300_000
    with pytest.raises(ValueError):
        parse_size("lots")
    assert index_json({"b": "2", "a": "1"}, 3) == {"metadata": {"total_size": 3}, "weight_map": {"a": "1", "b": "2"}}


def test_hf_cache_snapshot_symlinks_are_inside(tmp_path):
    """A huggingface_hub cache snapshot links its files into ../../blobs: that is not an escape."""
    repo = tmp_path / "models--org--name"
    blobs, snap = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    save_file({"w": torch.ones(2)}, blobs / "0f1e2d")
    os.symlink("../../blobs/0f1e2d", snap / "model.safetensors")
    (blobs / "idx").write_text(json.dumps({"weight_map": {"w": "model.safetensors"}}))
    os.symlink("../../blobs/idx", snap / "model.safetensors.index.json")
    ck = Checkpoint.open(snap)
    assert list(ck.tensors) == ["w"]
    # a link out of the cache is still refused
    save_file({"z": torch.zeros(1)}, tmp_path / "elsewhere.safetensors")
    os.symlink(tmp_path / "elsewhere.safetensors", snap / "x.safetensors")
    (blobs / "idx").write_text(json.dumps({"weight_map": {"w": "model.safetensors", "z": "x.safetensors"}}))
    with pytest.raises(CheckpointError, match="symlink"):
        Checkpoint.open(snap)
