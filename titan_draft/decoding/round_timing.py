"""Where a speculative round's time goes: the draft's proposal, the target's verify pass, the
draft's commit of what was accepted, and the loop's own work between them.

A round's wall time says how fast speculative decoding is, not why. ``round_breakdown`` decodes
prompts again with the same loop (``speculative_decode``) through two thin proxies that wait for
the device before and after each ``propose``, each verify forward and each ``commit`` and time
them; what a round takes beyond the three is the loop's (choosing the tokens, reading them on the
host, cropping the cache, the launches between the phases). The device waits serialize what
would otherwise overlap, so the synchronized round is at least the real one: read the phases as
shares, and the eval's tokens/s as the speed. The prefill and the prompt's commit are not rounds
and are left out; so are the first ``warmup`` prompts' rounds (CUDA graphs are captured there).
"""

from __future__ import annotations

import statistics
import time

import torch

from titan_draft.decoding.speculative import _sync, speculative_decode
from titan_draft.distributed.cuda_graphs import maybe_graphed
from titan_draft.protocols.proposer import Proposer

PHASES = ("proposal", "verify", "commit")
_now = time.perf_counter  # the clock (a test gives its own)


class _Clock:
    """Per-round phase times (seconds) of the decodes run through its proxies."""

    def __init__(self, device: torch.device):
        self.device = device
        self.rounds: list[dict[str, float]] = []
        self._round_start: float | None = None

    def timed(self, phase: str, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` between two device waits, its time added to the open round's
        ``phase`` (none is open before a sequence's first proposal: the prefill, the prompt's
        commit)."""
        _sync(self.device)
        t0 = _now()
        out = fn(*args, **kwargs)
        _sync(self.device)
        if self._round_start is not None:
            self.rounds[-1][phase] += _now() - t0
        return out

    def start_round(self) -> None:
        self.end_round()
        _sync(self.device)
        self._round_start = _now()
        self.rounds.append({p: 0.0 for p in PHASES})

    def end_round(self) -> None:
        """Close the open round (at the next proposal, or when the decode returns)."""
        if self._round_start is None:
            return
        _sync(self.device)
        self.rounds[-1]["round"] = _now() - self._round_start
        self._round_start = None


class _TimedTarget:
    """The target as the loop calls it: a forward inside a round is its verify pass (the prefill
    comes before the first round)."""

    def __init__(self, target, clock: _Clock):
        self.target, self.clock = target, clock

    def new_cache(self, *args, **kwargs):
        return self.target.new_cache(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        return self.clock.timed("verify", self.target, *args, **kwargs)


class _TimedProposer:
    """The proposer as the loop calls it: each ``propose`` opens a round, and the ``commit`` inside
    it is the round's (the prompt's comes before the first round)."""

    def __init__(self, proposer: Proposer, clock: _Clock):
        self.proposer, self.clock = proposer, clock

    def __getattr__(self, name):  # num_draft_tokens, capture_layers, draft_probs, reset, set_sampling, ...
        return getattr(self.proposer, name)

    def propose(self, last_token: int) -> torch.Tensor:
        self.clock.start_round()
        return self.clock.timed("proposal", self.proposer.propose, last_token)

    def commit(self, token_ids, aux, last_hidden=None) -> None:
        self.clock.timed("commit", self.proposer.commit, token_ids, aux, last_hidden)


@torch.no_grad()
def round_breakdown(target, proposer: Proposer, prompts: list, *, max_new_tokens: int, stop_ids,
                    device: torch.device, cuda_graphs: bool = True, warmup: int = 1) -> dict:
    """Median milliseconds a greedy round spends in each phase (module docstring) over the rounds
    of ``prompts[warmup:]`` (prompts with ``.ids``): ``{"rounds", "proposal", "verify", "commit",
    "loop", "round"}``, ``loop`` being a round's time outside the three phases."""
    if len(prompts) <= warmup:
        raise ValueError(f"round timing: {len(prompts)} prompt(s) leave none after the {warmup} warm-up one(s)")
    clock = _Clock(device)
    stepped = _TimedTarget(maybe_graphed(target, device, cuda_graphs), clock)
    timed = _TimedProposer(proposer, clock)
    for i, p in enumerate(prompts):
        speculative_decode(stepped, timed, p.ids, max_new_tokens, stop_ids, device)
        clock.end_round()
        if i < warmup:
            clock.rounds.clear()
    rounds = clock.rounds
    if not rounds:
        raise ValueError("round timing: the timed prompts took no speculative round (each ended at its first token)")
    for r in rounds:
        r["loop"] = r["round"] - sum(r[p] for p in PHASES)
    out = {"rounds": len(rounds)}
    out.update({k: 1e3 * statistics.median(r[k] for r in rounds) for k in (*PHASES, "loop", "round")})
    return out


def breakdown_line(b: dict) -> str:
    """One line of ``round_breakdown``'s medians."""
    return (f"round (each phase synchronized, median of {b['rounds']} rounds): proposal {b['proposal']:.2f} ms, "
            f"verify {b['verify']:.2f} ms, commit {b['commit']:.2f} ms, loop {b['loop']:.2f} ms; "
            f"{b['round']:.2f} ms a round")
