"""The eval CLI's --proposer-option: parsed to keyword arguments, refused in one line."""

from __future__ import annotations

import pytest

from titan_draft.eval import build_proposer, parse_proposer_options


def test_parse_values_as_json_or_text():
    assert parse_proposer_options(["confidence_threshold=0.5", "mode=fast", "n=3", "on=true"]) == {
        "confidence_threshold": 0.5, "mode": "fast", "n": 3, "on": True}
    assert parse_proposer_options([]) == {}
    for bad in ("confidence_threshold", "=3", "a-b=1"):
        with pytest.raises(ValueError, match="is not KEY=VALUE"):
            parse_proposer_options([bad])


def test_an_option_the_proposer_lacks_is_named():
    class Spec:
        name = "toy"

        @staticmethod
        def build_proposer_fn(draft, max_len=0):
            return ("proposer", draft, max_len)

    assert build_proposer(Spec, "d", {}) == ("proposer", "d", 0)
    assert build_proposer(Spec, "d", {"max_len": 4}) == ("proposer", "d", 4)
    with pytest.raises(ValueError, match=r"draft 'toy' does not take \['confidence_threshold'\]"):
        build_proposer(Spec, "d", {"confidence_threshold": 0.5})

