"""On CUDA: the target's capture of packed rows through flex attention with the causal document
BlockMask built from per-tile document starts (no dense [S, S] mask): its tile tables equal
create_block_mask's, each packed document's features equal those of the document alone (bf16),
and the graphed capture replays the same features for new document ids. Skipped without CUDA."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from models.common.causal_documents import build_causal_document_mask, causal_document_mask_mod
from models.targets.qwen3 import Qwen3Model, qwen3_flavors
from titan_draft.features.graphed_capture import GraphedCapture
from titan_draft.protocols.features import document_spans

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SEQ = 512
ARGS = replace(qwen3_flavors["debugmodel"], vocab_size=1024, tie_word_embeddings=False)


def _doc_ids(lengths_per_row: list[list[int]]) -> torch.Tensor:
    rows = []
    for lengths in lengths_per_row:
        ids = [d for d, n in enumerate(lengths) for _ in range(n)]
        rows.append(ids + [len(lengths)] * (SEQ - len(ids)))
    return torch.tensor(rows, dtype=torch.int32, device="cuda")


LENGTHS = [[100, 37, 200, 60], [511], [5, 130, 128, 129, 3]]


def test_block_mask_equals_create_block_mask():
    doc = _doc_ids(LENGTHS)
    starts, _ = document_spans(doc, torch.full((3,), SEQ, device="cuda"), SEQ)
    ours = build_causal_document_mask(starts)
    ref = create_block_mask(causal_document_mask_mod(starts), 3, None, SEQ, SEQ, device="cuda")
    assert torch.equal(ours.to_dense(), ref.to_dense())
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name


def test_packed_capture_equals_each_document_alone():
    torch.manual_seed(0)
    model = Qwen3Model(ARGS).to("cuda", torch.bfloat16)
    model.init_weights(0)
    doc = _doc_ids(LENGTHS)
    ids = torch.randint(1, ARGS.vocab_size, (3, SEQ), device="cuda")
    aux, last = model.capture(ids, [0, 2], True, document_ids=doc)
    graphed = GraphedCapture(model)
    g_aux, g_last = graphed.capture(ids, [0, 2], True, document_ids=doc)
    assert torch.equal(g_aux, aux) and torch.equal(g_last, last)
    for r, lengths in enumerate(LENGTHS):
        at = 0
        for n in lengths:
            alone_aux, alone_last = model.capture(ids[r: r + 1, at: at + n], [0, 2], True)
            torch.testing.assert_close(aux[r, at: at + n], alone_aux[0], rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(last[r, at: at + n], alone_last[0], rtol=2e-2, atol=2e-2)
            at += n
    # a replay with other document ids follows them (the ids are a graph input)
    other = _doc_ids([[256, 256], [300, 211], [511]])
    g_aux2, _ = graphed.capture(ids, [0, 2], True, document_ids=other)
    e_aux2, _ = model.capture(ids, [0, 2], True, document_ids=other)
    assert torch.equal(g_aux2, e_aux2)
