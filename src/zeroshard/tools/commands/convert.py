"""`zeroshard convert`: a DeepSpeed ZeRO checkpoint -> a zeroshard checkpoint."""

from __future__ import annotations

import argparse
import json
import sys

from zeroshard.tools.commands import CommandError, add_command

DESCRIPTION = """\
Write a zeroshard checkpoint from one DeepSpeed wrote (ZeRO stages 1-3; fp32, bf16 or fp16; any
world size), without DeepSpeed installed: the fp32 master weights, the optimizer states (Adam's
moments and step), hyper-parameters, step counts, LR scheduler and fp16 loss scaler, buffers and
client state. The result loads at any world size and stage with engine.load_checkpoint (which also
reads DeepSpeed checkpoints directly) and is verified by checksums like every zeroshard checkpoint.
DS_DIR is DeepSpeed's save_dir (the tag `latest` names is used unless --tag is given) or one of its
tag directories. DeepSpeed's files are pickles: they are loaded with torch's weights_only loader and
an allow-list of DeepSpeed's own types; a file naming any other type is refused."""

EXAMPLES = [
    "zeroshard convert ds_checkpoints/ zs_checkpoints/                  # the tag 'latest' names",
    "zeroshard convert ds_checkpoints/ zs_checkpoints/ --tag global_step1000 --json",
]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers,
        "convert",
        summary="DeepSpeed ZeRO checkpoint -> zeroshard checkpoint",
        description=DESCRIPTION,
        examples=EXAMPLES,
    )
    parser.add_argument("checkpoint", metavar="DS_DIR", help="DeepSpeed's save_dir, or one of its tag directories")
    parser.add_argument("output", metavar="OUT_DIR", help="save_dir of the zeroshard checkpoint to write")
    parser.add_argument("--tag", help="DeepSpeed tag to convert (default: the one 'latest' names); also the output tag")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from zeroshard.checkpoint import CheckpointError
    from zeroshard.checkpoint.deepspeed import find
    from zeroshard.checkpoint.deepspeed_convert import convert_deepspeed

    try:
        path = find(args.checkpoint, args.tag)
        if path is None:
            raise CheckpointError(
                f"{args.checkpoint}: no DeepSpeed checkpoint there (no 'latest' naming a tag "
                "directory with mp_rank_00_model_states.pt or zero_pp_rank_0_mp_rank_00_model_"
                "states.pt, and --tag not given or not found)"
            )
        summary = convert_deepspeed(path, args.output, tag=args.tag)
    except CheckpointError as error:
        raise CommandError(str(error)) from None
    if args.json:
        sys.stdout.write(json.dumps(summary, indent=2) + "\n")
    else:
        sys.stdout.write(
            f"wrote {summary['output']}: {summary['parameters']} parameters from {summary['checkpoint']} "
            f"(DeepSpeed, stage {summary['deepspeed_stage']}, {summary['deepspeed_world_size']} ranks, "
            f"step {summary['global_steps']}) in {summary['seconds']:.1f} s\n"
        )
    return 0
