"""`qtool quantize` execution: layer-streamed calibration + quantization, resumable, atomic output.

Per decoder layer: load it dense (qtool.stream.layer_stream), install the statistics hooks (per-expert token
counts and input amaxes, AWQ activations, K/V amax), optionally run the peer backend's calibration on
that layer (qtool.ops.quantize.backends), forward the calibration hidden states through it (BF16
propagation: the next layer sees the unquantized model's activations, as in ModelOpt's and
llm-compressor's basic calibration), then quantize the layer's experts from the weights already in memory
(the source is read once) and write the layer's shard: quantize's stage (qtool.ops.quantize.stage) of the
one layer loop (qtool.stream.layer_run). A journal in `<out>.partial/.quantize/` records the
finished layers; `--resume` continues after the last one. The output appears at `<out>` only when complete
and checked (qtool.ops.inspect.find_problems finds no error).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qtool import dist
from qtool.errors import UsageError, VerificationError
from qtool.io.apply import OutputJob, ProducedShards, check_written, input_hasher, write_output
from qtool.io.identity import input_identity, tensor_list_text
from qtool.io.manifest import RUN
from qtool.io.output import OutputDir, partial_path
from qtool.io.plan import Shard
from qtool.io.stream_digest import NO_DIGESTS, DigestSink
from qtool.ops.checks import PlannedProblems, inspect_check
from qtool.ops.contract import Report
from qtool.ops.quantize.output import input_files
from qtool.ops.quantize.plan import HIDDEN_FILES, QuantizeOptions, QuantizePlan
from qtool.ops.quantize.plan import plan as make_plan
from qtool.ops.quantize.stage import FinishedShards, QuantizeStage  # (torch and the codecs: imported on first use)
from qtool.stream.calib_data import token_digest
from qtool.stream.hidden_store import DiskStore
from qtool.stream.layer_journal import JOURNAL, LayerJournal
from qtool.stream.layer_run import LayerRun
from qtool.stream.layer_stream import LayerStreamer, streamed_files

if TYPE_CHECKING:
    import torch

WORK = ".quantize"


def _journal_key(plan: QuantizePlan, digest: str) -> str:
    h = hashlib.sha256(tensor_list_text(plan.ckpt.tensors))
    h.update(json.dumps(plan.recipe.to_json() | {"path": None}, sort_keys=True).encode())
    h.update(f"{plan.backend.value}|{plan.format.value}|{digest}|{plan.awq_rows}".encode())
    # a same-size edit of an input with its mtime put back changes the key (content samples)
    h.update(json.dumps(input_identity(str(f) for f in input_files(plan))).encode())
    return h.hexdigest()[:32]


@contextlib.contextmanager
def first_layer_read(
    plan: QuantizePlan, partial: Path, digests: DigestSink = NO_DIGESTS
) -> Iterator[tuple[LayerStreamer, int]]:
    """(a LayerStreamer, the run's first layer) with that layer's read begun: a --resume's next layer, as
    its journal says (0 without one; calibrate_and_write checks the journal is this job's). The rest of
    the start (the output plan: 3 s of per-tensor Python for the 397B's 372k output tensors on the 2-core
    VM) runs while it is read. The streamer is closed on the way out (its reads end there). digests: the
    job's inputs hashed from the streamer's reads (the transaction's input hasher's)."""
    options = plan.options
    streamer = LayerStreamer(
        plan.ckpt,
        device=plan.device,
        model_map=plan.model_map,
        batch_tokens=options.batch_tokens if options else None,
        digests=digests,
    )
    try:
        first = LayerJournal.peek(partial / WORK / JOURNAL) if options is not None and options.resume else 0
        if 0 <= first < len(plan.layers):
            streamer.prefetch(plan.layers[first].index)
        yield streamer, first
    finally:
        streamer.close()


def calibrate_and_write(
    plan: QuantizePlan,
    partial: Path,
    ids: torch.Tensor,
    streamer: LayerStreamer,
    *,
    resume: bool,
    progress: Callable[[int], None] | None = None,
    mode: int = 0o644,
    shards: FinishedShards | None = None,
    prefetched: int | None = None,
) -> dict:
    """The layers, calibrated, quantized and written, through `streamer` (first_layer_read's, which has
    begun reading plan.layers[prefetched] and closes it): one LayerRun of the layer loop with quantize's
    stage (qtool.ops.quantize.stage). Layer L+1's bytes are read while L computes, and L's shard is coded
    and written by a writer thread while L+1 loads and runs forward (at most plan.layers_in_flight layers
    pending, and the last layer besides them; qtool.stream.layer_run.WriteBehind). The journal entry of L
    is saved once L's shard is on disk, in layer order; the store keeps HIDDEN_FILES hidden-state files so
    that the inputs of the layers in flight survive the forward until then."""
    group = streamer.group
    n, seq = int(ids.shape[0]), int(ids.shape[1])
    batch = streamer.batch_windows(seq)
    journal = LayerJournal(partial / WORK / JOURNAL, _journal_key(plan, f"{token_digest(ids)}|{batch}"), group)
    journal.open(
        resume=resume,
        what="quantize journal",
        job="the quantize job (source, recipe, data, flags)",
        inputs="source, recipe, data or flags",
    )
    # with write-behind the journal may lag plan.layers_in_flight layers behind the forward; always
    # HIDDEN_FILES, so that a resume finds the file its journal names whatever it plans in flight
    store = DiskStore(
        partial / WORK,
        (n, seq, streamer.hidden_size),
        streamer.dtype,
        current=journal.current(),
        files=HIDDEN_FILES,
        device=streamer.device,
    )
    start = journal.next_layer
    layer_reports: list[dict] = list(journal.saved.get("layers", []))
    stage = QuantizeStage(plan, shards, layer_reports, group)
    run = LayerRun(
        streamer,
        store,
        seq,
        batch,
        [layer_plan.index for layer_plan in plan.layers[start:]],
        [stage],
        journal,
        progress,
        partial=partial,
        file_mode=mode,
        layers_in_flight=plan.layers_in_flight,
    )
    if start < len(plan.layers) and start != prefetched:
        streamer.prefetch(plan.layers[start].index)  # the first layer is read while the embeddings are made
    if start == 0:
        run.embed(ids)
    t0 = time.perf_counter()
    streamer.run_layers(run)
    streamer.close()  # (the reads are over: the GPU peak into the clock reported here)
    return {
        "layers": layer_reports,
        "seconds": time.perf_counter() - t0,
        "resumed_from_layer": start,
        "timing": streamer.clock,
        "kernels": streamer.kernels,
    }


class CheckedShards:
    """The executor's ProducedShards, with the output's checks on the plan's view of it run as each layer's
    shard is finished (qtool.ops.checks.PlannedProblems): a wrong plan stops the job at its first layer."""

    def __init__(self, shards: ProducedShards, checking: PlannedProblems) -> None:
        self._shards = shards
        self._checking = checking

    def stop_if_failed(self) -> None:
        self._shards.stop_if_failed()

    def finished(self, name: str, sha256: Future | str | None = None) -> None:
        self._shards.finished(name, sha256)
        self._checking.begin()  # from the first layer written on: the start has nothing to share its CPU with
        problems = self._checking.found_early()
        if problems:  # the plan itself is wrong (a qtool bug): the end's check would fail it, an hour later
            raise VerificationError(
                f"the planned output has {len(problems)} problem(s); stopped at {name}",
                path=self._shards.partial,
                got="; ".join(f"{x.code.value}: {x.message}" for x in problems[:3]),
                hint="this is a qtool bug: please report it with this message",
            )


def execute(plan: QuantizePlan, *, progress: Callable[[int], None] | None = None) -> Report:
    """Calibrate, quantize layer by layer and write (through the output transaction)."""
    opts = plan.options
    assert opts is not None  # plan() keeps its options
    report: dict = {}
    if plan.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda but no CUDA device is available", hint="use --device cpu")
    if opts.calib_ids is None:
        assert plan.calib is not None  # planned without calib_ids
        ids = plan.calib.ids
        report["calibration"] = plan.calib.to_json()
    else:
        ids = opts.calib_ids
        report["calibration"] = {"dataset": "ids", "digest": token_digest(ids), "tokens": int(ids.numel())}
    if not dist.current().leader:  # a data-parallel rank: its share of the forward; rank 0 writes
        partial = partial_path(plan.out)
        with first_layer_read(plan, partial) as (streamer, first):
            report["plan"] = plan.to_json()  # (makes the output plan, as rank 0 does)
            report.update(
                calibrate_and_write(plan, partial, ids, streamer, resume=opts.resume, prefetched=first),
                rank=dist.current().rank,
            )
        return Report({"plan": report.pop("plan"), **report})

    def produce(shards: ProducedShards) -> None:
        report.update(
            calibrate_and_write(
                plan,
                tx.partial,
                ids,
                streamer,
                resume=opts.resume,
                progress=progress,
                mode=tx.file_mode,
                shards=CheckedShards(shards, checking),
                prefetched=first,
            )
        )

    def check() -> dict:
        shutil.rmtree(tx.partial / WORK, ignore_errors=True)  # the hidden states: every file is written now
        check_written(plan.make_output(), tx.partial, (Shard,))  # the layer shards were, by write_output
        checked = inspect_check(checking.result())
        report["problems"] = checked["inspect_problems"]
        report["output_warnings"] = checked.get("inspect_warnings", [])  # (moved into report["output"] below)
        return checked

    with OutputDir(plan.out, sources=[plan.ckpt.root], force=opts.force, resume=opts.resume) as tx:
        # the first layer is read while the output is planned: the input's hashes are taken from the reads
        # from the first one on, so the hasher comes first
        hasher, planned = None, False
        try:
            hasher = input_hasher(tx, streamed_files(plan.ckpt, plan.model_map))
            with first_layer_read(plan, tx.partial, hasher.read_digests) as (streamer, first):
                report["plan"] = plan.to_json()  # (makes the output plan)
                planned = True
                # the output's checks on the plan's view of it, found while the layers are written: reading
                # the 397B's written headers back and mapping them took 2.4 s after its last layer (2-core VM)
                view = (
                    plan.output_map if plan.output_map is not None and plan.output_map.ckpt.root == tx.partial else None
                )
                checking = PlannedProblems(plan.make_output(), tx.partial, view)
                write_output(
                    plan.make_output(),
                    tx,
                    OutputJob(
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
                    ),
                )
        finally:
            if hasher is not None:
                hasher.close()  # (after the streamer: its reads hand their bytes to the hasher's digests)
            if not planned:  # refused by (or before) its output plan: nothing is left, as of a refusal in plan()
                tx.withdraw()
    report["output"] = {
        "output": str(plan.out),
        **plan.make_output().summary,
        "side_files": plan.make_output().extra["side_files"],
        "problems": report["problems"],
        "warnings": report.pop("output_warnings"),
    }
    return Report({"plan": report.pop("plan"), **report})


def run(
    checkpoint: str | Path, *, dry_run: bool = False, progress: Callable[[int], None] | None = None, **options: Any
) -> dict:
    """plan + execute in one call (library convenience): `options` are QuantizeOptions fields."""
    quantize_plan = make_plan(QuantizeOptions(Path(checkpoint), **options))
    return {"plan": quantize_plan.to_json()} if dry_run else execute(quantize_plan, progress=progress).to_json()
