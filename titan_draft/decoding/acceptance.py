"""The true acceptance length of a draft: real greedy speculative decoding of a set of prompts
against the target, with every output checked against plain greedy decoding.

``evaluate`` runs the prompts and returns an :class:`EvalReport` (per prompt and overall τ,
acceptance per draft position, tokens/s of both decodes, lossless count, divergences with their
logit margins). Under data parallelism the target is sharded, so every target forward is a
collective: ranks split the prompts and :class:`Lockstep` keeps their forwards in step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from titan_draft.distributed.cuda_graphs import maybe_graphed
from titan_draft.decoding.speculative import Divergence, compare, greedy_decode, speculative_decode
from titan_draft.decoding.sampling import SampledRule
from titan_draft.decoding.tau_interval import format_interval, tau_interval
from titan_draft.data.chat.prompts import EvalPrompt
from titan_draft.protocols.proposer import Proposer


class Lockstep:
    """Makes ranks run the same number of forwards of a sharded target (each one all-gathers
    weights). Before each forward a working rank all-reduces 1; a rank whose prompts are done
    all-reduces 0 and, while the sum says someone still works, runs a dummy forward."""

    def __init__(self, target, device: torch.device):
        self.target, self.device = target, device
        self.active = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def _tick(self, working: bool) -> int:
        flag = torch.tensor([int(working)], device=self.device)
        dist.all_reduce(flag)
        return int(flag)

    def __call__(self, *args, **kwargs):
        if self.active:
            self._tick(True)
        return self.target(*args, **kwargs)

    def new_cache(self, *args, **kwargs):
        return self.target.new_cache(*args, **kwargs)

    def drain(self) -> None:
        """Call once this rank's work is done; returns when every rank's is."""
        if not self.active:
            return
        dummy = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        while self._tick(False):
            self.target(dummy)


@dataclass
class PromptReport:
    name: str
    prompt_tokens: int
    new_tokens: int
    rounds: int
    round_tokens: int
    tau: float
    speculative_s: float
    accepted: list[int] = field(repr=False)
    greedy_s: float | None = None
    lossless: bool | None = None
    divergence: dict | None = None
    proposed: list[int] = field(default_factory=list, repr=False)
    """Draft tokens proposed in each round (fewer than num_draft_tokens where a proposer stops
    early, e.g. on its confidence)."""
    sampled_rounds: int = 0
    """Rounds whose drafts were drawn from the draft's distributions (T > 0, a sampling proposer)."""


