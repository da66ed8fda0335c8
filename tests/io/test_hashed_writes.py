"""A layer shard's sha256 computed as it is written (qtool.io.hashed_writes.HashedWrites): the digest of exactly the
bytes on disk, or None (the file is then hashed from disk) when the hash falls behind the writer."""

from __future__ import annotations

import hashlib
import os
import threading
import time

from qtool.errors import Interrupted
from qtool.io.hashed_writes import HashedWrites


class SlowHash:
    """A hash that cannot keep up: its updates (or only its first, `first_only`) wait for the test's gate."""

    def __init__(self, real, gate: threading.Event, first_only: bool = False):
        self.real, self.gate, self.first_only, self.calls = real, gate, first_only, 0
        self.entered = threading.Event()  # set in the first update

    def update(self, data):
        self.calls += 1
        self.entered.set()
        if self.calls == 1 or not self.first_only:
            self.gate.wait(5)
        self.real.update(data)

    def hexdigest(self):
        return self.real.hexdigest()


def test_the_digest_is_of_the_bytes_written(tmp_path):
    parts = [os.urandom(n) for n in (8, 1 << 20, 3, 5 << 20, 0, 77)]
    p = tmp_path / "shard.safetensors"
    with open(p, "wb") as f:
        out = HashedWrites(f, depth=64)
        for b in parts:
            out.write(memoryview(b))
        digest = out.hexdigest()
    assert p.read_bytes() == b"".join(parts)
    assert digest == hashlib.sha256(b"".join(parts)).hexdigest()


def test_a_hash_that_falls_behind_gives_none_and_never_holds_the_writer(tmp_path):
    gate = threading.Event()
    p = tmp_path / "shard.safetensors"
    with open(p, "wb") as f:
        out = HashedWrites(f, depth=2)
        out.h = SlowHash(out.h, gate)
        for k in range(6):
            out.write(bytes([k]) * 1000)  # returns although no update has finished
        assert out.hexdigest() is None
        gate.set()
        out.stop()
    assert p.read_bytes() == b"".join(bytes([k]) * 1000 for k in range(6))


def test_a_hash_that_falls_behind_trails_the_file_to_the_same_digest(tmp_path):
    """With the file's path, a hash that falls behind lets the buffers go and reads the rest back from the
    file as it is written: the digest is still that of the bytes on disk, the writer never waits, and the
    file may be renamed before the hash is done (the layer shard's tmp file is)."""
    gate = threading.Event()
    p = tmp_path / "shard.tmp"
    parts = [os.urandom(n) for n in (5, 1 << 20, 3, 7, 2 << 20, 1, 333)]
    with open(p, "wb", buffering=1 << 16) as f:  # buffered: the small writes reach the file late
        out = HashedWrites(f, depth=2, path=p)
        out.h = SlowHash(out.h, gate, first_only=True)  # the writer runs ahead of the first update
        for b in parts:
            out.write(memoryview(b))
        assert out.behind
        digest = out.digest()
        assert not digest.done()
    renamed = tmp_path / "shard.safetensors"
    os.replace(p, renamed)
    gate.set()
    assert digest.result(10) == hashlib.sha256(b"".join(parts)).hexdigest()
    assert renamed.read_bytes() == b"".join(parts)


def test_a_writer_keeping_pace_waits_for_the_hash_which_never_reads_the_file(tmp_path, monkeypatch):
    """keep_pace (the job's last layer shard, whose digest ends the job): where the hash falls behind, the
    writer waits for it rather than letting it go to the file, so every byte is hashed from the buffers
    written (no read of the file: the trailing read hashed at 0.76-0.80 GB/s mid-job on the H100, the
    buffers at one core's full rate), and no more than `depth` buffers wait for it."""
    from qtool.io import hashed_writes

    def no_read(*a, **k):
        raise AssertionError("the hash read the file back")

    monkeypatch.setattr(hashed_writes.os, "preadv", no_read)
    gate = threading.Event()
    p = tmp_path / "shard.tmp"
    parts = [os.urandom(n) for n in (5, 1 << 20, 3, 7, 2 << 20, 1, 333, 4096)]
    waiting = []
    with open(p, "wb", buffering=1 << 16) as f:
        out = HashedWrites(f, depth=2, path=p, keep_pace=True)
        out.h = SlowHash(out.h, gate, first_only=True)  # the first update holds the hash back

        def write_all():
            for b in parts:
                out.write(memoryview(b))
                waiting.append(len(out.queue))

        t = threading.Thread(target=write_all, daemon=True)
        t.start()
        _until(lambda: len(waiting) == 3 and len(out.queue) == 2)  # the hash holds the first, two wait
        time.sleep(0.2)
        assert t.is_alive() and len(waiting) == 3  # held there: the fourth write waits for room
        assert not out.behind
        gate.set()
        t.join(10)
        assert not t.is_alive()
        digest = out.digest()
    assert digest.result(10) == hashlib.sha256(b"".join(parts)).hexdigest()
    assert not out.behind and max(waiting) <= 2
    assert p.read_bytes() == b"".join(parts)


