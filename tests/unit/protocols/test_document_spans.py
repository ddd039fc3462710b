"""Packed rows' document spans and positions, against a per-position Python reference."""

import torch

from titan_draft.protocols.features import document_spans, position_ids


def _reference(ids: list[int], valid: int):
    """Walk the row: each document's first position, one past its last real token, offset."""
    starts, ends, pos = [], [], []
    for p, d in enumerate(ids):
        s = p
        while s > 0 and ids[s - 1] == d:
            s -= 1
        e = p
        while e + 1 < len(ids) and ids[e + 1] == d:
            e += 1
        starts.append(s)
        ends.append(max(s, min(e + 1, valid)))
        pos.append(p - s)
    return starts, ends, pos


def test_spans_and_positions_match_reference():
    g = torch.Generator().manual_seed(0)
    seq = 37
    rows, valid = [], []
    for _ in range(6):
        lengths = torch.randint(1, 12, (8,), generator=g).tolist()
        ids, d = [], 0
        for n in lengths:
            if len(ids) + n > seq:
                break
            ids += [d] * n
            d += 1
        valid.append(len(ids))
        ids += [d] * (seq - len(ids))  # the padding tail: one id more than the last document
        rows.append(ids)
    t = torch.tensor(rows, dtype=torch.int32)
    vl = torch.tensor(valid)
    starts, ends = document_spans(t, vl, seq)
    pos = position_ids(t, seq, "cpu")
    for r, ids in enumerate(rows):
        s, e, p = _reference(ids, valid[r])
        assert starts[r].tolist() == s
        assert ends[r].tolist() == e
        assert pos[r].tolist() == p
        # padding positions are not real tokens, every document position before valid is
        real = (torch.arange(seq) < ends[r]).tolist()
        assert real == [i < valid[r] for i in range(seq)]


def test_unpacked_rows_are_one_document():
    vl = torch.tensor([3, 5])
    starts, ends = document_spans(None, vl, 6)
    assert starts.eq(0).all()
    assert ends.tolist() == [[3] * 6, [5] * 6]
    assert position_ids(None, 6, "cpu").tolist() == [list(range(6))]
