"""One GPU, ZeRO stage 2 with the optimizer offloaded to CPU (ZeRO-Offload, arXiv 2101.06840):
bf16 compute on the GPU, fp32 master weights and AdamW states in host memory, the fused AdamW
kernel running on the CPU. Reports model TFLOP/s and GPU memory. Never part of CI.

    torchrun --nproc_per_node 1 benchmarks/gpu_offload.py --n-layer 24 --n-embd 2048 --steps 10

TFLOP/s counts 6 x parameters x tokens per step (forward + backward of the matmuls, Kaplan et al.)
plus attention (12 x layers x width x seq^2 per sequence), over the median step time after warm-up.
GPU memory is the allocator's peak (torch.cuda.max_memory_allocated), with and without offload.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

import zeroshard
from zeroshard.tools.models.gpt import GPT, GPTConfig


def run(args, offload: bool) -> dict:
    torch.manual_seed(0)
    torch.cuda.reset_peak_memory_stats()
    model = GPT(GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer,
                          n_head=args.n_head, n_embd=args.n_embd)).cuda()
    zero = {"stage": 2, "overlap_comm": True}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    config = {"train_micro_batch_size_per_gpu": args.batch, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
              "zero_optimization": zero}
    engine, *_ = zeroshard.initialize(model=model, config=config)
    params = engine.num_parameters()
    times = []
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device="cuda")
        torch.cuda.synchronize()
        started = time.perf_counter()
        _, loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
    median = statistics.median(times)
    tokens_per_step = args.batch * args.seq
    flops = 6 * params * tokens_per_step + 12 * args.n_layer * args.n_embd * args.seq ** 2 * args.batch
    result = dict(offload=offload, params=params, median_step_s=median, tflops=flops / median / 1e12,
                  tokens_per_s=tokens_per_step / median, gpu_peak_gb=torch.cuda.max_memory_allocated() / 1e9,
                  last_loss=loss.item())
    engine.destroy()
    del model
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-layer", type=int, default=24)
    parser.add_argument("--n-embd", type=int, default=2048)
    parser.add_argument("--n-head", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default="gpu_offload.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_offload.py needs a CUDA GPU; on CPU use benchmarks/offload_nvme.py")
    zeroshard.init_distributed()
    results = [run(args, offload=False), run(args, offload=True)]
    for r in results:
        print(f"offload={r['offload']!s:5}  {r['params'] / 1e9:.2f}B params  step {r['median_step_s']:.3f} s  "
              f"{r['tflops']:.1f} TFLOP/s  {r['tokens_per_s']:,.0f} tokens/s  GPU peak {r['gpu_peak_gb']:.1f} GB")
    with open(args.out, "w") as handle:
        json.dump(dict(device=torch.cuda.get_device_name(), args=vars(args), results=results), handle, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
