"""A masked-language-model trained and checkpointed the way HelloDeepSpeed's train_bert_ds.py does it
(a config dict built in the script, the optimizer from the config, `save_checkpoint` with a client
state every few steps, `load_checkpoint` to resume), with a small RoBERTa-like model and random tokens.
Only the import differs from a DeepSpeed script.

    torchrun --nproc_per_node 2 examples/deepspeed_patterns/bert_style.py --checkpoint_dir /tmp/bert --stages 0,1,2,3

For each stage: train 6 steps saving at step 3, resume from that checkpoint in a new engine, train the
remaining 3 steps, and print both runs' losses (they must agree).
"""

import argparse
import json
import logging
import os
import pathlib

import torch
import torch.nn as nn

import zeroshard as deepspeed
from zeroshard.accelerator import get_accelerator


def is_rank_0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def log_dist(message, ranks=(), level=logging.INFO):
    if int(os.environ.get("RANK", "0")) in ranks:
        logging.getLogger("bert").log(level, message)


class TinyRoberta(nn.Module):
    def __init__(self, vocab=100, h_dim=32, num_layers=2, num_heads=4, ff_dim=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, h_dim)
        layer = nn.TransformerEncoderLayer(h_dim, num_heads, ff_dim, dropout=0.0, batch_first=True)
        self.layers = nn.ModuleList(
            layer.__class__(h_dim, num_heads, ff_dim, dropout=0.0, batch_first=True) for _ in range(num_layers)
        )
        self.head = nn.Linear(h_dim, vocab)

    def forward(self, src_tokens, tgt_tokens):
        x = self.embed(src_tokens)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        return nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), tgt_tokens.view(-1), ignore_index=0)


def batch(step, rank, batch_size=4, seq=12, vocab=100):
    g = torch.Generator().manual_seed(100 * step + rank)
    tokens = torch.randint(1, vocab, (batch_size, seq), generator=g)
    mask = torch.rand(batch_size, seq, generator=g) < 0.15
    return tokens.masked_fill(mask, 1), tokens.masked_fill(~mask, 0)


def create_engine(stage, dtype):
    torch.manual_seed(42)
    model = TinyRoberta()
    ds_config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        dtype: {"enabled": True},
        "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu" if stage else "none"}},
    }
    model, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    return model


def train(exp_dir, stage, dtype, num_iterations, checkpoint_every, load_checkpoint_dir=None):
    device = (
        torch.device(get_accelerator().device_name(), int(os.environ["LOCAL_RANK"]))
        if get_accelerator().is_available()
        else torch.device("cpu")
    )
    model = create_engine(stage, dtype)
    start_step = 1
    if load_checkpoint_dir is not None:
        _, client_state = model.load_checkpoint(load_dir=load_checkpoint_dir)
        start_step = client_state["checkpoint_step"] + 1
    log_dist(f"Total number of model parameters: {sum(p.numel() for p in model.parameters()):,d}", ranks=[0])
    model.train()
    losses = {}
    for step in range(start_step, num_iterations + 1):
        src, tgt = batch(step, model.global_rank)
        loss = model(src.to(device), tgt.to(device))
        model.backward(loss)
        model.step()
        losses[step] = loss.item()
        if step % checkpoint_every == 0 and step < num_iterations:
            model.save_checkpoint(save_dir=exp_dir, client_state={"checkpoint_step": step})
    model.destroy()
    return losses


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint_dir", required=True)
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--dtype", default="bf16")
    args = parser.parse_args()
    deepspeed.init_distributed()
    for stage in [int(s) for s in args.stages.split(",")]:
        # Every rank must name the same directory: HelloDeepSpeed names it from each rank's clock,
        # which zeroshard refuses with a message saying the ranks passed different paths.
        exp_dir = pathlib.Path(args.checkpoint_dir) / f"stage{stage}"
        full = train(exp_dir, stage, args.dtype, num_iterations=6, checkpoint_every=3)
        resumed = train(
            exp_dir / "unused", stage, args.dtype, num_iterations=6, checkpoint_every=100, load_checkpoint_dir=exp_dir
        )
        if is_rank_0():
            print("RESULT " + json.dumps({"stage": stage, "full": full, "resumed": resumed}), flush=True)


if __name__ == "__main__":
    main()
