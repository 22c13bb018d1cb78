"""What the benchmarks that measure in `torchrun --standalone --nproc_per_node 2` launches share: the
launch, the model-state recipes they compare, and the record they write (docs/bench/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

# Model-state recipes: name -> (compute precision, bf16 masters, the optimizer `build_optimizer`
# makes, the estimator's name for its states).
RECIPES = {
    "fp32": ("fp32", False, "adamw", "adamw"),
    "fp32-adamw8bit": ("fp32", False, "adamw8bit", "adamw8bit"),
    "fp32-adamw4bit": ("fp32", False, "adamw4bit", "adamw4bit"),
    "bf16": ("bf16", False, "adamw", "adamw"),
    "bf16-masters": ("bf16", True, "adamw", "adamw"),
    "bf16-masters-adamw8bit": ("bf16", True, "adamw8bit-sr", "adamw8bit"),
    "bf16-masters-adamw4bit": ("bf16", True, "adamw4bit-sr", "adamw4bit"),
}


def build_optimizer(name: str, params, **settings):
    """torch's AdamW, or torchao's AdamW8bit / AdamW4bit (`-sr`: with bf16 stochastic rounding)."""
    if name == "adamw":
        return torch.optim.AdamW(params, **settings)
    import torchao.optim

    kind = {"adamw8bit": torchao.optim.AdamW8bit, "adamw4bit": torchao.optim.AdamW4bit}[name.removesuffix("-sr")]
    return kind(params, bf16_stochastic_round=name.endswith("-sr"), **settings)


def bf16_config(precision: str, bf16_masters: bool) -> dict:
    """The config's `bf16` section for a recipe."""
    section: dict = {"enabled": precision == "bf16"}
    if bf16_masters:
        section.update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    return section


def modelled_bytes(recipe: str) -> float:
    """Bytes per parameter of model states, params + grads + K, as `zeroshard estimate` models them."""
    from zeroshard.tools import estimator

    precision, bf16_masters, _, states = RECIPES[recipe]
    return float(
        estimator.bytes_per_param(estimator.recipe(precision, states, master="bf16" if bf16_masters else "fp32"))
    )


def parse_recipes(parser, text: str) -> list[str]:
    names = [r for r in text.split(",") if r]
    if bad := [r for r in names if r not in RECIPES]:
        parser.error(f"--recipes {','.join(bad)}: allowed {', '.join(RECIPES)}")
    return names


def add_shape_arguments(parser, layers: int, width: int) -> None:
    """--layers and --width of the untied GPT the benchmark trains (vocab 8192, sequence 128)."""
    parser.add_argument("--layers", type=int, default=layers, help=f"GPT layers (default: {layers})")
    parser.add_argument("--width", type=int, default=width, help=f"GPT width, a multiple of 64 (default: {width})")


def gpt_shape(parser, args) -> dict:
    """The GPTConfig keywords of --layers and --width (heads of 64), or a usage error naming both."""
    if args.layers < 1 or args.width < 64 or args.width % 64:
        parser.error(f"--layers {args.layers} --width {args.width}: at least 1 layer, a width that is a multiple of 64")
    return dict(
        vocab_size=8192,
        block_size=128,
        n_layer=args.layers,
        n_head=args.width // 64,
        n_embd=args.width,
        tie_weights=False,
    )


def launch(script: str, argv: list[str], what: str = "the launch", env: dict | None = None) -> str:
    """Run `script` on 2 local ranks (1 torch thread each); its standard output, or exit with its error."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script, *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"), **(env or {})}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        sys.exit(f"{what} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return done.stdout


def launch_for_result(script: str, argv: list[str], what: str, env: dict | None = None) -> dict:
    """`launch`, whose rank 0 writes a JSON result to the path given as `--result`."""
    with tempfile.TemporaryDirectory() as scratch:
        result = Path(scratch) / "result.json"
        launch(script, [*argv, "--result", str(result)], what, env)
        if not result.exists():
            sys.exit(f"{what} wrote no result")
        return json.loads(result.read_text())


def table_of(stdout: str) -> str:
    return "\n".join(line for line in stdout.splitlines() if line.strip())


def write_record(out: Path | None, script: str, text: str, torchao: bool = False) -> None:
    """`out`, if given: the date, cores and versions, the command as run, then `text`."""
    if out is None:
        return
    versions = f"torch {torch.__version__}"
    if torchao:
        import torchao as ao

        versions += f", torchao {ao.__version__}"
    header = f"# {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, {versions}\n"
    out.write_text(f"{header}$ python benchmarks/{Path(script).name} {' '.join(sys.argv[1:])}\n{text}\n")
