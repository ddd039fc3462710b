"""Feature storage: float8 e4m3 with a per-token scale against an independent float64 rounding,
its round-trip error, and bfloat16 / float8 caches against the online target's features."""

from __future__ import annotations

import pytest
import torch

from offline_cache import Paths, job_argv, prepare_cache
from titan_draft.data.feature_shards import dequantize, quantize


def _e4m3_reference(x: torch.Tensor) -> torch.Tensor:
    """x [T, H] through a per-token-scaled e4m3 round trip, computed in float64 from the format's
    definition: 3 mantissa bits, exponents down to -6 (below: subnormal steps of 2^-9), round half
    to even, largest value 448."""
    x = x.double()
    amax = x.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax.float().double() / 448, torch.ones_like(amax))
    v = x / scale
    exp = torch.floor(torch.log2(v.abs().clamp(min=2.0**-30))).clamp(min=-6)
    step = 2.0 ** (exp - 3)
    q = (torch.round(v / step) * step).clamp(-448, 448)
    return q * scale


def test_float8_matches_the_float64_definition():
    g = torch.Generator().manual_seed(0)
    # hidden-state-like rows: a heavy-tailed bulk, a few outlier channels, an all-zero row
    x = torch.randn(64, 256, generator=g) * torch.rand(64, 1, generator=g) * 10
    x[:, :3] *= 50
    x[5] = 0
    stored = quantize(x, "float8_e4m3")
    assert stored[""].dtype == torch.float8_e4m3fn and stored[".scale"].shape == (64,)
    # each token's largest value lands on e4m3's largest
    assert torch.equal(stored[""].float().abs().amax(-1)[x.abs().amax(-1) > 0], torch.full((63,), 448.0))
    back = dequantize(stored[""], stored[".scale"][:, None], torch.float32)
    ref = _e4m3_reference(x)
    torch.testing.assert_close(back.double(), ref, rtol=2e-7, atol=0)
    assert not back[5].any()
    # the round-trip error: at most half a step of 2^-3 relative (1/16) on normal values, and
    # half a subnormal step (2^-10 of the scale) below 2^-6 of it
    scale = stored[".scale"][:, None].double()
    bound = torch.maximum(x.double().abs() / 16, scale * 2.0**-10)
    assert ((back.double() - x.double()).abs() <= bound * (1 + 1e-6)).all()
    rel = (back - x).norm() / x.norm()
    assert 0.005 < rel < 0.05, rel  # what one token of a cache loses, as a whole


def test_dequantize_several_layers():
    g = torch.Generator().manual_seed(1)
    layers = [torch.randn(10, 32, generator=g) * (i + 1) for i in range(3)]
    parts = [quantize(x, "float8_e4m3") for x in layers]
    values = torch.cat([p[""] for p in parts], -1)  # [T, K*H], as the collate lays the layers out
    scales = torch.stack([p[".scale"] for p in parts], -1)  # [T, K]
    out = dequantize(values, scales, torch.float32)
    for i, p in enumerate(parts):
        assert torch.equal(out[:, i * 32:(i + 1) * 32], dequantize(p[""], p[".scale"][:, None], torch.float32))


@pytest.mark.parametrize("storage", ["bfloat16", "float8_e4m3"])
def test_cache_holds_the_online_features_in_storage(storage, tmp_path, random_target_dir, chat_jsonl):
    argv = job_argv("eagle3", tmp_path / "dump", random_target_dir, chat_jsonl)  # aux and last hidden
    prepare_cache(tmp_path / "cache", argv, "--storage", storage, "--shard-mb", "0.05")
    paths = Paths(argv)
    k = len(paths.layer_ids)
    for i, ((_, on), batch) in enumerate(zip(paths.online(), paths.offline(str(tmp_path / "cache")))):
        off = paths.features(batch)
        valid = torch.arange(on.input_ids.shape[1])[None, :] < on.valid_lengths[:, None]
        assert torch.equal(on.input_ids, off.input_ids) and off.aux_hidden.dtype == torch.float32
        for name, n in (("aux_hidden", k), ("last_hidden", 1)):
            want, got = getattr(on, name)[valid], getattr(off, name)[valid]
            if storage == "bfloat16":  # what a bf16 GPU target computes and hands over
                assert torch.equal(got, want.to(torch.bfloat16).float())
            else:
                per_layer = want.unflatten(-1, (n, -1))
                ref = torch.stack([_e4m3_reference(per_layer[:, j]) for j in range(n)], 1).flatten(1)
                torch.testing.assert_close(got.double(), ref, rtol=2e-7, atol=0)
        if i == 3:
            break
