"""Optimizer-state bytes and step time of torchao's and bitsandbytes' block-wise optimizers against
torch's AdamW, under zeroshard stage 3 at 2 ranks.

    python benchmarks/lowbit_states.py --out docs/bench/lowbit_states.txt

One `torchrun --standalone --nproc_per_node 2` launch (gloo, 1 torch thread per rank, fp32) trains
the same GPT (vocab 8192, 8 layers of width 512, sequence 128: 33.7M parameters with an untied head)
with each optimizer in turn: torch.optim.AdamW, torchao's AdamW8bit and AdamW4bit, bitsandbytes'
AdamW8bit (`bnb-adamw8bit`; lr 3e-4, weight decay 0.01), micro-batch 4 per rank, the same random
tokens. Per optimizer: the optimizer-state bytes
each rank holds after the timed steps (`ZeroOptimizer.state_bytes`: a quantized moment's codes,
scales and code map), the estimator's model for them (`zeroshard estimate --precision fp32
--optimizer ...`, per rank), the median over the timed steps of the slowest rank's step time, and the
loss of the last step. The first step of each optimizer is not timed: torchao compiles its update
there (`torch.compile`, once per parameter shape).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from two_ranks import launch, table_of, write_record

OPTIMIZERS = ("adamw", "adamw8bit", "adamw4bit", "bnb-adamw8bit")
MODELLED_AS = {"bnb-adamw8bit": "adamw8bit"}  # the same bytes: a code per element, a scale per 256
SHAPE = dict(vocab_size=8192, block_size=128, n_layer=8, n_head=8, n_embd=512, tie_weights=False)
MICRO, SEED = 4, 1234


def _optimizer(name: str, params):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=3e-4, weight_decay=0.01)
    if name == "bnb-adamw8bit":
        import bitsandbytes

        return bitsandbytes.optim.AdamW8bit(params, lr=3e-4, weight_decay=0.01)
    import torchao.optim

    return {"adamw8bit": torchao.optim.AdamW8bit, "adamw4bit": torchao.optim.AdamW4bit}[name](
        params, lr=3e-4, weight_decay=0.01
    )


def worker(args) -> None:
    import torch.distributed as dist

    import zeroshard
    from zeroshard.tools import estimator as est
    from zeroshard.tools.models.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    zeroshard.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    config = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 3}, "gradient_clipping": 0.0}
    gen = torch.Generator().manual_seed(SEED + rank)
    tokens = torch.randint(0, SHAPE["vocab_size"], (args.steps + 1, MICRO, SHAPE["block_size"] + 1), generator=gen)
    rows = []
    for name in args.optimizers:
        torch.manual_seed(SEED)
        model = GPT(GPTConfig(**SHAPE))
        params = sum(p.numel() for p in model.parameters())
        engine, _, _, _ = zeroshard.initialize(
            model=model, optimizer=_optimizer(name, model.parameters()), config=config
        )
        times, loss = [], None
        for step in range(args.steps + 1):
            dist.barrier()
            started = time.perf_counter()
            _, loss = engine(tokens[step, :, :-1], tokens[step, :, 1:])
            engine.backward(loss)
            engine.step()
            elapsed = torch.tensor([time.perf_counter() - started])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if step:  # the first step compiles torchao's update
                times.append(float(elapsed))
        held = torch.tensor([engine.optimizer.state_bytes()], dtype=torch.float64)
        everyone = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(everyone, held)
        modelled = est.model_state_bytes(params, world, 3, est.recipe("fp32", MODELLED_AS.get(name, name))).optimizer
        rows.append((name, params, [int(t) for t in everyone], modelled, statistics.median(times), float(loss)))
        engine.destroy()
    if rank == 0:
        print(
            f"{'optimizer':<13} {'params':>11} {'state bytes rank 0':>19} {'rank 1':>12} {'modelled/rank':>14} "
            f"{'B/param':>8} {'step s':>7} {'loss':>7}"
        )
        for name, params, held, modelled, step_s, loss in rows:
            per_param = sum(held) / params
            print(
                f"{name:<13} {params:>11,} {held[0]:>19,} {held[1]:>12,} {modelled:>14,} {per_param:>8.3f} "
                f"{step_s:>7.3f} {loss:>7.4f}"
            )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per optimizer (after one untimed)")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS), help=f"a comma-separated list of {OPTIMIZERS}")
    parser.add_argument("--out", type=Path, default=None, help="also write the command and the table here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.optimizers = [o for o in args.optimizers.split(",") if o]
    if bad := [o for o in args.optimizers if o not in OPTIMIZERS]:
        parser.error(f"--optimizers {bad}: allowed {', '.join(OPTIMIZERS)}")
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: at least 1")
    if args.worker:
        worker(args)
        return
    stdout = launch(__file__, ["--worker", "--steps", str(args.steps), "--optimizers", ",".join(args.optimizers)])
    text = table_of(stdout)
    print(text)
    write_record(args.out, __file__, text)


if __name__ == "__main__":
    main()
