"""KL divergence between a reference and a test model over deterministic token windows (`qtool eval kld`).

windows.py   the token windows (calibrate-kv's rule, optionally sliding) and /v1/completions requests
sources.py   log-probs from a checkpoint (in-process, layer-streamed), an engine dump, or a compact ref
compact.py   the compact reference: top-k exact + unbiased tail sample; the KL estimator
evaluate.py  plan, walk the windows chunk by chunk, statistics, --save-ref
"""

from qtool.ops.kld.evaluate import RESULT_KEYS, KldOptions, KldReport, run, summarize

__all__ = ["RESULT_KEYS", "KldOptions", "KldReport", "run", "summarize"]
