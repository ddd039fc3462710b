"""A key/value cache whose every call has the same shapes, so a decode step can be a CUDA graph.

:class:`~models.targets.qwen3.cache.KVCache` slices its tensors at the host's ``length``: each step has
new shapes and Python decides them, which is fine on a CPU and costs a kernel launch per op on a
GPU. Here the filled length also lives on the device (``_len``): new keys go in with
``index_copy_`` at device-computed slots and attention always spans all ``max_len`` slots under a
mask built from ``_len``, so one captured graph replays at any length. Slots past the length hold
stale keys (of cropped drafts, or of a graph's warm-up); the mask gives them zero weight.

The host keeps its own ``length`` (every advance and crop is decided there), the value the
device's counter holds after the queued work has run.
"""

from __future__ import annotations

import torch

from models.targets.qwen3.cache import KVCache


class StaticKVCache(KVCache):
    """:class:`KVCache` with fixed-shape calls (module docstring); same arguments and layout."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._len = torch.zeros((), dtype=torch.long, device=self.k.device)
        self._slots = torch.arange(self.max_len, device=self.k.device)

    def positions(self, num_new: int) -> torch.Tensor:
        return self._slot_positions(self._len + self._slots[:num_new])

    def attn_mask(self, num_new: int) -> torch.Tensor:
        """Boolean ``[B, 1, T, max_len]`` mask of the next ``num_new`` queries (always a mask:
        the unfilled slots must be hidden)."""
        return self._slot_mask(self._len + self._slots[:num_new], self._slots)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.check_room(k.shape[2])
        slots = self._len + self._slots[: k.shape[2]]
        self.k[layer].index_copy_(2, slots, k)
        self.v[layer].index_copy_(2, slots, v)
        return self.k[layer], self.v[layer]

    def advance(self, num_new: int) -> None:
        self.length += num_new
        self._len += num_new

    def crop(self, length: int) -> None:
        super().crop(length)
        self._len.fill_(length)

    def set_length(self, length: int) -> None:
        """Host and device length to ``length`` (also forward: after a graph's warm-up runs)."""
        if not 0 <= length <= self.max_len:
            raise ValueError(f"KVCache.set_length: {length} is outside 0 .. {self.max_len}")
        self.length = length
        self._len.fill_(length)

    def note_replayed(self, num_new: int) -> None:
        """A replayed graph advanced the device counter by ``num_new``; follow it on the host."""
        self.length += num_new
