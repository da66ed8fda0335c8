"""Silence the producer libraries (ModelOpt, transformers, llm-compressor, compressed-tensors) while
qtool drives them: library code never prints (docs/design.md), and their prints, warnings, log lines and
progress bars would otherwise interleave with qtool's own report."""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Iterator
from typing import Any

from qtool.stream.warm_import import join


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Keep the producer libraries' chatter out of our output: ModelOpt's prints (stdout), Python
    warnings, transformers' log messages and progress bars, llm-compressor's loguru messages. Restores
    every setting on exit."""
    join()  # no transformers import beside the background one (qtool.stream.warm_import)
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    loguru_logger: Any = None
    with contextlib.suppress(ImportError):  # loguru comes with llm-compressor
        from loguru import logger as loguru_logger
    noisy = ("llmcompressor", "compressed_tensors")
    try:
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        if loguru_logger is not None:
            for mod in noisy:
                loguru_logger.disable(mod)
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),  # tqdm bars of llm-compressor
        ):
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
        if loguru_logger is not None:
            for mod in noisy:
                loguru_logger.enable(mod)


# ModelOpt warns at import that a transformers it was not tested with "may cause issues", for every
# transformers >= 5.15 (modelopt/torch/__init__.py). qtool pins the pair it tests together (pyproject:
# transformers>=5.2,<6 with nvidia-modelopt>=0.47,<0.48), and its tests cross-check ModelOpt's results on it.
MODELOPT_UNTESTED_TRANSFORMERS = r"transformers \S+ is not tested with current version of modelopt"


def pinned_pair_warnings_off() -> None:
    """Hide the warnings that concern only the versions qtool pins and tests together (for the process)."""
    warnings.filterwarnings("ignore", message=MODELOPT_UNTESTED_TRANSFORMERS)


@contextlib.contextmanager
def transformers_errors_only() -> Iterator[None]:
    """Only transformers' errors reach the user while qtool drives its modules (its tokenizer's
    'sequence length is longer than the maximum' and the standalone-expert-module notices are expected:
    qtool tokenizes a whole corpus and builds decoder layers one at a time). Progress bars and our own
    output stay untouched."""
    join()  # no transformers import beside the background one (qtool.stream.warm_import)
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    try:
        hf_logging.set_verbosity_error()
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
