"""`zeroshard generate`: ZeRO-Inference from a Hugging Face checkpoint, weights streamed from CPU or NVMe."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, cast

from zeroshard.tools.commands import CommandError, add_command, bounded

log = logging.getLogger(__name__)

DESCRIPTION = """\
Generate text with a causal language model whose weights need not fit in memory (ZeRO-Inference).
MODEL_DIR is what save_pretrained() wrote: config.json and model.safetensors, or the shards that
model.safetensors.index.json names. The model is built on the meta device and each rank's shard of
the weights is read straight into the store (--offload cpu: host memory; nvme: files under
--nvme-path); each forward gathers one layer at a time and prefetches the next, so memory holds
about two layers plus the embeddings. Every weight is read once per generated token for the whole
batch: a larger --batch-size costs little more time per token. --quant-bits 8|4 keeps the weights
packed (int8, or int4: a quarter or an eighth of the fp32 bytes, plus a scale and minimum per group
of --group-size), so fewer bytes are read per token. --draft self (a 4-bit copy of the model kept in
memory) or --draft DIR (a small model of the same vocabulary) turns on speculative decoding at batch
1: the draft proposes tokens, the streamed model checks several per pass over its weights, and the
tokens are the model's own (greedy: equal; sampled: the same distribution). Runs as one process, or
on N ranks under torchrun (weights partitioned N ways, every rank generating the same prompts)."""

EXAMPLES = [
    "zeroshard generate ./my-model --prompt 'Once upon a time' --max-new-tokens 32",
    "zeroshard generate ./my-model --prompt-ids 5,6,7 --offload nvme --nvme-path /local_nvme --batch-size 8",
    "zeroshard generate ./my-model --prompt 'Hello' --do-sample --seed 0 --top-k 50 --json",
    "zeroshard generate ./my-model --prompt 'Hello' --offload nvme --nvme-path /local_nvme --quant-bits 4",
    "zeroshard generate ./my-model --prompt 'Hello' --offload nvme --nvme-path /local_nvme --draft self",
    "torchrun --nproc_per_node 2 -m zeroshard.tools.cli generate ./my-model --prompt 'Hello'",
]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers,
        "generate",
        summary="generate with a model larger than memory (ZeRO-Inference)",
        description=DESCRIPTION,
        examples=EXAMPLES,
    )
    parser.add_argument("model", metavar="MODEL_DIR", type=Path, help="a save_pretrained() directory (safetensors)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs the tokenizer files in MODEL_DIR or --tokenizer)")
    prompt.add_argument("--prompt-ids", metavar="IDS", help="prompt token ids, comma separated (no tokenizer needed)")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer directory (default: MODEL_DIR)")
    parser.add_argument(
        "--max-new-tokens", type=bounded(int, 1), default=32, metavar="N", help="tokens to generate (default: 32)"
    )
    parser.add_argument(
        "--batch-size",
        type=bounded(int, 1),
        default=1,
        metavar="B",
        help="copies of the prompt generated together (default: 1)",
    )
    parser.add_argument(
        "--offload",
        choices=("cpu", "nvme"),
        default=None,
        help="where the weights live (default: cpu, or the --config's offload_param)",
    )
    parser.add_argument("--nvme-path", metavar="DIR", help="directory of the NVMe store (with --offload nvme)")
    parser.add_argument(
        "--config",
        type=Path,
        metavar="JSON",
        help="DeepSpeed config (zero_optimization stage 3, offload_param, bf16/fp16, ...)",
    )
    parser.add_argument(
        "--quant-bits",
        type=int,
        choices=(8, 4),
        default=None,
        help="keep the weights quantized to 8 or 4 bits in the store (weight_quantization.quantized_initialization)",
    )
    parser.add_argument(
        "--packed-matmul",
        action="store_true",
        help="with --quant-bits 4: Linear layers multiply by the packed weights (torch's int4 kernel, bf16 "
        "activations; tokens close to, not equal to, the dequantized model's: zeroshard.packed_matmul)",
    )
    parser.add_argument(
        "--group-size",
        type=bounded(int, 1),
        default=64,
        metavar="G",
        help="weights sharing one scale and minimum, with --quant-bits or --draft self (default: 64)",
    )
    parser.add_argument(
        "--draft",
        metavar="self|DIR",
        default=None,
        help="speculative decoding (batch 1): 'self' = a 4-bit copy of MODEL_DIR kept in memory, or a "
        "save_pretrained() directory of a small model with the same vocabulary",
    )
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--seed", type=int, default=0, help="random seed for sampling (default: 0)")
    parser.add_argument("--temperature", type=bounded(float, 0.0, inclusive=False), default=None)
    parser.add_argument("--top-k", type=bounded(int, 1), default=None)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=run)


def build_config(args: argparse.Namespace) -> dict:
    """The DeepSpeed config of the run: --config, with stage 3 and --offload/--nvme-path over it."""
    from zeroshard.config import ConfigError, read_config

    try:
        config = read_config(args.config) if args.config is not None else {}
    except ConfigError as error:
        raise CommandError(f"--config {args.config}: {error}") from None
    zero = dict(config.get("zero_optimization") or {})
    if zero.get("stage", 3) != 3:
        raise CommandError(
            f"--config: zero_optimization.stage is {zero['stage']}; ZeRO-Inference streams stage-3 "
            "parameter shards, so the stage must be 3 (or left out)"
        )
    zero["stage"] = 3
    offload = dict(zero.get("offload_param") or {})
    if args.offload is not None:
        offload["device"] = args.offload
    offload.setdefault("device", "cpu")
    if args.nvme_path is not None:
        if offload["device"] != "nvme":
            raise CommandError("--nvme-path is only used with --offload nvme")
        offload["nvme_path"] = args.nvme_path
    if offload["device"] == "nvme" and not offload.get("nvme_path"):
        raise CommandError("--offload nvme needs --nvme-path DIR (or offload_param.nvme_path in --config)")
    zero["offload_param"] = offload
    zero.setdefault("stage3_prefetch_bucket_size", 1)  # prefetch the next unit only: memory stays ~2 units
    config = {**config, "zero_optimization": zero}
    if args.quant_bits is not None:
        config["weight_quantization"] = {
            "quantized_initialization": {"num_bits": args.quant_bits, "group_size": args.group_size}
        }
    if args.packed_matmul:
        if args.quant_bits != 4:
            raise CommandError(
                f"--packed-matmul multiplies by 4-bit weights: it needs --quant-bits 4 (got {args.quant_bits})"
            )
        config["zeroshard"] = {**(config.get("zeroshard") or {}), "packed_matmul": True}
    return config


def _draft(args: argparse.Namespace):
    """The assistant model of --draft, or None; with a counter of its forwards (its proposals)."""
    if args.draft is None:
        return None
    if args.batch_size != 1:
        raise CommandError(f"--draft decodes one sequence at a time: --batch-size must be 1, got {args.batch_size}")
    from zeroshard.inference import resident_draft

    if args.draft == "self":
        return resident_draft(args.model, num_bits=4, group_size=args.group_size)
    from transformers import AutoModelForCausalLM

    where = Path(args.draft)
    if not (where / "config.json").is_file():
        raise CommandError(f"--draft {args.draft}: give 'self' or a save_pretrained() directory (no config.json there)")
    return AutoModelForCausalLM.from_pretrained(where).eval()


def _prompt_ids(args: argparse.Namespace):
    import torch

    if args.prompt_ids is not None:
        try:
            ids = [int(token) for token in args.prompt_ids.split(",")]
        except ValueError:
            raise CommandError(
                f"--prompt-ids {args.prompt_ids!r}: give integers separated by commas, e.g. 5,6,7"
            ) from None
        return torch.tensor([ids] * args.batch_size), None
    from transformers import AutoTokenizer

    where = args.tokenizer or args.model
    try:
        tokenizer = AutoTokenizer.from_pretrained(where)
    except (OSError, ValueError) as error:
        raise CommandError(
            f"--prompt needs a tokenizer and {where} has none ({error}); give --tokenizer DIR or --prompt-ids"
        ) from None
    ids = tokenizer(args.prompt, return_tensors="pt").input_ids  # (1, T)
    return ids.repeat(args.batch_size, 1), tokenizer


def run(args: argparse.Namespace) -> int:
    import torch

    from zeroshard.checkpoint import CheckpointError
    from zeroshard.compat.inference import from_pretrained

    config = build_config(args)
    prompt, tokenizer = _prompt_ids(args)
    try:
        engine = from_pretrained(args.model, config)
    except CheckpointError as error:
        raise CommandError(str(error)) from None
    vocab = cast(Any, engine.module).config.vocab_size  # a Hugging Face model's config
    if int(prompt.max()) >= vocab or int(prompt.min()) < 0:
        raise CommandError(f"prompt ids must lie in [0, {vocab}) for this model, got {prompt[0].tolist()}")
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, attention_mask=torch.ones_like(prompt))
    kwargs.update({k: v for k, v in (("temperature", args.temperature), ("top_k", args.top_k)) if v is not None})
    from zeroshard.inference import PassCounter, speculation_report

    draft = _draft(args)
    passes = PassCounter(engine.module)
    proposals = PassCounter(getattr(draft, "module", draft)) if draft is not None else None
    if draft is not None:
        kwargs["assistant_model"] = draft
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    tokens = engine.generate(prompt, **kwargs)
    seconds = time.perf_counter() - started
    new = tokens.shape[1] - prompt.shape[1]
    report = {
        "tokens": tokens.tolist(),
        "new_tokens": new,
        "batch_size": args.batch_size,
        "seconds": seconds,
        "tokens_per_s": new * args.batch_size / seconds,
        "ranks": engine.world_size,
        "store": config["zero_optimization"]["offload_param"]["device"],
        "quant_bits": args.quant_bits,
        "packed_layers": len(engine.inference.packed.layers) if engine.inference.packed is not None else 0,
    }
    if proposals is not None:
        report["speculation"] = speculation_report(new, passes.passes, proposals.passes)
        if hasattr(draft, "destroy"):
            draft.destroy()
    if tokenizer is not None:
        report["text"] = tokenizer.batch_decode(tokens, skip_special_tokens=True)
    if engine.global_rank == 0:
        _print(report, args.json)
    engine.destroy()
    return 0


def _print(report: dict, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(report) + "\n")
        return
    for row, tokens in enumerate(report.get("text") or report["tokens"]):
        sys.stdout.write(f"[{row}] {tokens}\n")
    bits = f", int{report['quant_bits']}" if report["quant_bits"] else ""
    packed = f", {report['packed_layers']} layers packed" if report["packed_layers"] else ""
    sys.stdout.write(
        f"{report['new_tokens']} new tokens x {report['batch_size']} in {report['seconds']:.2f} s: "
        f"{report['tokens_per_s']:.2f} tokens/s ({report['ranks']} rank(s), weights in "
        f"{report['store']}{bits}{packed})\n"
    )
    if "speculation" in report:
        spec = report["speculation"]
        sys.stdout.write(
            f"speculative decoding: {spec['target_passes']} passes over the weights, "
            f"{spec['tokens_per_pass']:.2f} tokens a pass, {100 * spec['acceptance']:.0f}% of "
            f"{spec['draft_proposals']} proposals kept\n"
        )
