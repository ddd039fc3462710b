"""Feature storage: float8 e4m3 with a per-token scale against an independent float64 rounding,
its round-trip error, and bfloat16 / float8 caches against the online target's features."""

from __future__ import annotations

import pytest
import torch

from helpers import Paths, job_argv, prepare_cache
from titan_draft.data.features.shards import dequantize, quantize, row_features, to_storage, write_shard


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


@pytest.mark.parametrize("storage", ["bfloat16", "float32", "float8_e4m3"])
def test_a_batch_stored_at_once_equals_each_row_and_layer_stored_alone(storage):
    """prepare_features puts a whole batch [B, L, K*H] in storage form on the device; a shard must
    hold what quantizing each row's [n, H] per layer would give, whatever the other rows hold."""
    g = torch.Generator().manual_seed(2)
    k, h, lengths, layer_ids = 3, 16, [7, 4], [1, 5, 9]
    aux = torch.randn(2, 7, k * h, generator=g) * torch.rand(2, 7, k * h, generator=g) * 30
    last = torch.randn(2, 7, h, generator=g)
    aux[1, 4:] = 1e4  # padding with outliers must not touch a real token's scale
    batch = to_storage(aux, last, k, storage)
    for i, n in enumerate(lengths):
        row = row_features(batch, i, n, layer_ids)
        want = {}
        for j, lid in enumerate(layer_ids):
            want.update({f"hidden.{lid}{s}": t for s, t in quantize(aux[i, :n, j * h:(j + 1) * h], storage).items()})
        want.update({f"last_hidden{s}": t for s, t in quantize(last[i, :n], storage).items()})
        assert sorted(row) == sorted(want)
        for name, t in row.items():
            assert t.dtype == want[name].dtype and t.is_contiguous()
            assert torch.equal(t.view(torch.uint8), want[name].view(torch.uint8)), name


def test_a_shard_refuses_features_not_in_its_storage(tmp_path):
    rows = dict(input_ids=[[1, 2]], loss_mask=[[True, True]], row_ids=[0])
    with pytest.raises(ValueError, match=r"write_shard: hidden.3 is torch.float32, a bfloat16 shard stores torch.bfloat16"):
        write_shard(str(tmp_path / "s"), features={"hidden.3": [torch.zeros(2, 4)]}, storage="bfloat16", **rows)
    with pytest.raises(ValueError, match=r"write_shard: hidden.3 has no hidden.3.scale"):
        write_shard(str(tmp_path / "s"), features={"hidden.3": [torch.zeros(2, 4).to(torch.float8_e4m3fn)]},
                    storage="float8_e4m3", **rows)
    assert not list(tmp_path.iterdir())


def _batch_and_reference(device):
    """A [2, 32, 4*64] batch quantized on ``device``, dequantized on the host, and its float64 reference."""
    g = torch.Generator().manual_seed(3)
    aux = torch.randn(2, 32, 4 * 64, generator=g) * torch.rand(2, 32, 1, generator=g) * 20
    stored = to_storage(aux.to(device), None, 4, "float8_e4m3")
    back = dequantize(stored["aux"].flatten(-2).cpu(), stored["aux.scale"].cpu(), torch.float32)
    per_layer = aux.unflatten(-1, (4, -1))
    ref = torch.stack([_e4m3_reference(per_layer[..., j, :].flatten(0, 1)) for j in range(4)], 1)
    return stored, back, ref.flatten(1).view(aux.shape)


def test_a_batch_in_float8_matches_the_float64_definition():
    _, back, ref = _batch_and_reference("cpu")
    torch.testing.assert_close(back.double(), ref, rtol=2e-7, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="quantizing on the device needs a GPU")
def test_float8_on_the_device_is_the_hosts():
    """prepare_features quantizes on the GPU: a cache must be the same wherever it was quantized."""
    stored, back, ref = _batch_and_reference("cuda")
    on_host, _, _ = _batch_and_reference("cpu")
    for name, t in on_host.items():
        assert torch.equal(stored[name].cpu().view(torch.uint8), t.view(torch.uint8)), name
    torch.testing.assert_close(back.double(), ref, rtol=2e-7, atol=0)
