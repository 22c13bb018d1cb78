"""TRL's trainers on zeroshard against TRL's own DDP run: DPO's per-rank memory (the reference model
included) and GRPO's step time with generation inside the step.

    python benchmarks/trl_trainers.py --out docs/bench/trl_trainers      # writes .txt and .json

The model is a Llama of `zeroshard.tools.models.words` (width 768, 8 layers, 12 heads / 6 key-value
heads, MLP 2048, vocabulary 32000, untied head: 101.7M parameters), saved once and loaded by path as
TRL loads models (and, for DPO, its reference model: a second copy). Every configuration is its own
`torchrun --standalone --nproc_per_node 2` launch on gloo, 1 torch thread per rank, fp32, TRL's
defaults otherwise (AdamW, gradient checkpointing on, clipping at 1.0); zeroshard is at stage 3 with its
defaults but `stage3_param_persistence_threshold: 0`.

DPO: micro-batch 2 preference pairs per rank (a 32-word prompt, 64-word completions), 4 steps. Memory is
the kernel's RSS high-water mark (VmHWM) of each rank, reset when training begins (after both models
are built and, for zeroshard, sharded), with MALLOC_MMAP_THRESHOLD_=65536 ([Note: measuring peak
memory] in tools/bench/measure.py); `model states` counts the bytes of parameters, gradients and
optimizer states each rank holds right before the optimizer's step, the reference model's parameters
included (zeroshard: the engines' memory reports; DDP: the tensors); the largest over steps and ranks
is shown. DPO's step times come from that launch (the allocator setting slows every system).

GRPO: 2 prompts of 16 words per step, 4 generations each (micro-batch 4 per rank), up to 32 new tokens
(transformers' `generate` inside the step), rewarded by the even-numbered words of a completion, no
reference model (beta 0, TRL's default), 5 steps; the
step time is the slowest rank's wall time of a whole optimizer step, the median of steps 2-5, with
glibc's default allocator settings. zeroshard gathers for generation either the whole model once per
`generate()` (`ds3_gather_for_generation=True`, TRL's default: `generate_gather: "whole"`) or each unit
for each token ("units").
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
import torch.distributed as dist

CONFIGS = {  # name: (trainer, zeroshard stage or None for TRL's DDP run, extra TRL arguments)
    "dpo ddp": ("dpo", None, {}),
    "dpo zeroshard-3": ("dpo", 3, {}),
    "grpo ddp": ("grpo", None, {}),
    "grpo zeroshard-3 whole": ("grpo", 3, {"ds3_gather_for_generation": True}),
    "grpo zeroshard-3 units": ("grpo", 3, {"ds3_gather_for_generation": False}),
}


# -- one configuration, on each rank --------------------------------------------------------------------
def _state_bytes(trainer) -> int:
    """Bytes of model states this rank holds: parameters, gradients, optimizer states, reference model.
    Called right before the torch optimizer's step, while the gradients (shards) exist."""
    engine = getattr(trainer, "engine", None)
    if engine is not None:
        return sum(e.memory_report()["total"] for e in [engine, *trainer.frozen_engines])
    from zeroshard.tools.bench.measure import optimizer_state_bytes, tensor_bytes

    params = list(trainer.model.parameters())
    optimizer = trainer.optimizer.optimizer  # under Accelerate's wrapper
    total = tensor_bytes(params) + tensor_bytes(p.grad for p in params) + optimizer_state_bytes(optimizer)
    ref = getattr(trainer, "ref_model", None)
    return total + (tensor_bytes(ref.parameters()) if ref is not None else 0)


def _torch_optimizer(trainer):
    engine = getattr(trainer, "engine", None)
    return engine.basic_optimizer if engine is not None else trainer.optimizer.optimizer


def reward_even(completions, **kwargs) -> list[float]:
    """GRPO's reward here: the words of a completion with an even number (w0, w2, ...). It varies
    between completions of one prompt, so advantages are not all 0."""
    return [float(sum(word[1:].isdigit() and int(word[1:]) % 2 == 0 for word in c.split())) for c in completions]


