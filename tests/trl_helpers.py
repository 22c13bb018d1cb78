"""Tiny, offline pieces for TRL's trainers: a word-level tokenizer built here (nothing downloaded), a
Llama-style model sized to it, and the datasets each trainer reads (standard, not conversational,
format), with the arguments every run shares."""

from __future__ import annotations

import torch

WORDS = [f"w{i}" for i in range(40)]
SPECIAL = ["<pad>", "<eos>", "<unk>"]
TOKEN_ARGS = dict(pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tokenizer():
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(SPECIAL + WORDS)}
    model = tokenizers.models.WordLevel(vocab=vocab, unk_token="<unk>")
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, **TOKEN_ARGS)


def llama(seed: int = 0, *, num_labels: int | None = None, tied: bool = False):
    """A 2-layer Llama over the tokenizer's vocabulary (grouped-query attention); `num_labels`: the
    sequence-classification head a reward model has."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=len(SPECIAL) + len(WORDS),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    if num_labels is not None:
        config.num_labels = num_labels
        return transformers.LlamaForSequenceClassification(config)
    return transformers.LlamaForCausalLM(config)


def lora(sequence_classification: bool = False):
    """LoRA on the attention's q and v projections (with a sequence-classification task, the score
    head is trained whole beside them, as PEFT does for SEQ_CLS)."""
    import peft

    task = "SEQ_CLS" if sequence_classification else "CAUSAL_LM"
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type=task)


def _sentence(gen: torch.Generator, length: int) -> str:
    start = int(torch.randint(0, len(WORDS), (1,), generator=gen))
    return " ".join(WORDS[(start + i) % len(WORDS)] for i in range(length))


def _shuffled(gen: torch.Generator, length: int) -> str:
    return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (length,), generator=gen))


def dataset(kind: str, rows: int = 16):
    """`kind`: "sft" (text), "preference" (prompt, chosen, rejected: DPO and reward models),
    "unpaired" (prompt, completion, label: KTO), "prompt" (GRPO)."""
    import datasets

    gen = torch.Generator().manual_seed(7)
    data: dict[str, list] = {}
    for _ in range(rows):
        prompt = _sentence(gen, 4)
        good, bad = _sentence(gen, 5), _shuffled(gen, 5)
        row: dict = {
            "sft": {"text": f"{prompt} {good}"},
            "preference": {"prompt": prompt, "chosen": " " + good, "rejected": " " + bad},
            "prompt": {"prompt": prompt},
        }.get(kind) or {"prompt": prompt, "completion": " " + (good if len(data.get("label", [])) % 2 else bad)}
        if kind == "unpaired":
            row["label"] = len(data.get("label", [])) % 2 == 1
        for key, value in row.items():
            data.setdefault(key, []).append(value)
    return datasets.Dataset.from_dict(data)


def common_args(output_dir: str, **overrides) -> dict:
    """TrainingArguments every run shares: CPU, fp32, seeded, nothing reported or shuffled by time.
    No clipping: zeroshard sums the gradient norm in fp64, torch's clip_grad_norm_ in fp32, so a
    clipped step agrees with DDP's to rounding, not bit for bit."""
    args = dict(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        max_steps=3,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        data_seed=0,
        bf16=False,
        dataloader_num_workers=0,
        max_grad_norm=0.0,
    )
    args.update(overrides)
    return args


def reward_length(completions, **kwargs) -> list[float]:
    """A reward function for GRPO: longer completions score higher."""
    return [float(len(c.split())) for c in completions]