def test_a_stopped_hash_lets_a_writer_keeping_pace_go_on(tmp_path):
    """An error path while the writer waits for a slow hash: stop() ends the hash and the writer writes
    the rest without it (nothing waits for ever)."""
    gate = threading.Event()
    p = tmp_path / "shard.tmp"
    with open(p, "wb") as f:
        out = HashedWrites(f, depth=1, path=p, keep_pace=True)
        out.h = SlowHash(out.h, gate)
        t = threading.Thread(target=lambda: [out.write(bytes([k]) * 100) for k in range(6)], daemon=True)
        t.start()
        _until(lambda: out.h.calls == 1 and len(out.queue) == 1)
        time.sleep(0.2)
        assert t.is_alive()  # waiting for the hash
        threading.Timer(0.2, gate.set).start()  # the update in progress ends after the stop
        out.stop()
        t.join(10)
        assert not t.is_alive() and not out.thread.is_alive()
    assert p.read_bytes() == b"".join(bytes([k]) * 100 for k in range(6))


def test_a_failed_hash_lets_a_writer_keeping_pace_go_on_and_the_digest_holds_the_error(tmp_path):
    """The hash thread fails (its update raises) while the writer waits for it: the writer is let go and
    writes the rest (the layer's writer then reaches the digest, which raises: the job fails, never hangs)."""

    class Failing:
        def __init__(self):
            self.calls = 0

        def update(self, data):
            self.calls += 1
            if self.calls == 2:
                raise MemoryError("the hash failed")

    p = tmp_path / "shard.tmp"
    with open(p, "wb") as f:
        out = HashedWrites(f, depth=1, path=p, keep_pace=True)
        out.h = Failing()
        t = threading.Thread(target=lambda: [out.write(bytes([k]) * 100) for k in range(6)], daemon=True)
        t.start()
        t.join(10)
        assert not t.is_alive()  # not left waiting for a hash that is gone
        digest = out.digest()
    import pytest

    with pytest.raises(MemoryError):
        digest.result(10)
    assert p.read_bytes() == b"".join(bytes([k]) * 100 for k in range(6))


def _until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting for the hash thread"
        time.sleep(0.01)


def test_the_trailing_hash_reads_the_file_in_many_pieces_into_one_buffer(tmp_path, monkeypatch):
    """A file far longer than one trailing read (a real shard is GBs, the read 16 MiB): the one buffer the
    trailing hash reads into is refilled many times, with pieces that end mid-write; the digest is still
    that of the bytes on disk."""
    monkeypatch.setattr(HashedWrites, "READ", 4099)
    gate = threading.Event()
    p = tmp_path / "shard.tmp"
    parts = [os.urandom(n) for n in (5, 70_001, 3, 12_345, 1, 99_999)]
    with open(p, "wb") as f:
        out = HashedWrites(f, depth=1, path=p)
        out.h = SlowHash(out.h, gate, first_only=True)
        for b in parts:
            out.write(memoryview(b))
        assert out.behind
        digest = out.digest()
    gate.set()
    assert digest.result(10) == hashlib.sha256(b"".join(parts)).hexdigest()


def test_a_cancelled_hash_stops(tmp_path):
    p = tmp_path / "shard.tmp"
    with open(p, "wb") as f:
        out = HashedWrites(f, depth=1, path=p)
        for k in range(5):
            out.write(bytes([k]) * 100)
        out.stop()  # an error path: no digest asked
    assert not out.thread.is_alive()


def test_a_file_not_written_in_order_is_an_error_not_a_hang(tmp_path):
    """Behind, the hash trails the file up to the bytes written in order: a seek past this object leaves a
    file it cannot vouch for, so the digest is an error (never a wait for bytes that will not come)."""
    gate = threading.Event()
    p = tmp_path / "shard.tmp"
    with open(p, "wb") as f:
        out = HashedWrites(f, depth=1, path=p)
        out.h = SlowHash(out.h, gate)
        for k in range(4):
            out.write(bytes([k]) * 100)
        f.seek(200)
        out.write(b"x" * 100)
        digest = out.digest()
        gate.set()
    try:
        digest.result(5)
    except OSError as e:
        assert "written in order" in str(e)
    else:
        raise AssertionError("a digest of a file written out of order")


