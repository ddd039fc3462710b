"""Each proposer says how it decodes, its defaults resolved: the eval's report records it, so two
reports of one draft say whether they decoded it the same way."""

from __future__ import annotations

from models.dflash2.proposal import DFlashProposer
from models.dspark import DSparkProposer
from models.eagle3 import Eagle3Proposer
from tests.unit.decoding.test_proposals_graph_safe import dspark_draft, eagle3_draft
from tests.unit.decoding.test_sampled_proposals_graph_safe import _dflash2_draft


def test_settings_resolve_the_defaults_and_follow_the_options():
    e = eagle3_draft()
    assert Eagle3Proposer(e).settings == {"num_draft_tokens": e.args.ttt_steps}
    assert Eagle3Proposer(e, num_draft_tokens=3).settings == {"num_draft_tokens": 3}

    d = dspark_draft("rnn")
    assert DSparkProposer(d).settings == {"decode_as": "sglang", "confidence_threshold": 0.0,
                                          "num_draft_tokens": d.args.block_size}
    assert DSparkProposer(d, confidence_threshold=0.25).settings["confidence_threshold"] == 0.25

    f = _dflash2_draft()
    assert DFlashProposer(f).settings == {"outside_candidates": True}  # the default with a selector
    assert DFlashProposer(f, outside_candidates=False).settings == {"outside_candidates": False}
