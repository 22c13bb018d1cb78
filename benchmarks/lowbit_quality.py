"""What fewer bytes per parameter do to training: `zeroshard train`'s model trained with each
model-state recipe for the same tokens, against AdamW with fp32 masters at the same compute precision.

    python benchmarks/lowbit_quality.py --out docs/bench/lowbit_quality.txt

One `torchrun --standalone --nproc_per_node 2` launch (gloo, ZeRO stage 3, 1 torch thread per rank)
per recipe. Everything else is `zeroshard train`'s defaults (tools/demo/loop.py): the character-level
GPT of family member 3 (3 layers of width 192) on the standard library's source, micro-batch 8 x 128
per rank, 300 steps, linear warmup then cosine decay to 0.1 of the peak lr 2e-3, betas (0.9, 0.99),
weight decay 0.01, gradient clipping 1.0, seed 0. The optimizer is built here with those values and
handed to `zeroshard.initialize`, as a user's own optimizer is. The recipes:

  fp32                    fp32 compute, torch AdamW: the reference of the fp32 rows
  fp32-adamw8bit          fp32 compute, torchao AdamW8bit
  fp32-adamw4bit          fp32 compute, torchao AdamW4bit
  bf16                    bf16 compute, fp32 masters, torch AdamW: the reference of the bf16 rows
  bf16-masters            bf16 masters and moments (bf16_master_weights_and_grads), torch AdamW
  bf16-masters-adamw8bit  bf16 masters, torchao AdamW8bit with bf16_stochastic_round=True

Per recipe: the modelled bytes of model states per parameter (`zeroshard estimate`'s 2 + 2 + K at
bf16, 4 + 4 + K at fp32), the mean training loss of the last 10 steps, the held-out loss over 32
batches of the validation split (the same windows for every recipe) and its perplexity per
character, the held-out loss's difference from the reference of its precision, and the training
time (bf16 matrix products are slow on a CPU without AVX-512 BF16: the bf16 rows take far longer).
`--seed` trains from another initialisation and data order (the held-out windows stay the same):
how far a seed alone moves the losses says which differences between recipes mean something.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from two_ranks import (
    RECIPES,
    bf16_config,
    build_optimizer,
    launch_for_result,
    modelled_bytes,
    parse_recipes,
    write_record,
)

QUALITY_RECIPES = ("fp32", "fp32-adamw8bit", "fp32-adamw4bit", "bf16", "bf16-masters", "bf16-masters-adamw8bit")
REFERENCES = {"fp32": "fp32", "bf16": "bf16"}  # compute precision -> the row the others are compared with
STEPS, LR, VALIDATION_BATCHES = 300, 2e-3, 32
VALIDATION_SEED = 1  # the held-out windows: the same whatever --seed trains with


def worker(recipe: str, steps: int, out: Path, seed: int = 0) -> None:
    import torch.distributed as dist

    import zeroshard
    from zeroshard.tools.bench import family
    from zeroshard.tools.demo.corpus import Batches, CharTokenizer, load_corpus, split
    from zeroshard.tools.demo.loop import default_config
    from zeroshard.tools.models.gpt import GPT, GPTConfig

    precision, bf16_masters, optimizer, _ = RECIPES[recipe]
    torch.set_num_threads(1)
    zeroshard.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = {"steps": steps, "batch": 8, "lr": LR, "precision": precision, "seed": seed}
    config = default_config(spec)
    del config["optimizer"]  # the recipe's own optimizer object is passed
    config["bf16"] = bf16_config(precision, bf16_masters)
    corpus = load_corpus()
    tokenizer = CharTokenizer(corpus.text)
    torch.manual_seed(spec["seed"])
    model = GPT(GPTConfig(**{**family.gpt_shape(3, 0, 128), "vocab_size": tokenizer.vocab_size}))
    if bf16_masters:  # the optimizer steps the bf16 parameters themselves
        model.to(torch.bfloat16)
    settings = dict(lr=LR, betas=(0.9, 0.99), weight_decay=0.01)
    engine, *_ = zeroshard.initialize(
        model=model, optimizer=build_optimizer(optimizer, model.parameters(), **settings), config=config
    )
    train_tokens, val_tokens = split(tokenizer.encode(corpus.text))
    train = Batches(train_tokens, 128, 8, spec["seed"], rank)
    val = Batches(val_tokens, 128, 8, VALIDATION_SEED, rank)
    losses, started = [], time.perf_counter()
    for _ in range(steps):
        _, loss = engine(*train.next())
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    seconds = time.perf_counter() - started
    engine.eval()
    with torch.no_grad():
        held = torch.tensor([sum(engine(*val.next())[1].float().item() for _ in range(VALIDATION_BATCHES))])
    dist.all_reduce(held)
    if rank == 0:
        result = {
            "recipe": recipe,
            "seed": seed,
            "params": sum(p.numel() for p in model.parameters()),
            "train_loss_last_10": sum(losses[-10:]) / 10,
            "validation_loss": float(held) / (VALIDATION_BATCHES * world),
            "seconds": seconds,
        }
        out.write_text(json.dumps(result))
    engine.destroy()
    dist.destroy_process_group()


def table(rows: list[dict]) -> str:
    held = {r["recipe"]: r["validation_loss"] for r in rows}
    lines = [
        f"{'recipe':<23} {'B/param':>7} {'train loss (last 10)':>21} {'held-out loss':>14} {'perplexity':>11} "
        f"{'vs reference':>13} {'seconds':>8}"
    ]
    for row in rows:
        reference = REFERENCES[RECIPES[row["recipe"]][0]]
        change = f"{(row['validation_loss'] - held[reference]) / held[reference]:+.2%}" if reference in held else "-"
        per_param = f"{modelled_bytes(row['recipe']):.2f}".rstrip("0").rstrip(".")
        lines.append(
            f"{row['recipe']:<23} {per_param:>7} {row['train_loss_last_10']:>21.4f} "
            f"{row['validation_loss']:>14.4f} {math.exp(row['validation_loss']):>11.3f} {change:>13} "
            f"{row['seconds']:>8.0f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS, help=f"optimizer steps per run (default: {STEPS})")
    parser.add_argument(
        "--recipes",
        default=",".join(QUALITY_RECIPES),
        help=f"a comma-separated list of {', '.join(RECIPES)} (default: {','.join(QUALITY_RECIPES)})",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="the model's and the training data's seed (default: 0, the guide's run)"
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the command and the table here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 10:
        parser.error(f"--steps {args.steps}: at least 10 (the training loss is the mean of the last 10)")
    if args.worker is not None:
        worker(args.worker, args.steps, args.result, args.seed)
        return
    rows = []
    for name in parse_recipes(parser, args.recipes):
        argv = ["--worker", name, "--steps", str(args.steps), "--seed", str(args.seed)]
        rows.append(launch_for_result(__file__, argv, f"{name}: the launch"))
        print(table(rows).splitlines()[-1], flush=True)
    text = table(rows)
    print(text)
    write_record(args.out, __file__, text, torchao=True)


if __name__ == "__main__":
    main()
