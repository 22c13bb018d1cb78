"""The longest sequence that trains under a per-rank memory cap, with and without Ulysses sequence
parallelism and tiles, DeepSpeed's ALST beside it, and the tokens per second where they fit.

    python benchmarks/long_sequence.py --out docs/bench/long_sequence      # writes .txt and .json
    python benchmarks/long_sequence.py --deepspeed-python /path/venv/bin/python \
        --configs "sp=1,sp=2,sp=1 tiled,sp=2 tiled,DeepSpeed sp=2,DeepSpeed sp=2 tiled"

2 gloo ranks, 1 thread each, fp32, stage 3 (parameters all sharded: persistence threshold 0), torch's
AdamW, activation checkpointing of every decoder layer (transformers', non-reentrant), a Llama of
`zeroshard.tools.models.words` with a 128k vocabulary (width 512, 4 layers, MLP 1344, 8 heads / 4
key-value heads, untied head: 141.7M parameters), sdpa attention, random tokens. Configurations:
sp = 1 (dp = 2: each rank trains its own sequence of the length), sp = 2 (dp = 1: both ranks train
one sequence, half each), each with and without tiles (`TiledMLP` in every layer, tiles of 512
positions, ALST's sequence / hidden size; `TiledFusedLogitsLoss`, tiles of 256 positions, 128 MB of
logits); DeepSpeed 0.19.8's ZeRO-3 with ALST's pieces (`register_with_transformers`, its mpu, its
tiles with `compute_params`) at sp = 2, run by `--deepspeed-python` (a Python with deepspeed and
zeroshard installed), its parameters released after each module's use (`stage3_max_reuse_distance`
0, no prefetch bucket, as zeroshard does) and its buckets at 5e7 elements. Each system's loss is the
whole sequence's mean token loss (zeroshard: `whole_loss`; DeepSpeed: torch's differentiable
all-reduce over its sp group, as ALST's examples).

Each trial is its own `torchrun` launch with MALLOC_MMAP_THRESHOLD_=65536: each rank builds and
shards the model, trains one step of 64 tokens (so the optimizer's states exist), caps its memory
with RLIMIT_DATA at `--cap` ([Note: the memory cap] in tools/bench/capped.py: private writable
memory, thread stacks included, the process baseline included) and trains one step at the length. A
trial whose allocation fails does not fit. The search doubles the length from `--start` until a trial
fails, then bisects to 1/8 of the length that fit (128 tokens at least); it stops at `--max`. Tokens
per second count the tokens both ranks trained in a step, over the slowest rank's step time: at the
longest length every configuration fits, in a launch of its own, the second of 2 steps; at 8k, the
search's trial (one step after the warm-up).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

SHAPE = dict(vocab=int(os.environ.get("LONG_SEQUENCE_VOCAB", 128000)), hidden=512, layers=4)  # env: smoke runs
CONFIGS = {  # name: (system, sp, tiled)
    "sp=1": ("zeroshard", 1, False),
    "sp=1 tiled": ("zeroshard", 1, True),
    "sp=2": ("zeroshard", 2, False),
    "sp=2 tiled": ("zeroshard", 2, True),
    "DeepSpeed sp=2": ("deepspeed", 2, False),
    "DeepSpeed sp=2 tiled": ("deepspeed", 2, True),  # ALST
}
MLP_TILE = SHAPE["hidden"]  # positions per MLP tile: ALST's rule (sequence / hidden size tiles)
LOSS_TILE = 256  # positions per loss tile: 128 MB of fp32 logits at a 128k vocabulary


class _Tiled(torch.nn.Module):
    """The causal LM with tiled MLPs, whose forward returns the shard's summed token loss, tiled.

    `tiles` is the module holding TiledMLP and TiledFusedLogitsLoss (zeroshard's or DeepSpeed's: the
    same names and arguments); `params` passes each tile's parameters as `compute_params`, which
    DeepSpeed's ZeRO-3 needs and zeroshard does not."""

    def __init__(self, lm, tiles, params: bool):
        import functools

        super().__init__()
        self.lm, self.tiles, self.params = lm, tiles, params
        for layer in lm.model.layers:
            layer.mlp.forward = functools.partial(self._mlp, layer.mlp)

    def _mlp(self, mlp, x):
        shards = max(1, math.ceil(x.shape[-2] / MLP_TILE))
        compute = list(mlp.parameters()) if self.params else None
        return self.tiles.TiledMLP.apply(
            lambda module, tile: type(module).forward(module, tile), mlp, x, shards, compute
        )

    def forward(self, input_ids, position_ids, shift_labels):
        hidden = self.lm.model(input_ids=input_ids, position_ids=position_ids).last_hidden_state

        def loss(head, x, y):
            return F.cross_entropy(head(x).flatten(0, -2), y.flatten(), ignore_index=-100, reduction="sum")

        shards = max(1, math.ceil(hidden.shape[0] * hidden.shape[1] / LOSS_TILE))
        compute = [self.lm.lm_head.weight] if self.params else None
        head = self.lm.lm_head
        return self.tiles.TiledFusedLogitsLoss.apply(loss, head, hidden, shift_labels, None, shards, compute, "sum")


