"""What a draft of a transformers-backend target receives, held to what serving gives it.

**Input embedding.** The drafts embed tokens with the raw rows of the target's table
(``embed_weight()``), never multiplied by a family's embedding scale. That is what SGLang serves:
an EAGLE3 draft embeds with its own plain embedding module holding the target's table, and a
DFlash draft calls the target's embedding module, which in SGLang is a plain table for Gemma,
Gemma2, Granite and the other families that scale their embeddings in the decoder's forward
(Gemma's ``sqrt(hidden)``, Granite's ``embedding_multiplier``). For the families whose SGLang
embedding module carries the scale itself (Gemma3), EAGLE3 and DFlash drafts receive different
embeddings at serving time, so no single table trains both: they are refused.

**Attention kernel.** A family that transforms its attention scores (Gemma2's
``attn_logit_softcapping``) is computed only by transformers' eager kernel; whether the default
kernel refuses such a family or runs it without the transform depends on the transformers
version, so the backend asks for the eager kernel by name (``attention_kernel``).

**Teacher logits.** Drafts that read the target's final hidden state (``needs_last_hidden``) take
the teacher's logits as ``last_hidden @ lm_head.T``; a family whose head transforms that product
(soft-capping, a logit scale) would be distilled towards other logits than it serves, so such a
job is refused at start-up.
"""

from __future__ import annotations

from models.targets.hf.args import text_config

# model_type -> why SGLang's embedding module of the family already applies a scale
SCALED_EMBEDDING_MODULE = {
    "gemma3": "Gemma3's embedding module multiplies the table by sqrt(hidden_size)",
    "gemma3_text": "Gemma3's embedding module multiplies the table by sqrt(hidden_size)",
}


def head_transforms(hf_config: dict) -> list[str]:
    """The ``config.json`` settings by which the family's logits differ from ``h @ lm_head.T``."""
    text = text_config(hf_config)
    found = []
    if text.get("final_logit_softcapping"):
        found.append(f"final_logit_softcapping = {text['final_logit_softcapping']}")
    for key in ("logits_scaling", "logit_scale"):  # Granite divides by it, Cohere multiplies
        if text.get(key) not in (None, 1, 1.0):
            found.append(f"{key} = {text[key]}")
    return found


def attention_kernel(hf_config: dict) -> str | None:
    """The ``attn_implementation`` to request for this folder (None: transformers' default)."""
    return "eager" if text_config(hf_config).get("attn_logit_softcapping") else None


def check_serving_conventions(hf_config: dict, *, needs_teacher: bool = False) -> None:
    """ValueError in one line when a draft trained on this folder would not see at serving what it
    saw in training (``needs_teacher``: the draft distils ``last_hidden @ lm_head.T``)."""
    model_type = str(hf_config.get("model_type"))
    text_type = str(text_config(hf_config).get("model_type", model_type))
    why = SCALED_EMBEDDING_MODULE.get(model_type) or SCALED_EMBEDDING_MODULE.get(text_type)
    if why:
        raise ValueError(f"target.backend = 'transformers': model_type {model_type!r} is not supported: {why}, so "
                         "SGLang's EAGLE3 drafts (raw table) and DFlash drafts (scaled) embed differently at serving")
    transforms = head_transforms(hf_config) if needs_teacher else []
    if transforms:
        raise ValueError(f"target.backend = 'transformers': model_type {model_type!r} applies "
                         f"{', '.join(transforms)} to its logits, which this draft's teacher "
                         "(last_hidden @ lm_head) does not: use a draft that does not read the target's "
                         "last hidden state (dflash2)")
