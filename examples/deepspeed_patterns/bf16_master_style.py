"""A small transformer trained the way DeepSpeedExamples' training/bf16_master_weight/train.py trains
it: `deepspeed.comm` for ranks, the accelerator for the device, a JSON config file with bf16 (and
`bf16_master_weights_and_grads`), `torch_autocast` read from the same file, and PyTorch-style
`loss.backward()` followed by `model_engine.step()`. Only the import differs from a DeepSpeed script.

    torchrun --nproc_per_node 2 examples/deepspeed_patterns/bf16_master_style.py --workdir /tmp/bf16 --stages 0,1,2,3
"""

import argparse
import json
import os

import torch
import torch.nn as nn

import zeroshard as deepspeed
from zeroshard.accelerator import get_accelerator


class SimpleTransformerModel(nn.Module):
    def __init__(self, vocab_size=64, hidden_dim=32, num_layers=2, num_heads=4, max_seq_len=16):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, hidden_dim)
        self.pos_embedding = nn.Embedding(max_seq_len, hidden_dim)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(hidden_dim, num_heads, 4 * hidden_dim, dropout=0.0, batch_first=True)
            for _ in range(num_layers)
        )
        self.output = nn.Linear(hidden_dim, vocab_size)

    def forward(self, input_ids):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embedding(input_ids) + self.pos_embedding(positions)
        for layer in self.layers:
            x = layer(x)
        return self.output(x)


def write_config(path, stage, autocast):
    config = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
        },
        "zero_optimization": {
            "stage": stage,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 5e7,
        },
        "steps_per_print": 100,
        "wall_clock_breakdown": False,
    }
    if autocast:
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    else:
        config["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    with open(path, "w") as handle:
        json.dump(config, handle)


def run(args, config_path):
    local_rank = args.local_rank
    if local_rank == -1:
        local_rank = int(deepspeed.comm.get_rank())
    world_size = deepspeed.comm.get_world_size()
    device = get_accelerator().device_name(local_rank)
    get_accelerator().set_device(local_rank)
    torch.manual_seed(args.seed)
    get_accelerator().manual_seed_all(args.seed)
    get_accelerator().reset_peak_memory_stats()
    model = SimpleTransformerModel()
    with open(config_path) as f:
        ds_config = json.load(f)
    use_autocast = ds_config.get("torch_autocast", {}).get("enabled", False)
    autocast_dtype = torch.bfloat16
    model_engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config_path
    )
    model_engine.train()
    loss_fn = nn.CrossEntropyLoss()
    losses = []
    generator = torch.Generator().manual_seed(local_rank)
    for _step in range(args.num_steps):
        input_ids = torch.randint(0, 64, (4, 16), generator=generator).to(device)
        labels = torch.roll(input_ids, -1, dims=1)
        if use_autocast:
            with torch.autocast(device_type=get_accelerator().device_name(), dtype=autocast_dtype):
                logits = model_engine(input_ids)
                loss = loss_fn(logits.view(-1, 64), labels.view(-1))
        else:
            logits = model_engine(input_ids)
            loss = loss_fn(logits.view(-1, 64).float(), labels.view(-1))
        loss.backward()  # PyTorch-style backward
        model_engine.step()
        losses.append(loss.item())
    peak = get_accelerator().max_memory_allocated()
    model_engine.destroy()
    return {"losses": losses, "world_size": world_size, "peak_mem_bytes": peak}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--num_steps", type=int, default=6)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    deepspeed.init_distributed()
    os.makedirs(args.workdir, exist_ok=True)
    for stage in [int(s) for s in args.stages.split(",")]:
        for autocast in (False, True):
            path = os.path.join(args.workdir, f"ds_config_{stage}_{int(autocast)}.json")
            if deepspeed.comm.get_rank() == 0:
                write_config(path, stage, autocast)
            deepspeed.comm.barrier()
            result = run(args, path)
            if deepspeed.comm.get_rank() == 0:
                print("RESULT " + json.dumps({"stage": stage, "autocast": autocast, **result}), flush=True)


if __name__ == "__main__":
    main()
