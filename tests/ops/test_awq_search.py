"""The AWQ chunk coder (`_int4_expert_chunk`: a chunk of experts searched and coded as one batch) gives,
byte for byte, what searching and coding each expert alone gives: the same alpha, the same errors and
the same packed tensors. The one-at-a-time reference below is the search as llm-compressor's
`_compute_best_scale` runs it (one alpha, one RTN, one error at a time; the first lowest error wins)."""

from __future__ import annotations

import pytest
import torch

from qtool.formats import awq
from qtool.ops.quantize.awq_search import awq_down_scales, rtn
from qtool.ops.quantize.calib import ExpertStats
from qtool.ops.quantize.layer import _int4_expert_chunk
from qtool.recipes import OutFormat, load_recipe


def _one_expert_search(x, w, group, grid, sdt):
    """(s, alpha index, best err, rtn err) of one expert, alpha by alpha."""
    if x.numel() == 0:
        return torch.ones(w.shape[-1]), 0, 0.0, 0.0
    xf, wf = x.float(), w.float()
    ref = xf @ wf.t()
    x_mean = xf.abs().mean(dim=0)
    scales, errs = [], []
    for i in range(grid):
        s = x_mean.pow(i / grid).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        wq = rtn((wf * s).to(w.dtype), group, sdt).dequantize(torch.float32)
        scales.append(s)
        errs.append(float(((xf / s) @ wq.t() - ref).pow(2).mean()))
    best = min(range(grid), key=lambda i: (errs[i], i))
    return scales[best], best, errs[best], errs[0]


def _one_expert_tensors(gate, up, dn, x, group, grid, sdt, fmt, search=True):
    found = None
    if search:
        found = _one_expert_search(x, dn, group, grid, sdt)
        s = found[0]
        dn = (dn.float() * s).to(dn.dtype)
        up = (up.float() / s.unsqueeze(-1)).to(up.dtype)
    out = {}
    for part, w in (("down_proj", dn), ("gate_proj", gate), ("up_proj", up)):
        q = rtn(w, group, sdt)
        t = awq.to_compressed_tensors(q, sdt) if fmt is OutFormat.COMPRESSED_TENSORS else awq.to_awq(q)
        out[part] = list(t.values())[:3]
    return out, found


def _chunk(k=6, hidden=64, inter=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    gu = (torch.randn(k, 2 * inter, hidden, generator=g) * 0.05).to(torch.bfloat16)
    dn = (torch.randn(k, hidden, inter, generator=g) * 0.05).to(torch.bfloat16)
    # heavy-tailed activations (a few hot channels, as real down_proj inputs have) and one expert that
    # no token reached
    hot = torch.ones(inter)
    hot[torch.randperm(inter, generator=g)[:3]] = 20.0
    rows = [(torch.randn(n, inter, generator=g) * hot).to(torch.bfloat16).float() for n in (40, 7, 0, 1, 90, 33)[:k]]
    return gu, dn, rows


@pytest.mark.parametrize("fmt", [OutFormat.COMPRESSED_TENSORS, OutFormat.AWQ])
@pytest.mark.parametrize("batch", ["whole", "by 3"])
@pytest.mark.parametrize("inter,group", [(32, 32), (56, 8)])
def test_the_chunk_coder_gives_each_experts_own_bytes_and_alpha(fmt, batch, inter, group, monkeypatch):
    """`by 3`: the candidates' memory bound splits the alphas (and the experts' final coding) into batches
    of 3, as a 397B expert's are split in 7s. inter 56: not a multiple of the CPU's SIMD width, where
    torch's pow of a [k, I] tensor is not each row's own (the search takes it row by row)."""
    from qtool.ops.quantize import awq_search

    if batch == "by 3":
        monkeypatch.setattr(awq_search, "CANDIDATE_BYTES", 3 * 64 * inter * 4)
    recipe = load_recipe("qwen35-awq-int4")
    gu, dn, rows = _chunk(inter=inter)
    inter = dn.shape[-1]
    sdt = torch.float16 if fmt is OutFormat.AWQ else torch.bfloat16
    stats = ExpertStats(10 + len(rows), keep_rows=128)  # the chunk: experts 10-15 of the layer
    stats.mid_rows[10:] = [[r] if r.numel() else [] for r in rows]
    stats.tokens[10:] = torch.tensor([r.shape[0] for r in rows])  # (an expert below the token floor is RTN)
    report: list = []
    got = _int4_expert_chunk(gu, dn, inter, stats, 10, recipe, fmt, report, group)
    assert [r["expert"] for r in report] == [10 + k for k in range(len(rows))]
    alphas = set()
    for k, x in enumerate(rows):
        want, (_, best, best_err, rtn_err) = _one_expert_tensors(
            gu[k, :inter], gu[k, inter:], dn[k], x, group, recipe.int4.awq_grid, sdt, fmt
        )
        assert report[k]["alpha"] == best / recipe.int4.awq_grid
        assert report[k]["down_mse"] == best_err and report[k]["down_mse_rtn"] == rtn_err
        for part, tensors in want.items():
            for a, b in zip(got[part][k], tensors, strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (k, part)
        alphas.add(best)
    assert len(alphas) > 1  # the experts chose different alphas: the test sees the selection


def test_plain_rtn_chunk_is_each_experts_rtn():
    recipe = load_recipe("qwen35-awq-int4")
    gu, dn, _ = _chunk(k=5, seed=1)
    inter = dn.shape[-1]
    got = _int4_expert_chunk(gu, dn, inter, None, 0, recipe, OutFormat.COMPRESSED_TENSORS, [], 32)
    for k in range(5):
        want, _ = _one_expert_tensors(
            gu[k, :inter], gu[k, inter:], dn[k], None, 32, 0, torch.bfloat16, OutFormat.COMPRESSED_TENSORS, search=False
        )
        for part, tensors in want.items():
            assert all(torch.equal(a, b) for a, b in zip(got[part][k], tensors, strict=True)), (k, part)


def test_nan_errors_fall_back_to_rtn_not_a_crash():
    """An expert whose rows hold a NaN: every alpha's error is NaN, so none wins and the expert gets
    plain RTN (s = 1); its neighbours are searched as usual."""
    gu, dn, rows = _chunk(k=2, seed=2)
    rows[0] = rows[0].clone()
    rows[0][0, 0] = float("nan")
    found = awq_down_scales(rows, dn, 32, 20)
    assert found.best.tolist()[0] == 0 and torch.equal(found.s[0], torch.ones(dn.shape[-1]))
    assert found.best_err.isnan().tolist()[0]
    rep = found.report(0)
    assert rep[0]["down_mse"] is None and rep[0]["down_mse_rtn"] is None  # the manifest stays JSON
    assert rep[1]["down_mse"] is not None
    _, best, _, _ = _one_expert_search(rows[1], dn[1], 32, 20, torch.bfloat16)
    assert found.best.tolist()[1] == best
