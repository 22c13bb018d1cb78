"""`zeroshard consolidate`: a sharded checkpoint -> one full state dict file, streamed unit by unit."""

from __future__ import annotations

import argparse
import json
import sys

from zeroshard.tools.commands import CommandError, add_command

DESCRIPTION = """\
Write the full model of a zeroshard checkpoint (any world size, any ZeRO stage) to one file that
`model.load_state_dict(..., strict=True)` accepts: the model's own parameter names, tied aliases
and buffers included. CKPT_DIR is the directory given to engine.save_checkpoint (the tag that
`latest` names is used unless --tag is given) or one checkpoint directory. Safetensors output is
streamed unit by unit, so memory stays about one unit; a .pt file is built in memory. Every shard's
checksum is verified first; a damaged or incomplete checkpoint is an error naming the file.
A checkpoint saved under tensor/pipeline parallelism (dp x tp x pp) gives the full model: each
parameter's tp slices joined along the dim they were cut on, the pipeline stages side by side.
A checkpoint DeepSpeed wrote (ZeRO stages 1-3, any world size) is accepted too: the result is what
DeepSpeed's zero_to_fp32.py makes of it, streamed parameter by parameter, without DeepSpeed.
With --format hf, OUT is a directory that transformers' from_pretrained reads: safetensors files of
at most --max-shard-size and model.safetensors.index.json, as save_pretrained writes them (copy the
model's config.json next to them)."""

EXAMPLES = [
    "zeroshard consolidate checkpoints/ model.safetensors             # the 'latest' tag, fp32",
    "zeroshard consolidate checkpoints/ model-bf16.safetensors --dtype bf16",
    "zeroshard consolidate checkpoints/ model.pt --tag global_step1000   # torch.save format",
    "zeroshard consolidate checkpoints/global_step1000 out.bin --format pt --json",
    "zeroshard consolidate ds_checkpoints/ model.safetensors          # a DeepSpeed checkpoint",
    "zeroshard consolidate checkpoints/ hf_model/ --format hf --max-shard-size 2GB  # Hugging Face's layout",
]

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers,
        "consolidate",
        summary="sharded checkpoint -> one full state dict file",
        description=DESCRIPTION,
        examples=EXAMPLES,
    )
    parser.add_argument("checkpoint", metavar="CKPT_DIR", help="save_dir of save_checkpoint, or one checkpoint")
    parser.add_argument(
        "output",
        metavar="OUT",
        help="output file (.safetensors, or .pt/.bin for torch.save), or directory (--format hf)",
    )
    parser.add_argument("--tag", help="checkpoint tag inside CKPT_DIR (default: the one 'latest' names)")
    parser.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="fp32",
        help="dtype of the parameters written (default: fp32, the master weights as they are)",
    )
    parser.add_argument(
        "--format",
        choices=["safetensors", "pt", "hf"],
        dest="fmt",
        help="output format (default: from OUT's suffix, safetensors unless .pt/.pth/.bin); hf: a directory of "
        "sharded safetensors with their index, as transformers' save_pretrained writes",
    )
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        help="--format hf: the largest file, in bytes or like 5GB, 500MB (default 5GB, as save_pretrained)",
    )
    parser.add_argument("--no-verify", action="store_true", help="skip the checksum checks of the shard files")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from zeroshard.checkpoint import CheckpointError, consolidate

    try:
        summary = consolidate(
            args.checkpoint,
            args.output,
            tag=args.tag,
            dtype=getattr(torch, DTYPES[args.dtype]),
            fmt=args.fmt,
            verify=not args.no_verify,
            progress=not args.quiet,
            max_shard_size=args.max_shard_size,
        )
    except (CheckpointError, ValueError) as error:
        raise CommandError(str(error)) from None
    if args.json:
        sys.stdout.write(json.dumps(summary, indent=2) + "\n")
    else:
        sys.stdout.write(
            f"wrote {summary['output']}: {summary['tensors']} tensors, "
            f"{summary['bytes'] / 1e6:.1f} MB "
            f"({summary['format']}, {args.dtype}) from {summary['checkpoint']} in "
            f"{summary['seconds']:.1f} s\n"
        )
    return 0
