"""The target's capture of packed rows: every document is captured as if it were alone (RoPE
positions restart, attention stays inside it), in float64 against one document per row; and the
flex tile tables of the causal document mask equal the mask evaluated position by position."""

from __future__ import annotations

from dataclasses import replace

import torch

from models.common.attention import dense_mask_from_mask_mod
from models.common.causal_documents import causal_document_mask_mod, causal_document_tiles
from models.targets.qwen3 import Qwen3Model, qwen3_flavors
from titan_draft.protocols.features import document_spans

ARGS = replace(qwen3_flavors["debugmodel"], vocab_size=97, hidden_size=32, intermediate_size=48, head_dim=8,
               num_hidden_layers=3, tie_word_embeddings=False)


def _packed(lengths: list[int], seq: int, seed: int = 0):
    """Documents of ``lengths`` back to back in one row of ``seq``, then the padding tail."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(1, ARGS.vocab_size, (n,), generator=g) for n in lengths]
    ids = torch.zeros(1, seq, dtype=torch.long)
    doc_ids = torch.full((1, seq), len(lengths), dtype=torch.int32)
    at = 0
    for d, t in enumerate(docs):
        ids[0, at: at + len(t)] = t
        doc_ids[0, at: at + len(t)] = d
        at += len(t)
    return docs, ids, doc_ids


def test_packed_capture_equals_each_document_alone():
    model = Qwen3Model(ARGS).double()
    model.init_weights(0)
    lengths, seq = [7, 12, 5], 32
    docs, ids, doc_ids = _packed(lengths, seq)
    aux, last = model.capture(ids, [0, 2], True, document_ids=doc_ids)
    at = 0
    for t in docs:
        alone_aux, alone_last = model.capture(t[None], [0, 2], True)
        torch.testing.assert_close(aux[0, at: at + len(t)], alone_aux[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(last[0, at: at + len(t)], alone_last[0], rtol=1e-12, atol=1e-12)
        at += len(t)
    # without the document ids the second document would see the first (the test can fail)
    plain, _ = model.capture(ids, [0, 2], True)
    assert not torch.allclose(plain[0, 7:19], aux[0, 7:19])


def test_changing_one_document_changes_nothing_in_the_others():
    model = Qwen3Model(ARGS).double()
    model.init_weights(1)
    docs, ids, doc_ids = _packed([9, 10, 6], 32, seed=3)
    aux, _ = model.capture(ids, [1], False, document_ids=doc_ids)
    changed = ids.clone()
    changed[0, :9] = torch.randint(1, ARGS.vocab_size, (9,), generator=torch.Generator().manual_seed(9))
    aux2, _ = model.capture(changed, [1], False, document_ids=doc_ids)
    assert not torch.equal(aux[0, :9], aux2[0, :9])
    assert torch.equal(aux[0, 9:25], aux2[0, 9:25])


def test_document_tiles_match_the_mask_tile_by_tile():
    tile, n = 4, 6
    seq = tile * n
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(5):
        cuts = sorted(torch.randperm(seq - 1, generator=g)[: int(torch.randint(0, 6, (1,), generator=g))] + 1)
        ids, d, prev = [], 0, 0
        for c in cuts + [seq]:
            ids += [d] * (int(c) - prev)
            prev, d = int(c), d + 1
        rows.append(ids)
    doc_ids = torch.tensor(rows, dtype=torch.int32)
    starts, _ = document_spans(doc_ids, torch.full((5,), seq), seq)
    dense = dense_mask_from_mask_mod(causal_document_mask_mod(starts), 5, seq, seq, "cpu")
    tiles = dense.view(5, 1, n, tile, n, tile).permute(0, 1, 2, 4, 3, 5).reshape(5, 1, n, n, tile * tile)
    partial, full = causal_document_tiles(starts, tile)
    assert torch.equal(full, tiles.all(-1))
    assert torch.equal(partial, tiles.any(-1) & ~tiles.all(-1))
    # and the mask itself is causal within documents, checked pointwise
    for b in range(5):
        for q in range(seq):
            for kv in range(seq):
                assert bool(dense[b, 0, q, kv]) == (kv <= q and rows[b][kv] == rows[b][q])