def _copied_shard(tmp_path):
    """A source file and a shard plan taking its ranges in two runs around a small inline tensor and a
    large copied one (what an assemble or a quantize's non-layer shard writes)."""
    from qtool.io.writer import FileRange, InlineBytes, OutTensor

    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(3 << 20))
    s = str(src)
    tensors = [
        OutTensor("a", "BF16", (1 << 19,), FileRange(s, 0, 1 << 20)),
        OutTensor("b", "U8", (5,), InlineBytes(b"12345")),
        OutTensor("c", "U8", (2 << 20,), FileRange(s, 1 << 20, 3 << 20)),
    ]
    return tensors


def test_a_copied_shard_is_hashed_as_it_is_written(tmp_path, monkeypatch):
    """write_shard's on_digest: the sha256 of exactly the file written, by a thread that trails the kernel
    copy chunk by chunk (not a second pass once the file is written)."""
    from qtool.io import files, writer

    monkeypatch.setattr(files, "COPY_CHUNK", 256 << 10)  # many chunks: the hash trails each of them
    monkeypatch.setattr(writer, "TRAILING_COPY_READ", 96 << 10)
    grown = []
    real_grew = HashedWrites.grew
    monkeypatch.setattr(HashedWrites, "grew", lambda self: grown.append(1) or real_grew(self))
    digests = []
    tensors = _copied_shard(tmp_path)
    out = tmp_path / "out.safetensors"
    size = writer.write_shard(out, tensors, {"format": "pt"}, on_digest=digests.append)
    assert size == out.stat().st_size
    assert digests[0].result(5) == hashlib.sha256(out.read_bytes()).hexdigest()
    assert len(grown) >= 12  # after each chunk of the copy, not once at the end
    plain = tmp_path / "plain.safetensors"
    writer.write_shard(plain, tensors, {"format": "pt"})
    assert plain.read_bytes() == out.read_bytes()  # hashing changes nothing in what is written


def test_an_interrupted_copy_stops_its_hash(tmp_path, monkeypatch):
    import pytest

    from qtool.io import files, writer

    monkeypatch.setattr(files, "COPY_CHUNK", 256 << 10)
    stop = threading.Event()
    stop.set()
    digests = []
    with pytest.raises(Interrupted):
        writer.write_shard(tmp_path / "out.safetensors", _copied_shard(tmp_path), stop=stop, on_digest=digests.append)
    assert digests == []
    assert not [t for t in threading.enumerate() if t.name == "qtool-out-sha256" and t.is_alive()]


def test_a_digest_nobody_waits_for_any_more_stops_its_thread_when_cancelled(tmp_path):
    """Found as: a job that failed after some shards were written left their hashes running into the
    interpreter's exit (daemon threads there can abort the process: pytorch#38228). InputHasher.close
    cancels the digests it was handed; the hash stops and its thread is gone before cancel returns."""
    gate = threading.Event()
    p = tmp_path / "shard.tmp"
    with open(p, "wb") as f:
        out = HashedWrites(f, depth=0, path=p, read=1 << 20)
        out.h = SlowHash(out.h, gate)  # a hash far behind the writer
        for k in range(8):
            out.write(bytes([k]) * (1 << 20))
        digest = out.digest()
    assert out.thread.is_alive()
    assert out.h.entered.wait(5)  # (a loaded machine may not have started the hash thread yet)
    threading.Timer(0.2, gate.set).start()  # the hash in its first update when cancelled
    assert digest.cancel() and digest.cancelled()
    assert not out.thread.is_alive()
    assert out.h.calls == 1  # it stopped: not hashed to the end of the file


def test_an_input_digest_abandoned_by_a_failed_job_stops_and_does_not_read_the_rest(tmp_path):
    """Found as the digest above: FileDigest.abandon (a failed layer-streamed job) used to read and hash the
    rest of the input (hundreds of GB at real size) on a thread nobody waited for."""
    from qtool.io.stream_digest import CHUNK, FileDigest

    p = tmp_path / "model-00001-of-00002.safetensors"
    p.write_bytes(os.urandom(8 * CHUNK))
    d = FileDigest(str(p))
    d.wait_covered(CHUNK)  # the job read its first layer, then failed
    d.abandon()
    assert not d._thread.is_alive()
    assert d.cursor < 8 * CHUNK


def test_bytes_copied_into_an_unbuffered_file_are_in_its_digest(tmp_path):
    """grew() after a kernel copy into the descriptor: the hash reads what the copy put there, whether or not
    the file object buffers (an unbuffered one used to give the digest of the header alone)."""
    p = tmp_path / "shard.tmp"
    with open(p, "wb", buffering=0) as f:
        out = HashedWrites(f, depth=0, path=p)
        out.write(b"header" * 100)
        os.write(f.fileno(), os.urandom(3 << 20))  # as copy_range's kernel copy does
        out.grew()
        digest = out.digest()
    assert digest.result(10) == hashlib.sha256(p.read_bytes()).hexdigest()
