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
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

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
      image utilities import torchvision where it is installed (the lent GPU machine's image has it). Both
      serve vision models' losses and image processors; qtool builds neither.

    Only this process's view of transformers changes (where transformers names a check differently,
    nothing changes)."""
    import sys

    if "transformers.generation.candidate_generator" in sys.modules:
        return
    if "transformers.utils.import_utils" not in sys.modules:
        from qtool.stream import package_map

        package_map.install()
    import transformers.utils as tu

    for check in UNUSED_BACKENDS:
        if callable(getattr(tu, check, None)):
            setattr(tu, check, _not_available)


# transformers' `is_*_available` checks that gate imports a streamed job never uses (skip_unused_imports)
UNUSED_BACKENDS = ("is_sklearn_available", "is_scipy_available", "is_torchvision_available")


def _not_available() -> bool:
    return False


def start() -> None:
    """Begin the import once per process (torch first, in the caller's thread: the two threads then
    never import torch's core in opposite orders)."""
    global _started
    if _started is not None:
        return
    import importlib

    import torch  # noqa: F401

    def work() -> None:
        try:
            skip_unused_imports()
            importlib.import_module(MODULE)
        except Exception:  # noqa: BLE001 -- re-raised by the streamer's own import
            pass

    _started = threading.Thread(target=work, name="qtool-warm-import", daemon=True)
    _started.start()


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
    """Wait for a started background import (call before any transformers import in this process)."""
    if _started is not None:
        _started.join()
