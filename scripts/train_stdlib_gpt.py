"""Train a byte-level Llama on the Python standard library's own source: a model that has learned
something, for measuring what weight quantization and speculative decoding do to a real model.

    python scripts/train_stdlib_gpt.py --out /tmp/stdlib_gpt        # about 30 minutes on 2 cores

Writes two Hugging Face model directories (config.json + model.safetensors), `target/` (6 layers,
width 384, 10.8M parameters) and `draft/` (2 layers, width 256, 1.7M parameters: a small model to
propose tokens for the target), and `data.json` naming the held-out files. The data: every `.py`
file of the running interpreter's standard library (`sysconfig`'s stdlib path, tests and
site-packages left out), sorted by path; every 20th file is held out, the rest is training text.
One token is one byte (vocabulary 256). Training samples random 256-byte windows with a seeded
generator, AdamW with a warmup and cosine decay, so a rerun on the same interpreter and torch gives
the same weights. Held-out perplexity per byte is printed at the end and written to `data.json`.
Nothing here is committed: the script regenerates it.
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
from pathlib import Path

import torch

HOLD_OUT_EVERY = 20
CONTEXT = 256

MODELS = {
    "target": {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 6, "intermediate_size": 1024},
    "draft": {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 688},
}


def source_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "site-packages", "dist-packages", "idle_test"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def split() -> tuple[list[Path], list[Path]]:
    files = source_files()
    held = [p for i, p in enumerate(files) if i % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1]
    train = [p for i, p in enumerate(files) if i % HOLD_OUT_EVERY != HOLD_OUT_EVERY - 1]
    return train, held


def as_bytes(files: list[Path]) -> torch.Tensor:
    return torch.frombuffer(bytearray(b"".join(p.read_bytes() for p in files)), dtype=torch.uint8).long()


def build(name: str):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=256,
        max_position_embeddings=2 * CONTEXT,
        tie_word_embeddings=False,
        num_key_value_heads=MODELS[name]["num_attention_heads"],
        **MODELS[name],
    )
    return transformers.LlamaForCausalLM(config)


@torch.no_grad()
def perplexity(model, data: torch.Tensor, windows: int = 64) -> float:
    """exp(mean next-byte loss) over `windows` evenly spaced CONTEXT-byte windows of `data`."""
    model.eval()
    starts = torch.linspace(0, len(data) - CONTEXT - 1, windows).long()
    losses = []
    for chunk in starts.split(16):
        x = torch.stack([data[s : s + CONTEXT] for s in chunk.tolist()])
        losses.append(model(input_ids=x, labels=x).loss.item() * len(chunk))
    return math.exp(sum(losses) / windows)


def train(name: str, data: torch.Tensor, held: torch.Tensor, steps: int, batch: int, lr: float, out: Path) -> float:
    torch.manual_seed(0)
    model = build(name)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    generator = torch.Generator().manual_seed(1)
    started = time.perf_counter()
    model.train()
    for step in range(steps):
        starts = torch.randint(0, len(data) - CONTEXT - 1, (batch,), generator=generator)
        x = torch.stack([data[s : s + CONTEXT] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if step % 50 == 0 or step == steps - 1:
            print(
                f"{name} step {step}/{steps} loss {loss.item():.3f} ({time.perf_counter() - started:.0f} s)", flush=True
            )
    ppl = perplexity(model, held)
    model.save_pretrained(out / name, safe_serialization=True)
    print(f"{name}: {params / 1e6:.2f}M parameters, held-out perplexity per byte {ppl:.3f}", flush=True)
    return ppl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for target/, draft/ and data.json")
    parser.add_argument("--steps", type=int, default=600, help="target's optimizer steps (default: 600)")
    parser.add_argument("--draft-steps", type=int, default=600, help="draft's optimizer steps (default: 600)")
    parser.add_argument("--batch", type=int, default=16, help="windows of 256 bytes per step (default: 16)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    train_files, held_files = split()
    data, held = as_bytes(train_files), as_bytes(held_files)
    print(f"{len(train_files)} training files ({len(data) / 1e6:.1f} MB), {len(held_files)} held out", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "stdlib": sysconfig.get_paths()["stdlib"],
        "held_out": [str(p) for p in held_files],
        "context": CONTEXT,
        "perplexity": {},
    }
    for name, steps, lr in (("target", args.steps, 2e-3), ("draft", args.draft_steps, 3e-3)):
        result["perplexity"][name] = train(name, data, held, steps, args.batch, lr, args.out)
    (args.out / "data.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
