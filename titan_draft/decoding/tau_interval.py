"""How far a true acceptance length can be trusted: bootstrap intervals over the eval's prompts.

tau is a ratio over all prompts (tokens from verify rounds / rounds). On 40 or 80 prompts it moves
with the prompts drawn, and at T > 0 with the sampling seed too, so two drafts 2 % apart may not
be in any order at all. The percentile bootstrap resamples whole prompts with replacement (a
prompt's rounds are not independent of one another, its prompts are) and recomputes the ratio.

Two drafts decoded on the same prompts are compared *paired*: each resample draws one set of
prompt indices and takes both drafts' tau on it, so the spread that comes from easy and hard
prompts (which moves both drafts alike) cancels from the difference. That is the interval that says
whether an order between two drafts is established.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

LEVEL = 0.95
RESAMPLES = 4000


class PromptMismatch(ValueError):
    """Two reports that were not decoded on the same prompts cannot be paired."""


def _counts(prompts: Sequence[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens from verify rounds, rounds) per prompt, float64."""
    tokens = torch.tensor([float(p["round_tokens"]) for p in prompts], dtype=torch.float64)
    rounds = torch.tensor([float(p["rounds"]) for p in prompts], dtype=torch.float64)
    return tokens, rounds


def _resampled_indices(n: int, resamples: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(n, (resamples, n), generator=g)


def _ratio(tokens: torch.Tensor, rounds: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return tokens[idx].sum(-1) / rounds[idx].sum(-1).clamp_min(1.0)


def _tau(tokens: torch.Tensor, rounds: torch.Tensor) -> float:
    """tau over all the prompts as drawn (the eval's own figure)."""
    return (tokens.sum() / rounds.sum().clamp_min(1.0)).item()


def _bounds(samples: torch.Tensor, level: float) -> tuple[float, float]:
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    lo, hi = torch.quantile(samples, q).tolist()
    return lo, hi


def tau_interval(prompts: Sequence[dict], level: float = LEVEL, resamples: int = RESAMPLES,
                 seed: int = 0) -> dict:
    """``{"tau", "low", "high", "level", "resamples"}`` for one eval's per-prompt reports (dicts
    with ``round_tokens`` and ``rounds``, as ``python -m titan_draft.eval --out`` writes them)."""
    if not prompts:
        raise ValueError("tau_interval: no prompts")
    tokens, rounds = _counts(prompts)
    lo, hi = _bounds(_ratio(tokens, rounds, _resampled_indices(len(prompts), resamples, seed)), level)
    return {"tau": _tau(tokens, rounds), "low": lo, "high": hi, "level": level, "resamples": resamples}


def paired_difference(a: Sequence[dict], b: Sequence[dict], level: float = LEVEL,
                      resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """tau(a) - tau(b) on the same prompts, with its paired bootstrap interval and the share of
    resamples in which ``a`` is ahead. ``established`` is True when the interval excludes 0."""
    return paired_contrast([a, b], [1.0, -1.0], level=level, resamples=resamples, seed=seed)


def paired_contrast(evals: Sequence[Sequence[dict]], weights: Sequence[float], level: float = LEVEL,
                    resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """sum_i weights[i] * tau(evals[i]), every eval decoded on the same prompts, with its paired
    bootstrap interval: one set of prompt indices per resample for all of them. With weights
    (1, -1, -1, 1) over (A changed, A, B changed, B) it says whether a change helps draft A more
    than draft B, a question the two paired differences alone cannot settle (their intervals share
    the prompts). ``a_ahead`` is the share of resamples in which the contrast is positive."""
    if len(evals) != len(weights) or len(evals) < 2:
        raise ValueError(f"paired_contrast: {len(evals)} evals for {len(weights)} weights (need as many, two or more)")
    names = [p["name"] for p in evals[0]]
    for other in evals[1:]:
        names_b = [p["name"] for p in other]
        if names != names_b:
            only = sorted(set(names) ^ set(names_b))
            what = f"prompts only one has: {', '.join(only[:3])}" if only else "the same prompts in another order"
            some = "the two evals" if len(evals) == 2 else "the evals"
            raise PromptMismatch(f"{some} were not decoded on the same prompts ({len(names)} against "
                                 f"{len(names_b)}; {what})")
    if not names:
        raise ValueError("paired_contrast: no prompts")
    idx = _resampled_indices(len(names), resamples, seed)
    value, samples = 0.0, torch.zeros(resamples, dtype=torch.float64)
    for prompts, w in zip(evals, weights):
        tokens, rounds = _counts(prompts)
        value += w * _tau(tokens, rounds)
        samples += w * _ratio(tokens, rounds, idx)
    lo, hi = _bounds(samples, level)
    return {"difference": value, "low": lo, "high": hi, "level": level, "resamples": resamples,
            "a_ahead": (samples > 0).double().mean().item(), "established": lo > 0 or hi < 0}


def across_seeds(a_seeds: Sequence[Sequence[dict]], b_seeds: Sequence[Sequence[dict]], level: float = LEVEL,
                 resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """Draft A against draft B when each was trained more than once (one eval per training seed,
    all on the same prompts). The prompt bootstrap sees only the prompts, not how much a second
    training run moves tau, so the order is called only where it holds in every pairing of an A
    seed with a B seed, each paired on the prompts: ``established`` is True when every one of
    those intervals excludes 0 on the same side. ``mean`` is the mean of A's seeds less the mean
    of B's with its prompt-paired interval (seeds held fixed), ``pairings`` each pairing's
    :func:`paired_difference`, ``spread_a``/``spread_b`` the range of each draft's seeds' tau."""
    if not a_seeds or not b_seeds:
        raise ValueError("across_seeds: each draft needs at least one eval")
    ka, kb = len(a_seeds), len(b_seeds)
    mean = paired_contrast([*a_seeds, *b_seeds], [1.0 / ka] * ka + [-1.0 / kb] * kb,
                           level=level, resamples=resamples, seed=seed)
    pairings = [paired_difference(a, b, level=level, resamples=resamples, seed=seed) for a in a_seeds for b in b_seeds]
    taus_a = [_tau(*_counts(a)) for a in a_seeds]
    taus_b = [_tau(*_counts(b)) for b in b_seeds]
    ahead = sum(p["low"] > 0 for p in pairings)
    behind = sum(p["high"] < 0 for p in pairings)
    return {"mean": mean, "tau_a": sum(taus_a) / ka, "tau_b": sum(taus_b) / kb,
            "spread_a": max(taus_a) - min(taus_a), "spread_b": max(taus_b) - min(taus_b),
            "pairings": pairings, "established_pairings": max(ahead, behind),
            "established": ahead == len(pairings) or behind == len(pairings)}


def format_interval(iv: dict, digits: int = 3) -> str:
    """'1.505 (95 % interval 1.471 to 1.540)'."""
    return (f"{iv['tau']:.{digits}f} ({100 * iv['level']:g} % interval {iv['low']:.{digits}f} to "
            f"{iv['high']:.{digits}f})")
