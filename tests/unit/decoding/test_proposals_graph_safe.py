"""EAGLE-3's and DSpark's graph-safe proposals (what a CUDA graph replays; run eagerly here) draft
exactly the tokens of the eager proposals they replaced, in float64 on tiny random drafts, round
after round with accepted and rejected drafts; and they read nothing on the host.

The references below are the eager proposals as they were before the graph-safe rewrite: the
DSpark walk that reads the confidence product on the host slot by slot and stops there, and the
EAGLE-3 chain over a cache sliced to its committed length. The GPU side (graphed == eager) is
tests/gpu/test_proposals_gpu.py, which reuses them."""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from models.block_diffusion.decoder import BlockDecoder
from models.dspark import DSparkDraft, DSparkProposer
from models.eagle3 import Eagle3Draft, Eagle3Proposer
from tests.unit.models.dspark.test_models_dspark import BASE as DSPARK_ARGS
from tests.unit.models.eagle3.test_models_eagle3 import ARGS as EAGLE3_ARGS


class ReferenceDSpark(BlockDecoder):
    """The eager DSpark proposal: the block, then the Markov chain with a host-side stop."""

    def __init__(self, draft, first_slot: int = 0, stop_below: float = 0.0):
        super().__init__(draft, graphs=False)
        self.first_slot, self.stop_below = first_slot, stop_below
        self.reset(0)

    @torch.no_grad()
    def walk(self, last_token: int):
        d = self.draft
        hidden = self.block_hidden(last_token)
        head, w = d.markov_head, d.target_lm_head
        prev = torch.tensor([last_token], device=self.device)
        state, survival = None, 1.0
        tokens, logits, conf = [], [], []
        for k in range(self.first_slot, hidden.shape[0]):
            h = hidden[k : k + 1]
            f, e, state = head.step(h, prev, state)
            if d.confidence_head is not None:
                c = torch.sigmoid(d.confidence_head(h, e).to(self.acc_dtype))
                survival *= float(c)
                if survival < self.stop_below:
                    break
                conf.append(float(c))
            z = (h.to(w.dtype) @ w.t()).to(self.acc_dtype) + head.markov_w2(f).to(self.acc_dtype)
            prev = z.argmax(dim=-1)
            tokens.append(int(prev))
            logits.append(z[0])
        return tokens, logits, conf

    def propose(self, last_token: int) -> torch.Tensor:
        return torch.tensor(self.walk(last_token)[0], dtype=torch.long)


class ReferenceEagle3:
    """The eager EAGLE-3 proposal: a chain over the cache sliced to the committed length."""

    def __init__(self, draft, num_draft_tokens: int):
        self.draft, self.num_draft_tokens = draft, num_draft_tokens
        w = draft.fc.weight
        self.dtype, self.device = w.dtype, w.device
        self.acc_dtype = torch.promote_types(self.dtype, torch.float32)
        self.ids = draft.draft_ids()

    def reset(self, max_len: int) -> None:
        a = self.draft.args
        shape = (1, a.num_key_value_heads, 0, a.head_dim)
        self._k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.pending = None

    def _step(self, position: int, token: int, hidden, chain: list):
        d = self.draft
        rope = d.rope(torch.tensor([[position]], device=self.device), self.acc_dtype)
        emb = d.embed(torch.tensor([[token]], device=self.device), self.dtype)
        context = [(self._k, self._v)] if self._k.shape[2] else []
        return d.midlayer(emb, hidden, rope, context + chain, None)

    def _append(self, kv) -> None:
        self._k = torch.cat([self._k, kv[0]], dim=2)
        self._v = torch.cat([self._v, kv[1]], dim=2)

    @torch.no_grad()
    def commit(self, token_ids, aux, last_hidden=None) -> None:
        fused = self.draft.fuse(aux[None])
        tokens = token_ids.tolist()
        waiting = [self.pending] if self.pending is not None else []
        rows = waiting + [fused[:, i : i + 1] for i in range(len(tokens) - 1)]
        for hidden, nxt in zip(rows, tokens if waiting else tokens[1:]):
            self._append(self._step(self._k.shape[2], nxt, hidden, [])[1])
        self.pending = fused[:, -1:]

    @torch.no_grad()
    def walk(self, last_token: int):
        d, position = self.draft, self._k.shape[2]
        out, kv = self._step(position, last_token, self.pending, [])
        self._append(kv)
        self.pending = None
        picks, logits, chain = [], [], []
        for j in range(self.num_draft_tokens):
            logits.append(d.lm_head(d.norm(out)).to(self.acc_dtype)[0, -1])
            picks.append(int(self.ids[logits[-1].argmax()]))
            if j + 1 == self.num_draft_tokens:
                break
            out, kv = self._step(position + 1 + j, picks[-1], out, chain)
            chain.append(kv)
        return picks, logits, []

    def propose(self, last_token: int) -> torch.Tensor:
        return torch.tensor(self.walk(last_token)[0], dtype=torch.long)


