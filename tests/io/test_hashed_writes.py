"""A layer shard's sha256 computed as it is written (io/writer.HashedWrites): the digest of exactly the bytes
on disk, or None (the file is then hashed from disk) when the hash falls behind the writer."""

from __future__ import annotations

import hashlib
import os
import threading

from qtool.io.writer import HashedWrites


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
        real = out.h

        class Slow:  # a hash that cannot keep up (it waits for the test)
            def update(self, data):
                gate.wait(5)
                real.update(data)

            def hexdigest(self):
                return real.hexdigest()

        out.h = Slow()
        for k in range(6):
            out.write(bytes([k]) * 1000)  # returns although no update has finished
        assert out.hexdigest() is None
        gate.set()
        out.close()
    assert p.read_bytes() == b"".join(bytes([k]) * 1000 for k in range(6))
