"""Offline text for TRL's trainers in tests and benchmarks: a word-level tokenizer over made-up words
(built here, nothing downloaded), a Llama-style model sized to it, and the datasets each trainer
reads, in TRL's standard (not conversational) format. Needs the `hf` extra (transformers, tokenizers,
datasets)."""

from __future__ import annotations

import torch

SPECIAL = ["<pad>", "<eos>", "<unk>"]  # ids 0, 1, 2


def words(vocab: int) -> list[str]:
    """The made-up words of a `vocab`-token vocabulary (the special tokens come first)."""
    return [f"w{i}" for i in range(vocab - len(SPECIAL))]


def tokenizer(vocab: int = 43):
    """A fast tokenizer splitting on whitespace, `vocab` tokens, <pad> 0, <eos> 1, <unk> 2."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    table = {word: i for i, word in enumerate(SPECIAL + words(vocab))}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=table, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def llama(vocab: int = 43, hidden: int = 32, layers: int = 2, *, seed: int = 0, num_labels: int | None = None):
    """A Llama over that vocabulary (grouped-query attention: heads / 2 key-value heads, untied head,
    eager attention); `num_labels`: a sequence-classification head instead (a reward model)."""
    import transformers

    heads = max(4, hidden // 64)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden if hidden < 256 else 8 * hidden // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    config._attn_implementation = "eager"  # the same attention in every run (no sdpa/eager choice by platform)
    torch.manual_seed(seed)
    if num_labels is not None:
        config.num_labels = num_labels
        return transformers.LlamaForSequenceClassification(config)
    return transformers.LlamaForCausalLM(config)


def dataset(kind: str, rows: int = 16, *, vocab: int = 43, prompt: int = 4, completion: int = 5, seed: int = 7):
    """`kind`: "sft" (text), "preference" (prompt, chosen, rejected: DPO, reward models), "unpaired"
    (prompt, completion, label: KTO), "prompt" (GRPO). A good completion counts on from its prompt's
    words; a bad one is random words. Lengths in words."""
    import datasets  # type: ignore[import-untyped]

    vocabulary = words(vocab)
    gen = torch.Generator().manual_seed(seed)

    def counting(length: int) -> str:
        start = int(torch.randint(0, len(vocabulary), (1,), generator=gen))
        return " ".join(vocabulary[(start + i) % len(vocabulary)] for i in range(length))

    def shuffled(length: int) -> str:
        return " ".join(vocabulary[int(i)] for i in torch.randint(0, len(vocabulary), (length,), generator=gen))

    columns: dict[str, list] = {}
    for index in range(rows):
        head, good, bad = counting(prompt), counting(completion), shuffled(completion)
        row: dict
        if kind == "sft":
            row = {"text": f"{head} {good}"}
        elif kind == "preference":
            row = {"prompt": head, "chosen": " " + good, "rejected": " " + bad}
        elif kind == "unpaired":
            row = {"prompt": head, "completion": " " + (good if index % 2 else bad), "label": index % 2 == 1}
        elif kind == "prompt":
            row = {"prompt": head}
        else:
            raise ValueError(f"dataset kind {kind!r}: one of 'sft', 'preference', 'unpaired', 'prompt'")
        for key, value in row.items():
            columns.setdefault(key, []).append(value)
    return datasets.Dataset.from_dict(columns)


def reward_length(completions, **kwargs) -> list[float]:
    """A GRPO reward function: longer completions score higher."""
    return [float(len(c.split())) for c in completions]
