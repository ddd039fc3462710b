"""The eval CLI's --proposer-option: parsed to keyword arguments, refused in one line."""

from __future__ import annotations

import pytest

import titan_draft.protocols.discovery  # noqa: F401  (registers the drafts)
from titan_draft.eval import build_proposer, check_proposer_options, parse_proposer_options
from titan_draft.protocols.model_spec import get_model_spec


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



@pytest.mark.parametrize("draft,item,names", [
    ("dspark", "graph_commit=False", "bool or null"),  # not JSON: the text 'False', which bool() reads as true
    ("dflash2", "graph_commit=1", "bool or null"),
    ("eagle3", "graphs=yes", "bool or null"),
    ("eagle3", "num_draft_tokens=3.5", "int or null"),
    ("eagle3", "num_draft_tokens=true", "int or null"),
    ("dspark", 'confidence_threshold="0.3"', "float"),
])
def test_a_value_of_the_wrong_type_is_refused(draft, item, names):
    spec = get_model_spec(draft)
    options = parse_proposer_options([item])
    key = item.partition("=")[0]
    with pytest.raises(ValueError, match=rf"--proposer-option {key}=.*: draft '{draft}' takes {names} there"):
        check_proposer_options(spec, options)
    with pytest.raises(ValueError, match=rf"takes {names} there"):
        build_proposer(spec, None, options)  # refused before the proposer is built


@pytest.mark.parametrize("draft,items", [
    ("dspark", ["graph_commit=false", "confidence_threshold=0", "decode_as=sglang"]),
    ("dspark", ["confidence_threshold=0.25", "graphs=null"]),
    ("eagle3", ["num_draft_tokens=3", "graphs=false"]),
    ("dflash2", ["graph_commit=true"]),
])
def test_values_of_the_annotated_types_pass(draft, items):
    check_proposer_options(get_model_spec(draft), parse_proposer_options(items))