@dataclass
class EvalReport:
    """Overall figures of one eval; ``prompts`` holds the per-prompt ones."""

    prompts: list[PromptReport]
    num_draft_tokens: int
    max_new_tokens: int
    temperature: float = 0.0
    """0: greedy, checked token for token; > 0: speculative sampling (lossless in distribution,
    tests/unit/decoding/test_speculative_sampling.py), so no per-token check."""

    @property
    def rounds(self) -> int:
        return sum(p.rounds for p in self.prompts)

    @property
    def draft_sampling(self) -> str:
        """"greedy" (T = 0), "q" (drafts drawn from the draft's distributions and verified with
        them), "point mass" (the proposer drafted its greedy chain at T > 0), or "mixed"."""
        if self.temperature <= 0:
            return "greedy"
        sampled = sum(p.sampled_rounds for p in self.prompts)
        return "q" if sampled == self.rounds else "point mass" if sampled == 0 else "mixed"

    @property
    def tau(self) -> float:
        """Tokens produced by verification rounds / rounds, over all prompts."""
        return sum(p.round_tokens for p in self.prompts) / max(self.rounds, 1)

    @property
    def tau_prompt_mean(self) -> float:
        return sum(p.tau for p in self.prompts) / max(len(self.prompts), 1)

    def accept_rate(self) -> list[float]:
        """Share of rounds whose draft token at position k (1-based) was accepted."""
        counts = [0] * self.num_draft_tokens
        for p in self.prompts:
            for m in p.accepted:
                for k in range(min(m, self.num_draft_tokens)):
                    counts[k] += 1
        return [c / max(self.rounds, 1) for c in counts]

    def tokens_per_s(self, which: str) -> float | None:
        times = [p.speculative_s if which == "speculative" else p.greedy_s for p in self.prompts]
        if any(t is None for t in times) or not times:
            return None
        return sum(p.new_tokens for p in self.prompts) / max(sum(times), 1e-12)

    @property
    def lossless(self) -> int | None:
        flags = [p.lossless for p in self.prompts]
        return None if any(f is None for f in flags) else sum(flags)

    def summary(self) -> dict:
        spec, greedy = self.tokens_per_s("speculative"), self.tokens_per_s("greedy")
        return {
            "tau": self.tau,
            "tau_prompt_mean": self.tau_prompt_mean,
            # how far the prompts drawn move tau (percentile bootstrap over prompts)
            "tau_interval": tau_interval([{"round_tokens": p.round_tokens, "rounds": p.rounds} for p in self.prompts])
            if self.prompts else None,
            "num_prompts": len(self.prompts),
            "rounds": self.rounds,
            "new_tokens": sum(p.new_tokens for p in self.prompts),
            "num_draft_tokens": self.num_draft_tokens,
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "draft_sampling": self.draft_sampling,
            "accept_rate": self.accept_rate(),
            "proposed_per_round": sum(sum(p.proposed) for p in self.prompts) / max(self.rounds, 1),
            "speculative_tokens_per_s": spec,
            "greedy_tokens_per_s": greedy,
            "speedup": spec / greedy if spec and greedy else None,
            "lossless_prompts": self.lossless,
            "divergences": [dict(name=p.name, **p.divergence) for p in self.prompts if p.divergence],
        }

    def to_json(self) -> dict:
        return {"summary": self.summary(), "prompts": [dataclasses.asdict(p) for p in self.prompts]}

    def table(self) -> str:
        """A short human-readable report."""
        s = self.summary()
        mode = "greedy" if self.temperature <= 0 else \
            f"sampling at T={self.temperature:g}, drafts {'drawn from q' if self.draft_sampling == 'q' else 'as ' + self.draft_sampling}"
        lines = [f"true acceptance length ({mode}, batch 1, {s['max_new_tokens']} new tokens): "
                 f"tau {_tau_text(s)} over {s['num_prompts']} prompts ({s['rounds']} verify rounds, "
                 f"{s['new_tokens']} tokens; per-prompt mean {s['tau_prompt_mean']:.3f}; "
                 f"{s['proposed_per_round']:.2f} of {s['num_draft_tokens']} draft tokens proposed per round)"]
        rates = s["accept_rate"]
        shown = [f"{k + 1}:{r:.2f}" for k, r in enumerate(rates) if k < 8 or r > 0]
        lines.append("accepted at draft position " + " ".join(shown))
        if s["greedy_tokens_per_s"] is not None:
            plain = "greedy" if self.temperature <= 0 else "sampling"
            lines.append(f"speed: speculative {s['speculative_tokens_per_s']:.1f} tok/s, plain {plain} "
                         f"{s['greedy_tokens_per_s']:.1f} tok/s ({s['speedup']:.2f}x)")
            if self.temperature > 0:
                lines.append("lossless: in distribution (the rejection rule), not comparable token for token")
            else:
                lines.append(f"lossless: {s['lossless_prompts']}/{s['num_prompts']} prompts identical to "
                             "plain greedy decoding")
            for d in s["divergences"]:
                lines.append(f"  {d['name']}: differs at new token {d['index']} (greedy {d['greedy_token']}, "
                             f"speculative {d['speculative_token']}; greedy top-2 margin {d['margin']:.4g}, "
                             f"recomputed margin {d['recomputed_margin']:.4g})")
        return "\n".join(lines)


