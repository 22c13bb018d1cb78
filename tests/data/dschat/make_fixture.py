"""Writes expected.json and models.safetensors beside this file: what DeepSpeed 0.19.8 itself makes of
the copied DeepSpeed-Chat step-1 script, the reference tests/test_dschat_step1.py holds zeroshard to.

DeepSpeed is not a dependency of zeroshard: run this with a virtual environment that has it,
transformers and accelerate (HfDeepSpeedConfig checks for both), on CPU with gloo:

    python3.11 -m venv /tmp/dsvenv
    /tmp/dsvenv/bin/pip install torch==2.13.0 deepspeed==0.19.8 transformers==5.24.0 accelerate
    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python tests/data/dschat/make_fixture.py

It copies this directory with every `# zeroshard test: import swap (was: ...)` line put back as it
was (the script as DeepSpeed-Chat publishes it, importing deepspeed), builds the tiny model
(tiny_offline.py), and runs run_step1.py under torchrun at 2 ranks: ZeRO stages 0-3, LoRA off and on,
in fp32, and the variants run_step1.RUNS names (adapters only with activation checkpointing and
accumulation; bf16). expected.json holds each run's losses per rank and step, its evaluation losses before and
after training, and which model of models.safetensors it ended with (runs that end with equal files
share one); `model_sha256` is the tiny model's weights file, so a changed stand-in is told apart from
a changed result. `with_model_draws` is the stage-3 LoRA run with the generator left as DeepSpeed's
path through transformers leaves it ([Note: model creation and the adapters' random start] in
run_step1.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import tiny_offline  # noqa: E402
from run_step1 import RUNS, parse_output  # noqa: E402

SWAP = re.compile(r"^(\s*)\S.*  # zeroshard test: import swap \(was: (.*)\)$", re.M)


def deepspeed_variant(source: Path, target: Path) -> None:
    """A copy of `source` whose import swaps are undone."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.json", "*.safetensors"))
    for path in target.rglob("*.py"):
        text = path.read_text()
        path.write_text(SWAP.sub(lambda m: m[1] + m[2], text))


def torchrun(copy: Path, model: Path, work: Path, *args: str) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += [str(copy / "run_step1.py"), "--model", str(model), "--work", str(work), *args]
    env = dict(os.environ, DS_ACCELERATOR="cpu", LOCAL_SIZE="2", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(work / "torch_extensions"))
    env.pop("PYTHONPATH", None)
    work.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=work)
    if result.returncode != 0:
        raise RuntimeError(result.stdout[-3000:] + result.stderr[-5000:])
    return result.stdout


def main() -> None:
    import deepspeed
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        model = tiny_offline.make_tiny_model(tmp_path / "model")
        copy = tmp_path / "copy"
        deepspeed_variant(HERE, copy)
        runs = parse_output(torchrun(copy, model, tmp_path / "work", "--runs", RUNS))
        drawn = parse_output(torchrun(copy, model, tmp_path / "drawn", "--runs", "3:4", "--keep_model_draws"))
        models: dict[str, torch.Tensor] = {}
        for tag, run in runs.items():
            name = tag.replace(":", "_")
            run["model"] = _dedup(models, name, torch.load(tmp_path / "work" / name / "pytorch_model.bin"))
        expected = {
            "versions": {"deepspeed": deepspeed.__version__, "torch": torch.__version__,
                         "transformers": transformers.__version__},
            "model_sha256": hashlib.sha256((model / "model.safetensors").read_bytes()).hexdigest(),
            "runs": runs,
            "with_model_draws": drawn,
        }  # fmt: skip
    save_file(models, HERE / "models.safetensors")
    (HERE / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


def _dedup(models: dict[str, torch.Tensor], name: str, state: dict[str, torch.Tensor]) -> str:
    """The name under which `state` is stored in `models`: an earlier run's if the tensors are equal."""
    for other in {key.split("/")[0] for key in models}:
        stored = {k.split("/", 1)[1]: v for k, v in models.items() if k.startswith(other + "/")}
        if stored.keys() == state.keys() and all(torch.equal(stored[k], state[k]) for k in state):
            return other
    models.update({f"{name}/{key}": value.clone() for key, value in state.items()})  # a tied weight: one copy per key
    return name


if __name__ == "__main__":
    main()
