"""Random-weight checkpoints of families only the transformers backend runs (Gemma2's soft-capping,
Mistral's sliding window), saved by transformers itself, for the backend's tests."""

from __future__ import annotations

import torch


HF_ONLY_FAMILIES = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               {"head_dim": 16, "sliding_window": 8, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0,
                "query_pre_attn_scalar": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                {"head_dim": 16, "sliding_window": 8, "tie_word_embeddings": False}),
}


def write_hf_only_target(folder, family: str, vocab_size: int = 300, num_layers: int = 3, seed: int = 0,
                         max_shard_size: str = "100KB") -> str:
    """A random-weight ``family`` checkpoint (HF_ONLY_FAMILIES) saved by transformers itself,
    sharded with an index as real checkpoints are; windows of 8 tokens so a 40-token row uses them."""
    import transformers

    config_cls, model_cls, extra = HF_ONLY_FAMILIES[family]
    config = getattr(transformers, config_cls)(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():  # HF's init is too small for soft-capping to bite: widen it
        for name, p in model.named_parameters():
            if name.endswith("proj.weight"):
                p.normal_(0, 0.3)
    model.save_pretrained(str(folder), max_shard_size=max_shard_size)
    return str(folder)


# a family's own turn markers, no ChatML tokens: 'auto' renders with the folder's template. Gemma2's
# marks its answers ({% generation %}), Mistral's does not (the render-twice rule finds them).
_HF_ONLY_TEMPLATE = (
    "{%- for m in messages %}{%- if m['role'] == 'assistant' %}<turn model>\n{% generation %}{{ m['content'] }}"
    "{{ eos_token }}{% endgeneration %}\n{%- else %}<turn {{ m['role'] }}>\n{{ m['content'] }}\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<turn model>\n{% endif %}"
)
HF_ONLY_TEMPLATES = {"gemma2": _HF_ONLY_TEMPLATE,
                     "mistral": _HF_ONLY_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")}


def write_hf_only_chat_target(folder, family: str, num_layers: int = 4) -> str:
    """``write_hf_only_target`` with a tokenizer (the Qwen BPE cut to its first 4000 ranks, so the
    run stays fast; <|endoftext|> and <|im_end|>, the eos, its only special tokens) and the family's
    chat template of HF_ONLY_TEMPLATES: a folder a training job runs on."""
    import tiktoken

    from titan_draft.data.tokenizer import Tokenizer, build_tokenizer
    from titan_draft.data.tokenizer.hf_save import save_hf_tokenizer

    qwen = build_tokenizer("qwen3")
    ranks = {b: r for b, r in qwen.encoding._mergeable_ranks.items() if r < 4000}
    enc = tiktoken.Encoding(name="hf-only-test", pat_str=qwen.encoding._pat_str, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": 4000, "<|im_end|>": 4001})
    tokenizer = Tokenizer("hf-only-test", enc, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                          chat_template=HF_ONLY_TEMPLATES[family])
    write_hf_only_target(folder, family, vocab_size=tokenizer.n_vocab + 16, num_layers=num_layers,
                         max_shard_size="2GB")
    save_hf_tokenizer(tokenizer, str(folder))
    return str(folder)
