"""`qtool quantize` execution: layer-streamed calibration + quantization, resumable, atomic output.

Per decoder layer: load it dense (qtool.stream.layer_stream), install the statistics hooks (per-expert token
counts and input amaxes, AWQ activations, K/V amax), optionally run the peer backend's calibration on
that layer (qtool.ops.quantize.backends), forward the calibration hidden states through it (BF16
propagation: the next layer sees the unquantized model's activations, as in ModelOpt's and
llm-compressor's basic calibration), then quantize the layer's experts from the weights already in memory
(the source is read once) and write the layer's shard. A journal in `<out>.partial/.quantize/` records the
finished layers; `--resume` continues after the last one. The output appears at `<out>` only when complete
and checked (qtool.ops.inspect.find_problems finds nothing).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from qtool.errors import PlanError, UsageError, VerificationError
from qtool.io.identity import input_identity, tensor_list_text
from qtool.io.jsonio import load_json, write_json
from qtool.io.manifest import RUN
from qtool.io.output import OutputDir
from qtool.io.stream_digest import NO_DIGESTS, DigestSink
from qtool.ops.contract import Report
from qtool.ops.quantize.output import input_files
from qtool.ops.quantize.plan import HIDDEN_FILES, QuantizeOptions, QuantizePlan, plan
from qtool.ops.quantize.schemes import install_linear_amax, remove_linear_amax
from qtool.recipes import Scheme

JOURNAL = "journal.json"
WORK = ".quantize"


def _journal_key(p: QuantizePlan, digest: str) -> str:
    h = hashlib.sha256(tensor_list_text(p.ckpt.tensors))
    h.update(json.dumps(p.recipe.to_json() | {"path": None}, sort_keys=True).encode())
    h.update(f"{p.backend.value}|{p.format.value}|{digest}|{p.awq_rows}".encode())
    # a same-size edit of an input with its mtime put back changes the key (content samples)
    h.update(json.dumps(input_identity(str(f) for f in input_files(p))).encode())
    return h.hexdigest()[:32]


@contextlib.contextmanager
def first_layer_read(p: QuantizePlan, partial: Path, digests: DigestSink = NO_DIGESTS) -> Iterator[tuple[object, int]]:
    """(a LayerStreamer, the run's first layer) with that layer's read begun: a --resume's next layer, as
    its journal says (0 without one; calibrate_and_write checks the journal is this job's). The rest of
    the start (the output plan: 3 s of per-tensor Python for the 397B's 372k output tensors on the 2-core
    VM) runs while it is read. The streamer is closed on the way out (its reads end there). digests: the
    job's inputs hashed from the streamer's reads (the transaction's input hasher's)."""
    from qtool.stream.layer_stream import LayerStreamer

    streamer = LayerStreamer(
        p.ckpt, device=p.device, mm=p.mm, batch_tokens=p.options.batch_tokens if p.options else None, digests=digests
    )
    try:
        first = 0
        if p.options is not None and p.options.resume:
            try:
                first = int(json.loads((partial / WORK / JOURNAL).read_text()).get("next_layer", 0))
            except (OSError, ValueError, TypeError, AttributeError):
                pass  # no journal, or not one to resume from: calibrate_and_write says which
        if 0 <= first < len(p.layers):
            streamer.prefetch(p.layers[first].index)
        yield streamer, first
    finally:
        streamer.close()


def calibrate_and_write(
    p: QuantizePlan,
    partial: Path,
    ids,
    streamer,
    *,
    resume: bool,
    progress=None,
    mode: int = 0o644,
    done=None,
    prefetched: int | None = None,
) -> dict:
    """The layers, calibrated, quantized and written, through `streamer` (first_layer_read's, which has
    begun reading p.layers[prefetched] and closes it)."""
    from qtool.stream.calib_data import token_digest
    from qtool.stream.layer_stream import DiskStore

    g = streamer.group
    n, seq = int(ids.shape[0]), int(ids.shape[1])
    batch = streamer.batch_windows(seq)
    key = _journal_key(p, f"{token_digest(ids)}|{batch}")
    g.barrier()  # rank 0 has opened the output transaction (OUT.partial exists from here on)
    g.agree("the quantize job (source, recipe, data, flags)", key)
    work = partial / WORK
    work.mkdir(parents=True, exist_ok=True)
    jpath = work / JOURNAL
    journal = None
    if resume and jpath.exists():
        journal, _ = load_json(jpath, what="quantize journal")
        if journal.get("key") != key:
            raise PlanError(
                "--resume: the journal was written for other inputs (source, recipe, data or flags)",
                path=jpath,
                hint="run again without --resume to start over",
            )
    g.barrier()  # every rank has read the journal before rank 0 writes the next one
    # with write-behind the journal may lag p.layers_in_flight layers behind the forward (_quantize_layers);
    # always HIDDEN_FILES, so that a resume finds the file its journal names whatever it plans in flight
    store = DiskStore(
        work,
        (n, seq, streamer.hidden_size),
        streamer.dtype,
        current=(journal or {}).get("current", "a"),
        files=HIDDEN_FILES,
        device=streamer.device,
    )
    start = int((journal or {}).get("next_layer", 0))
    layer_reports: list[dict] = list((journal or {}).get("layers", []))

    def save(next_layer: int, current: str) -> None:
        if not g.leader:
            return  # rank 0 keeps the journal
        write_json(jpath, {"key": key, "next_layer": next_layer, "current": current, "layers": layer_reports})

    if start < len(p.layers) and start != prefetched:
        streamer.prefetch(p.layers[start].index)  # the first layer is read while the embeddings are made
    if start == 0:
        streamer.embed_into(ids, store, batch)
        save(0, store.current)
    t0 = time.perf_counter()
    _quantize_layers(p, partial, streamer, store, seq, batch, start, layer_reports, save, progress, mode, done)
    streamer.close()  # (the reads are over: the GPU peak into the clock reported here)
    return {
        "layers": layer_reports,
        "seconds": time.perf_counter() - t0,
        "resumed_from_layer": start,
        "timing": streamer.clock,
        "kernels": streamer.kernels,
    }


def _quantize_layers(p, partial, streamer, store, seq, batch, start, layer_reports, save, progress, mode, done):
    """The layer loop: layer L+1's bytes are read while L computes (streamer.prefetch), and L's experts are
    quantized and its shard written by a writer thread while L+1 loads and runs forward (write-behind, at
    most p.layers_in_flight layers pending, and the last layer besides them, each on a writer thread and a
    CUDA stream of its own; not with a peer backend, whose library state is not thread-safe). The journal
    entry of L is saved once L's shard is on disk, in layer order (a layer written before the one ahead of
    it waits for that one's entry);
    the store keeps HIDDEN_FILES hidden-state files so that the inputs of the layers in flight survive the
    forward until then. With several ranks every rank codes and writes its share of L's experts
    (layer.Share) into the one file, and rank 0 renames and journals it once every share is written (the
    ranks meet at L+1's end)."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor
    from contextlib import nullcontext

    import torch

    from qtool.io.files import tmp_path
    from qtool.ops.calibrate_kv.calibrate import reduce_kv
    from qtool.ops.quantize.calib import (
        ExpertStats,
        KvStat,
        install_expert_stats,
        reduce_expert_stats,
        remove_expert_stats,
    )
    from qtool.ops.quantize.layer import Share, copied_whole, create_layer_tmp, release_dense_experts, write_layer_shard
    from qtool.stream.layer_stream import attention_tap, kv_amax_tap
    from qtool.stream.side_stream import SideStream

    g = streamer.group
    share = Share(g.rank, g.world)

    def commit(lp, stats, kv, current, awq: list[dict], sha256: str | None = None) -> None:
        """Rank 0, once the layer's shard is whole on disk: named, hashed and journaled."""
        if g.world > 1:
            os.replace(tmp_path(partial / lp.shard), partial / lp.shard)
        if done is not None:
            done(lp.shard, sha256)  # hashed as it was written; or (several ranks) now, while the next layer runs
        entry = {"layer": lp.index, "routed_experts": lp.scheme.value, **stats.to_json()}
        if lp.full_attention:
            entry["kv"] = {"k_amax": kv.k_amax, "v_amax": kv.v_amax, "tokens": kv.tokens}
        if awq:
            awq = sorted(awq, key=lambda r: r["expert"])  # the ranks' experts, summed in one process's order
            entry["awq"] = {
                "mean_alpha": sum(r["alpha"] for r in awq) / len(awq),
                # None: an expert whose rows held a NaN or an inf (plain RTN); not summed
                "down_mse": sum(r["down_mse"] for r in awq if r["down_mse"] is not None),
                "down_mse_rtn": sum(r["down_mse_rtn"] for r in awq if r["down_mse_rtn"] is not None),
                "experts_not_searched": sum(r["down_mse"] is None for r in awq),
            }
        layer_reports.append(entry)
        streamer.inputs_hashed(lp.index)  # the digests the journal's resume relies on cover this layer
        save(lp.index + 1, current)
        streamer.clock["layers_done"].append(time.time())
        if progress is not None:
            progress(lp.index)

    def finish(
        lp, layer, stats, kv, backend, current, coder=None, ready=None, ahead=None, keep_pace=False
    ) -> list[dict]:
        """Write this rank's share of the layer; one rank also commits it here, on the writer thread, once
        the layer `ahead` of it (a Future) has committed. The coding runs on the writer's own CUDA stream,
        after the handoff mark `ready` (qtool.stream.side_stream). `keep_pace`: the job's last layer
        (write_layer_shard)."""
        if ahead is not None and ahead.done() and ahead.exception() is not None:
            raise ahead.exception()  # the layer ahead failed: this one is not begun
        with torch.no_grad(), coder.run(ready) if coder is not None else nullcontext():
            rep = write_layer_shard(
                partial / lp.shard, lp, layer, stats, (kv.k_amax, kv.v_amax), p, backend, mode, share, keep_pace
            )
        if g.world == 1:
            if ahead is not None:
                ahead.result()  # its error is this layer's too: no journal entry past a layer not on disk
            commit(lp, stats, kv, current, rep["awq"], rep.get("sha256"))
        return rep["awq"]

    def settle(previous) -> None:
        """Wait for this rank's share of the previous layer; with several ranks, meet the others (each
        share is on disk once the gather returns) and commit it on rank 0."""
        fut, lp, stats, kv, current = previous
        awq = fut.result()  # its error is raised here
        if g.world > 1:
            every = g.gather(awq)  # here: collectives stay on this thread
            if g.leader:
                commit(lp, stats, kv, current, [r for part in every for r in part])

    todo = p.layers[start:]
    in_flight = p.layers_in_flight if g.world == 1 else 1
    # One rank: the last layer is begun beside the ones in flight, not after one of them is written. No layer
    # is read or run after it, so what it holds is what the next layer's forward would have held; and its
    # shard's sha256 (~1.2 GB/s on one core, 3.4 s for a 397B NVFP4 shard: the end of the job) starts a
    # layer write earlier (0.5-1.0 s on the lent H100 machine's /dev/shm, where one layer is in flight).
    writers = in_flight + 1 if g.world == 1 else in_flight
    pending: deque = deque()  # (future, lp, stats, kv, current) of the layers being written, in order
    # each writer codes beside the next layer's forward, not behind it, on a stream of its own
    coders = [SideStream(streamer.device) for _ in range(writers)]
    # the writer codes on the job's device: a new thread's current CUDA device is 0 whatever the job's is
    on_device = (None, ())
    if streamer.device.startswith("cuda"):
        index = torch.device(streamer.device).index
        on_device = (torch.cuda.set_device, (torch.cuda.current_device() if index is None else index,))
    with ThreadPoolExecutor(
        max_workers=writers, thread_name_prefix="qtool-layer-write", initializer=on_device[0], initargs=on_device[1]
    ) as writer:
        try:
            for k, lp in enumerate(todo):
                # the copied tensors' source bytes (whole tensors, or one expert's slice of a fused source)
                copied = {s.name: s.source for s in lp.specs if s.source is not None} if share.rank == 0 else {}
                layer = streamer.load_layer(lp.index, keep_bytes=copied)  # the copied tensors: written from memory
                if k + 1 < len(todo):
                    streamer.prefetch(todo[k + 1].index)  # read while this layer computes and is written
                stats = ExpertStats(p.n_experts, keep_rows=p.awq_rows if lp.scheme is Scheme.W4A16 else 0)
                kv = KvStat()
                backend = None
                if lp.scheme is Scheme.NVFP4:
                    from qtool.ops.quantize import backends

                    backend = backends.for_layer(p)
                    if backend is not None:
                        backend.calibrate(layer, streamer, store, seq, batch)
                        stats.hooks += backend.hooks
                        stats.batch_hooks += backend.batch_hooks
                install_expert_stats(layer.mlp.experts, stats)
                install_linear_amax(layer, list(lp.fp8))  # the fp8 linears' static input scales
                if lp.full_attention:
                    attention_tap(layer, kv_amax_tap(kv))
                streamer.forward_layer(layer, store, seq, batch, on_batch=stats.set_batch)
                attention_tap(layer, None)
                remove_expert_stats(layer.mlp.experts)
                remove_linear_amax(layer)
                stats.settle()
                # data parallel: every rank now holds the layer's stats (the AWQ rows of the experts it codes)
                reduce_expert_stats(stats, g, owner=lambda e: share.owner(e, p.n_experts))
                reduce_kv(kv, g)
                # the oldest layer in flight written and journaled; all of them, in order, once one has
                # failed (its error is raised here, before another layer is begun)
                failed = any(f.done() and f.exception() is not None for f, *_ in pending)
                # a layer a peer backend codes here, on this thread, comes after every layer in flight (a BF16
                # override's layer is written behind even then); the last layer written behind, beside them
                slots = 1 if backend is not None else writers if k == len(todo) - 1 else in_flight
                while pending and (len(pending) >= slots or failed):
                    settle(pending.popleft())
                if g.world > 1 and g.leader:
                    create_layer_tmp(partial / lp.shard, mode)  # the file every rank writes its share into
                # the other ranks wait for that journal entry: the next layer's forward overwrites the
                # file the previous journal entry names (three files, one layer of lag)
                g.barrier()
                if copied_whole(lp):
                    release_dense_experts(layer)
                job = (lp, layer, stats, kv, backend, store.current)
                last = k == len(todo) - 1  # no layer waits for its write: it keeps pace with its sha256
                if backend is None:
                    coder = coders[k % writers]
                    ahead = pending[-1][0] if pending else None
                    pending.append(
                        (writer.submit(finish, *job, coder, coder.handoff(), ahead, last), lp, stats, kv, store.current)
                    )
                else:
                    finish(*job, keep_pace=last)
                del layer, backend, job
            while pending:
                settle(pending.popleft())
        finally:
            for fut, *_ in pending:
                fut.cancel()
            for fut, *_ in pending:
                try:
                    fut.result()
                except BaseException:
                    pass  # the error that brought us here is the one raised


def execute(p: QuantizePlan, *, progress=None) -> Report:
    """Calibrate, quantize layer by layer and write (through the output transaction)."""
    opts = p.options
    report: dict = {}
    if p.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda but no CUDA device is available", hint="use --device cpu")
    if opts.calib_ids is None:
        ids = p.calib.ids
        report["calibration"] = p.calib.to_json()
    else:
        from qtool.stream.calib_data import token_digest

        ids = opts.calib_ids
        report["calibration"] = {"dataset": "ids", "digest": token_digest(ids), "tokens": int(ids.numel())}
    from qtool import dist

    if not dist.current().leader:  # a data-parallel rank: its share of the forward; rank 0 writes
        from qtool.io.output import partial_path

        partial = partial_path(p.out)
        with first_layer_read(p, partial) as (streamer, first):
            report["plan"] = p.to_json()  # (makes the output plan, as rank 0 does)
            report.update(
                calibrate_and_write(p, partial, ids, streamer, resume=opts.resume, prefetched=first),
                rank=dist.current().rank,
            )
        return Report({"plan": report.pop("plan"), **report})
    from qtool.io.apply import input_hasher, write_output
    from qtool.ops.checks import PlannedProblems
    from qtool.stream.layer_stream import streamed_files

    def produce(done) -> None:
        def layer_done(name: str, sha256=None) -> None:
            done(name, sha256)
            checking.begin()  # from the first layer written on: the start has nothing to share its CPU with
            problems = checking.found_early()
            if problems:  # the plan itself is wrong (a qtool bug): the end's check would fail it, an hour later
                raise VerificationError(
                    f"the planned output has {len(problems)} problem(s); stopped at {name}",
                    path=tx.partial,
                    got="; ".join(f"{x.code.value}: {x.message}" for x in problems[:3]),
                    hint="this is a qtool bug: please report it with this message",
                )

        layer_done.check = done.check
        report.update(
            calibrate_and_write(
                p,
                tx.partial,
                ids,
                streamer,
                resume=opts.resume,
                progress=progress,
                mode=tx.file_mode,
                done=layer_done,
                prefetched=first,
            )
        )

    def check() -> dict:
        from qtool.io.apply import check_written
        from qtool.io.plan import Shard

        shutil.rmtree(tx.partial / WORK, ignore_errors=True)  # the hidden states: every file is written now
        check_written(p.output, tx.partial, (Shard,))  # the layer shards were, by write_output
        problems = [x.to_json() for x in checking.result()]
        report["problems"] = problems
        return {
            "inspect_problems": problems,
            "passed": not problems,
            "summary": problems[0]["message"] if problems else None,
        }

    with OutputDir(p.out, sources=[p.ckpt.root], force=opts.force, resume=opts.resume) as tx:
        # the first layer is read while the output is planned: the input's hashes are taken from the reads
        # from the first one on, so the hasher comes first
        hasher, planned = None, False
        try:
            hasher = input_hasher(tx, streamed_files(p.ckpt, p.mm))
            with first_layer_read(p, tx.partial, hasher.read_digests) as (streamer, first):
                report["plan"] = p.to_json()  # (makes the output plan)
                planned = True
                # the output's checks on the plan's view of it, found while the layers are written: reading
                # the 397B's written headers back and mapping them took 2.4 s after its last layer (2-core VM)
                view = p.output_map if p.output_map is not None and p.output_map.ckpt.root == tx.partial else None
                checking = PlannedProblems(p.output, tx.partial, view)
                write_output(
                    p.output,
                    tx,
                    command=opts.command,
                    produce=produce,
                    check=check,
                    hasher=hasher,
                    early_shards=True,
                    extra=lambda: {
                        "calibration": report.get("calibration"),
                        "layers": report["layers"],
                        RUN: {"kernels": report.get("kernels")},
                    },
                )
        finally:
            if hasher is not None:
                hasher.close()  # (after the streamer: its reads hand their bytes to the hasher's digests)
            if not planned:  # refused by (or before) its output plan: nothing is left, as of a refusal in plan()
                tx.withdraw()
    report["output"] = {
        "output": str(p.out),
        **p.output.summary,
        "side_files": p.output.extra["side_files"],
        "problems": report["problems"],
    }
    return Report({"plan": report.pop("plan"), **report})


def run(checkpoint: str | Path, *, dry_run: bool = False, progress=None, **options) -> dict:
    """plan + execute in one call (library convenience): `options` are QuantizeOptions fields."""
    p = plan(QuantizeOptions(Path(checkpoint), **options))
    return {"plan": p.to_json()} if dry_run else execute(p, progress=progress).to_json()
