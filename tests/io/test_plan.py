"""qtool.io.plan / qtool.io.apply: an output decided as data, then written by the one executor."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from qtool.errors import VerificationError, WriteError
from qtool.io.apply import OutputJob, write_output
from qtool.io.checkpoint import Checkpoint
from qtool.io.output import OutputDir
from qtool.io.plan import Copy, Index, Json, Link, OutputPlan, Pending, Produced, Shard, header_checkpoint, promised
from qtool.io.writer import FileRange, InlineBytes, OutTensor, write_shard


def _source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    write_shard(
        src / "a.safetensors",
        [
            OutTensor("x", "F32", (4,), InlineBytes(struct.pack("<4f", 1, 2, 3, 4))),
            OutTensor("y", "BF16", (2,), InlineBytes(b"\x80\x3f\x00\x40")),
        ],
        {"format": "pt"},
    )
    (src / "tokenizer.json").write_text('{"t": 1}')
    return src


def _plan(src: Path) -> OutputPlan:
    info = Checkpoint.open(src).tensors["x"]
    return OutputPlan(
        "test",
        [
            Link("a.safetensors", str(src / "a.safetensors")),
            Shard(
                "b.safetensors",
                [
                    OutTensor("x2", "F32", (4,), FileRange(info.file, info.start, info.end)),
                    OutTensor("s", "F32", (), Pending("s", 4)),
                ],
                {"format": "pt"},
            ),
            Copy("tokenizer.json", str(src / "tokenizer.json")),
            Json("config.json", {"architectures": ["X"]}),
            Index(
                "model.safetensors.index.json",
                {"x": "a.safetensors", "y": "a.safetensors", "x2": "b.safetensors", "s": "b.safetensors"},
                {"total_size": 36},
            ),
        ],
        sources={"src": src},
        inputs=[str(src / "a.safetensors"), str(src / "tokenizer.json")],
    )


def test_the_executor_writes_what_the_plan_says_and_records_every_file(tmp_path):
    src = _source(tmp_path)
    plan = _plan(src)
    with OutputDir(tmp_path / "out", sources=[src]) as tx:
        applied = write_output(plan, tx, OutputJob(command="qtool test", values={"s": struct.pack("<f", 0.5)}))
    out = tmp_path / "out"
    assert applied.written == ["b.safetensors"] and sum(applied.linked.values()) == 1
    ck = Checkpoint.open(out)
    assert sorted(ck.tensors) == ["s", "x", "x2", "y"]
    assert (out / "b.safetensors").read_bytes()[-4:] == struct.pack("<f", 0.5)
    from qtool.io.reader import read_bytes

    assert read_bytes(ck.tensors["x2"]) == read_bytes(ck.tensors["x"])
    assert ck.headers["b.safetensors"].metadata == {"format": "pt"}
    assert json.loads((out / "config.json").read_text()) == {"architectures": ["X"]}
    man = json.loads((out / "qtool-manifest.json").read_text())
    assert man["operation"] == "test" and man["command"] == "qtool test"
    for rel, entry in man["files"].items():  # every output file with its real digest
        assert entry["sha256"] == hashlib.sha256((out / rel).read_bytes()).hexdigest(), rel
    assert set(man["files"]) == {
        "a.safetensors",
        "b.safetensors",
        "tokenizer.json",
        "config.json",
        "model.safetensors.index.json",
    }
    assert set(man["sources"]["src"]["files"]) == {"a.safetensors", "tokenizer.json"}
    assert not list(out.glob(".qtool-*"))


def test_the_plans_own_checkpoint_is_the_written_ones(tmp_path):
    """header_checkpoint (what a decide step computes configs from) has exactly the headers the writer
    then writes, and a copied tensor can be read through it before anything is written."""
    src = _source(tmp_path)
    plan = _plan(src)
    virtual = header_checkpoint(tmp_path / "out", plan, {"architectures": ["X"]})
    with OutputDir(tmp_path / "out", sources=[src]) as tx:
        write_output(plan, tx, OutputJob(command=None, values={"s": struct.pack("<f", 0.5)}))
    real = Checkpoint.open(tmp_path / "out")
    assert {n: (i.dtype, i.shape) for n, i in virtual.tensors.items()} == {
        n: (i.dtype, i.shape) for n, i in real.tensors.items()
    }
    assert {s: h.file_size for s, h in virtual.headers.items()} == {s: h.file_size for s, h in real.headers.items()}
    from qtool.io.reader import read_bytes

    assert read_bytes(virtual.tensors["x2"]) == struct.pack("<4f", 1, 2, 3, 4)


def test_the_plans_checkpoint_as_written_is_the_written_one_tensor_for_tensor(tmp_path):
    """as_written: every tensor (a copied one too) at the file and byte range where the written output
    holds it, so a job's checks can read values back from its output through the plan's view."""
    src = _source(tmp_path)
    plan = _plan(src)
    out = tmp_path / "out"
    written = header_checkpoint(out, plan, {"architectures": ["X"]}, as_written=True)
    assert any(i.file.startswith(str(src)) for i in header_checkpoint(out, plan, None).tensors.values())
    with OutputDir(out, sources=[src]) as tx:
        write_output(plan, tx, OutputJob(command=None, values={"s": struct.pack("<f", 0.5)}))
    real = Checkpoint.open(out)
    assert dict(written.tensors.items()) == dict(real.tensors.items())
    assert {s: (h.path, h.data_start, h.file_size) for s, h in written.headers.items()} == {
        s: (h.path, h.data_start, h.file_size) for s, h in real.headers.items()
    }
    from qtool.io.reader import read_bytes

    assert read_bytes(written.tensors["s"]) == struct.pack("<f", 0.5)


def test_plan_hash_changes_with_any_byte_range_and_not_with_nothing(tmp_path):
    src = _source(tmp_path)
    a, b = _plan(src), _plan(src)
    assert a.plan_hash() == b.plan_hash()
    t = b.files[1].tensors
    t[0] = t[0]._replace(source=FileRange(t[0].source.file, t[0].source.start + 4, t[0].source.end + 4))
    assert a.plan_hash() != b.plan_hash()


def test_plan_hash_is_the_json_of_every_tensor(tmp_path, monkeypatch):
    """A --resume compares the plan hash with its journal's: the hash of a shard's tensors stays the
    sha256 of each tensor's `json.dumps([name, dtype, shape, source key])`, in order (what qtool wrote
    before it built that text itself for the 397B's 372k tensors), for every kind of source."""
    src = _source(tmp_path)
    monkeypatch.chdir(src)  # a relative source path: hashed as its absolute path
    tensors = [
        OutTensor("x2", "F32", (4,), FileRange("a.safetensors", 8, 24)),
        OutTensor("s", "F32", (), Pending("s", 4)),
        OutTensor('w\u00e9."q"', "U8", (2, 3, 1), InlineBytes(b"\x01" * 6)),
        OutTensor("z", "BF16", (2,), Pending("z", 4)),
        OutTensor("i", "BOOL", (1, 2), Pending("i", 2)),
        OutTensor("b", "BOOL", (True, 2), Pending("b", 2)),  # JSON's true (and not (1, 2)'s text)
        OutTensor("f", "BOOL", (1.0, 2), Pending("f", 2)),
        OutTensor("l", "F32", [3], FileRange("a.safetensors", 0, 12)),
    ]
    plan = OutputPlan(
        "test",
        [Shard("b.safetensors", tensors, {"format": "pt"}), Produced("c.safetensors", tensors[1:2])],
        sources={},
        inputs=[],
    )
    h = hashlib.sha256(b"test")
    for e in plan.files:
        h.update(type(e).__name__.encode())
        h.update(json.dumps([e.name, e.metadata]).encode())
        for t in e.tensors:
            s = t.source
            key = (
                ["range", os.path.abspath(s.file), s.start, s.end]
                if isinstance(s, FileRange)
                else ["bytes", hashlib.sha256(s.data).hexdigest()]
                if isinstance(s, InlineBytes)
                else ["pending", s.key, s.nbytes]
            )
            h.update(json.dumps([t.name, t.dtype, list(t.shape), key]).encode())
    assert plan.plan_hash() == h.hexdigest()