def _zeroshard(lm, sp: int, tiled: bool):
    """zeroshard's stage 3 over (dp, sp); returns (the model to call, a step from the summed loss and its token count, this rank in its sp group)."""
    from torch.distributed.device_mesh import init_device_mesh

    import zeroshard
    from zeroshard.compat.ulysses_sp import attach
    from zeroshard.runtime.sequence_parallel import ulysses_sp

    model = _Tiled(lm, ulysses_sp, params=False) if tiled else lm
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // sp, sp), mesh_dim_names=("dp", "sp")) if sp > 1 else None
    sharded = zeroshard.shard(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-5),
        stage=3,
        mesh=mesh,
        gathering=zeroshard.GatheringPolicy(persistence_threshold=0),
    )
    sequence = sharded.sequence_parallel
    if sequence is not None:
        attach(lm, sequence)

    def step(summed, count):
        loss = sequence.whole_loss(summed, count) if sequence is not None else summed / count
        loss.backward()
        sharded.step()
        return loss

    return sharded, step, sequence.rank if sequence is not None else 0


def _deepspeed(lm, sp: int, tiled: bool):
    """DeepSpeed's ZeRO-3 with ALST's pieces (register_with_transformers, its mpu, its tiles)."""
    import deepspeed
    from deepspeed.runtime.sequence_parallel import ulysses_sp

    deepspeed.init_distributed("gloo")  # its own comm module wraps the process group started here
    mpu = None
    if sp > 1:
        mpu = ulysses_sp.UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=lm, core_attn_implementation="sdpa", sequence_parallel_size=sp, micro_batch_size=1
        )
    model = _Tiled(lm, ulysses_sp, params=True) if tiled else lm
    world = dist.get_world_size()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world // sp,
        "sequence_parallel_size": sp,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,  # each module's parameters released after its use, as zeroshard does
            "stage3_prefetch_bucket_size": 0,
            # DeepSpeed's default 5e8 allocates a 2 GB gradient bucket at initialize (fp32), which alone
            # would leave it little room under the cap; 5e7 is the peers' comparisons' bucket.
            "reduce_bucket_size": 5e7,
            "allgather_bucket_size": 5e7,
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu)

    def step(summed, count):
        from torch.distributed.nn.functional import all_reduce

        if mpu is not None:  # the whole sequence's mean token loss, as ALST's examples compute it
            group = mpu.get_sequence_parallel_group()
            summed, count = all_reduce(summed, group=group), all_reduce(count, group=group)
        loss = summed / count
        engine.backward(loss)
        engine.step()
        return loss

    return engine, step, mpu.get_sequence_parallel_rank() if mpu is not None else 0


