"""One GPU, ZeRO stage 2, bf16, with and without the optimizer offloaded to CPU (ZeRO-Offload,
arXiv 2101.06840): the fp32 master weights and AdamW states in host memory, torch's fused AdamW
kernel stepping them on the CPU, bf16 compute on the GPU. Never part of CI; benchmarks/gpu_check.sh
runs it (docs/gpu.md).

    python benchmarks/gpu_offload.py --mode offload --size auto --out offload.json
    python benchmarks/gpu_offload.py --mode plain --like offload.json --out plain.json
    python benchmarks/gpu_offload.py --summarize offload.json plain.json --out summary.json

`--size auto` takes the largest shape of SHAPES whose model states fit the memory the mode puts them
in (host RAM for offload, GPU memory without), by the byte counts of `state_bytes`, and no larger than
`--max-params` billion parameters when given; `--like` reuses
another run's shape, micro batch and accumulation so the two modes train the same model on the same
tokens. A run whose micro batch does not fit is retried with half the micro batch and twice the
accumulation (same tokens per step); a model whose states do not fit is recorded as such.

Figures: tokens/s and model TFLOP/s over the median step after warm-up, against `--peak-tflops`
(790: the H200's bf16 dense peak as measured there); model FLOPs count 6 x parameters x tokens plus
attention (12 x layers x width x seq^2 per sequence, Kaplan et al.); GPU peak memory is the
allocator's (torch.cuda.max_memory_allocated); CPU Adam time is the time inside the torch
optimizer's step (its step hooks), summed over the step's sub-groups; step time is split into
forward+backward (all micro steps) and the engine's step (norm, Adam, copies back to the GPU).
`--dry-run` runs a tiny model on the CPU (gloo) so that the script is known to work before a GPU.
Progress (build, initialisation, each step) goes to stderr as it happens, so that a run stopped by a
time limit still says how far it came.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import socket
import statistics
import sys
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

import zeroshard
from zeroshard.tools.models.gpt import GPT, GPTConfig

# (n_layer, n_embd, n_head), smallest first: GPT-3-like shapes from 0.35B to 13B parameters.
SHAPES = [
    (24, 1024, 16),
    (24, 2048, 16),
    (32, 2560, 32),
    (36, 3072, 24),
    (40, 3072, 24),
    (32, 3584, 28),
    (40, 3584, 28),
    (32, 4096, 32),
    (40, 4096, 32),
    (40, 5120, 40),
]
DRY_SHAPE = (2, 64, 4)
# Bytes per parameter where each mode keeps the model states (stage 2, one rank, bf16, AdamW):
#   offload, host: fp32 master 4 + exp_avg 4 + exp_avg_sq 4 + bf16 gradient shard 2 + its fp32 copy
#                  for the step 4;  GPU: bf16 parameters 2 (+ one unit's gradients in flight)
#   plain,   GPU:  bf16 parameters 2 + master 4 + states 8 + bf16 gradient shard 2 + fp32 copy 4
STATE_BYTES = {"offload": {"host": 18, "gpu": 2}, "plain": {"host": 0, "gpu": 20}}
HOST_FRACTION = 0.75  # of available host memory, leaving room for the process, pinned-copy staging
GPU_FRACTION = 0.6  # of GPU memory for model states: the rest is activations and the allocator's slack


def num_params(shape, vocab: int, seq: int) -> int:
    n_layer, n_embd, _ = shape
    return 12 * n_layer * n_embd**2 + (vocab + seq) * n_embd


def fits(shape, mode: str, args, host: int, gpu: int) -> bool:
    params = num_params(shape, args.vocab, args.seq)
    need = STATE_BYTES[mode]
    return need["host"] * params <= HOST_FRACTION * host and need["gpu"] * params <= GPU_FRACTION * gpu


def memory_budget(device: torch.device) -> tuple[int, int]:
    host = psutil.virtual_memory().available
    gpu = torch.cuda.mem_get_info(device)[1] if device.type == "cuda" else host
    return host, gpu


def init_world_of_one(device: torch.device) -> None:
    """This process alone, without torchrun (NCCL on the GPU, gloo on the CPU)."""
    if dist.is_initialized():
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    zeroshard.init_distributed("nccl" if device.type == "cuda" else "gloo")


def config_for(args, mode: str, micro: int, gas: int) -> dict:
    zero = {"stage": 2, "overlap_comm": True}
    if mode == "offload":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": args.device == "cuda"}
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "zeroshard": {"check_collectives": False},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
    }


class AdamClock:
    """Seconds spent inside the torch optimizer's step (pre/post hooks), per engine step."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.total = 0.0
        self._started = 0.0
        optimizer.register_step_pre_hook(self._pre)
        optimizer.register_step_post_hook(self._post)

    def _pre(self, *_):
        self._started = time.perf_counter()

    def _post(self, *_):
        self.total += time.perf_counter() - self._started


