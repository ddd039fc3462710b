"""Write a small random-weight HF-format Qwen3 folder (config.json, safetensors, tokenizer.json).

The default job (train_configs/debug_model.toml) trains against such a folder, so it walks the
same loading path as a real checkpoint: config.json -> family -> meta-device build -> FSDP2
shard -> per-rank safetensors reads, and the tokenizer from tokenizer.json.

    python scripts/write_random_target.py --out ./assets/random_qwen3_debug
    python scripts/write_random_target.py --out /tmp/q8 --flavor qwen3_8b --max-shard-gb 5
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from titan_draft.features.target import write_random_target  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder to write (created if missing)")
    parser.add_argument("--flavor", default="debugmodel", help="qwen3 target flavor (debugmodel, qwen3_8b)")
    parser.add_argument("--seed", type=int, default=1234, help="weight init seed")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--max-shard-gb", type=float, default=0.0,
                        help="split the weights into shards of at most this size with an index (0: one file)")
    parser.add_argument("--force", action="store_true", help="overwrite a folder that already has config.json")
    args = parser.parse_args(argv)
    if os.path.isfile(os.path.join(args.out, "config.json")) and not args.force:
        print(f"{args.out} already holds a checkpoint (config.json); pass --force to overwrite")
        return
    write_random_target(args.out, flavor=args.flavor, seed=args.seed, dtype=getattr(torch, args.dtype),
                        max_shard_bytes=int(args.max_shard_gb * 2**30))
    print(f"wrote random {args.flavor} Qwen3 target to {args.out}")


if __name__ == "__main__":
    main()
