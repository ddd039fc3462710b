"""EAGLE-3's ``prepare_fn``: the draft vocabulary, counted from the job's own data or read back.

The file (``model.args.draft_vocab_file``, default ``job.dump_folder/draft_vocab.safetensors``)
records what it was counted from; a resumed run reads it back and a job whose data, tokenizer,
format or sizes differ is refused (``vocab.load_draft_vocab``), never silently given it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

from models.eagle3.args import Eagle3Args
from models.eagle3.vocab import (build_draft_vocab, count_loss_tokens, load_draft_vocab, save_draft_vocab,
                                 unseen_coverage)

logger = logging.getLogger(__name__)

VOCAB_FILE = "draft_vocab.safetensors"


def vocab_origin(args: Eagle3Args, ctx) -> dict:
    """What a draft vocabulary is a function of."""
    d = ctx.job.data
    return {
        "data.source": d.source, "data.max_rows": d.max_rows, "data.holdout_rows": d.holdout_rows,
        "data.max_length": d.max_length, "data.chat_template": ctx.chat.template,
        "data.system_prompt": ctx.chat.system_prompt,
        "data.enable_thinking": ctx.chat.enable_thinking, "data.last_turn_only": ctx.chat.last_turn_only,
        "tokenizer": ctx.tokenizer.name, "vocab_size": args.vocab_size, "draft_vocab_size": args.draft_vocab_size,
    }


def prepare_eagle3(args: Eagle3Args, ctx) -> Eagle3Args:
    path = args.draft_vocab_file or os.path.join(ctx.dump_folder, VOCAB_FILE)
    origin = vocab_origin(args, ctx)
    if os.path.isfile(path):
        load_draft_vocab(path, origin)  # refuses a vocabulary counted from something else
        logger.info("eagle3: draft vocabulary read from %s", path)
        return replace(args, draft_vocab_file=path)
    halves = ctx.all_reduce_sum(count_loss_tokens(ctx.samples(), args.vocab_size, parts=2))
    counts = halves.sum(0)
    d2t, t2d = build_draft_vocab(counts, args.draft_vocab_size)
    total, covered = int(counts.sum()), int(counts[t2d].sum())
    if ctx.is_rank0:
        save_draft_vocab(path, d2t, t2d, counts, {**origin, "loss_tokens": total})
    ctx.barrier()  # the other ranks' models read the file
    # the draft never proposes a token outside its vocabulary: the unseen share is a ceiling on
    # acceptance that no training removes, and the place to look before raising draft_vocab_size
    logger.info("eagle3: draft vocabulary of %d tokens covers %.2f%% of the %d loss tokens it was counted from, "
                "about %.2f%% of unseen text (counted on every other sample, measured on the rest); wrote %s",
                args.draft_vocab_size, 100.0 * covered / max(total, 1), total,
                100.0 * unseen_coverage(halves, args.draft_vocab_size), path)
    return replace(args, draft_vocab_file=path)