def dspark_draft(kind: str = "rnn", seed: int = 0, **kw) -> DSparkDraft:
    """A float64 DSpark of 5-token blocks whose Markov and confidence heads matter."""
    torch.manual_seed(seed)
    d = DSparkDraft(replace(DSPARK_ARGS, markov_head_type=kind, block_size=5, **kw)).double()
    d.init_weights()
    with torch.no_grad():
        for name, p in d.named_parameters():
            p.add_(torch.randn_like(p) * (0.2 if "norm" in name else 0.5 if "markov" in name else 0.1))
    g = torch.Generator().manual_seed(seed + 1)
    a = d.args
    d.load_frozen_tables(torch.randn(a.vocab_size, a.hidden_size, generator=g, dtype=torch.float64),
                         torch.randn(a.vocab_size, a.hidden_size, generator=g, dtype=torch.float64))
    return d.eval()


def eagle3_draft(seed: int = 0) -> Eagle3Draft:
    """A float64 EAGLE-3 whose chain steps change their picks."""
    torch.manual_seed(seed)
    a = EAGLE3_ARGS
    d = Eagle3Draft(a).double()
    d.init_weights()
    with torch.no_grad():
        for name, p in d.named_parameters():
            p.add_(torch.randn_like(p) * (0.2 if "norm" in name else 0.15))
        d.d2t.copy_(torch.tensor(sorted(torch.randperm(a.vocab_size)[: a.draft_vocab_size].tolist()))
                    - torch.arange(a.draft_vocab_size))
    g = torch.Generator().manual_seed(seed + 1)
    d.load_frozen_tables(torch.randn(a.vocab_size, a.hidden_size, generator=g, dtype=torch.float64),
                         torch.randn(a.vocab_size, a.hidden_size, generator=g, dtype=torch.float64))
    return d.eval()


def run_rounds(proposers, vocab: int, *, rounds: int = 10, prompt: int = 9, seed: int = 0,
               max_len: int = 64, grow: int = 0, check=None) -> list[int]:
    """Decode rounds as the eval does, with random features and random accept counts: every
    proposer gets the same commits; each round's proposals must be equal (``check(last)`` runs
    first, on the proposers' state before the round). Returns the accepted counts. ``grow``:
    one commit of that many tokens half way (past the first reservation)."""
    p0 = proposers[0]
    width, dtype, dev = p0.draft.fc.in_features, p0.dtype, p0.device
    g = torch.Generator().manual_seed(seed)

    def commit(tokens: list[int]) -> None:
        aux = torch.randn(len(tokens), width, generator=g, dtype=torch.float64).to(dev, dtype)
        for p in proposers:
            p.commit(torch.tensor(tokens, device=dev), aux)

    def token() -> int:
        return int(torch.randint(0, vocab - 1, (1,), generator=g))

    for p in proposers:
        p.reset(max_len)
    commit([token() for _ in range(prompt)])
    last, accepted = token(), []
    for r in range(rounds):
        if check is not None:
            check(last)
        drafts = [p.propose(last).cpu().tolist() for p in proposers]
        assert all(d == drafts[0] for d in drafts), (r, drafts)
        m = int(torch.randint(0, len(drafts[0]) + 1, (1,), generator=g))
        accepted.append(m)
        commit([last] + drafts[0][:m])
        if grow and r == rounds // 2:
            commit([token() for _ in range(grow)])
        last = token()
    return accepted