def _tau_text(summary: dict) -> str:
    iv = summary["tau_interval"]
    return f"{summary['tau']:.3f}" if iv is None else format_interval(iv)


def _prompt_report(prompt: EvalPrompt, spec, greedy, divergence: Divergence | None,
                   sampled: bool = False) -> PromptReport:
    rep = PromptReport(
        name=prompt.name, prompt_tokens=len(prompt.ids), new_tokens=len(spec.tokens), rounds=spec.rounds,
        round_tokens=spec.round_tokens, tau=spec.round_tokens / max(spec.rounds, 1),
        speculative_s=spec.wall_s, accepted=list(spec.accepted), proposed=list(spec.proposed),
        sampled_rounds=spec.sampled_rounds,
    )
    if greedy is not None:
        rep.greedy_s = greedy.wall_s
        rep.lossless = None if sampled else divergence is None
        rep.divergence = None if divergence is None else {
            k: (None if isinstance(v, float) and math.isnan(v) else v)
            for k, v in dataclasses.asdict(divergence).items()
        }
    return rep


@torch.no_grad()
def evaluate(target, proposer: Proposer, prompts: list[EvalPrompt], *, max_new_tokens: int,
             stop_ids, device: torch.device, check_lossless: bool = True, temperature: float = 0.0,
             seed: int = 0, cuda_graphs: bool = True, greedy_cache: dict | None = None,
             progress: Callable[[list[PromptReport], int], None] | None = None) -> EvalReport:
    """Speculative (and, with ``check_lossless``, plain) decoding of every prompt: greedy, or at
    ``temperature`` > 0 speculative sampling with prompt i's draws seeded ``seed + i`` (the plain
    run then only gives the speed to compare with).

    With a process group of several ranks, rank ``r`` decodes prompts ``r, r + W, ...`` and the
    returned report (the same on every rank) holds all of them in order. ``cuda_graphs``: the
    target's decode steps replay as CUDA graphs where they can (``cuda_graphs.maybe_graphed``).
    ``greedy_cache`` (greedy only): plain decodes by prompt and length, filled by the first call and
    reused by the next; the target is frozen, so they would come out the same (training's evals
    pay for them once; their speed is then the first eval's). ``progress(reports, planned)``: called on
    every rank after each of its prompts with its reports so far and how many it decodes in all.
    """
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    stepped = Lockstep(maybe_graphed(target, device, cuda_graphs), device)
    mine = []
    planned = len(range(rank, len(prompts), world))
    for i in range(rank, len(prompts), world):
        p = prompts[i]
        rule = _rule(temperature, seed + i)
        spec = speculative_decode(stepped, proposer, p.ids, max_new_tokens, stop_ids, device, rule=rule)
        greedy = divergence = None
        if check_lossless:
            key = (tuple(p.ids), max_new_tokens, tuple(sorted(stop_ids)))
            greedy = greedy_cache.get(key) if greedy_cache is not None and rule is None else None
            if greedy is None:
                greedy = greedy_decode(stepped, p.ids, max_new_tokens, stop_ids, device, rule=_rule(temperature, seed + i))
                if greedy_cache is not None and rule is None:
                    greedy_cache[key] = greedy
            if rule is None:
                divergence = compare(stepped, p.ids, greedy, spec, device)
        mine.append((i, _prompt_report(p, spec, greedy, divergence, sampled=rule is not None)))
        if progress is not None:
            progress([rep for _, rep in mine], planned)
    stepped.drain()
    if world > 1:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, mine)
        mine = [item for part in gathered for item in part]
    reports = [rep for _, rep in sorted(mine, key=lambda item: item[0])]
    return EvalReport(prompts=reports, num_draft_tokens=proposer.num_draft_tokens, max_new_tokens=max_new_tokens,
                      temperature=temperature)


def _rule(temperature: float, seed: int) -> SampledRule | None:
    return SampledRule(temperature, torch.Generator().manual_seed(seed)) if temperature > 0 else None