def trial(length: int, sp: int, tiled: bool, cap: int, out: str, steps: int, system: str) -> None:
    """One launch's rank: a warm-up step at 64 tokens (the optimizer's states exist after it), then
    `steps` steps at `length` under the cap; writes its report."""
    from zeroshard.core.sequence import shard_batch
    from zeroshard.tools.bench.capped import status_bytes
    from zeroshard.tools.models import words

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report: dict = {"rank": rank, "fits": False, "system": system}
    try:
        lm = words.llama(**SHAPE)
        lm.config._attn_implementation = "sdpa"
        lm.activation_checkpointing_enable()  # every decoder layer, torch's non-reentrant checkpoint
        model, step, sp_rank = (_zeroshard if system == "zeroshard" else _deepspeed)(lm, sp, tiled)
        del lm

        def train(tokens: int, seed: int) -> float:
            ids = torch.randint(3, SHAPE["vocab"], (1, tokens), generator=torch.Generator().manual_seed(seed))
            part = shard_batch({"input_ids": ids, "labels": ids}, sp_rank, sp)
            labels = part.pop("shift_labels")
            started = time.perf_counter()
            if tiled:
                summed = model(**part, shift_labels=labels)
            else:
                logits = model(**part).logits
                summed = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
                del logits
            loss = step(summed, (labels != -100).sum().to(summed.dtype))
            took = torch.tensor([time.perf_counter() - started])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            report["loss"] = loss.item()
            return float(took)

        data_rank = rank // sp  # the ranks of one sp group train the same sequence
        train(64, seed=1000 + data_rank)
        report["vmdata_before_cap"] = status_bytes("VmData")
        resource.setrlimit(resource.RLIMIT_DATA, (cap, resource.RLIM_INFINITY))
        times = [train(length, seed=data_rank * 7 + i) for i in range(steps)]
        report.update(fits=True, step_s=times[-1])
    except (MemoryError, RuntimeError) as error:
        resource.setrlimit(resource.RLIMIT_DATA, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        report["error"] = f"{type(error).__name__}: {str(error)[:300]}"
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    os._exit(0)  # no teardown: a rank that failed leaves its peer in a collective


def _machine() -> str:
    """The CPU's model name, its cores and memory, as the record names the machine."""
    import psutil

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    return f"{cpu}, {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB, Python {sys.version.split()[0]}"


def _launch(name: str, length: int, args, work: Path, steps: int = 1) -> dict:
    system, sp, tiled = CONFIGS[name]
    python = args.deepspeed_python if system == "deepspeed" else sys.executable
    run = work / f"{system}-{length}-{sp}-{int(tiled)}-{steps}"
    run.mkdir(parents=True, exist_ok=True)
    for old in run.glob("rank*.json"):
        old.unlink()
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536", TRANSFORMERS_VERBOSITY="error")
    command = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__]
    command += ["--trial", str(length), "--sp", str(sp), "--cap", str(args.cap), "--run-dir", str(run)]
    command += ["--steps", str(steps), "--system", system] + (["--tiled"] if tiled else [])
    try:
        subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=3600)
    except subprocess.TimeoutExpired:
        return {"fits": False, "error": "timeout"}
    reports = [json.loads(p.read_text()) for p in sorted(run.glob("rank*.json"))]
    if len(reports) < 2:  # not a failed allocation, which each rank reports: a crash to look at
        raise RuntimeError(f"{name} at {length} tokens ended without its reports; run it alone: {' '.join(command)}")
    fits = len(reports) == 2 and all(r["fits"] for r in reports)
    result = {"fits": fits, "reports": reports}
    if fits:
        result["step_s"] = max(r["step_s"] for r in reports)
        result["tokens_per_s"] = length * (2 // sp) / result["step_s"]
    return result


def search(name: str, args, work: Path, log) -> dict:
    tried: dict[int, dict] = {}

    def fits(length: int) -> bool:
        tried[length] = _launch(name, length, args, work)
        log(f"{name}: {length} tokens {'fits' if tried[length]['fits'] else 'does not fit'}")
        return tried[length]["fits"]

    low, high = 0, None
    length = args.start
    while length <= args.max:
        if fits(length):
            low, length = length, length * 2
        else:
            high = length
            break
    while high is not None and high - low > max(128, low // 8):
        middle = (low + high) // 256 * 128
        if middle <= low:
            break
        if fits(middle):
            low = middle
        else:
            high = middle
    return {"longest": low, "first_failure": high, "trials": {str(k): v for k, v in sorted(tried.items())}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_out/long_sequence")
    parser.add_argument("--work", default="bench_out/long_sequence_runs")
    parser.add_argument("--cap", type=int, default=3 * 2**30, help="RLIMIT_DATA per rank, bytes")
    parser.add_argument("--start", type=int, default=512)
    parser.add_argument("--max", type=int, default=8192, help="the longest length tried")
    parser.add_argument("--configs", default=",".join(n for n, c in CONFIGS.items() if c[0] == "zeroshard"))
    parser.add_argument("--deepspeed-python", help="a Python with deepspeed 0.19.8 (and zeroshard) installed")
    parser.add_argument("--trial", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--sp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--tiled", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--system", default="zeroshard", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trial:
        return trial(args.trial, args.sp, args.tiled, args.cap, args.run_dir, args.steps, args.system)
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"--configs: {unknown} unknown; the configurations are {list(CONFIGS)}")
    if any(CONFIGS[n][0] == "deepspeed" for n in names) and not args.deepspeed_python:
        parser.error("--configs names DeepSpeed's: give --deepspeed-python")
    work = Path(args.work)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines: list[str] = []

    def log(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    results = {name: search(name, args, work, log) for name in names}
    common = min(r["longest"] for r in results.values())
    long_lengths = [n for n in (8192, 16384, 32768) if n <= args.max]
    lengths = sorted(({common} - {0}) | set(long_lengths))
    speeds: dict[str, dict[str, dict]] = {name: {} for name in names}
    for name in names:  # at the longest common length: a launch of its own, 2 steps
        if common:
            speeds[name][str(common)] = speed = _launch(name, common, args, work, steps=2)
            rate = f"{speed['tokens_per_s']:.1f} tokens/s" if speed["fits"] else "did not fit again"
            log(f"{name}: {common} tokens, 2 steps: {rate}")
        for length in long_lengths:  # the search's own trial: one step after the warm-up
            trial_result = results[name]["trials"].get(str(length), {})
            if trial_result.get("fits") and length != common:
                speeds[name][str(length)] = trial_result
    table = [
        f"longest sequence under {args.cap / 2**30:.2f} GiB per rank (searched to {args.max}); tokens/s of the"
        f" 2 ranks at {common} tokens (2 steps, the second's) and at {', '.join(map(str, long_lengths))} (the"
        " search's trial: 1 step)"
    ]
    table.append(f"{'config':<22} {'longest':>8} {'first failure':>14} " + " ".join(f"{n:>9}" for n in lengths))
    for name, result in results.items():
        rates = []
        for length in lengths:
            speed = speeds[name].get(str(length), {})
            rates.append(f"{speed['tokens_per_s']:>9.1f}" if speed.get("fits") else f"{'-':>9}")
        failure = str(result["first_failure"] or f">{args.max}")
        table.append(f"{name:<22} {result['longest']:>8} {failure:>14} " + " ".join(rates))
    header = f"# benchmarks/long_sequence.py, {started}, torch {torch.__version__}\n# {' '.join(sys.argv)}\n"
    header += f"# machine: {_machine()}\n"
    text = header + "\n".join(lines) + "\n\n" + "\n".join(table) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.txt").write_text(text)
    Path(f"{args.out}.json").write_text(
        json.dumps({"started": started, "argv": sys.argv, "results": results, "speeds": speeds}, indent=1)
    )
    print("\n".join(table))


if __name__ == "__main__":
    main()
