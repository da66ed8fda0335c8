"""calibrate-kv: execute (calibrate, then write) and run."""

from __future__ import annotations

import shutil
from pathlib import Path

from qtool import dist
from qtool.errors import UsageError
from qtool.io.apply import OutputJob, ProducedShards, input_hasher, write_output
from qtool.io.in_place import InPlaceDir
from qtool.io.manifest import RUN
from qtool.io.output import OutputDir
from qtool.io.plan import Remove
from qtool.ops.calibrate_kv.calibrate import ShardFeeder, calibrate, outlier_warnings
from qtool.ops.calibrate_kv.plan import CalibrateKvOptions, KvPlan, plan
from qtool.ops.calibrate_kv.write import fed_spans, scale_values
from qtool.ops.contract import Report
from qtool.stream.layer_stream import streamed_files

# ---- the whole operation ---------------------------------------------------------------------------


def execute(p: KvPlan, *, progress=None) -> Report:
    """Calibrate and write (through the output transaction: -o OUT or the in-place swap)."""
    opts = p.options
    report = {"plan": p.to_json()}
    if p.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda but no CUDA device is available", hint="use --device cpu")
    calib = p.calib

    if not dist.current().leader:  # a data-parallel rank: its share of the forward; rank 0 writes
        stats, timing = calibrate(p, calib.ids, resume=opts.resume)
        return Report(
            {**report, "rank": dist.current().rank, "layers": [stats[i].to_json() for i in p.layers], "timing": timing}
        )
    # the transaction (lock, writability, the --force rules) is taken before the forward pass
    tx = (
        OutputDir(p.out, sources=[p.ckpt.root], force=opts.force, resume=opts.resume)
        if p.out is not None
        else InPlaceDir(p.ckpt.root, resume=opts.resume)
    )
    state: dict = {}

    def produce(shards: ProducedShards) -> dict:  # writes no Produced shard: the scales are Pending values
        def each_layer(idx: int) -> None:
            # a failed early shard (the copies beside the layers) stops the job at its next layer
            shards.stop_if_failed()
            if progress is not None:
                progress(idx)

        # the shards that held the old scales are written from the layers' reads (the input is read once)
        feeder = ShardFeeder(fed_spans(p), shards.feed) if p.rewrite_shards else None
        stats, state["timing"] = calibrate(
            p, calib.ids, resume=opts.resume, progress=each_layer, digests=hasher.read_digests, feeder=feeder
        )
        state["stats"] = stats
        return scale_values(p, stats)

    def check() -> dict:
        shutil.rmtree(p.work_dir, ignore_errors=True)  # the hidden states: every file is written now
        return {}

    with tx:
        # the input is hashed from the forward's reads (one read of it): the hasher hands them over
        hasher = input_hasher(tx, streamed_files(p.ckpt, p.mm))
        try:
            applied = write_output(
                p.output,
                tx,
                OutputJob(
                    command=opts.command,
                    produce=produce,
                    check=check,
                    hasher=hasher,
                    early_shards=True,
                    extra=lambda: {RUN: {"kernels": state["timing"].get("kernels")}},
                ),
            )
        finally:
            hasher.close()  # (after the forward: its reads hand their bytes to the hasher's digests)
    stats = state["stats"]
    report["layers"] = [stats[i].to_json() for i in p.layers]
    report["warnings"] = p.warnings + outlier_warnings(stats)
    report["timing"] = state["timing"]
    report["calibration"] = calib.to_json()
    files = dict(p.output.extra["kv_cache"]["scale_tensors"], output=str(tx.out))
    if tx.in_place:
        files["removed_shards"] = [e.name for e in p.output.entries(Remove)]
    else:
        files["shards_reused_by"] = sorted(applied.linked) or ["none"]
    report["output"] = files
    return Report(report)


def run(checkpoint: str | Path, *, dry_run: bool = False, progress=None, **options) -> dict:
    """plan + execute in one call (library convenience): `options` are CalibrateKvOptions fields."""
    p = plan(CalibrateKvOptions(Path(checkpoint), **options))
    return {"plan": p.to_json()} if dry_run else execute(p, progress=progress).to_json()
