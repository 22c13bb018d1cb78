"""A DeepSpeed ALST (Ulysses sequence parallelism) training script, with zeroshard's import.

    torchrun --nproc_per_node 2 examples/alst_train.py --sequence-parallel-size 2

Each rank's dataloader yields its own batches of sequences; the adapter hands every sp rank its
shard of each of them in turn, attention sees the whole sequence through two all-to-alls, and ZeRO
stage 3 partitions the model over all ranks. Swap the two zeroshard imports for `import deepspeed`
and `deepspeed.runtime.sequence_parallel.ulysses_sp` and it runs on DeepSpeed.
"""

import argparse

import torch
import torch.nn.functional as F

import zeroshard as deepspeed
from zeroshard.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
from zeroshard.tools.models import words


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sequence-parallel-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args()
    deepspeed.init_distributed()
    rank = torch.distributed.get_rank()
    sp = args.sequence_parallel_size

    model = words.llama(vocab=200, hidden=64, layers=2)  # or AutoModelForCausalLM.from_pretrained(name)
    model.config._attn_implementation = "sdpa"
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=sp, micro_batch_size=2
    )
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "sequence_parallel_size": sp,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    engine, *_ = deepspeed.initialize(model=model, config=config, mpu=mpu)

    # A toy corpus: rows counting upward from a random word; this rank's own batches.
    generator = torch.Generator().manual_seed(rank)
    batches = []
    for _ in range(args.steps):
        ids = (torch.randint(3, 200, (2, 1), generator=generator) + torch.arange(args.seq_len)) % 197 + 3
        batches.append({"input_ids": ids, "labels": ids})

    group = mpu.get_sequence_parallel_group()
    loader = UlyssesSPDataLoaderAdapter(
        batches, sp_rank=mpu.get_sequence_parallel_rank(), sp_group=group, sp_world_size=sp, device=engine.device
    )
    for step, batch in enumerate(loader):
        shift_labels = batch.pop("shift_labels")
        logits = engine(**batch).logits
        loss = F.cross_entropy(logits.flatten(0, 1), shift_labels.flatten(), ignore_index=-100)
        # The whole sequence's mean over the sp shards, weighted by their real tokens (differentiable).
        losses_per_rank = torch.distributed.nn.functional.all_gather(loss, group=group)
        good_tokens = (shift_labels != -100).view(-1).sum()
        good_tokens_per_rank = torch.distributed.nn.functional.all_gather(good_tokens, group=group)
        total_loss = sum(losses_per_rank[r] * good_tokens_per_rank[r] for r in range(sp))
        loss = total_loss / max(sum(good_tokens_per_rank), 1)
        engine.backward(loss)
        engine.step()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}, sequence shard {tuple(batch['input_ids'].shape)}")
    engine.destroy()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
