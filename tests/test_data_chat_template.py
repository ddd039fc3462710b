"""Qwen ChatML rendering and the assistant loss mask."""

import pytest

from titan_draft.data.chat_template import render_chat
from titan_draft.data.tokenizer import build_tokenizer

IM_START, IM_END, NL = 151644, 151645, 198


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("qwen3")


def _expected(turns, tok):
    """Ids and mask built piece by piece. Special tokens split pre-tokenization and the role
    header ends in "\\n", which the pre-tokenizer splits from text that starts with a non-space,
    so encoding the pieces separately must give the joint encoding's ids."""
    ids, mask = [], []
    for role, text in turns:
        is_asst = role == "assistant"
        for piece, m in (
            ("<|im_start|>", False),
            (f"{role}\n", False),
            (text, is_asst),
            ("<|im_end|>", is_asst),
            ("\n", False),
        ):
            piece_ids = tok.encode(piece)
            ids += piece_ids
            mask += [m] * len(piece_ids)
    return ids, mask


def test_literal_two_turns(tok):
    ids, mask = render_chat([("user", "Hi"), ("assistant", "Hello!")], tok)
    assert ids == [IM_START, 872, NL, 13048, IM_END, NL, IM_START, 77091, NL, 9707, 0, IM_END, NL]
    assert mask == [False] * 9 + [True, True, True, False]


def test_multi_turn_ids_and_mask(tok):
    turns = [
        ("system", "You are a helpful assistant."),
        ("user", "What is 2+2?"),
        ("assistant", "2+2 equals 4."),
        ("user", "And 3+3? Answer in one word, please."),
        ("assistant", "Six. 日本語 works too 😀!"),
    ]
    ids, mask = render_chat(turns, tok)
    exp_ids, exp_mask = _expected(turns, tok)
    rendered = "".join(f"<|im_start|>{r}\n{t}<|im_end|>\n" for r, t in turns)
    assert tok.encode(rendered) == exp_ids  # the premise of the piecewise construction
    assert ids == exp_ids
    assert mask == exp_mask
    assert ids[:3] == [IM_START, 8948, NL]
    assert ids.count(IM_START) == 5 and ids.count(IM_END) == 5
    # Exactly the two assistant texts plus their <|im_end|> are trained on.
    n_asst = len(tok.encode("2+2 equals 4.")) + len(tok.encode("Six. 日本語 works too 😀!")) + 2
    assert sum(mask) == n_asst
    trained = [i for i, m in zip(ids, mask) if m]
    assert tok.decode(trained) == "2+2 equals 4.<|im_end|>Six. 日本語 works too 😀!<|im_end|>"


def test_system_prompt(tok):
    turns = [("user", "Hi"), ("assistant", "Hello!")]
    ids, mask = render_chat(turns, tok, system_prompt="Be brief.")
    exp_ids, exp_mask = _expected([("system", "Be brief."), *turns], tok)
    assert (ids, mask) == (exp_ids, exp_mask)
    # A conversation with its own system turn keeps it and gets no second one.
    own = [("system", "Own."), *turns]
    assert render_chat(own, tok, system_prompt="Be brief.") == _expected(own, tok)
    assert render_chat(turns, tok, system_prompt="") == _expected(turns, tok)


def test_leading_newlines_merge_into_header(tok):
    # "\n" + "\n\n" pre-tokenize as one token that starts in the header: not trained on.
    ids, mask = render_chat([("user", "Hi"), ("assistant", "\n\nGood.")], tok)
    header_end = ids.index(77091) + 1
    assert ids[header_end] == tok.encode("\n\n\n")[0]
    assert mask[header_end] is False
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "Good.<|im_end|>"


def test_unknown_template_and_role(tok):
    with pytest.raises(ValueError, match="unknown chat template 'llama3'"):
        render_chat([("user", "Hi"), ("assistant", "Yo")], tok, template="llama3")
    with pytest.raises(ValueError, match="unknown chat role"):
        render_chat([("tool", "Hi"), ("assistant", "Yo")], tok)
