"""Per-rank memory of each model-state recipe at stage 3, 2 ranks: the model states each rank holds
(counted from its tensors), its process's peak during training steps, and the estimator's model.

    python benchmarks/recipe_memory.py --out docs/bench/recipe_memory.txt

One `torchrun --standalone --nproc_per_node 2` launch (gloo, 1 torch thread per rank,
MALLOC_MMAP_THRESHOLD_=65536 so that freed buffers leave the process) per recipe, each training the
same GPT (default: vocab 8192, 16 layers of width 1024, sequence 128, untied head: 218M parameters;
`--layers 8 --width 512` is the 33.7M one) with ZeRO stage 3 and the same random tokens, lr 1e-3,
no weight decay. The recipes:

  fp32                    fp32 compute, torch AdamW
  fp32-adamw8bit          fp32 compute, torchao AdamW8bit
  fp32-adamw4bit          fp32 compute, torchao AdamW4bit
  bf16                    bf16 compute, fp32 masters, torch AdamW
  bf16-masters            bf16 masters and moments (bf16_master_weights_and_grads), torch AdamW
  bf16-masters-adamw8bit  bf16 masters, torchao AdamW8bit with bf16_stochastic_round=True
  bf16-masters-adamw4bit  bf16 masters, torchao AdamW4bit with bf16_stochastic_round=True

Per recipe and rank: the model states held after the steps (`memory_report()`: parameters, masters,
gradients and optimizer states), the estimator's model-state bytes per rank for the recipe (`zeroshard
estimate`, stage 3, 2 ranks), the process's resident memory before the steps, and its peak over the
measured steps (VmHWM, reset after one untimed step, in which torchao compiles its update). A
micro-batch of 1 x 32 tokens keeps activations small beside the model states, and the bf16 rows
within reach of a CPU without AVX-512 BF16, where a bf16 matrix product is many times slower than
an fp32 one; for that reason no step time is reported here (docs/bench/lowbit_states.txt has the
step times of the fp32 rows).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from two_ranks import (
    RECIPES,
    add_shape_arguments,
    bf16_config,
    build_optimizer,
    gpt_shape,
    launch_for_result,
    parse_recipes,
    write_record,
)

MICRO, TOKENS, SEED = 1, 32, 1234
MiB = 2**20


def worker(args) -> None:
    import torch.distributed as dist

    import zeroshard
    from zeroshard.tools import estimator as est
    from zeroshard.tools.bench.measure import PeakMemory, rss, trim
    from zeroshard.tools.models.gpt import GPT, GPTConfig

    precision, bf16_masters, optimizer, states = RECIPES[args.worker]
    torch.set_num_threads(1)
    zeroshard.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    config: dict = {
        "train_micro_batch_size_per_gpu": MICRO,
        "zero_optimization": {"stage": 3},
        "gradient_clipping": 0.0,
        "bf16": bf16_config(precision, bf16_masters),
    }
    shape = args.shape
    torch.manual_seed(SEED)
    model = GPT(GPTConfig(**shape))
    if bf16_masters:  # the optimizer steps the bf16 parameters themselves
        model.to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    adamw = build_optimizer(optimizer, model.parameters(), lr=1e-3, weight_decay=0.0)
    engine, *_ = zeroshard.initialize(model=model, optimizer=adamw, config=config)
    gen = torch.Generator().manual_seed(SEED + rank)
    tokens = torch.randint(0, shape["vocab_size"], (args.steps + 1, MICRO, TOKENS + 1), generator=gen)
    peak = PeakMemory(torch.device("cpu"))
    for step in range(args.steps + 1):
        if step == 1:  # after the untimed step: torchao has compiled, buffers exist
            trim()
            at_rest = rss()
            peak.reset()
        _, loss = engine(tokens[step, :, :-1], tokens[step, :, 1:])
        engine.backward(loss)
        engine.step()
    highest = peak.peak()
    held = engine.memory_report()
    rec = est.recipe(precision, states, master="bf16" if bf16_masters else "fp32")
    mine = [held["total"], at_rest, highest, float(loss)]
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        result = {
            "recipe": args.worker,
            "params": params,
            "modelled": est.model_state_bytes(params, world, 3, rec).total,
            "bytes_per_param": float(est.bytes_per_param(rec)),
            "ranks": [dict(zip(("states", "at_rest", "peak", "loss"), r)) for r in everyone],
            "method": peak.method,
        }
        args.result.write_text(json.dumps(result))
    engine.destroy()
    dist.destroy_process_group()


def table(rows: list[dict]) -> str:
    lines = [
        f"{'recipe':<23} {'params':>12} {'B/param':>7} {'modelled/rank':>14} {'states r0':>10} {'states r1':>10} "
        f"{'at rest r0':>11} {'peak r0':>8} {'peak r1':>8}   (MiB)"
    ]
    for row in rows:
        r0, r1 = row["ranks"]
        lines.append(
            f"{row['recipe']:<23} {row['params']:>12,} {row['bytes_per_param']:>7.2f} {row['modelled'] / MiB:>14.1f} "
            f"{r0['states'] / MiB:>10.1f} {r1['states'] / MiB:>10.1f} {r0['at_rest'] / MiB:>11.1f} "
            f"{r0['peak'] / MiB:>8.1f} {r1['peak'] / MiB:>8.1f}"
        )
    return "\n".join(lines + [f"peak: {rows[0]['method']}"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="measured steps per recipe, after one untimed")
    parser.add_argument("--recipes", default=",".join(RECIPES), help=f"a comma-separated list of {', '.join(RECIPES)}")
    add_shape_arguments(parser, layers=16, width=1024)
    parser.add_argument("--out", type=Path, default=None, help="also write the command and the table here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: at least 1")
    args.shape = gpt_shape(parser, args)
    if args.worker is not None:
        worker(args)
        return
    rows = []
    for name in parse_recipes(parser, args.recipes):
        argv = ["--worker", name, "--steps", str(args.steps), "--layers", str(args.layers), "--width", str(args.width)]
        rows.append(launch_for_result(__file__, argv, f"{name}: the launch", env={"MALLOC_MMAP_THRESHOLD_": "65536"}))
        print(table(rows).splitlines()[-2], flush=True)
    text = table(rows)
    print(text)
    write_record(args.out, __file__, text, torchao=True)


if __name__ == "__main__":
    main()
