"""``hybridtrain merge``: fold a PEFT-format LoRA adapter into its base Hugging Face checkpoint
(:func:`hybridtrain.peft.export.merge_adapter_into_hf`); an adapter inside a run's ``step_N/`` is
read with that step pinned, as every reader of a run folder reads it."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from hybridtrain.fileio import given_path, output_folder
from hybridtrain.peft.export import merge_adapter_into_hf
from hybridtrain.training.checkpoint_reader import read_checkpoint

__all__ = ["run"]


def run(argv: Sequence[str] | None = None) -> int:
    """``hybridtrain merge --base BASE_HF_DIR --adapter ADAPTER_DIR --out OUT_DIR [--dtype D]
    [--allow-base-mismatch]``:
    fold a PEFT-format LoRA adapter into its base checkpoint and write a plain HF checkpoint."""
    parser = argparse.ArgumentParser(
        prog="hybridtrain merge",
        description="Merge a LoRA adapter (adapter_config.json + adapter_model.safetensors, as "
                    "written by hybridtrain or PEFT) into its base Hugging Face checkpoint.")
    parser.add_argument("--base", required=True, help="local base model directory (config.json + safetensors)")
    parser.add_argument("--adapter", required=True, help="adapter directory")
    parser.add_argument("--out", required=True, help="output directory for the merged checkpoint")
    parser.add_argument("--dtype", default=None,
                        help="dtype of the merged weights (default: the base checkpoint's)")
    parser.add_argument("--max-shard-size", default="5GB", help="safetensors shard size (default 5GB)")
    parser.add_argument("--allow-base-mismatch", action="store_true",
                        help="merge even though adapter_config.json names another base model")
    args = parser.parse_args(list(argv) if argv is not None else None)
    base, adapter = given_path(args.base, "--base"), given_path(args.adapter, "--adapter")
    out_dir = output_folder(args.out, "--out")  # not a file, nor under one: said before reading
    # an adapter inside a run's step_N/ is read with that step pinned (a live run keeps it)
    out = read_checkpoint(adapter, lambda path: merge_adapter_into_hf(
        base, path, out_dir, dtype=args.dtype, max_shard_size=args.max_shard_size,
        allow_base_mismatch=args.allow_base_mismatch))
    print(f"merged {args.adapter} into {args.base} -> {out}")
    return 0
