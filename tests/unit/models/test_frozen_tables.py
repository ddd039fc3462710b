"""models/common/tensor_utils.register_frozen_tables: the target's tables as a draft's buffers."""

from __future__ import annotations

import pytest
import torch

from models.common.tensor_utils import register_frozen_tables


def test_frozen_tables_are_unsaved_copies_in_their_dtype():
    m = torch.nn.Linear(4, 3)
    embed = torch.randn(10, 4, dtype=torch.bfloat16)
    head = torch.randn(10, 4, dtype=torch.float64)
    register_frozen_tables(m, embed, head, (10, 4), m.weight)
    assert torch.equal(m.target_embed, embed) and m.target_embed.dtype == torch.bfloat16
    assert torch.equal(m.target_lm_head, head) and m.target_lm_head.dtype == torch.float64
    embed.zero_()  # a copy: the caller's tensor changing does not reach the draft
    assert m.target_embed.abs().sum() > 0
    assert "target_embed" not in m.state_dict() and "target_lm_head" not in m.state_dict()


@pytest.mark.parametrize("which", ["embed", "lm_head"])
def test_frozen_tables_name_the_wrong_shape(which):
    m = torch.nn.Linear(4, 3)
    good, bad = torch.zeros(10, 4), torch.zeros(10, 5)
    embed, head = (bad, good) if which == "embed" else (good, bad)
    with pytest.raises(ValueError, match=rf"target {which} weight has shape \(10, 5\), draft expects \(10, 4\)"):
        register_frozen_tables(m, embed, head, (10, 4), m.weight)
    assert not hasattr(m, "target_embed")
