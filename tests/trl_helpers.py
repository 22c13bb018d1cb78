"""The tiny setup TRL's trainers run on in tests: zeroshard.tools.models.words' tokenizer, model and
datasets at their smallest, a LoRA config, and the TrainingArguments every run shares."""

from __future__ import annotations

from zeroshard.tools.models.words import dataset, llama, reward_length, tokenizer

__all__ = ["common_args", "dataset", "llama", "lora", "reward_length", "tokenizer"]


def lora(sequence_classification: bool = False):
    """LoRA on the attention's q and v projections (with a sequence-classification task, the score
    head is trained whole beside them, as PEFT does for SEQ_CLS)."""
    import peft

    task = "SEQ_CLS" if sequence_classification else "CAUSAL_LM"
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type=task)


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