_STARTED = time.perf_counter()


def progress(message: str) -> None:
    print(f"[{time.perf_counter() - _STARTED:7.1f}s] {message}", file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(args, mode: str, shape, micro: int, gas: int, device: torch.device) -> dict:
    n_layer, n_embd, n_head = shape
    torch.manual_seed(0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with device:  # initialise on the device: no host copy of a model that may not fit there
        model = GPT(
            GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
        )
    built = time.perf_counter()
    progress(f"{mode}: built {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters on {device}")
    engine, *_ = zeroshard.initialize(model=model, config=config_for(args, mode, micro, gas))
    init_s = time.perf_counter() - built
    progress(f"{mode}: initialize took {init_s:.1f}s; micro batch {micro} x {gas} accumulation steps")
    clock = AdamClock(engine.optimizer.optimizer)
    steps, forward_backward, adam = [], [], []
    for step in range(args.warmup + args.steps):
        sync(device)
        started = time.perf_counter()
        for _ in range(gas):
            tokens = torch.randint(0, args.vocab, (micro, args.seq + 1), device=device)
            _, loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            if engine.is_gradient_accumulation_boundary():
                sync(device)
                stepped, clock.total = time.perf_counter(), 0.0
            engine.step()
        sync(device)
        ended = time.perf_counter()
        progress(f"{mode}: step {step} took {ended - started:.2f}s" + (" (warm-up)" if step < args.warmup else ""))
        if step >= args.warmup:
            steps.append(ended - started)
            forward_backward.append(stepped - started)
            adam.append(clock.total)
    params = engine.num_parameters()
    memory = engine.memory_report()
    last_loss = float(loss.item())
    engine.destroy()
    median = statistics.median(steps)
    tokens = micro * gas * args.seq
    flops = 6 * params * tokens + 12 * n_layer * n_embd * args.seq**2 * micro * gas
    gpu_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return dict(
        mode=mode,
        shape=dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head),
        params=params,
        micro_batch=micro,
        gradient_accumulation=gas,
        seq=args.seq,
        tokens_per_step=tokens,
        init_s=init_s,
        median_step_s=median,
        step_s=steps,
        median_forward_backward_s=statistics.median(forward_backward),
        median_engine_step_s=median - statistics.median(forward_backward),
        median_cpu_adam_s=statistics.median(adam) if mode == "offload" else None,
        tokens_per_s=tokens / median,
        tflops=flops / median / 1e12,
        fraction_of_peak=flops / median / 1e12 / args.peak_tflops,
        gpu_peak_bytes=gpu_peak,
        host_peak_rss_bytes=_peak_rss(),
        model_states=memory,
        last_loss=last_loss,
    )


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def run(args) -> dict:
    device = torch.device(args.device)
    init_world_of_one(device)
    host, gpu = memory_budget(device)
    if args.like:
        like = json.loads(Path(args.like).read_text())["run"]
        shape = tuple(like["shape"][k] for k in ("n_layer", "n_embd", "n_head"))
        micro, gas = like["micro_batch"], like["gradient_accumulation"]
    else:
        shape = DRY_SHAPE if args.dry_run else _pick_shape(args, host, gpu)
        micro, gas = args.batch, args.gas
    record = dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        torch=torch.__version__,
        host_available_bytes=host,
        gpu_total_bytes=gpu,
        peak_tflops=args.peak_tflops,
        fits_estimate={m: fits(shape, m, args, host, gpu) for m in STATE_BYTES},
    )
    while True:
        try:
            record["run"] = train(args, args.mode, shape, micro, gas, device)
            break
        except Exception as error:  # out of memory is a result here, anything else is re-raised
            if not _out_of_memory(error):
                raise
            record.setdefault("out_of_memory", []).append(
                dict(micro_batch=micro, gradient_accumulation=gas, error=str(error)[:300])
            )
            _free(device)
            if micro == 1:
                record["run"] = dict(
                    mode=args.mode,
                    shape=dict(zip(("n_layer", "n_embd", "n_head"), shape)),
                    params=num_params(shape, args.vocab, args.seq),
                    micro_batch=micro,
                    gradient_accumulation=gas,
                    does_not_fit=True,
                )
                break
            micro, gas = micro // 2, gas * 2
    return record


