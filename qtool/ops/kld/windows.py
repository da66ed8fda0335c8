"""Token windows for `eval kld`: the calibrate-kv rule (qtool.stream.calib_data), optionally sliding.

Without --stride (or with stride = seq_len) the windows ARE calibrate-kv's: `build_calib_set(...).ids`,
the first N non-overlapping windows of L tokens of the tokenized dataset. With --stride S the same token
stream (same documents, same tokenizer, no special tokens) is cut into windows i = ids[i*S : i*S + L]
(the EXL3 / llama.cpp style sliding evaluation; S < L overlaps, S > L skips).

`emit_requests` turns the windows into OpenAI-compatible /v1/completions bodies that make a patched
engine compute (and dump) the log-probs of every prompt position while generating one token:
  `prompt` = the token ids (both engines accept a list of ints), `max_tokens` 1, `temperature` 0,
  `echo` true + `logprobs` 1:
  - vLLM 0.33.0: echo makes `prompt_logprobs = logprobs` (vllm/entrypoints/openai/completion/protocol.py,
    CompletionRequest.to_sampling_params), so the runner's _get_prompt_logprobs_dict computes the prompt
    logits, which patches/vllm hooks;
  - SGLang 0.5.23: echo + logprobs sets `logprob_start_len = 0` and `return_logprob`
    (sglang/srt/entrypoints/openai/serving_completions.py _convert_to_internal_request), so the
    LogitsProcessor computes input logprobs from position 0, which patches/sglang hooks.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from qtool.errors import PlanError, UsageError
from qtool.io.files import new_file, tmp_path
from qtool.stream.calib_data import build_calib_set


def token_windows(
    tokenizer_dir, dataset: str, windows: int, seq_len: int, stride: int | None = None, *, tokenizer=None
):
    """LongTensor [windows, seq_len] of token ids (see the module docstring for the rule)."""
    if windows < 1 or seq_len < 2:
        raise UsageError("--windows must be >= 1 and --seq-len >= 2", got=(windows, seq_len))
    if stride is None or stride == seq_len:
        return build_calib_set(tokenizer_dir, dataset, windows, seq_len, tokenizer=tokenizer).ids
    if stride < 1:
        raise UsageError("--stride must be positive", got=stride)
    need = (windows - 1) * stride + seq_len
    try:
        stream = build_calib_set(tokenizer_dir, dataset, 1, need, tokenizer=tokenizer).ids[0]
    except PlanError as e:
        avail = e.got if isinstance(e.got, int) else 0
        most = max(0, (avail - seq_len) // stride + 1) if avail >= seq_len else 0
        raise PlanError(
            f"the dataset gives {avail} tokens, {need} needed for {windows} windows of {seq_len} at stride {stride}",
            expected=need,
            got=avail,
            hint=f"use at most --windows {most}, a larger --stride, or a larger --dataset",
        ) from None
    return stream.unfold(0, seq_len, stride)[:windows].contiguous()


def completion_body(ids: list[int], model: str) -> dict:
    return {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "echo": True, "logprobs": 1}


_EMITTED = re.compile(rb'^\{"model":"(?:[^"\\]|\\.)*","prompt":\[')


def is_emitted_requests(head: bytes) -> bool:
    """Whether a file's first bytes are an `emit_requests` file (what --force may replace): its first
    line opens as `completion_body` writes it (a window's line is longer than the head read)."""
    return _EMITTED.match(head) is not None


def emit_requests(ids, path: str | Path, model: str) -> int:
    """Write one /v1/completions body per window (JSON Lines, window order); returns the count.
    Written to a hidden temp file (created new, fsynced) and renamed."""
    p = Path(path)
    tmp = tmp_path(p)
    with new_file(tmp) as f:
        for row in ids.tolist():
            f.write((json.dumps(completion_body(row, model), separators=(",", ":")) + "\n").encode())
    tmp.replace(p)
    return int(ids.shape[0])
