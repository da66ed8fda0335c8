"""A layer shard's writes run on a thread of their own (qtool.io.in_order.InOrder) while the next chunk is
coded: they happen in the order given, a failed write stops the ones queued after it and reaches the
caller, and nothing is still writing when the caller closes the file."""

from __future__ import annotations

import threading
import time

import pytest

from qtool.io.in_order import InOrder


def test_operations_run_in_order_behind_the_caller(tmp_path):
    path = tmp_path / "f"
    with open(path, "wb") as f:
        ops = InOrder(depth=2)
        for k in range(50):
            ops.call(f.write, bytes([k]) * (1000 + k))
        ops.close()
    assert path.read_bytes() == b"".join(bytes([k]) * (1000 + k) for k in range(50))


def test_the_queue_is_bounded():
    gate = threading.Event()
    ops = InOrder(depth=2)
    ops.call(gate.wait)
    ops.call(lambda: None)
    t0 = time.monotonic()
    threading.Timer(0.3, gate.set).start()
    ops.call(lambda: None)  # waits for the first to finish: at most `depth` queued
    assert time.monotonic() - t0 >= 0.25
    ops.close()


def test_a_failed_write_skips_the_rest_and_reaches_the_caller(tmp_path):
    done = []
    ops = InOrder(depth=4)

    def fail():
        raise OSError(28, "No space left on device")

    ops.call(done.append, 1)
    ops.call(fail)
    ops.call(done.append, 2)  # queued behind the failure: skipped
    with pytest.raises(OSError, match="No space left"):
        for _ in range(10):
            ops.call(done.append, 3)  # the error comes back on a later call at the latest
            time.sleep(0.01)
        ops.close()
    with pytest.raises(OSError, match="No space left"):
        ops.close()  # and again on close
    assert done == [1]


def test_abandon_waits_for_the_running_write_and_skips_the_queue():
    started, release = threading.Event(), threading.Event()
    done = []

    def slow():
        started.set()
        release.wait()
        done.append("slow")

    ops = InOrder(depth=3)
    ops.call(slow)
    ops.call(done.append, "queued")
    started.wait()
    threading.Timer(0.2, release.set).start()
    ops.abandon()  # returns once the running write is over
    assert done == ["slow"]
