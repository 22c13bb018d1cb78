"""The model, data and config shared by make_checkpoints.py (run under DeepSpeed) and the tests (run
under zeroshard): both sides must build bit-identical models and batches from the same seeds.

Sizes are odd on purpose (1,613 parameters; 7, 24, 5 features) so that every world size of 2, 3
and 4 pads its flat buffers differently, in DeepSpeed and in zeroshard alike.
"""

from __future__ import annotations

import torch
from torch import nn

IN, WIDTH, OUT, DEPTH = 7, 24, 5, 2
GLOBAL_BATCH = 12  # divisible by 2, 3 and 4: every world size sees the same global batch
SEED = 1234
STEPS_BEFORE_SAVE = 3
STEPS_AFTER_SAVE = 3


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN, WIDTH)
        self.blocks = nn.ModuleList([Block(WIDTH) for _ in range(DEPTH)])
        self.head = nn.Linear(WIDTH, OUT)
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, OUT))  # a persistent buffer

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        # DeepSpeed 0.19.8 keeps floating buffers in fp32 under bf16/fp16, zeroshard casts them to the
        # compute dtype: casting here makes both compute the same thing.
        return self.head(h) + self.shift.to(h.dtype)


# Checkpoint name -> (stage, precision, variant). Variants: "" plain; "groups": two optimizer param
# groups (no weight decay for biases and norms) and one frozen parameter; "fp32grads": bf16 with
# fp32 gradient accumulation, which DeepSpeed runs with its separate BF16_Optimizer at stage 1.
CASES = {
    f"stage{stage}_{precision}": (stage, precision, "") for stage in (1, 2, 3) for precision in ("fp32", "bf16", "fp16")
}
CASES.update(
    {
        "stage2_fp32_groups": (2, "fp32", "groups"),
        "stage3_fp32_groups": (3, "fp32", "groups"),
        "stage1_bf16_fp32grads": (1, "bf16", "fp32grads"),
    }
)
FROZEN = "blocks.0.norm.weight"


def build_model(variant: str = "") -> TinyNet:
    torch.manual_seed(SEED)
    model = TinyNet()
    if variant == "groups":
        model.get_parameter(FROZEN).requires_grad_(False)
    return model


def model_parameters(model: TinyNet, variant: str = ""):
    """What the script passes as `model_parameters`: the parameters, or two param groups."""
    if variant != "groups":
        return list(model.parameters())
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in trainable if n.endswith("weight") and "norm" not in n]
    no_decay = [p for n, p in trainable if not (n.endswith("weight") and "norm" not in n)]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def batch(step: int, rank: int, world_size: int, dtype=torch.float32):
    """This rank's contiguous slice of global step `step`'s batch (inputs, targets)."""
    generator = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(GLOBAL_BATCH, IN, generator=generator)
    y = torch.randn(GLOBAL_BATCH, OUT, generator=generator)
    per = GLOBAL_BATCH // world_size
    lo = rank * per
    return x[lo : lo + per].to(dtype), y[lo : lo + per].to(dtype)


def loss_fn(out, y):
    return torch.nn.functional.mse_loss(out.float(), y.float())


def config(stage: int, precision: str, world_size: int, variant: str = "") -> dict:
    """The DeepSpeed config of a run. torch_adam: both DeepSpeed and zeroshard then step with
    torch.optim.AdamW (the same kernel), so losses can be compared bit for bit."""
    cfg = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 0.01, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.05, "torch_adam": True},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 5, "warmup_type": "linear"},
        },
        "zero_optimization": {"stage": stage},
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 2}
    if variant == "fp32grads":
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# -- a model with frozen parameters: a LoRA-style fine-tune (make_frozen_checkpoints.py) --------------
VOCAB, TOKENS, LORA_RANK = 13, 3, 2


class LoraLinear(nn.Module):
    """A linear layer whose base weight and bias are frozen, plus a trainable low-rank adapter."""

    def __init__(self, width: int, rank: int):
        super().__init__()
        self.base = nn.Linear(width, width)
        self.lora_a = nn.Parameter(torch.randn(rank, width) * 0.2)
        self.lora_b = nn.Parameter(torch.randn(width, rank) * 0.2)  # not zero: every step moves both

    def forward(self, x):
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


class AdapterNet(nn.Module):
    """Tokens -> a frozen embedding -> a block with a LoRA-adapted frozen linear layer -> a fully
    trainable block (but for its frozen norm bias) -> a trainable head. Frozen and trainable
    parameters alternate in the module's order, the first parameter being frozen."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block(WIDTH), Block(WIDTH)])
        self.blocks[0].fc = LoraLinear(WIDTH, LORA_RANK)
        self.head = nn.Linear(WIDTH, OUT)

    def forward(self, tokens):
        h = self.embed(tokens).mean(dim=1)  # (B, T) -> (B, T, C) -> (B, C)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


FROZEN_ADAPTER = ["embed.weight", "blocks.0.fc.base.weight", "blocks.0.fc.base.bias", "blocks.1.norm.bias"]
# Checkpoint name -> ZeRO stage; every one fp32, one optimizer param group.
FROZEN_CASES = {f"stage{stage}_fp32_frozen": stage for stage in (1, 2, 3)}
# The stage-1 run saved a second time, with save_checkpoint(exclude_frozen_parameters=True).
FROZEN_EXCLUDED = "stage1_fp32_frozen_excluded"


def build_adapter_model() -> AdapterNet:
    torch.manual_seed(SEED)
    model = AdapterNet()
    for name in FROZEN_ADAPTER:
        model.get_parameter(name).requires_grad_(False)
    return model


def token_batch(step: int, rank: int, world_size: int):
    """This rank's contiguous slice of global step `step`'s batch (token ids, targets)."""
    generator = torch.Generator().manual_seed(20_000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, TOKENS), generator=generator)
    y = torch.randn(GLOBAL_BATCH, OUT, generator=generator)
    per = GLOBAL_BATCH // world_size
    lo = rank * per
    return tokens[lo : lo + per], y[lo : lo + per]
