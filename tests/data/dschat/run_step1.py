"""Runs the copied DeepSpeed-Chat step-1 `main()` once per configuration, one after the other in the
same torchrun launch (saving its start-up per configuration):

    torchrun --standalone --nproc_per_node 2 run_step1.py --model DIR --work DIR --runs 0:0,3:4 [--dtype fp32]

`--runs` lists `stage:lora_dim[:variant]` tags, a variant adding the arguments VARIANTS names. Each
run gets the arguments DeepSpeed-Chat's own training scripts pass (batch sizes, sequence length,
seed, `--print_loss`) and, as DeepSpeed's launcher does, `--local_rank` from torchrun's LOCAL_RANK
(the script initializes torch.distributed only when given one). Each rank prints `RUN <tag> on rank
<R>` before each run; the model lands in WORK/<tag with ':' as '_'>/pytorch_model.bin. `parse_output`
reads the losses back from the output, both ranks' streams merged (torchrun) or one after the other.

[Note: model creation and the adapters' random start]
At ZeRO stage 3, DeepSpeed's path through transformers (the script's HfDeepSpeedConfig) draws from
torch's global generator while the model is built: `resize_token_embeddings` makes a new embedding
even at the same size, whose initialization draws. The LoRA adapters the script initializes next
(`kaiming_uniform_`) would then start elsewhere than at stages 0-2, and than under zeroshard, whose
HfDeepSpeedConfig leaves transformers on its plain path: DeepSpeed's own stage-3 LoRA losses differ
from its stage-2 ones by 6e-4 in this setup. So that runs differ by their ZeRO stage alone, the
generator is restored after model creation (`--keep_model_draws` leaves it as the script has it).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
RUNS = "0:0,1:0,2:0,3:0,0:4,1:4,2:4,3:4,0:4:lora_only,3:4:lora_only,1:4:bf16,3:4:bf16"

VARIANTS = {
    "bf16": ["--dtype", "bf16"],
    # as DeepSpeed-Chat's LoRA scripts train: adapters only, activation checkpointing, accumulation
    "lora_only": ["--only_optimize_lora", "--gradient_checkpointing", "--gradient_accumulation_steps", "2"],
}
_RECORD = re.compile(
    r"RUN (\S+) on rank (\d+)"
    r"|Epoch: \d+, Step: (\d+), Rank: (\d+), loss = (\S+?)(?=Epoch|Model|RUN|ppl|\s|$)"
    r"|ppl: \S+, loss: (\S+?)(?=Epoch|Model|RUN|ppl|\s|$)"
)


def parse_output(text: str) -> dict[str, dict]:
    """{tag: {"losses": {rank: [loss per step]}, "eval": [loss before, after]}} from the printed output
    of both ranks, merged in any order (a line's newline may land after the other rank's text): each
    rank's records belong to the run its own last marker named; the evaluation is rank 0's."""
    runs: dict[str, dict] = {}
    current: dict[str, dict] = {}  # rank -> its run
    for match in _RECORD.finditer(text):
        if match[1] is not None:
            current[match[2]] = runs.setdefault(match[1], {"losses": {}, "eval": []})
        elif match[3] is not None:
            current[match[4]]["losses"].setdefault(match[4], {})[int(match[3])] = float(match[5])
        else:
            current["0"]["eval"].append(float(match[6]))
    for run in runs.values():
        run["losses"] = {rank: [steps[i] for i in sorted(steps)] for rank, steps in sorted(run["losses"].items())}
    return runs


def step1_argv(model: str, work: Path, tag: str, dtype: str) -> list[str]:
    stage, lora_dim, *variant = tag.split(":")
    argv = [
        "main.py",
        "--model_name_or_path", model,
        "--data_output_path", str(work / "data"),
        "--per_device_train_batch_size", "4",
        "--per_device_eval_batch_size", "4",
        "--max_seq_len", "32",
        "--learning_rate", "1e-2",
        "--weight_decay", "0.1",
        "--num_train_epochs", "1",
        "--seed", "1234",
        "--zero_stage", stage,
        "--dtype", dtype,
        "--print_loss",
        "--output_dir", str(work / tag.replace(":", "_")),
        "--local_rank", os.environ["LOCAL_RANK"],
    ]  # fmt: skip
    if lora_dim != "0":
        argv += ["--lora_dim", lora_dim, "--lora_learning_rate", "1e-2"]
    return argv + [arg for name in variant for arg in VARIANTS[name]]


def without_draws(create_hf_model):
    """`create_hf_model` that leaves torch's CPU generator as it found it
    ([Note: model creation and the adapters' random start])."""

    def create(*args, **kwargs):
        with torch.random.fork_rng(devices=[]):
            return create_hf_model(*args, **kwargs)

    return create


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="a directory tiny_offline.make_tiny_model wrote")
    parser.add_argument("--work", required=True, type=Path)
    parser.add_argument("--runs", default=RUNS)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--keep_model_draws", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))  # `dschat` and `tiny_offline`, as DeepSpeed-Chat's `pip install -e .` provides
    import main as step1  # the copied script

    if not args.keep_model_draws:
        step1.create_hf_model = without_draws(step1.create_hf_model)
    for tag in args.runs.split(","):
        print(f"RUN {tag} on rank {os.environ['RANK']}", flush=True)
        sys.argv = step1_argv(args.model, args.work, tag, args.dtype)
        step1.main()
        sys.stdout.flush()


if __name__ == "__main__":
    main()
