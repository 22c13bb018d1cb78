"""Offline stand-ins for what DeepSpeed-Chat's step 1 downloads: a tiny OPT model with its tokenizer
(`make_tiny_model`, written with `save_pretrained` so that the script's own `from_pretrained` path loads
it) and a synthetic dataset shaped like `Dahoas/rm-static` (`load_dataset`, which raw_datasets.py and
data_utils.py import in place of the `datasets` package's).

Everything here is deterministic and independent of the global random state: the same files and the
same samples under zeroshard and under DeepSpeed.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

# Byte-level BPE symbols (GPT-2's byte-to-unicode map): a space is "Ġ"; the synthetic text uses only these.
LETTERS = "abcdehilmnorstuHA:"
SPECIALS = ["</s>", "<pad>", "<unk>"]
VOCAB = {token: index for index, token in enumerate(SPECIALS + list(LETTERS) + ["Ġ"])}
VOCAB_SIZE = 8 * -(-len(VOCAB) // 8)  # the script resizes the embeddings to a multiple of 8: already one
WORDS = ["the", "cat", "dish", "moon", "sat", "run", "on", "it", "tree", "blue", "old", "the", "a", "mind"]


def make_tokenizer(path: Path):
    """OPT's tokenizer class (GPT-2's byte-level BPE) over `VOCAB`, with no merges: one token a character.
    vocab.json and merges.txt lie beside tokenizer.json, as in a hub repository: the script's
    `save_vocabulary` copies the vocabulary file."""
    from transformers import GPT2Tokenizer

    tokenizer = GPT2Tokenizer(
        vocab=VOCAB, merges=[], bos_token="</s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tokenizer.save_pretrained(path)
    (path / "vocab.json").write_text(json.dumps(VOCAB))
    (path / "merges.txt").write_text("#version: 0.2\n")
    return tokenizer


def make_tiny_model(path: str | Path, seed: int = 0) -> Path:
    """A 2-layer OPT (hidden 16) and its tokenizer in `path`, weights drawn from `seed`; dropout off,
    so that a run's losses depend on the seed and data alone."""
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    make_tokenizer(path)
    config = OPTConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=16,
        word_embed_proj_dim=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        ffn_dim=32,
        max_position_embeddings=64,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        layerdrop=0.0,
        pad_token_id=VOCAB["<pad>"],
        bos_token_id=VOCAB["</s>"],
        eos_token_id=VOCAB["</s>"],
    )
    torch.manual_seed(seed)
    model = OPTForCausalLM(config)
    model.save_pretrained(path)
    return path


def _sentence(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def _sample(rng: random.Random) -> dict:
    prompt = f" Human: {_sentence(rng, 2, 5)} Assistant:"
    return {"prompt": prompt, "chosen": " " + _sentence(rng, 2, 6), "rejected": " " + _sentence(rng, 2, 6)}


def load_dataset(name: str, *args, **kwargs) -> dict:
    """`datasets.load_dataset`'s stand-in: `{"train": [...], "test": [...]}` of prompt/chosen/rejected
    samples, the columns of Dahoas/rm-static, seeded by the name."""
    rng = random.Random(name)
    return {"train": [_sample(rng) for _ in range(160)], "test": [_sample(rng) for _ in range(40)]}


def load_from_disk(path: str, *args, **kwargs):
    raise FileNotFoundError(f"{path}: the offline copy serves synthetic data by name only")


if __name__ == "__main__":
    print(make_tiny_model(sys.argv[1]))
