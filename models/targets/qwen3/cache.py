"""Key/value cache of a decoding target: prefill once, then extend by a few tokens per call.

The true-acceptance eval (one prompt, a verify pass of a whole draft block per round, rejected
tokens cropped away) and data regeneration (a batch of left-padded prompts, one token per step)
both decode through it, so it holds every layer's keys and values in one preallocated tensor and
only moves an integer ``length`` when tokens are added or cropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class KVCache:
    """Keys and values ``[layers, B, kv_heads, max_len, head_dim]`` of the first ``length`` slots.

    Rows may be left-padded: row ``b``'s tokens start at slot ``pad[b]``, its RoPE positions
    count from there (slot ``pad[b]`` is position 0) and no query ever sees its padding. A pad
    slot's query sees only itself, so it stays finite (a fully masked row would give NaN, and a
    NaN value under a masked key still poisons ``softmax @ V``).

    Args:
        num_layers, batch, max_len, kv_heads, head_dim: the preallocated shape.
        dtype, device: of the keys and values (the target's compute dtype).
        pad: ``[B]`` left-padding per row (None: no padding).
    """

    def __init__(self, num_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
                 *, dtype: torch.dtype, device: torch.device | str, pad: torch.Tensor | None = None):
        shape = (num_layers, batch, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0
        self.pad = None if pad is None else pad.to(device=device, dtype=torch.long)
        if self.pad is not None and (self.pad.shape != (batch,) or int(self.pad.max()) >= max_len):
            raise ValueError(f"KVCache: pad must be [B={batch}] with entries < max_len {max_len}")

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def positions(self, num_new: int) -> torch.Tensor:
        """``[B, T]`` RoPE positions of the next ``num_new`` slots."""
        return self._slot_positions(torch.arange(self.length, self.length + num_new, device=self.k.device))

    def attn_mask(self, num_new: int) -> torch.Tensor | None:
        """Boolean ``[B, 1, T, length + T]`` mask of the next ``num_new`` queries (None when one
        unpadded query may see every slot, the common decode step)."""
        if num_new == 1 and self.pad is None:
            return None
        total = self.length + num_new
        return self._slot_mask(torch.arange(self.length, total, device=self.k.device),
                               torch.arange(total, device=self.k.device))

    def _slot_positions(self, slots: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` positions of the query ``slots [T]``: the slot, less the row's left padding."""
        pos = slots.expand(self.batch, slots.shape[0])
        if self.pad is not None:
            pos = (pos - self.pad[:, None]).clamp(min=0)
        return pos

    def _slot_mask(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """``[B, 1, T, S]`` mask of query slots ``q [T]`` over key slots ``kv [S]``: causal over
        absolute slots, a row's padding hidden (each query still sees its own slot)."""
        mask = (kv[None, :] <= q[:, None])[None, None]
        if self.pad is not None:
            real = kv[None, :] >= self.pad[:, None]  # [B, S]
            mask = (mask & real[:, None, None, :]) | (kv[None, :] == q[:, None])[None, None]
        return mask.expand(self.batch, 1, q.shape[0], kv.shape[0])

    def check_room(self, num_new: int) -> int:
        """The length after ``num_new`` more slots; raises when the cache cannot hold them."""
        end = self.length + num_new
        if end > self.max_len:
            raise ValueError(f"KVCache: {end} slots needed, the cache holds {self.max_len}")
        return end

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k, v [B, kv_heads, T, head_dim]`` into slots ``length .. length + T - 1`` of
        ``layer``; returns that layer's keys and values of all ``length + T`` slots."""
        end = self.check_room(k.shape[2])
        self.k[layer, :, :, self.length:end] = k
        self.v[layer, :, :, self.length:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, num_new: int) -> None:
        """Count ``num_new`` written slots (after every layer has written them)."""
        self.length += num_new

    def crop(self, length: int) -> None:
        """Forget every slot from ``length`` on (rejected draft tokens)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"KVCache.crop: {length} is outside 0 .. {self.length}")
        self.length = length


@dataclass
class LayerCache:
    """One layer's view of a :class:`KVCache` (what an attention module receives)."""

    cache: KVCache
    layer: int
    mask: torch.Tensor | None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.update(self.layer, k, v)


@dataclass
class DecodeStep:
    """What a target returns for the tokens of one cached forward."""

    logits: torch.Tensor | None
    """``[B, T', V]`` next-token logits in fp32 (T' = T for ``logits='all'``, 1 for ``'last'``)."""
    aux: torch.Tensor | None
    """``[B, T, K*H]`` capture-layer outputs of the new tokens (None without ``layer_ids``)."""
    last_hidden: torch.Tensor | None
    """``[B, T, H]`` final-norm hidden states of the new tokens (when asked for)."""
