"""The eval-side target: loaded and checked against the target the draft export records.

``python -m titan_draft.eval`` and the scripts that read a draft against its target
(``scripts/first_token.py``, ``scripts/vocab_mass.py``) load the target here, so that none of them
measures a draft next to a target it was not trained for without saying so.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from titan_draft.checkpoint.export import TARGET_FACTS, build_target_record, recorded_target, target_mismatches
from titan_draft.config.job_config import TARGET_BACKENDS
from titan_draft.features.target import load_target, read_hf_config
from titan_draft.protocols.target_spec import get_target_spec, target_spec_for_model_type

logger = logging.getLogger(__name__)


def target_architecture(path: str, backend: str = "native"):
    """(architecture args, family) of the HF folder ``path``, read from its config.json alone."""
    hf_config = read_hf_config(path, backend=backend)
    spec = (get_target_spec("transformers") if backend == "transformers"
            else target_spec_for_model_type(hf_config.get("model_type"), path))
    return spec.args_from_hf_config(hf_config), spec.family


def add_target_backend_arg(p) -> None:
    """``--target-backend`` of the eval and of the scripts that read a draft against its target,
    resolved by ``resolve_target_backend``."""
    p.add_argument("--target-backend", default=None, choices=TARGET_BACKENDS,
                   help="how the target folder is run (default: the backend the draft's training run recorded, "
                        "else native)")


def resolve_target_backend(flag: str | None, runs: Sequence[dict]) -> str:
    """How the target folder is run: ``flag`` where given, else the backend the drafts' training
    runs recorded (``native`` where none did). Drafts whose runs recorded different backends need
    the flag: which one to read them with is the user's choice, not the first draft's."""
    if flag is not None:
        return flag
    recorded = {r["target_backend"] for r in runs if r.get("target_backend")}
    if len(recorded) > 1:
        raise ValueError("the drafts were trained with targets run by different backends "
                         f"({', '.join(sorted(recorded))}): pass --target-backend")
    return recorded.pop() if recorded else "native"


def check_eval_target(draft: str, target: str, recorded: dict | None, actual: dict, *,
                      allow_mismatch: bool = False) -> None:
    """Refuse (ValueError) a target that differs from the one the export ``draft`` records, naming
    every differing fact; with ``allow_mismatch`` log them instead. An export without a record is
    evaluated with a warning: nothing can be checked."""
    if recorded is None:
        if "table_fingerprint" not in actual:  # said once, at the first check
            logger.warning(f"eval: {draft} records no target facts (a checkpoint folder, or an export older "
                           "than the record): the target is not checked against the one it was trained for")
        return
    differences = target_mismatches({k: v for k, v in recorded.items() if k in actual}, actual)
    if not differences:
        return
    line = f"--target: {target} is not the target {draft} was trained for: {'; '.join(differences)}"
    if not allow_mismatch:
        raise ValueError(f"{line} (pass --allow-target-mismatch to evaluate anyway)")
    logger.warning(f"eval: {line}; evaluating anyway (--allow-target-mismatch)")


def load_checked_target(target: str, drafts: Sequence[str], *, dtype: torch.dtype, device: torch.device,
                        backend: str = "native", allow_mismatch: bool = False, fingerprint: bool = False):
    """``(target, table fingerprint or None)``: the target folder ``target`` loaded in ``dtype`` on
    ``device``, checked against the record of every export in ``drafts``: its architecture from
    config.json before the weights load, its frozen tables (embedding, lm_head) once they have. The
    fingerprint is computed where a record needs it or ``fingerprint`` asks for it."""
    records = [(d, recorded_target(d)) for d in drafts]
    args, family = target_architecture(target, backend)
    facts = {"family": family, **{k: getattr(args, k, None) for k in TARGET_FACTS[1:]}}
    for draft, recorded in records:
        check_eval_target(draft, target, recorded, facts, allow_mismatch=allow_mismatch)
    model = load_target(target, dtype=dtype, device=device, backend=backend)
    table = None
    if fingerprint or any(r is not None for _, r in records):
        table = build_target_record(model, model.args, model.family)["table_fingerprint"]
    for draft, recorded in records:
        if recorded is not None:
            check_eval_target(draft, target, recorded, {"table_fingerprint": table}, allow_mismatch=allow_mismatch)
    return model, table
