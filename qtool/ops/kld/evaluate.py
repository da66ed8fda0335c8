"""`eval kld`: KLD(ref || test) per token position over deterministic token windows.

plan -> validate -> execute: `open_sources` + `check` read configs, headers and dump shapes only (and
the tokenizer, to make the windows); `evaluate` runs the in-process forwards and walks the windows chunk
by chunk; `save_ref` writes the compact reference through `<out>.partial/`.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from qtool import dist
from qtool.errors import PlanError, UsageError
from qtool.io.jsonio import write_json
from qtool.io.manifest import write_manifest
from qtool.io.output import MANIFEST_NAME, OutputDir, check_file_output, output_files
from qtool.ops.kld import compact as C
from qtool.ops.kld.sources import META, CompactSource, Kind, open_source
from qtool.ops.kld.windows import emit_requests, is_emitted_requests, token_windows
from qtool.stream import warm_import
from qtool.stream.calib_data import token_digest

RESULT_KEYS = ("mean", "median", "p95", "p99", "max", "top1_agreement", "positions", "histogram", "per_position")
# KLD histogram edges: fixed (10^-6 .. 10^1 nats, 4 bins a decade) so that the histograms of several
# checkpoints, or of one checkpoint over time, are comparable bin by bin; values below the first edge
# (identical distributions give 0) and above the last are counted apart.
HIST_DECADES = (-6, 1)
HIST_BINS_PER_DECADE = 4


@dataclass
class KldOptions:
    dataset: str = "builtin"
    windows: int = 4
    seq_len: int = 512
    stride: int | None = None
    device: str = "cpu"
    dtype: str | None = None
    tokenizer: str | None = None  # directory with the tokenizer (default: the first checkpoint given)
    chunk: int = 256  # positions per log-prob chunk
    topk: int = C.DEFAULT_TOPK
    tail_samples: int = C.DEFAULT_SAMPLES
    seed: int = C.DEFAULT_SEED
    work_dir: str | None = None
    force: bool = False
    command: str | None = None  # the command line, for the --save-ref output's manifest
    batch_tokens: int | None = None  # tokens per micro-batch of the streamed forward (the ranks' unit)


@dataclass
class KldReport:
    result: dict | None = None
    ref: dict | None = None
    test: dict | None = None
    windows: int = 0
    seq_len: int | None = None
    stride: int | None = None
    token_digest: str | None = None
    emitted: dict | None = None
    saved_ref: dict | None = None
    plan: dict | None = None
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)
    timing: dict = field(default_factory=dict)  # per streamed side: its layer clock (benchmarks)

    def to_json(self) -> dict:
        return {
            k: getattr(self, k)
            for k in (
                "result",
                "ref",
                "test",
                "windows",
                "seq_len",
                "stride",
                "token_digest",
                "emitted",
                "saved_ref",
                "plan",
                "seconds",
                "warnings",
                "timing",
            )
        }


def saved_window_flags(meta: dict) -> str:
    """The flags that make again the windows a compact reference was saved with (its metadata), as the
    parser takes them: no --stride for non-overlapping windows (the metadata's stride is None then)."""
    flags = (
        f"--dataset {shlex.quote(str(meta.get('dataset')))} --windows {meta.get('windows')} "
        f"--seq-len {meta.get('seq_len')}"
    )
    return flags + (f" --stride {meta['stride']}" if meta.get("stride") is not None else "")


def summarize(kl, top1, positions=None) -> dict:
    """The reported statistics of per-position KLD values `kl` [P] and top-1 matches `top1` [P] (bool):
    quantiles, the histogram (fixed log-spaced edges) and, with `positions` [P] (each value's position in
    its window), the mean KLD and top-1 agreement at each window position."""
    import numpy as np

    a = kl.double().cpu().numpy()
    if a.size == 0:
        raise PlanError("no positions to compare")
    q = np.quantile(a, [0.5, 0.95, 0.99])  # linear interpolation, as torch.quantile
    return {
        "mean": float(a.mean()),
        "median": float(q[0]),
        "p95": float(q[1]),
        "p99": float(q[2]),
        "max": float(a.max()),
        "top1_agreement": float(top1.double().mean()),
        "positions": int(a.size),
        "histogram": _histogram(a),
        "per_position": _per_position(a, top1.cpu().numpy(), None if positions is None else positions.cpu().numpy()),
    }


def _histogram(a) -> dict:
    import numpy as np

    lo, hi = HIST_DECADES
    edges = np.logspace(lo, hi, (hi - lo) * HIST_BINS_PER_DECADE + 1)
    counts, _ = np.histogram(np.clip(a, edges[0], edges[-1]), bins=edges)
    below = int((a < edges[0]).sum())
    above = int((a > edges[-1]).sum())
    counts[0] -= below  # np.clip put them in the first bin, the last bin includes its right edge
    counts[-1] -= above
    return {"edges": [float(e) for e in edges], "counts": [int(c) for c in counts], "below": below, "above": above}


def _per_position(a, top1, positions) -> dict | None:
    """Mean KLD and top-1 agreement by position in the window (where errors grow with context)."""
    import numpy as np

    if positions is None:
        return None
    n = int(positions.max()) + 1
    count = np.bincount(positions, minlength=n)
    kl_sum = np.bincount(positions, weights=a, minlength=n)
    agree = np.bincount(positions, weights=top1.astype(np.float64), minlength=n)
    seen = count > 0
    return {
        "position": [int(p) for p in np.flatnonzero(seen)],
        "mean": [float(x) for x in kl_sum[seen] / count[seen]],
        "top1_agreement": [float(x) for x in agree[seen] / count[seen]],
        "windows": [int(c) for c in count[seen]],
    }


def _describe(src) -> dict:
    d = {"path": str(src.path), "kind": src.kind.value, "vocab": src.vocab}
    if src.kind is Kind.COMPACT:
        d["method"] = src.meta.get("method")
    return d


def run(
    ref: str | None,
    test: str | None = None,
    *,
    opts: KldOptions | None = None,
    save_ref: str | None = None,
    emit_windows: str | None = None,
    model_name: str | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    dry_run: bool = False,
) -> KldReport:
    import torch

    o = opts or KldOptions()
    t0 = time.time()
    rep = KldReport(stride=o.stride)
    if ref is None and not (emit_windows and o.tokenizer):
        raise UsageError("--ref is required (or --emit-windows with --tokenizer)")
    if save_ref and ref is None:
        raise UsageError("--save-ref needs --ref")
    srcs = {}
    try:
        for role, path in (("ref", ref), ("test", test)):
            if path is not None:
                srcs[role] = open_source(
                    path, device=o.device, dtype=o.dtype, work_dir=o.work_dir, batch_tokens=o.batch_tokens
                )
        r, t = srcs.get("ref"), srcs.get("test")
        if t is not None and t.kind is Kind.COMPACT:
            raise UsageError(
                "the test side must give full log-probs (a checkpoint or a dump)",
                path=t.path,
                hint="a compact reference can only be --ref",
            )
        if save_ref and r.kind is Kind.COMPACT:
            raise UsageError("--ref is already a compact reference", path=r.path)

        group = dist.current()
        if group.world > 1 and (save_ref or emit_windows):
            raise UsageError(
                "--save-ref and --emit-windows run in one process",
                hint="drop --nproc/--devices for them; the KLD comparison itself runs on any number of ranks",
            )
        inputs = [s.path for s in srcs.values()] + ([Path(o.tokenizer)] if o.tokenizer else [])
        if os.path.exists(o.dataset):  # a local dataset file or directory is an input too
            inputs.append(Path(o.dataset))
        if (
            save_ref
            and emit_windows
            and Path(os.path.realpath(save_ref)) in Path(os.path.realpath(emit_windows)).parents
        ):
            raise UsageError(
                "--emit-windows lies inside the --save-ref directory (which is replaced whole)",
                path=emit_windows,
                hint="write the requests file outside --save-ref OUT",
            )
        if save_ref:
            # the one directory contract: never over or inside an input, replaced only when qtool made it
            OutputDir(save_ref, sources=inputs, force=o.force).check()
        if emit_windows:
            check_file_output(
                Path(emit_windows), sources=inputs, force=o.force, ours=is_emitted_requests, what="--emit-windows file"
            )
        if o.chunk < 1 or o.topk < 1 or o.tail_samples < 0:
            raise UsageError("--chunk and --topk must be >= 1, --tail-samples >= 0")

        # -- windows ------------------------------------------------------------------------------
        ckpts = [s for s in srcs.values() if s.kind is Kind.CHECKPOINT]
        if ckpts and r is not None and not dry_run and (save_ref or t is not None):
            warm_import.start()  # transformers' decoder module, imported while the windows are tokenized
        ids = None
        if ckpts or emit_windows:
            tok_dir = o.tokenizer or (str(ckpts[0].path) if ckpts else None)
            if tok_dir is None:
                raise UsageError("--emit-windows needs a tokenizer: pass --tokenizer DIR or a checkpoint")

            ids = token_windows(tok_dir, o.dataset, o.windows, o.seq_len, o.stride)
            rep.token_digest = token_digest(ids)
            rep.seq_len = o.seq_len
        if emit_windows:
            n = emit_requests(ids, emit_windows, model_name or (Path(ref).name if ref else "model"))
            rep.emitted = {
                "path": str(emit_windows),
                "requests": n,
                "seq_len": o.seq_len,
                "stride": o.stride,
                "token_digest": rep.token_digest,
            }
        if r is None or (t is None and not save_ref):
            return rep

        # -- validate ---------------------------------------------------------------------------
        for s in srcs.values():
            if s.kind is Kind.COMPACT and ids is not None:
                d = s.meta.get("token_digest")
                if d and d != rep.token_digest:
                    raise PlanError(
                        "the compact reference was made from other token windows",
                        path=s.path,
                        expected=d,
                        got=rep.token_digest,
                        hint=f"use the windows it was saved with: {saved_window_flags(s.meta)}",
                    )
        counts = {role: (int(ids.shape[0]) if s.kind is Kind.CHECKPOINT else s.windows) for role, s in srcs.items()}
        if len(set(counts.values())) != 1:
            raise PlanError(
                "ref and test have different numbers of windows",
                expected=counts.get("ref"),
                got=counts.get("test"),
                hint="dumps must hold one file per emitted request; match --windows to them",
            )
        n = counts["ref"]
        rep.windows = n
        if t is not None and r.vocab != t.vocab:
            raise PlanError(
                "ref and test vocabularies differ",
                expected=r.vocab,
                got=t.vocab,
                hint="both sides must give the full vocabulary (no TP padding columns)",
            )
        rep.plan = {
            role: (
                {"kind": s.kind.value, "memory": s.plan(n, int(ids.shape[1]), o.chunk)}
                if s.kind is Kind.CHECKPOINT
                else {"kind": s.kind.value, "windows": s.windows}
            )
            for role, s in srcs.items()
        }
        rep.ref = _describe(r)
        rep.test = _describe(t) if t is not None else None
        if dry_run:
            return rep
        for role, s in srcs.items():
            if s.kind is Kind.CHECKPOINT:
                s.prepare(
                    ids,
                    progress=(lambda i, s=s: progress(f"layers {s.path.name}", i + 1, s.streamer.num_layers))
                    if progress
                    else None,
                    head_ahead=s is ckpts[-1],
                )
                rep.timing[role] = s.streamer.clock
                getattr(rep, role)["kernels"] = s.streamer.kernels  # they made its log-probs

        # -- execute ----------------------------------------------------------------------------
        saver = _RefSaver(save_ref, o, r, rep, inputs) if save_ref else None
        if saver is not None:
            saver.ids = ids
        kls, top1s, est, where = [], [], [], []
        mine = _my_windows(n, ckpts, ids, group)
        for w in mine:
            rows = r.rows(w) if t is None else min(r.rows(w), t.rows(w))
            if t is not None and r.rows(w) != t.rows(w) and not rep.warnings:
                rep.warnings.append(
                    f"window {w}: ref has {r.rows(w)} positions, test {t.rows(w)}; "
                    f"compared the first {rows} (vLLM dumps lack the last prompt position)"
                )
            parts = []
            for r0 in range(0, rows, o.chunk):
                r1 = min(rows, r0 + o.chunk)
                lq = t.logprobs(w, r0, r1) if t is not None else None
                if r.kind is Kind.COMPACT:
                    cc = r.compact(w, r0, r1)
                    kl, _lower = C.kl_compact(cc, lq)
                    ref_top = cc.top_idx[:, 0].to(lq.device, torch.long)
                else:
                    lp = r.logprobs(w, r0, r1)
                    if saver is not None:
                        parts.append(saver.encode(w, lp))
                    if lq is None:
                        continue
                    kl = C.kl_full(lp, lq)
                    ref_top = lp.argmax(-1)
                    if saver is not None:
                        est.append(C.kl_compact(parts[-1], lq)[0].cpu())
                kls.append(kl.cpu())
                top1s.append((ref_top == lq.argmax(-1)).cpu())
                where.append(torch.arange(r0, r0 + kl.shape[0]))
            if saver is not None:
                saver.write(w, parts, rows)
            if progress:
                progress("windows", w + 1, n)
        if saver is not None:
            rep.saved_ref = saver.commit()
            if est:
                exact = torch.cat(kls).double().mean().item()
                approx = torch.cat(est).double().mean().item()
                rep.saved_ref["check"] = {
                    "exact_mean": exact,
                    "compact_mean": approx,
                    "relative_error": (approx - exact) / exact if exact else 0.0,
                }
        if t is not None:
            if group.world > 1:  # every rank's windows, in window order: the statistics of one process
                kls, top1s, where = _gather_windows(group, mine, kls, top1s, where, o.chunk, r, t)
            rep.result = summarize(torch.cat(kls), torch.cat(top1s), torch.cat(where))
        return rep
    except BaseException:
        warm_import.join()  # begun before the windows: a library caller may import transformers next
        raise
    finally:
        for s in srcs.values():
            s.close()
        rep.seconds = time.time() - t0


def _my_windows(n: int, ckpts, ids, group) -> list[int]:
    """The windows this rank evaluates: those of its micro-batches of the streamed forward (the same
    micro-batches as one process; qtool.dist), or every world-th window when no side is streamed."""
    if group.world == 1:
        return list(range(n))
    if not ckpts:
        return list(range(group.rank, n, group.world))
    s = ckpts[0].streamer
    return [w for b0, b1 in s.my_batches(n, s.batch_windows(int(ids.shape[1]))) for w in range(b0, b1)]


def _gather_windows(group, mine, kls, top1s, where, chunk, r, t):
    """Per-position KLD, top-1 and positions of all ranks, put back in window order."""
    import torch

    # split the chunk lists back into windows (each window gave ceil(rows / chunk) chunks)
    per_window, k = {}, 0
    for w in mine:
        rows = min(r.rows(w), t.rows(w))
        m = -(-rows // chunk)
        per_window[w] = (torch.cat(kls[k : k + m]), torch.cat(top1s[k : k + m]), torch.cat(where[k : k + m]))
        k += m
    every = {}
    for part in group.gather(per_window):
        every.update(part)
    order = sorted(every)
    return [every[w][0] for w in order], [every[w][1] for w in order], [every[w][2] for w in order]


class _RefSaver:
    """Writes the compact reference window by window into `<out>.partial/`, then renames."""

    def __init__(self, out: str, o: KldOptions, src, rep: KldReport, inputs: list[Path]):
        import torch

        self.out = Path(out)
        self.o = o
        self.src_path = getattr(src, "path", None)
        self.vocab = src.vocab
        self.tx = OutputDir(self.out, sources=inputs, force=o.force).begin()
        self.partial = self.tx.partial
        self.rows: list[int] = []
        self.rep = rep
        self.nbytes = 0
        self.gen = torch.Generator(device="cpu")
        self._window: int | None = None
        self.ids = None

    def encode(self, w: int, lp):
        # Reseeded at each window's first chunk: a window's samples depend on (seed, window, --chunk) only.
        if getattr(self, "_window", None) != w:
            self._window = w
            self.gen.manual_seed(self.o.seed * 1_000_003 + w)
        if self.vocab is None or self.vocab != lp.shape[-1]:
            self.vocab = int(lp.shape[-1])
        return C.encode(lp, self.o.topk, self.o.tail_samples, self.gen)

    def write(self, w: int, parts: list, rows: int) -> None:
        import torch
        from safetensors.torch import save_file

        names = ("top_idx", "top_logp", "tail_logmass", "smp_idx", "smp_logp")
        tensors = {k: torch.cat([p.tensors()[k] for p in parts]).contiguous() for k in names}
        f = self.partial / f"{w}.safetensors"
        save_file(tensors, str(f))
        self.nbytes += sum(t.numel() * t.element_size() for t in tensors.values())
        self.rows.append(rows)

    def commit(self) -> dict:

        positions = sum(self.rows)
        full = positions * self.vocab * 4
        meta = {
            "format": "qtool-kld-compact",
            "method": C.METHOD,
            "topk": self.o.topk,
            "samples": self.o.tail_samples,  # the compact format's field name
            "seed": self.o.seed,
            "vocab": self.vocab,
            "windows": len(self.rows),
            "rows": self.rows,
            "dataset": self.o.dataset,
            "seq_len": self.rep.seq_len,
            "stride": self.o.stride,
            "token_digest": self.rep.token_digest,
            "tensor_bytes": self.nbytes,
            "full_float32_bytes": full,
            "size_ratio": full / self.nbytes if self.nbytes else None,
        }
        if self.ids is not None:
            import torch
            from safetensors.torch import save_file

            # The token windows themselves, so that a later --emit-windows / check can use them.
            save_file({"input_ids": self.ids.to(torch.int32).contiguous()}, str(self.partial / "tokens.safetensors"))
        write_json(self.partial / META, meta)

        # the one manifest schema (what lets a later --force replace this directory); the reference
        # model's files are named, not hashed: its log-probs are the output, and re-reading 800 GB to
        # hash them would double the job
        write_manifest(
            self.partial / MANIFEST_NAME,
            kind="eval-kld-save-ref",
            command=self.o.command,
            sources={"ref": {"path": str(self.src_path), "files": {}}},
            summary={k: meta[k] for k in ("method", "windows", "seq_len", "token_digest", "tensor_bytes")},
            checks={},
            files=output_files(self.partial),
        )
        self.tx.commit()
        return {
            "path": str(self.out),
            **{
                k: meta[k]
                for k in ("method", "topk", "samples", "windows", "tensor_bytes", "full_float32_bytes", "size_ratio")
            },
        }


def load_meta(path) -> dict:
    return json.loads((Path(path) / META).read_text())


__all__ = ["KldOptions", "KldReport", "RESULT_KEYS", "run", "summarize", "CompactSource"]
