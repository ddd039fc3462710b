"""Checks of a job that need no target weights, run before anything heavy loads.

Each of these used to fail only after the target had been loaded and sharded (minutes on a large
model), some with a traceback: an unknown draft or flavor or draft arg, a ``data.source`` that does
not exist, a capture layer past the target's last layer, and a ``data.max_length`` (or data) that
leaves no row with a token to train. Each is a ``ValueError`` naming the key, which ``main`` prints
as one line.
"""

from __future__ import annotations

import logging
from collections import Counter
from contextlib import contextmanager

logger = logging.getLogger(__name__)

PROBE_ROWS = 200  # rows rendered to see that the data leaves something to train


def _check_draft(cfg) -> None:
    import dataclasses

    from titan_draft.protocols import get_model_spec

    spec = get_model_spec(cfg.model.name)  # unknown names list the registered drafts
    if cfg.model.flavor not in spec.flavors:
        raise ValueError(f"model.flavor: {cfg.model.flavor!r} is not a {spec.name} flavor ({sorted(spec.flavors)})")
    names = {f.name for f in dataclasses.fields(spec.flavors[cfg.model.flavor])}
    unknown = sorted(set(cfg.model.args) - names)
    if unknown:
        raise ValueError(f"model.args: unknown {spec.name} arg(s) {unknown}; known: {sorted(names)}")


def _check_capture_layers(cfg) -> None:
    if not (cfg.target.path and cfg.target.capture_layers):
        return
    from titan_draft.features.target import read_hf_config

    layers = read_hf_config(cfg.target.path).get("num_hidden_layers")
    bad = [i for i in cfg.target.capture_layers if layers is not None and i >= layers]
    if bad:
        raise ValueError(f"target.capture_layers: {bad} out of range: {cfg.target.path} has {layers} decoder "
                         f"layers (ids 0..{layers - 1})")


@contextmanager
def _quiet(*names: str):
    """The probe reads rows the pipeline reads again: let only the pipeline's read log."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _check_rows(cfg) -> None:
    """The source named by data.source is one a registered source reads and passes its own quick
    check; some of its first rows must keep a trained token at data.max_length (sources that are
    cheap to read twice: files, not the packaged ShareGPT dump; synthetic rows always do)."""
    from titan_draft.data.sources.registry import get_data_source

    d = cfg.data
    source = get_data_source(d.source)
    if source.check is not None:
        source.check(d.source)
    if not (source.probe_at_start and source.rows is not None):
        return
    from titan_draft.data.chat.format import build_chat_format
    from titan_draft.data.sources.chat import ChatSourceNode
    from titan_draft.data.sources.rows import load_rows
    from titan_draft.features.target import build_target_tokenizer

    tokenizer = build_target_tokenizer(cfg, 0)  # cached: the trainer gets the same one
    chat = build_chat_format(d, tokenizer)  # cached too
    probe = min(d.max_rows, PROBE_ROWS) if d.max_rows else PROBE_ROWS
    with _quiet("titan_draft.data.sources.files", "titan_draft.data.sources.report"):
        rows, total = load_rows(d.source, max_rows=probe, skip_rows=d.holdout_rows)
    node = ChatSourceNode(rows, tokenizer, chat=chat, max_length=d.max_length, seed=0, shuffle=False)
    reasons = Counter()
    for row in rows:
        sample = node.sample_or_reason(row)
        if not isinstance(sample, str):
            return
        reasons[sample] += 1
    which = f"the first {len(rows)}" if total >= probe else f"all {len(rows)}"
    hint = " (a longer data.max_length keeps the answers)" if reasons.get("no_loss_tokens") else ""
    raise ValueError(f"data.source: none of {which} rows of {d.source} is usable with data.max_length = "
                     f"{d.max_length}: skipped {dict(reasons.most_common())}{hint}")


def check_job_before_loading(cfg) -> None:
    """Every check above; raises ValueError naming the key."""
    _check_draft(cfg)
    _check_capture_layers(cfg)
    _check_rows(cfg)
