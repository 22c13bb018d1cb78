"""What low-bit optimizer states do to training: `zeroshard train`'s model trained with torch's AdamW
and with torchao's AdamW8bit and AdamW4bit, the same tokens each.

    python benchmarks/lowbit_quality.py --out docs/bench/lowbit_quality.txt

One `torchrun --standalone --nproc_per_node 2` launch (gloo, fp32, stage 3) per optimizer. Everything
else is `zeroshard train`'s defaults (tools/demo): the character-level GPT of family member 3 (3
layers of width 192, ~1.4M parameters) on the standard library's source, micro-batch 8 x 128 per
rank, 300 steps, warmup then cosine decay to 0.1 of the peak lr 2e-3, betas (0.9, 0.99), weight decay
0.01, gradient clipping 1.0, seed 0; the optimizer is built here with those values and handed to
`zeroshard.initialize`. Per optimizer: the mean training loss of the last 10 steps, the held-out loss
over 32 batches of the validation split (the same windows for every optimizer) and its perplexity
per character, and the difference from AdamW's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
OPTIMIZERS = ("adamw", "adamw8bit", "adamw4bit")
VALIDATION_BATCHES = 32


def _optimizer(name: str, params, lr: float):
    settings = dict(lr=lr, betas=(0.9, 0.99), weight_decay=0.01)
    if name == "adamw":
        return torch.optim.AdamW(params, **settings)
    import torchao.optim

    return {"adamw8bit": torchao.optim.AdamW8bit, "adamw4bit": torchao.optim.AdamW4bit}[name](params, **settings)


def worker(name: str, steps: int, out: Path) -> None:
    import torch.distributed as dist

    import zeroshard
    from zeroshard.tools.bench import family
    from zeroshard.tools.demo.corpus import Batches, CharTokenizer, load_corpus, split
    from zeroshard.tools.demo.loop import default_config
    from zeroshard.tools.models.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    zeroshard.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = {"steps": steps, "batch": 8, "lr": 2e-3, "precision": "fp32", "seed": 0}
    config = default_config(spec)
    del config["optimizer"]
    corpus = load_corpus()
    tokenizer = CharTokenizer(corpus.text)
    shape = family.gpt_shape(3, tokenizer.vocab_size, 128)
    torch.manual_seed(spec["seed"])
    model = GPT(GPTConfig(**shape))
    engine, _, _, _ = zeroshard.initialize(
        model=model, optimizer=_optimizer(name, model.parameters(), 2e-3), config=config
    )
    train_tokens, val_tokens = split(tokenizer.encode(corpus.text))
    train = Batches(train_tokens, 128, 8, spec["seed"], rank)
    val = Batches(val_tokens, 128, 8, spec["seed"] + 1, rank)
    losses, started = [], time.perf_counter()
    for _ in range(steps):
        x, y = train.next()
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    seconds = time.perf_counter() - started
    engine.eval()
    with torch.no_grad():
        held = torch.tensor([sum(engine(*val.next())[1].item() for _ in range(VALIDATION_BATCHES))])
    dist.all_reduce(held)
    if rank == 0:
        validation = float(held) / (VALIDATION_BATCHES * world)
        out.write_text(
            json.dumps(
                {
                    "optimizer": name,
                    "params": sum(p.numel() for p in model.parameters()),
                    "train_loss_last_10": sum(losses[-10:]) / 10,
                    "validation_loss": validation,
                    "seconds": seconds,
                }
            )
        )
    engine.destroy()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default: 300)")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS), help=f"a comma-separated list of {OPTIMIZERS}")
    parser.add_argument("--out", type=Path, default=None, help="also write the command and the table here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 10:
        parser.error(f"--steps {args.steps}: at least 10")
    if args.worker is not None:
        worker(args.worker, args.steps, args.result)
        return
    names = [o for o in args.optimizers.split(",") if o]
    if bad := [o for o in names if o not in OPTIMIZERS]:
        parser.error(f"--optimizers {bad}: allowed {', '.join(OPTIMIZERS)}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    rows = []
    for name in names:
        result = Path(f"/tmp/lowbit_quality_{os.getpid()}_{name}.json")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__]
        command += ["--worker", name, "--steps", str(args.steps), "--result", str(result)]
        done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
        if done.returncode != 0:
            sys.exit(f"{name}: the launch failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        rows.append(json.loads(result.read_text()))
        result.unlink()
    base = next((r for r in rows if r["optimizer"] == "adamw"), rows[0])
    lines = [
        f"{'optimizer':<10} {'params':>9} {'train loss (last 10)':>21} {'held-out loss':>14} {'perplexity':>11} "
        f"{'vs ' + base['optimizer']:>14} {'seconds':>8}"
    ]
    for row in rows:
        change = (row["validation_loss"] - base["validation_loss"]) / base["validation_loss"]
        lines.append(
            f"{row['optimizer']:<10} {row['params']:>9,} {row['train_loss_last_10']:>21.4f} "
            f"{row['validation_loss']:>14.4f} {math.exp(row['validation_loss']):>11.3f} {change:>+13.2%} "
            f"{row['seconds']:>8.0f}"
        )
    table = "\n".join(lines)
    print(table)
    if args.out is not None:
        header = f"# {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, torch {torch.__version__}\n"
        args.out.write_text(f"{header}$ python benchmarks/lowbit_quality.py {' '.join(sys.argv[1:])}\n{table}\n")


if __name__ == "__main__":
    main()