def _pick_shape(args, host: int, gpu: int):
    cap = float("inf") if args.max_params is None else args.max_params * 1e9
    fitting = [s for s in SHAPES if fits(s, "offload", args, host, gpu) and num_params(s, args.vocab, args.seq) <= cap]
    if not fitting:
        raise SystemExit(
            f"no shape of {SHAPES} fits {host / 1e9:.0f} GB of host memory for offload"
            + ("" if args.max_params is None else f" within --max-params {args.max_params}")
        )
    return fitting[-1]


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def summarize(paths: list[str]) -> dict:
    runs = {json.loads(Path(p).read_text())["run"]["mode"]: json.loads(Path(p).read_text()) for p in paths}
    out = {"runs": runs}
    offload, plain = runs.get("offload", {}).get("run", {}), runs.get("plain", {}).get("run", {})
    if "tflops" in offload and "tflops" in plain:
        out["offload_over_plain_throughput"] = offload["tflops"] / plain["tflops"]
    out["plain_fits"] = "tflops" in plain
    if "tflops" in offload:
        out["offload_fraction_of_peak"] = offload["fraction_of_peak"]
        out["goal_40_percent_of_peak_on_a_model_that_needs_offload"] = (
            offload["fraction_of_peak"] >= 0.4 and not out["plain_fits"]
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["offload", "plain"], default="offload")
    parser.add_argument("--size", choices=["auto"], default="auto", help="the largest shape that fits the mode")
    parser.add_argument("--max-params", type=float, help="with --size auto: at most this many billion parameters")
    parser.add_argument("--like", help="JSON of an earlier run: same shape, micro batch and accumulation")
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8, help="micro batch (sequences)")
    parser.add_argument("--gas", type=int, default=16, help="gradient accumulation steps")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--peak-tflops", type=float, default=790.0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dry-run", action="store_true", help="a tiny model on the CPU (gloo)")
    parser.add_argument("--summarize", nargs="+", metavar="JSON", help="merge runs and compute the ratio")
    parser.add_argument("--out", default="gpu_offload.json")
    args = parser.parse_args()
    if args.summarize:
        result = summarize(args.summarize)
    else:
        if args.dry_run:
            args.device, args.vocab, args.seq = "cpu", 256, 32
        elif not args.device.startswith("cuda"):
            raise SystemExit("gpu_offload.py needs a CUDA GPU (or --dry-run); on CPU use benchmarks/offload_nvme.py")
        result = run(args)
        run_ = result["run"]
        if "tflops" in run_:
            print(
                f"{args.mode}: {run_['params'] / 1e9:.2f}B params, micro {run_['micro_batch']} x gas "
                f"{run_['gradient_accumulation']}: step {run_['median_step_s']:.2f} s, {run_['tokens_per_s']:,.0f} "
                f"tokens/s, {run_['tflops']:.1f} TFLOP/s ({100 * run_['fraction_of_peak']:.1f}% of peak)"
            )
        else:
            print(f"{args.mode}: {run_['params'] / 1e9:.2f}B params do not fit")
        dist.destroy_process_group()
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
