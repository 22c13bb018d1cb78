"""Muon + AdamW under ZeRO, side by side: DDP, zeroshard stages 1-3 and DeepSpeed's Muon at stages 1-3.

    python benchmarks/muon.py --size 33m --out docs/bench/muon_33m.txt
    python benchmarks/muon.py --size 218m --steps 3 --warmup 1 --modes ddp,zs1,zs3 --out /tmp/muon_218m.txt
    python benchmarks/muon.py --modes ds1,ds2 --ds-python /path/to/deepspeed-venv/bin/python

Each mode is one `torchrun --standalone --nproc_per_node 2` launch (gloo, 1 torch thread per rank, fp32)
on the same GPT (pre-LN, untied head; embeddings named `embed`/`pos_embed` and the head `lm_head`,
so DeepSpeed's name rule and ours pick the same matrices: the blocks' four weights), seed 1234, the
same random tokens, micro-batch 4 x 128 per rank. The optimizers are DeepSpeed's MuonWithAuxAdam
defaults: Muon lr 0.02, momentum 0.95 on the hidden matrices; AdamW lr 3e-4, betas (0.9, 0.95), eps
1e-10 on the rest; no weight decay, no clipping (`gradient_clipping: 0`: DeepSpeed's default, which
zeroshard's config keeps, is 1.0, and DDP clips nothing).
  * `ddp`: DistributedDataParallel, `torch.optim.Muon` and `torch.optim.AdamW` stepped in turn;
  * `zsN`: zeroshard stage N through `zeroshard.initialize`, given the same two torch optimizers as a
    list, its defaults otherwise (overlap_comm on); `zsNa`: the same with AdamW alone over every
    parameter (AdamW's values above), the yardstick for Muon's bytes and memory at that stage;
  * `dsN`: DeepSpeed 0.19.8 stage N with `"optimizer": {"type": "Muon"}` and the same values (its own
    Newton-Schulz, `ns_method` "gram" by default); run with `--ds-python`, a venv where DeepSpeed is
    installed (docs/benchmarks.md, "DeepSpeed's rows"), zeroshard's src/ on PYTHONPATH for the meters only;
    at stage 3 with `reduce_scatter: false`, which DeepSpeed requires for Muon there.

Figures, per mode: the median over the timed steps of the slowest rank's step time (forward, backward,
optimizer step; a barrier before each, untimed); bytes per step in the paper's convention (zeroshard:
its counter; DDP and DeepSpeed: `C10dByteCounter` on one extra step); the peak RSS per rank over the
timed steps (VmHWM reset after warm-up; compare peaks only from runs with `MALLOC_MMAP_THRESHOLD_=65536`,
[Note: measuring peak memory] in tools/bench/measure.py); the matrices each rank's Muon updated per
step and their Newton-Schulz multiply-adds (`zeroshard.core.owners.newton_schulz_flops`; DeepSpeed's
split is not observable from outside: `-`); the mean loss over ranks at each timed step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

SIZES = {"33m": dict(vocab=8192, d=512, layers=8, heads=8), "218m": dict(vocab=8192, d=1024, layers=16, heads=16)}
SEQ, MICRO, SEED = 128, 4, 1234
MUON = dict(lr=0.02, momentum=0.95, weight_decay=0.0)
ADAMW = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0)
ROOT = Path(__file__).resolve().parent.parent


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(C, 2))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int):
        super().__init__()
        self.embed, self.pos_embed = nn.Embedding(vocab, d), nn.Embedding(SEQ, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f, self.lm_head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.embed(idx) + self.pos_embed(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def hidden(name: str, param: torch.Tensor) -> bool:
    """DeepSpeed's rule (deepspeed.set_optimizer_flags), restricted to the 2-D matrices torch's Muon takes."""
    return param.ndim == 2 and not any(word in name.lower() for word in ("embed", "lm_head"))


def torch_optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    named = list(model.named_parameters())
    matrices = [p for n, p in named if hidden(n, p)]
    others = [p for n, p in named if not hidden(n, p)]
    return [torch.optim.Muon(matrices, **MUON), torch.optim.AdamW(others, **ADAMW)]


def batch(step: int, rank: int, vocab: int):
    gen = torch.Generator().manual_seed(SEED * 1009 + step * 31 + rank)
    tokens = torch.randint(0, vocab, (MICRO, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


# -- on each rank -----------------------------------------------------------------------------------------


def worker(args) -> None:
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "src"))
    from zeroshard.core.owners import newton_schulz_flops
    from zeroshard.tools.bench.measure import C10dByteCounter, PeakMemory

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    meter_group = dist.new_group(backend="gloo")  # the bench's own reductions, apart from the system's
    shape = SIZES[args.size]
    torch.manual_seed(SEED)
    model = GPT(shape["vocab"], shape["d"], shape["layers"], shape["heads"])
    updates: dict[str, float] = {"matrices": 0, "flops": 0.0}

    def count_updates(muon, *_):  # a step pre-hook: what this rank's Muon is about to update
        for group in muon.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    updates["matrices"] += 1
                    updates["flops"] += newton_schulz_flops(p.shape, group["ns_steps"])

    kind, stage = args.mode[:2], int(args.mode[2]) if args.mode[2:3].isdigit() else 0
    adamw_only = args.mode.endswith("a")
    zs_counter = None
    if kind == "dd":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model)
        optimizers = torch_optimizers(model)
        optimizers[0].register_step_pre_hook(count_updates)

        def step(x, y) -> float:
            loss = ddp(x, y)
            loss.backward()
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            return loss.item()

    elif kind == "zs":
        import zeroshard

        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage},
        }
        optimizer = torch.optim.AdamW(model.parameters(), **ADAMW) if adamw_only else torch_optimizers(model)
        engine, *_ = zeroshard.initialize(model=model, optimizer=optimizer, config=config)
        if not adamw_only:
            engine.optimizer.optimizer.muon.register_step_pre_hook(count_updates)
        zs_counter = engine.comm.counter

        def step(x, y) -> float:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss.item()

    else:
        import deepspeed

        for name, param in model.named_parameters():  # deepspeed.initialize sets the same by its rule
            param.use_muon = hidden(name, param)
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_clipping": 0.0,
            # DeepSpeed's stage 3 refuses Muon with its reduce-scatter ("Muon and reduce scatter cannot be
            # used together"): it all-reduces instead
            "zero_optimization": {
                "stage": stage,
                "overlap_comm": True,
                **({"reduce_scatter": False} if stage == 3 else {}),
            },
            "optimizer": {
                "type": "Muon",
                "params": {
                    "muon_lr": MUON["lr"],
                    "adam_lr": ADAMW["lr"],
                    "momentum": MUON["momentum"],
                    "betas": list(ADAMW["betas"]),
                    "eps": ADAMW["eps"],
                    "weight_decay": 0.0,
                },
            },
        }
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

        def step(x, y) -> float:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss.item()

    def timed(index: int) -> tuple[float, float]:
        x, y = batch(index, rank, shape["vocab"])
        dist.barrier(group=meter_group)
        started = time.perf_counter()
        loss = step(x, y)
        took = torch.tensor([time.perf_counter() - started, loss / world], dtype=torch.float64)
        slowest = took[:1].clone()
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=meter_group)
        mean_loss = took[1:].clone()
        dist.all_reduce(mean_loss, group=meter_group)
        return float(slowest), float(mean_loss)

    for index in range(args.warmup):
        timed(index)
    peak = PeakMemory(torch.device("cpu"))
    peak.reset()
    updates.update(matrices=0, flops=0.0)
    before = zs_counter.data_bytes() if zs_counter is not None else 0
    results = [timed(args.warmup + i) for i in range(args.steps)]
    peak_bytes = peak.peak()
    per_step = {k: v / args.steps for k, v in updates.items()}
    if zs_counter is not None:
        comm_bytes = (zs_counter.data_bytes() - before) / args.steps
    else:
        with C10dByteCounter() as counter:
            timed(args.warmup + args.steps)
        comm_bytes = sum(counter.paper.values())
    every = [None] * world
    dist.all_gather_object(every, {"peak": peak_bytes, **per_step}, group=meter_group)
    if rank == 0:
        result = {
            "mode": args.mode,
            "params": engine.num_parameters()
            if kind == "zs"
            else sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()),
            "step_s": statistics.median(t for t, _ in results),
            "step_times": [t for t, _ in results],
            "losses": [loss for _, loss in results],
            "comm_bytes": comm_bytes,
            "peak_mb": [round(r["peak"] / 2**20) for r in every],
            "muon_matrices": [r["matrices"] for r in every] if kind != "ds" and not adamw_only else None,
            "ns_gflop": [round(r["flops"] / 1e9, 3) for r in every] if kind != "ds" and not adamw_only else None,
        }
        print("RESULT " + json.dumps(result), flush=True)
    dist.barrier(group=meter_group)
    dist.destroy_process_group()


# -- the launcher --------------------------------------------------------------------------------------------


def launch(args, mode: str) -> dict | None:
    python = args.ds_python if mode.startswith("ds") else sys.executable
    command = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}", __file__]
    command += [
        "--worker",
        "--mode",
        mode,
        "--size",
        args.size,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    started = time.time()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        print(f"{mode}: exit {done.returncode}\n{done.stderr[-3000:]}", file=sys.stderr)
        return None
    result = json.loads(lines[-1][len("RESULT ") :])
    result["wall_s"] = round(time.time() - started, 1)
    return result


def table(results: list[dict]) -> str:
    base = next((r for r in results if r["mode"] == "ddp"), None)
    rows = [
        "| mode | step s | x DDP | comm MB/step | peak MB/rank | Muon matrices/rank/step | Newton-Schulz GFLOP/rank/step | losses |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ratio = f"{r['step_s'] / base['step_s']:.2f}" if base else "-"
        same = "= DDP" if base and r["losses"] == base["losses"] else " ".join(f"{x:.6f}" for x in r["losses"][:3])
        rows.append(
            f"| {r['mode']} | {r['step_s']:.3f} | {ratio} | {r['comm_bytes'] / 1e6:.1f} | "
            f"{'/'.join(map(str, r['peak_mb']))} | {'/'.join(str(round(m)) for m in r['muon_matrices'] or []) or '-'} | "
            f"{'/'.join(map(str, r['ns_gflop'] or [])) or '-'} | {same} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="ddp")
    parser.add_argument("--modes", default="ddp,zs1,zs2,zs3")
    parser.add_argument("--size", choices=sorted(SIZES), default="33m")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--ds-python", default=None, help="python of a venv with DeepSpeed, for the ds modes")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--out", type=Path, default=None, help="write the table and the raw results here")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    modes = args.modes.split(",")
    if any(m.startswith("ds") for m in modes) and not args.ds_python:
        parser.error("the ds modes need --ds-python (a venv with DeepSpeed installed)")
    results = []
    for mode in modes:
        result = launch(args, mode)
        if result is not None:
            results.append(result)
            print(json.dumps(result), flush=True)
    text = table(results)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n\n" + "\n".join(json.dumps(r) for r in results) + "\n")


if __name__ == "__main__":
    main()
