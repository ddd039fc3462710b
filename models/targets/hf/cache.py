"""The decoding cache of a transformers target: transformers' own ``DynamicCache`` with the
bookkeeping the decoding loops read of a cache (``length``, ``crop``, left padding)."""

from __future__ import annotations

import torch


class HFDecodeCache:
    """``dynamic``: the ``DynamicCache`` the model fills; ``pad``: ``[B]`` left-padding per row
    (row ``b``'s position 0 is slot ``pad[b]``; its padding is masked out)."""

    def __init__(self, dynamic, batch: int, max_len: int, *, pad: torch.Tensor | None, device):
        self.dynamic = dynamic
        self.batch = batch
        self.max_len = max_len
        self.length = 0
        self.pad = None if pad is None else pad.to(device=device, dtype=torch.long)
        if self.pad is not None and (self.pad.shape != (batch,) or int(self.pad.max()) >= max_len):
            raise ValueError(f"cache: pad must be [B={batch}] with entries < max_len {max_len}")
        self.device = device

    def check_room(self, num_new: int) -> int:
        end = self.length + num_new
        if end > self.max_len:
            raise ValueError(f"cache: {end} slots needed, the cache holds {self.max_len}")
        return end

    def positions(self, num_new: int) -> torch.Tensor:
        """``[B, T]`` positions of the next slots: the slot less the row's padding."""
        slots = torch.arange(self.length, self.length + num_new, device=self.device).expand(self.batch, num_new)
        return slots if self.pad is None else (slots - self.pad[:, None]).clamp(min=0)

    def attention_mask(self, num_new: int) -> torch.Tensor:
        """``[B, length + T]`` 2D mask (1: a real token), from which transformers builds its own."""
        slots = torch.arange(self.length + num_new, device=self.device)
        return (slots[None, :] >= self.pad[:, None]).long()

    def advance(self, num_new: int) -> None:
        self.length += num_new

    def crop(self, length: int) -> None:
        """Forget every slot from ``length`` on (rejected draft tokens)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cache.crop: {length} is outside 0 .. {self.length}")
        if length < self.length:
            # a negative count removes that many slots in every transformers version
            self.dynamic.crop(length - self.length)
        self.length = length
