"""Time and memory of `engine.load_checkpoint` into a fresh engine ([Note: a load hands its tensors
over] in checkpoint/apply.py), and the time of the synchronous save before it.

    torchrun --standalone --nproc_per_node 2 benchmarks/checkpoint_load.py --dir CKPT --save
    torchrun --standalone --nproc_per_node 2 benchmarks/checkpoint_load.py --dir CKPT

The first launch trains one step of the GPT (default: 210M parameters, 16 layers of width 1024,
vocab 8192, sequence 128) at ZeRO stage 3 with torch's AdamW and saves a checkpoint to `--dir` (rank 0
prints how long `save_checkpoint` took, from a barrier); the second,
in fresh processes as after a restart, builds the same engine and loads it. Each rank prints how long
the load took and its resident memory: at the start of the load, the most above it while loading
(zeroshard.tools.bench.measure.PeakMemory, the bench's meter) and above it once loaded. The page cache holds the checkpoint
the first launch wrote unless it is dropped between the two.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist

import zeroshard
from zeroshard.tools.bench.measure import PeakMemory, rss
from zeroshard.tools.models.gpt import GPT, GPTConfig

VOCAB, SEQ = 8192, 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True, help="the checkpoint directory")
    parser.add_argument("--save", action="store_true", help="train one step and save instead of loading")
    parser.add_argument("--layers", type=int, default=16, help="GPT layers (default: 16)")
    parser.add_argument("--width", type=int, default=1024, help="GPT width, heads of 64 (default: 1024)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    zeroshard.init_distributed()
    torch.manual_seed(0)
    shape = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=args.layers, n_head=args.width // 64, n_embd=args.width)
    model = GPT(shape)
    count = sum(p.numel() for p in model.parameters())  # before stage 3 partitions them
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    engine, *_ = zeroshard.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4), config=config
    )
    if args.save:
        tokens = torch.randint(0, VOCAB, (1, SEQ + 1))
        _, loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        dist.barrier()
        began = time.perf_counter()
        engine.save_checkpoint(args.dir)
        took = time.perf_counter() - began
        if dist.get_rank() == 0:
            print(f"saved {count:,} parameters to {args.dir} in {took:.2f} s", flush=True)
    else:
        meter = PeakMemory(torch.device("cpu"))
        dist.barrier()
        start = rss()
        meter.reset()
        began = time.perf_counter()
        engine.load_checkpoint(args.dir)
        took = time.perf_counter() - began
        peak, after = meter.peak(), rss()
        print(
            f"rank {dist.get_rank()}: load {took:.2f} s; resident {start / 1e9:.3f} GB at the start, "
            f"+{(peak - start) / 1e9:.3f} GB at most while loading, +{(after - start) / 1e9:.3f} GB once loaded",
            flush=True,
        )
    engine.destroy()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