def _run(name: str, model_dir: str, out: str, vocab: int) -> None:
    import transformers
    import trl

    from zeroshard.integrations.hf import zeroshard_trainer
    from zeroshard.tools.bench.measure import PeakMemory
    from zeroshard.tools.models import words

    kind, stage, extra = CONFIGS[name]
    rank = dist.get_rank()
    meter = PeakMemory(torch.device("cpu"))
    times: list[float] = []

    states: list[int] = []

    class Meter(transformers.TrainerCallback):
        trainer = None  # set once the trainer exists

        def on_train_begin(self, args, state, control, **kwargs):
            meter.reset()
            _torch_optimizer(self.trainer).register_step_pre_hook(lambda *_: states.append(_state_bytes(self.trainer)))

        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            took = torch.tensor([time.perf_counter() - self.started])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank's step
            times.append(float(took))

    common = dict(
        output_dir=os.path.join(out, name.replace(" ", "-")),
        max_steps=4 if kind == "dpo" else 5,
        learning_rate=1e-5,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        bf16=False,
        **extra,
    )
    if kind == "dpo":
        args = trl.DPOConfig(per_device_train_batch_size=2, **common)
        data = words.dataset("preference", 64, vocab=vocab, prompt=32, completion=64)
        kwargs = {}
        trainer_class = trl.DPOTrainer
    else:
        args = trl.GRPOConfig(per_device_train_batch_size=4, num_generations=4, max_completion_length=32, **common)
        data = words.dataset("prompt", 64, vocab=vocab, prompt=16)
        kwargs = {"reward_funcs": reward_even}
        trainer_class = trl.GRPOTrainer
    if stage is not None:
        trainer_class = zeroshard_trainer(trainer_class)
        kwargs["zeroshard_config"] = {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    callback = Meter()
    trainer = trainer_class(
        model=model_dir,
        args=args,
        train_dataset=data,
        processing_class=words.tokenizer(vocab),
        callbacks=[callback],
        **kwargs,
    )
    callback.trainer = trainer
    trainer.train()
    peak = meter.peak()
    # GRPO's loss is 0 on its first iteration when completions are equally long (normalised advantages
    # average to 0; the gradient does not): its mean reward per step shows the run instead.
    key = "reward" if kind == "grpo" else "loss"
    losses = [e[key] for e in trainer.state.log_history if key in e]
    report = {"rank": rank, "peak_bytes": peak, "method": meter.method, "state_bytes": max(states), "step_s": times}
    report["losses"] = losses
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report)
    if rank == 0:
        Path(out, f"{name.replace(' ', '-')}.json").write_text(json.dumps(gathered))


def worker(name: str, model_dir: str, out: str, vocab: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        _run(name, model_dir, out, vocab)
    finally:
        dist.destroy_process_group()


# -- the driver ------------------------------------------------------------------------------------------
def _launch(name: str, model_dir: str, out: Path, vocab: int, memory: bool) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if memory:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += [__file__, "--worker", name, "--model-dir", model_dir, "--out", str(out), "--vocab", str(vocab)]
    report = out / f"{name.replace(' ', '-')}.json"
    report.unlink(missing_ok=True)
    done = subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    # Judged by the ranks' report, not the exit status: torch 2.13 + gloo may abort a process in its
    # teardown after every rank has reported ("terminate called without an active exception").
    if not report.exists():
        raise RuntimeError(f"{name}: no report (exit status {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(report.read_text())


def _table(results: dict) -> str:
    lines = [
        "config                       peak mem/rank   model states/rank   step s med [min-max]   loss (GRPO: mean reward) per step"
    ]
    for name, ranks in results.items():
        peak = max(r["peak_bytes"] for r in ranks) / 1e6
        states = max(r["state_bytes"] for r in ranks) / 1e6
        steps = ranks[0]["step_s"][1:]  # the first step warms up
        timing = f"{statistics.median(steps):6.2f} [{min(steps):.2f}-{max(steps):.2f}]" if steps else "-"
        losses = ", ".join(f"{x:.4f}" for x in ranks[0]["losses"])
        lines.append(f"{name:<28} {peak:9.1f} MB {states:14.1f} MB   {timing:>22}   {losses}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_out/trl_trainers", help="prefix of the .txt and .json written")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names of CONFIGS")
    parser.add_argument("--work", default="bench_out/trl_runs", help="the saved model and each launch's output")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.model_dir, args.out, args.vocab)
    from zeroshard.tools.models import words

    out = Path(args.out)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    shape = (args.vocab, args.hidden, args.layers)
    model_dir = str(work / "model-{}-{}-{}".format(*shape))
    if not Path(model_dir, "config.json").exists():
        words.llama(*shape).save_pretrained(model_dir)
    results = {}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for name in args.configs.split(","):
        results[name] = _launch(name, model_dir, work, args.vocab, memory=name.startswith("dpo"))
        print(name, "done", flush=True)
    params = sum(p.numel() for p in words.llama(*shape).parameters())
    header = (
        f"# benchmarks/trl_trainers.py, {started}, torch {torch.__version__}, 2 gloo ranks x 1 thread\n"
        f"# {' '.join(sys.argv)}\n# model: {params / 1e6:.1f}M parameters\n"
    )
    Path(f"{out}.txt").write_text(header + _table(results) + "\n")
    Path(f"{out}.json").write_text(json.dumps({"started": started, "params": params, "results": results}, indent=1))
    print(header + _table(results))


if __name__ == "__main__":
    main()
