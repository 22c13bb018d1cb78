"""A DeepSpeed ZeRO training script, unchanged except for its first import.

    torchrun --nproc_per_node 2 examples/deepspeed_train.py --deepspeed_config examples/ds_config.json

Swap the import back to `import deepspeed` and it runs on DeepSpeed.
"""

import argparse

import torch
from torch.utils.data import TensorDataset

import zeroshard as deepspeed
from zeroshard.tools.models.gpt import GPT, GPTConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    # A toy language: each sequence counts upward modulo the vocabulary, so the loss can fall fast.
    starts = torch.randint(0, 64, (512, 1))
    tokens = (starts + torch.arange(17)) % 64
    dataset = TensorDataset(tokens[:, :-1], tokens[:, 1:])

    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=dataset
    )
    step = 0
    while step < args.steps * engine.gradient_accumulation_steps():
        for inputs, targets in loader:
            _, loss = engine(inputs, targets)
            engine.backward(loss)
            engine.step()
            step += 1
            if engine.global_rank == 0 and step % engine.gradient_accumulation_steps() == 0:
                print(f"step {engine.global_steps:3d} loss {loss.item():.4f} lr {engine.get_lr()[0]:.2e}")
            if step >= args.steps * engine.gradient_accumulation_steps():
                break
    engine.destroy()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
