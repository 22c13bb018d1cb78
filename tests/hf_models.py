"""Tiny transformers causal LMs built from configs (GPT-2 with tied embeddings, a Llama-style model with
grouped-query attention and an untied head; nothing downloaded), their data and loss, LoRA adapters
on them (PEFT), and the environment their ranks run in."""

from __future__ import annotations

import torch

from tests.harness import PRELOAD_VAR

VOCAB, SEQ, BATCH = 96, 16, 4
# The libraries these ranks use, imported once by their fork server ([Note: a fork server per
# preload list] in tests/harness.py); a library that is not installed is left out there.
PRELOAD = (
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
    "peft",
    "datasets",
    "trl",
)
ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TRANSFORMERS_VERBOSITY": "error",
    PRELOAD_VAR: ",".join(PRELOAD),
}


def model_fn(kind: str, seed: int = 0):
    def build():
        import transformers

        torch.manual_seed(seed)
        return transformers.AutoModelForCausalLM.from_config(hf_config(kind))

    return build


def hf_config(kind: str):
    import transformers

    special = dict(bos_token_id=0, eos_token_id=1, pad_token_id=1)
    if kind == "gpt2":  # tied embedding and LM head
        return transformers.GPT2Config(
            vocab_size=VOCAB,
            n_positions=2 * SEQ,
            n_embd=32,
            n_layer=2,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **special,
        )
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2 * SEQ,
        tie_word_embeddings=False,
        **special,
    )


def batches(step: int, micro: int, rank: int):
    """Rows that count up from a random start (mod vocab): learnable, so losses fall."""
    gen = torch.Generator().manual_seed((step * 1009 + micro) * 1009 + rank)
    start = torch.randint(2, VOCAB, (BATCH, 1), generator=gen)  # (B, 1)
    tokens = (start + torch.arange(SEQ)) % VOCAB  # (B, T)
    return tokens, tokens


def causal_lm_loss(model, inputs, targets) -> torch.Tensor:
    out = model(input_ids=inputs, labels=targets)  # keywords only; a ModelOutput comes back
    return out.loss


def prompt_and_length(rank: int) -> tuple[torch.Tensor, int]:
    """Per-rank prompts and lengths: rank 1 finishes generating first, rank 0 runs on alone."""
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randint(2, VOCAB, (2, 5), generator=gen), 8 - 3 * rank


LORA_TARGETS = {"gpt2": ["c_attn", "c_proj"], "llama": ["q_proj", "v_proj", "down_proj"]}


def peft_fn(kind: str, layers: list[int] | None = None, checkpointing: str | None = None, modules_to_save=None):
    """The base model of `model_fn(kind)` with LoRA adapters (random B, so they change the output from
    the first step); `layers`: adapt only these blocks; `checkpointing`: "reentrant" or "non-reentrant";
    `modules_to_save`: modules trained whole beside the adapters (PEFT keeps a trainable copy)."""

    def build():
        import peft

        model = model_fn(kind)()
        if checkpointing is not None:
            model.gradient_checkpointing_enable({"use_reentrant": checkpointing == "reentrant"})
            model.enable_input_require_grads()  # as PEFT's prepare_model_for_kbit_training does
        config = peft.LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=LORA_TARGETS[kind],
            lora_dropout=0.0,
            init_lora_weights="gaussian",
            layers_to_transform=layers,
            modules_to_save=modules_to_save,
        )
        torch.manual_seed(1)
        return peft.get_peft_model(model, config)

    return build
