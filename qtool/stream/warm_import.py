"""Import transformers' Qwen3.5-MoE decoder module in the background while a streamed job plans, hashes
its inputs, reads the first layer and embeds the calibration set.

That import costs ~3-7 s warm (transformers pulls in torch.distributed.tensor, torch._dynamo and their
custom ops; measured with `python -X importtime`) and 9-12 s on a cold disk that the job's first reads
keep busy (the H200's timelines), all before a streamed job can build its first layer. It is mostly Python
work, but the planning, disk reads, hashing and torch kernels that run meanwhile release the GIL, so it
overlaps. Started as soon as a command knows it will run a streamed job, before it plans (the CLI's
`plan_then_execute`, eval kld's `run`; never for a dry run, which builds no layer), and again (a no-op) by
the streamer's first read-ahead.

Every transformers import of this process's other threads joins it first (`join()`: `load_tokenizer`,
`qtool.quiet`, the streamer's `hf_config`): transformers swaps a lazy module into sys.modules while it
initialises, so a second thread's `from transformers import X` does not wait on Python's import lock and
can fail. An import error is left for the importer that joined to raise where the user sees it.

The tokenizer's modules come first, and the job's tokenizing is handed to this thread between them and the
decoder module (`before_decoder`): the plan waits for the tokenizer's imports only, and the decoder
module's import overlaps the rest of the plan and the first layer's read. No transformers module is ever
imported by two threads at once.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

from qtool.stream import package_map
from qtool.stream.kernels import import_gdn_kernel_alone

T = TypeVar("T")

MODULE = "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"
_started: threading.Thread | None = None


def skip_unused_imports() -> None:
    """Keep transformers' import to what a streamed job runs. Call before the process's first transformers
    import (the tokenizer's, then the decoder module's); where transformers is already imported, nothing
    changes.

    - Its import of `transformers.utils` maps every installed distribution's files
      (`importlib.metadata.packages_distributions`, 1.08 s on the lent GPU machine's image): served from a
      cache kept between runs (qtool.stream.package_map).
    - Its configuration module imports the generation package, whose assisted-generation candidate
      generator imports scikit-learn's metrics (`if is_sklearn_available(): from sklearn.metrics import
      roc_curve`) where scikit-learn is installed: 1.8 s with scipy on that machine (`python -X
      importtime`), on the tokenizer's path. That generator is for `generate()` with an assistant model;
      qtool tokenizes text and runs decoder layers.
    - Its modeling utilities import the object-detection losses, which import `scipy.optimize` where scipy
      is installed (0.45 s of the decoder module's 3.4 s on a 2-core CPU, `python -X importtime`), and its
      image utilities import torchvision where it is installed (the lent GPU machine's image has it), and
      its video processing utilities through a check of their own (`is_torchvision_v2_available`, which
      calls the original check: 0.20 s of the decoder module's import there, `python -X importtime`). They
      serve vision models' losses and image and video processors; qtool builds none of them.
    - Its audio utilities (imported by the processing utilities the decoder module imports) import
      torchaudio, librosa and soundfile where they are installed: torchaudio and its wav2vec2 pipelines are
      in the lent GPU machine's image and were sampled in the import thread's timeline. They load and
      resample audio for audio models' processors.

    Only this process's view of transformers changes (where transformers names a check differently,
    nothing changes)."""
    import sys

    if "transformers.generation.candidate_generator" in sys.modules:
        return
    if "transformers.utils.import_utils" not in sys.modules:
        package_map.install()
    import transformers.utils as tu

    for check in UNUSED_BACKENDS:
        if callable(getattr(tu, check, None)):
            setattr(tu, check, _not_available)


# transformers' `is_*_available` checks that gate imports a streamed job never uses (skip_unused_imports)
UNUSED_BACKENDS = (
    "is_sklearn_available",
    "is_scipy_available",
    "is_torchvision_available",
    "is_torchvision_v2_available",
    "is_torchaudio_available",
    "is_librosa_available",
    "is_soundfile_available",
)


def _not_available() -> bool:
    return False


# the tokenizer's part of transformers, imported first: most of the import (on the 2-core VM 1.7 s of
# `from transformers import AutoTokenizer` after torch, against 0.7 s more for the decoder module)
TOKENIZER_MODULE = "transformers.models.auto.tokenization_auto"
_lock = threading.Lock()
_waiting: list = []  # (fn, Future): before_decoder's work, for the background thread
_decoder_begun = False  # the background thread has begun the decoder module: it takes no more work


def start() -> None:
    """Begin the import once per process (torch first, in the caller's thread: the two threads then
    never import torch's core in opposite orders)."""
    global _started, _decoder_begun
    if _started is not None:
        return
    import importlib

    import torch  # noqa: F401

    def work() -> None:
        try:
            try:
                skip_unused_imports()
                importlib.import_module(TOKENIZER_MODULE)
            except Exception:  # noqa: BLE001 -- re-raised by the importer's own import
                pass
            _serve_waiting()
            # it undoes its own failures; anything else costs only time
            with contextlib.suppress(Exception):
                import_gdn_kernel_alone()  # before transformers' own import of all of fla (kernels.py)
            with contextlib.suppress(Exception):  # re-raised by the streamer's own import
                importlib.import_module(MODULE)
        finally:
            _no_more_work()  # ended by anything (a SystemExit in an import): no caller waits on it for ever

    with _lock:
        _decoder_begun = False
        _waiting.clear()
    _started = threading.Thread(target=work, name="qtool-warm-import", daemon=True)
    _started.start()


def _serve_waiting() -> None:
    """In the background thread, between the tokenizer's modules and the decoder module: run the work
    handed over meanwhile (before_decoder), then take no more."""
    global _decoder_begun
    while True:
        with _lock:
            if not _waiting:
                _decoder_begun = True
                return
            fn, fut = _waiting.pop(0)
        try:
            fut.set_result(fn())
        except BaseException as e:  # noqa: BLE001 -- raised in the caller's thread
            fut.set_exception(e)


class _Ended(Exception):
    """The background thread ended before it ran the work handed to it: the caller runs it."""


def _no_more_work() -> None:
    global _decoder_begun
    with _lock:
        _decoder_begun = True
        left = list(_waiting)
        _waiting.clear()
    for _, fut in left:
        fut.set_exception(_Ended())


def before_decoder(fn: Callable[[threading.Event], T]) -> T:
    """fn()'s result, computed where transformers may be imported without racing the background import:
    in the background thread, once it has imported the tokenizer's modules and before it begins the decoder
    module, where it has not begun that yet (the caller then waits only for the tokenizer's part, and the
    decoder module is imported while the caller goes on: the rest of its plan, its first layer's read);
    else here, after join(). For a streamed job's tokenizer (qtool.stream.calib_data.build_calib_set).

    fn(stop) takes a threading.Event, set when the caller gives up waiting (Ctrl-C): work that can take long
    (tokenizing a Hub dataset as it streams in) checks it and ends, so that the caller's way out, which
    waits for the background thread, does not wait for that work to finish."""
    from concurrent.futures import Future

    fut: Future = Future()
    stop = threading.Event()
    try:
        with _lock:
            queued = _started is not None and not _decoder_begun
            if queued:
                _waiting.append((lambda: fn(stop), fut))
        if queued:
            return fut.result()
    except _Ended:
        pass  # run here, below
    except BaseException:
        stop.set()  # (a Ctrl-C the moment the work was queued too)
        raise
    join()
    return fn(stop)


@contextlib.contextmanager
def overlapping(enabled: bool = True) -> Iterator[None]:
    """Begin the import (where `enabled`) while the block runs (a job's plan). If the block raises, the
    import is waited for before the error leaves: an in-process caller (a test, a library user) may import
    transformers next, which must not race it."""
    if enabled:
        start()
    try:
        yield
    except BaseException:
        join()
        raise


def join() -> None:
    """Wait for a started background import (call before any transformers import in this process; in the
    background thread itself, running before_decoder's work, there is nothing to wait for)."""
    if _started is not None and _started is not threading.current_thread():
        _started.join()
