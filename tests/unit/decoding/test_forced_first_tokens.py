"""forced_first_tokens pairs the draft's first token after every decoded prefix with the target's
distribution of the next decoded token: checked in float64 against the closed form of a target and
a draft whose distributions depend on the last token only, with the draft seeing exactly the
prefix a speculative round would have committed there."""

from __future__ import annotations

import pytest
import torch

from tests.unit.decoding.test_speculative_sampling import TABLE, V, MarkovTarget
from titan_draft.decoding.first_token import forced_first_tokens

T = 0.7
DRAFT_TABLE = torch.tensor([[0.0, 2.0, 1.0, 0.0],
                            [1.0, 1.0, 0.0, 0.5],
                            [0.0, 0.0, 2.0, 1.0],
                            [2.0, 0.0, 0.5, 0.0]], dtype=torch.float64)


class LastTokenDrafter:
    """Drafts 2 tokens; the first from softmax(DRAFT_TABLE[last] / T). Records what it had
    committed at each proposal."""

    capture_layers: list[int] = []
    needs_last_hidden = False
    num_draft_tokens = 2

    def __init__(self):
        self.committed: list[int] = []
        self.seen: list[tuple[list[int], int]] = []
        self.temperature = 0.0
        self.draft_probs = None

    def reset(self, max_len):
        self.committed = []

    def set_sampling(self, temperature, generator):
        self.temperature = temperature

    def commit(self, token_ids, aux, last_hidden):
        self.committed += token_ids.tolist()

    def propose(self, last_token):
        self.seen.append((list(self.committed), last_token))
        q = torch.softmax(DRAFT_TABLE[last_token] / self.temperature, dim=-1)
        self.draft_probs = torch.stack([q, q])
        return torch.tensor([int(q.argmax()), 0])


def test_each_decoded_token_is_read_against_the_draft_of_its_own_prefix():
    prompt, tokens = [1, 2], [3, 0, 0, 2, 1, 3]
    drafter = LastTokenDrafter()
    out = forced_first_tokens(MarkovTarget(), drafter, prompt, tokens, torch.device("cpu"), temperature=T)
    n = len(tokens) - 1
    assert len(out.accept) == len(out.argmax_match) == len(out.target_top1) == len(out.target_entropy) == n
    # the round after token j has committed the prompt and tokens[:j], and drafts after tokens[j]
    assert drafter.seen == [(prompt + tokens[:j], tokens[j]) for j in range(n)]
    assert drafter.committed == prompt + tokens[:-1]
    for j in range(n):
        p = torch.softmax(TABLE[tokens[j]] / T, dim=-1)  # the target's distribution of tokens[j + 1]
        q = torch.softmax(DRAFT_TABLE[tokens[j]] / T, dim=-1)
        assert out.accept[j] == pytest.approx(float(torch.minimum(p, q).sum()), abs=1e-12)
        assert out.argmax_match[j] == (int(p.argmax()) == int(q.argmax()))
        assert out.target_top1[j] == pytest.approx(float(p.max()), abs=1e-12)
        assert out.target_entropy[j] == pytest.approx(float(-(p * p.log()).sum()), abs=1e-12)
    # the rows differ: a reading one token off would not match
    assert len({round(a, 9) for a in out.accept}) > 1
    assert V == TABLE.shape[0]


def test_a_proposer_without_q_and_greedy_are_refused():
    class NoQ(LastTokenDrafter):
        def propose(self, last_token):
            super().propose(last_token)
            self.draft_probs = None
            return torch.tensor([0, 0])

    with pytest.raises(ValueError, match="NoQ handed over no draft distribution at T = 0.7"):
        forced_first_tokens(MarkovTarget(), NoQ(), [1], [2, 3], torch.device("cpu"), temperature=T)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        forced_first_tokens(MarkovTarget(), LastTokenDrafter(), [1], [2, 3], torch.device("cpu"), temperature=0)
