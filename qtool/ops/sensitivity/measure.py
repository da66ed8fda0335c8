"""The streamed pass of `qtool sensitivity`: each unit's error with its quantized weights, on the inputs
the BF16 model gives it.

Both checkpoints are streamed a decoder layer at a time (qtool.stream.layer_stream: transformers' own
decoder layer, the quantized side dequantized to the compute dtype). The hidden states follow the BF16
model. While the BF16 layer runs a micro-batch, a forward hook on each measured unit's module (the layer's
`mlp.experts`, `mlp.shared_expert`, `self_attn` / `linear_attn`) runs the quantized layer's module on the
very same inputs (the routed experts with the BF16 router's choice) and adds up, in float32:

  error  = sum ||out_q - out||^2 / sum ||out||^2                 (the unit alone)
  effect = sum ||delta of what it adds to the residual||^2 / sum ||the layer's output||^2

For the shared expert "what it adds" is sigmoid(shared_expert_gate(x)) * out, as the MoE block adds it;
for the others it is the module's output itself. The planner sums the effects of the units left quantized:
its assumption is that their errors are uncorrelated (the cross terms of ||sum of deltas||^2 vanish).

With --formats (qtool.ops.sensitivity.formats) the same hook also runs the BF16 module with the unit's
weights coded in each candidate format (quantize's own codecs, coded once per layer, swapped in for the
call and put back) and keeps the same two sums per format: the planner's gain of each choice.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from qtool.io.identity import input_identity, tensor_list_text
from qtool.io.output import partial_path
from qtool.io.stream_digest import NO_DIGESTS, DigestSink
from qtool.ops.sensitivity.formats import Candidate, FormatSet, coded_weights
from qtool.ops.sensitivity.units import KIND_GROUPS
from qtool.stream.calib_data import token_digest
from qtool.stream.hidden_store import DiskStore
from qtool.stream.layer_journal import LayerJournal
from qtool.stream.layer_run import LayerRun, LayerStage
from qtool.stream.layer_stream import LayerStreamer

if TYPE_CHECKING:
    import torch

JOURNAL = "journal.json"
_MODULES = {"routed_experts": "mlp.experts", "shared_expert": "mlp.shared_expert"}


def _module_of(layer, kind: str):
    if kind == "attention":
        return getattr(layer, "self_attn", None) or layer.linear_attn
    obj = layer
    for part in _MODULES[kind].split("."):
        obj = getattr(obj, part)
    return obj


def _first(out):
    return out[0] if isinstance(out, tuple) else out


class _Sums:
    """Running float32 sums of one unit: ||delta||^2, ||out||^2, ||delta added||^2 (and tokens)."""

    def __init__(self, d: dict | None = None) -> None:
        d = d or {}
        self.delta, self.out, self.added, self.tokens = (
            float(d.get(k, 0.0)) for k in ("delta", "out", "added", "tokens")
        )

    def to_json(self) -> dict:
        return {"delta": self.delta, "out": self.out, "added": self.added, "tokens": self.tokens}


@dataclass(frozen=True)
class FormatUnit:
    """A unit the pass measures in candidate formats: its kind (the module hooked), its recipe group (what
    the format codes) and the formats other than BF16."""

    kind: str
    group: str
    formats: tuple[Candidate, ...]


def _add(s: _Sums, out, q, gate, args, kwargs) -> None:
    """One micro-batch of a unit into its sums: out is the BF16 module's output, q the coded one's."""
    import torch

    out, q = out.float(), q.float()
    delta = q - out
    s.delta += float(delta.pow(2).sum())
    s.out += float(out.pow(2).sum())
    if gate is not None:  # the MoE block adds sigmoid(gate(x)) * shared_expert(x)
        delta = delta * torch.sigmoid(gate(args[0] if args else kwargs["hidden_states"]).float())
    s.added += float(delta.pow(2).sum())
    s.tokens += int(out.numel() // out.shape[-1])


def _with_weights(layer, module, weights: dict, args, kwargs):
    """`module`'s output with the layer's parameters `weights` (name relative to the layer -> tensor) in
    place of its own, put back after (module.forward: the probe's own hook is not called again)."""
    saved = {}
    try:
        for name, w in weights.items():
            param = layer.get_parameter(name)
            saved[name] = param.data
            param.data = w
        return _first(module.forward(*args, **kwargs))
    finally:
        for name, data in saved.items():
            layer.get_parameter(name).data = data


class _Probe:
    """The hooks of one layer: a hook per measured unit (the quantized twin's module, and the unit's weights
    coded in each candidate format) and one on the layer for ||layer output||^2."""

    def __init__(
        self,
        layer_b,
        layer_q,
        kinds: list[str],
        sums: dict[str, _Sums],
        layer_sum: _Sums,
        coded: dict[str, dict[str, dict]] | None = None,
        format_sums: dict[str, dict[str, _Sums]] | None = None,
    ) -> None:
        self.handles = []
        self.layer_sum = layer_sum
        coded, format_sums = coded or {}, format_sums or {}
        for kind in sorted(set(kinds) | set(coded), key=list(KIND_GROUPS).index):
            mod_b = _module_of(layer_b, kind)
            gate = layer_b.mlp.shared_expert_gate if kind == "shared_expert" else None
            mod_q = _module_of(layer_q, kind) if kind in kinds else None
            hook = self._unit(layer_b, mod_b, mod_q, gate, sums.get(kind), coded.get(kind, {}), format_sums.get(kind))
            self.handles.append(mod_b.register_forward_hook(hook, with_kwargs=True))
        self.handles.append(layer_b.register_forward_hook(self._layer, with_kwargs=True))

    @staticmethod
    def _unit(layer_b, mod_b, mod_q, gate, s: _Sums | None, coded: dict[str, dict], fs: dict[str, _Sums] | None):
        def hook(_module, args, kwargs, output):
            out = _first(output)
            if mod_q is not None:
                _add(s, out, _first(mod_q(*args, **kwargs)), gate, args, kwargs)
            for fmt, weights in coded.items():
                _add(fs[fmt], out, _with_weights(layer_b, mod_b, weights, args, kwargs), gate, args, kwargs)

        return hook

    def _layer(self, _module, _args, _kwargs, output):
        y = _first(output).float()
        self.layer_sum.out += float(y.pow(2).sum())
        self.layer_sum.tokens += int(y.numel() // y.shape[-1])

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class ProbeStage(LayerStage):
    """sensitivity's stage of the layer loop: the quantized twin of each BF16 layer that has measured units
    is loaded and probed around the BF16 forward; with --formats, each unit's weights are coded in each
    candidate format (once per layer) and probed the same way."""

    def __init__(
        self,
        q: LayerStreamer,
        by_layer: dict[int, list[str]],
        sums: dict[str, _Sums],
        layer_sums: dict[int, _Sums],
        formats: FormatSet | None = None,
        format_units: dict[int, list[FormatUnit]] | None = None,
    ) -> None:
        self.q, self.by_layer, self.sums, self.layer_sums = q, by_layer, sums, layer_sums
        self.formats, self.format_units = formats, format_units or {}
        self.probe: _Probe | None = None

    def before_forward(self, run: LayerRun, idx: int, layer_b: torch.nn.Module) -> None:
        kinds = self.by_layer.get(idx, [])
        self.layer_sums[idx] = _Sums()
        layer_q = self.q.load_layer(idx) if kinds else None
        if self.by_layer.get(idx + 1):
            self.q.prefetch(idx + 1)  # read while this layer computes, as the BF16 side's next layer
        coded, format_sums = self._coded(idx, layer_b)
        if kinds or coded:
            unit_sums = {k: self.sums.setdefault(f"layer.{idx}.{k}", _Sums()) for k in kinds}
            self.probe = _Probe(layer_b, layer_q, kinds, unit_sums, self.layer_sums[idx], coded, format_sums)

    def _coded(self, idx: int, layer_b) -> tuple[dict, dict]:
        """{kind: {format: the unit's weights coded in it}} of layer `idx`, and their sums."""
        coded: dict[str, dict] = {}
        format_sums: dict[str, dict[str, _Sums]] = {}
        for fu in self.format_units.get(idx, []):
            ws = self.formats.method
            coded[fu.kind] = {f.value: coded_weights(layer_b, fu.group, f, ws) for f in fu.formats}
            format_sums[fu.kind] = {
                f.value: self.sums.setdefault(format_key(f"layer.{idx}.{fu.kind}", f.value), _Sums())
                for f in fu.formats
            }
        return coded, format_sums

    def after_forward(self, run: LayerRun, idx: int, layer_b: torch.nn.Module) -> None:
        if self.probe is not None:
            self.probe.remove()  # its hooks held the quantized layer: freed with them
            self.probe = None

    def before_commit(self, run: LayerRun, idx: int) -> None:
        if self.by_layer.get(idx):
            self.q.inputs_hashed(idx)  # the digests a resume relies on cover the quantized side's bytes too

    def journal_entry(self) -> dict:
        return {
            "units": {k: v.to_json() for k, v in self.sums.items()},
            "layers": {str(k): v.to_json() for k, v in self.layer_sums.items()},
        }


def format_key(unit_id: str, fmt: str) -> str:
    """A unit's sums in a candidate format (beside its sums against the quantized checkpoint)."""
    return f"{unit_id}@{fmt}"


def journal_key(bf_ckpt, q_ckpt, digest: str, dtype: str, unit_ids: list[str]) -> str:
    """What a --resume must find unchanged: both checkpoints' tensors and text configs (a config edit
    changes the forward), the token windows, the settings; as calibrate-kv's key. (A same-size edit of a
    shard with its mtime put back is refused by the digests the pass records as it reads:
    qtool.io.manifest.InputHasher, through the output executor.)"""
    h = hashlib.sha256()
    for ck in (bf_ckpt, q_ckpt):
        h.update(tensor_list_text(ck.tensors))
        h.update(json.dumps(ck.text_config, sort_keys=True).encode())
        h.update(json.dumps(input_identity(x.path for x in ck.headers.values())).encode())
    h.update(f"{digest}|{dtype}|{','.join(unit_ids)}".encode())
    return h.hexdigest()[:32]


def measure(plan, *, resume: bool, progress=None, digests: DigestSink = NO_DIGESTS) -> dict:
    """Run the pass; returns {"units": {id: sums}, "layers": {i: sums}, "timing": ...}. The hidden states
    and a journal live in plan.work_dir: an interrupted run resumes at its next layer. digests: the inputs
    hashed from the pass's reads (its output transaction's input hasher's)."""
    o = plan.options
    bf = LayerStreamer(plan.bf, device=o.device, dtype=o.dtype, batch_tokens=o.batch_tokens, digests=digests)
    q = LayerStreamer(plan.q, device=o.device, dtype=bf.dtype_name, batch_tokens=o.batch_tokens, digests=digests)
    ids = plan.calib.ids
    n, seq = int(ids.shape[0]), int(ids.shape[1])
    batch = bf.batch_windows(seq)
    measured = [u for u in plan.units if u.measured]
    format_units = _format_units(plan.units)
    probed = [u.id for u in measured]
    if o.formats is not None:  # (a table without --formats keeps its journal key)
        probed.append(f"formats={json.dumps(o.formats.to_json(), sort_keys=True)}")
    key = journal_key(plan.bf, plan.q, token_digest(ids), f"{bf.dtype_name}|{batch}", probed)
    journal = LayerJournal(plan.work_dir / JOURNAL, key, bf.group).open(
        resume=resume,
        what="sensitivity journal",
        job="the sensitivity job (checkpoints, data, settings)",
        inputs="checkpoints, data or settings",
    )
    start = journal.next_layer
    sums = {uid: _Sums(d) for uid, d in journal.saved.get("units", {}).items()}
    layer_sums = {int(i): _Sums(d) for i, d in journal.saved.get("layers", {}).items()}
    store = DiskStore(
        plan.work_dir,
        (n, seq, bf.hidden_size),
        bf.dtype,
        current=journal.current(),
        write_behind=True,
        device=bf.device,
    )
    by_layer: dict[int, list[str]] = {}
    for u in measured:
        by_layer.setdefault(u.layer, []).append(u.kind)
    stage = ProbeStage(q, by_layer, sums, layer_sums, o.formats, format_units)
    run = LayerRun(bf, store, seq, batch, list(range(start, bf.num_layers)), [stage], journal, progress)
    t0 = time.perf_counter()
    bf.prefetch(start)
    if by_layer.get(start):
        q.prefetch(start)
    try:
        if start == 0:
            run.embed(ids)
        bf.run_layers(run)  # the one layer loop
    except BaseException:
        store.close(quiet=True)
        raise
    finally:
        q.close()
    store.close()
    return {
        "units": {k: v.to_json() for k, v in sums.items()},
        "layers": {str(k): v.to_json() for k, v in layer_sums.items()},
        "timing": {
            "seconds": time.perf_counter() - t0,
            "resumed_from_layer": start,
            "layers_run": bf.num_layers - start,
            "kernels": bf.kernels,
            **bf.clock,
        },
    }  # the layer clock (benchmarks; not in the table's manifest)


def _format_units(units) -> dict[int, list[FormatUnit]]:
    """layer -> the units the pass measures in a candidate format other than BF16."""
    out: dict[int, list[FormatUnit]] = {}
    for u in units:
        coded = tuple(Candidate(f) for f in (u.formats or {}) if f != Candidate.BF16.value)
        if coded:
            out.setdefault(u.layer, []).append(FormatUnit(u.kind, u.group, coded))
    return out


def _ratios(s: dict, layer: dict) -> tuple[float, float]:
    """(error, effect) of a unit's sums (see the module's docstring)."""
    error = s["delta"] / s["out"] if s["out"] > 0 else 0.0
    effect = s["added"] / layer["out"] if layer.get("out") else 0.0
    return error, effect


def fill(units, result: dict) -> None:
    """Put the measured error and effect into the units (the table's columns), and into each candidate
    format's row."""
    for u in units:
        layer = result["layers"].get(str(u.layer), {})
        for fmt, row in (u.formats or {}).items():
            s = result["units"].get(format_key(u.id, fmt))
            if s is not None:
                row["error"], row["effect"] = _ratios(s, layer)
        s = result["units"].get(u.id)
        if s is None:
            continue
        u.error, u.effect = _ratios(s, layer)
        u.tokens = int(s["tokens"])


def work_dir(out: Path) -> Path:
    return partial_path(out) / ".sensitivity"