class _NoHostFunctions(TorchFunctionMode):
    FORBIDDEN = {"__int__", "__float__", "__bool__", "__index__", "item", "tolist", "tensor", "as_tensor",
                 "numpy", "cpu"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.FORBIDDEN:
            raise AssertionError(f"host read inside the proposal: {name}")
        return func(*args, **(kwargs or {}))


class _NoScalarReads(TorchDispatchMode):
    # what .item() and indexing by a 0-dim tensor run underneath (the latter from C++)
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError("host read inside the proposal: a tensor read as a scalar")
        return func(*args, **(kwargs or {}))


@contextmanager
def no_host_reads():
    """Fails on anything a CUDA graph cannot replay: a device value read on the host (``int``,
    ``float``, ``bool``, ``.item()``, ``.tolist()``, indexing by a 0-dim tensor) or a host value
    baked in (``torch.tensor``)."""
    with _NoHostFunctions(), _NoScalarReads():
        yield


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
@pytest.mark.parametrize("decode_as", ["sglang", "specforge_spec_generate"])
def test_dspark_drafts_what_the_eager_walk_drafts(kind, decode_as):
    d = dspark_draft(kind)
    prop = DSparkProposer(d, decode_as=decode_as)
    assert not prop.graphs  # the default on a CPU
    ref = ReferenceDSpark(d, first_slot=prop.first_slot)
    accepted = run_rounds([prop, ref], d.args.vocab_size, grow=300)
    assert len(set(accepted)) > 2  # rejections, partial and full acceptance
    assert prop._k.shape[3] > 256  # the reserve grew under the rounds


@pytest.mark.parametrize("threshold", [0.1, 0.2, 0.35])
def test_dspark_confidence_cut_after_the_chain_equals_the_walk_that_stops(threshold):
    """The cut from the device-side product (one host read after the whole chain) keeps exactly
    the tokens of the walk that stops at the first slot below the threshold."""
    d = dspark_draft("gated", seed=3)
    prop = DSparkProposer(d, confidence_threshold=threshold)
    ref = ReferenceDSpark(d, stop_below=threshold)
    lengths = []
    run_rounds([prop, ref], d.args.vocab_size, rounds=12, check=lambda last: lengths.append(
        len(ReferenceDSpark.walk(ref, last)[0])))
    assert len(set(lengths)) > 1, lengths  # the cut falls at different slots


def test_dspark_cut_at_a_threshold_equal_to_a_product():
    """A threshold equal to the host-side product c_0 * c_1 keeps slot 1, the next float above
    it does not: the device product is the host's, to the last bit."""
    d = dspark_draft("vanilla", seed=5)
    ref = ReferenceDSpark(d)
    run_rounds([ref], d.args.vocab_size, rounds=0)  # the prompt only
    _, _, conf = ref.walk(17)
    exact = conf[0] * conf[1]
    for thr, keep in ((exact, 2), (math.nextafter(exact, 1.0), 1)):
        prop = DSparkProposer(d, confidence_threshold=thr)
        run_rounds([prop], d.args.vocab_size, rounds=0)
        assert prop.propose(17).numel() == keep, thr


def test_eagle3_drafts_what_the_eager_chain_drafts():
    d = eagle3_draft()
    prop = Eagle3Proposer(d, num_draft_tokens=4)
    assert not prop.graphs
    ref = ReferenceEagle3(d, 4)
    accepted = run_rounds([prop, ref], d.args.vocab_size, rounds=12, grow=300)
    assert len(set(accepted)) > 2
    assert prop._k.shape[2] > 256 and prop.length == ref._k.shape[2]
    # the cache entries written at the device-side length are the reference's, slot for slot
    torch.testing.assert_close(prop._k[:, :, : prop.length], ref._k, rtol=0, atol=1e-12)
    torch.testing.assert_close(prop._v[:, :, : prop.length], ref._v, rtol=0, atol=1e-12)


def test_eagle3_logits_equal_the_eager_chain():
    d = eagle3_draft(seed=2)
    prop, ref = Eagle3Proposer(d, num_draft_tokens=3), ReferenceEagle3(d, 3)
    run_rounds([prop, ref], d.args.vocab_size, rounds=3)
    picks, logits = prop.propose_with_logits(5)
    want_picks, want_logits, _ = ref.walk(5)
    assert picks.tolist() == want_picks
    torch.testing.assert_close(logits, torch.stack(want_logits), rtol=0, atol=1e-12)


@torch.no_grad()
def test_proposals_read_nothing_on_the_host():
    """What a graph captures (block forward and chain; EAGLE-3's whole chain with its cache
    write) reads no device value on the host and bakes in no host value."""
    d = dspark_draft("rnn")
    prop = DSparkProposer(d, confidence_threshold=0.1)
    run_rounds([prop], d.args.vocab_size, rounds=2)
    prop._anchor.fill_(3)
    with no_host_reads():
        tokens, _, _, survival = prop._propose()
    assert tokens.numel() == 5 and survival.dtype == torch.float64
    e = eagle3_draft()
    eprop = Eagle3Proposer(e, num_draft_tokens=4)
    run_rounds([eprop], e.args.vocab_size, rounds=2)
    eprop._start_chain(3)
    with no_host_reads():
        picks, logits, _ = eprop._chain()
    assert picks.numel() == 4 and logits.shape == (4, e.args.draft_vocab_size)
    with pytest.raises(AssertionError, match="host read inside the proposal"), no_host_reads():
        ReferenceDSpark(d, stop_below=0.1).walk(3)  # the guard catches the eager walk's reads
    eref = ReferenceEagle3(e, 4)
    run_rounds([eref], e.args.vocab_size, rounds=2)
    with pytest.raises(AssertionError, match="host read inside the proposal"), no_host_reads():
        eref.walk(3)  # and the eager chain's
    ids, scores = e.draft_ids(), torch.arange(5.0)
    with pytest.raises(AssertionError, match="read as a scalar"), no_host_reads():
        ids[scores.argmax()]  # a 0-dim index is read on the host (from C++: only dispatch sees it)


def test_graphs_need_a_gpu():
    with pytest.raises(ValueError, match="graphs=True needs a CUDA device, the draft is on cpu"):
        Eagle3Proposer(eagle3_draft(), graphs=True)
    with pytest.raises(ValueError, match="graphs=True needs a CUDA device, the draft is on cpu"):
        DSparkProposer(dspark_draft(), graphs=True)