def test_a_missing_pending_value_or_a_wrong_produced_shard_publishes_nothing(tmp_path):
    src = _source(tmp_path)
    with OutputDir(tmp_path / "out", sources=[src]) as tx, pytest.raises(ValueError, match="no 4-byte value"):
        write_output(_plan(src), tx, OutputJob(command=None))
    assert not (tmp_path / "out").exists()
    plan = OutputPlan(
        "test", [Produced("p.safetensors", [promised("w", "F32", (2,), 8)])], sources={"src": src}, inputs=[]
    )

    def produce_wrong(done) -> None:  # a producer that writes another shape than it promised
        write_shard(tx.partial / "p.safetensors", [OutTensor("w", "F32", (1, 2), InlineBytes(bytes(8)))])

    with OutputDir(tmp_path / "out2", sources=[src]) as tx, pytest.raises(VerificationError, match="not what the plan"):
        write_output(plan, tx, OutputJob(command=None, produce=produce_wrong))
    assert not (tmp_path / "out2").exists()


def test_free_space_counts_what_a_resumed_partial_already_holds(tmp_path, monkeypatch):
    import qtool.io.apply as apply

    src = _source(tmp_path)
    big = src / "big.safetensors"
    write_shard(big, [OutTensor("z", "U8", (1 << 20,), InlineBytes(bytes(1 << 20)))])
    info = Checkpoint.open(src, check_file_sizes=False).tensors["z"]
    plan = OutputPlan(
        "test",
        [Shard("z.safetensors", [OutTensor("z", "U8", (1 << 20,), FileRange(info.file, info.start, info.end))])],
        sources={"src": src},
        inputs=[str(big)],
    )
    monkeypatch.setattr(apply, "space_margin", lambda *args: 0)
    monkeypatch.setattr(apply, "free_space", lambda p: 1000)
    with OutputDir(tmp_path / "out", sources=[src]) as tx, pytest.raises(WriteError, match="free disk space"):
        write_output(plan, tx, OutputJob(command=None))
    partial = tmp_path / "out.partial"
    assert not partial.exists()  # the refused run's own partial is withdrawn
    # the shard written and journaled by an interrupted run: a resumed run needs no space for it
    from qtool.io.identity import Journal, input_identity
    from qtool.io.output import PARTIAL_MARKER

    partial.mkdir()
    (partial / PARTIAL_MARKER).touch()
    write_shard(
        partial / "z.safetensors", [OutTensor("z", "U8", (1 << 20,), FileRange(info.file, info.start, info.end))]
    )
    Journal(partial / ".qtool-journal.jsonl", plan.plan_hash(), input_identity(plan.inputs), resume=False).record(
        "z.safetensors", size=(partial / "z.safetensors").stat().st_size
    )
    # ... after it had hashed its input (a resume is refused for an input it had not: issue 25)
    from qtool.io.files import INPUT_DIGESTS, hash_file

    (partial / INPUT_DIGESTS).write_text(json.dumps({"path": os.path.realpath(big), "sha256": hash_file(big)}) + "\n")
    with OutputDir(tmp_path / "out", sources=[src], resume=True) as tx:
        applied = write_output(plan, tx, OutputJob(command=None))
    assert applied.resumed == ["z.safetensors"] and (tmp_path / "out" / "z.safetensors").exists()
    shutil.rmtree(tmp_path / "out")
