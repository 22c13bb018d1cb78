"""Supervised fine-tuning the way DeepSpeed-Chat's step-1 main.py does it, on a tiny Llama built from a
config with random token data (no download): `get_train_ds_config`-style config (offload switches,
hybrid_engine, tensorboard), weight-decay param groups, `FusedAdam` / `DeepSpeedCPUAdam`, a
transformers scheduler built on that optimizer and passed to `deepspeed.initialize`, evaluation with
an all-reduced mean, `model.tput_timer`, and `save_hf_format`. Only the imports differ.

    torchrun --nproc_per_node 2 examples/deepspeed_patterns/dschat_style.py --output_dir /tmp/sft --stages 0,1,2,3

At stage 3 DeepSpeed-Chat saves with its save_zero_three_model (ds_* parameter metadata), which is
not exercised here; stages 0-2 write pytorch_model.bin with save_hf_format.
"""

import argparse
import json
import math
import os

import torch
import transformers
from torch.utils.data import DataLoader, DistributedSampler

import zeroshard as deepspeed
import zeroshard.comm as dist
from zeroshard import get_accelerator
from zeroshard.ops.adam import DeepSpeedCPUAdam, FusedAdam

GLOBAL_BATCH_SIZE = 32
MICRO_BATCH_SIZE = 4


def get_train_ds_config(offload, dtype, stage=2):
    device = "cpu" if offload else "none"
    data_type = "bfloat16" if dtype == "bf16" else "fp16"
    zero_opt_dict = {
        "stage": stage,
        "overlap_comm": True,
        "offload_param": {"device": device},
        "offload_optimizer": {"device": device},
        "stage3_param_persistence_threshold": 1e4,
        "stage3_max_live_parameters": 3e7,
        "stage3_prefetch_bucket_size": 3e7,
        "memory_efficient_linear": False,
    }
    if dist.get_world_size() != get_accelerator().device_count():
        pass  # DeepSpeed-Chat sets zero_hpz_partition_size here for mixed-precision LoRA only
    return {
        "train_batch_size": GLOBAL_BATCH_SIZE,
        "train_micro_batch_size_per_gpu": MICRO_BATCH_SIZE,
        "steps_per_print": 10,
        "zero_optimization": zero_opt_dict,
        data_type: {"enabled": True},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "hybrid_engine": {
            "enabled": False,
            "max_out_tokens": 512,
            "inference_tp_size": 1,
            "release_inference_cache": False,
            "pin_parameters": True,
            "tp_gather_partition_size": 8,
        },
        "tensorboard": {
            "enabled": False,
            "output_path": "step1_tensorboard/ds_tensorboard_logs/",
            "job_name": "step1_model_tensorboard",
        },
    }


def print_rank_0(msg, rank=0):
    if rank <= 0:
        print(msg, flush=True)


def to_device(batch, device):
    return {k: v.to(device) for k, v in batch.items()}


def get_all_reduce_mean(tensor):
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
    return tensor / torch.distributed.get_world_size()


def get_optimizer_grouped_parameters(model, weight_decay, no_decay_name_list=("bias", "norm.weight")):
    return [
        {
            "params": [
                p
                for n, p in model.named_parameters()
                if not any(nd in n.lower() for nd in no_decay_name_list) and p.requires_grad
            ],
            "weight_decay": weight_decay,
        },
        {
            "params": [
                p
                for n, p in model.named_parameters()
                if any(nd in n.lower() for nd in no_decay_name_list) and p.requires_grad
            ],
            "weight_decay": 0.0,
        },
    ]


def print_throughput(hf_model, args, e2e_time, rank=0):
    if rank <= 0:
        layers = hf_model.config.num_hidden_layers
        print(f"Model Parameters layers={layers}, Latency: {e2e_time:.3f}s", flush=True)


def save_hf_format(model, args, sub_folder=""):
    model_to_save = model.module if hasattr(model, "module") else model
    output_dir = os.path.join(args.output_dir, sub_folder)
    os.makedirs(output_dir, exist_ok=True)
    state_dict = model_to_save.state_dict()
    torch.save(state_dict, os.path.join(output_dir, "pytorch_model.bin"))
    model_to_save.config.to_json_file(os.path.join(output_dir, "config.json"))
    return sum(v.numel() for v in state_dict.values())


def synthetic_dataset(n, seed):
    g = torch.Generator().manual_seed(seed)
    ids = (torch.randint(2, 120, (n, 1), generator=g) + torch.arange(16)) % 126 + 2
    return [{"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row} for row in ids]


def train(args, stage, device):
    ds_config = get_train_ds_config(offload=args.offload, dtype=args.dtype, stage=stage)
    ds_config["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
    ds_config["train_batch_size"] = (
        args.per_device_train_batch_size * torch.distributed.get_world_size() * args.gradient_accumulation_steps
    )
    torch.manual_seed(args.seed)
    get_accelerator().manual_seed_all(args.seed)
    torch.distributed.barrier()
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    train_dataset, eval_dataset = synthetic_dataset(64, 0), synthetic_dataset(16, 1)
    collate = transformers.default_data_collator
    train_dataloader = DataLoader(
        train_dataset,
        collate_fn=collate,
        sampler=DistributedSampler(train_dataset),
        batch_size=args.per_device_train_batch_size,
    )
    eval_dataloader = DataLoader(
        eval_dataset,
        collate_fn=collate,
        sampler=DistributedSampler(eval_dataset),
        batch_size=args.per_device_train_batch_size,
    )

    def evaluation(model, eval_dataloader):
        model.eval()
        losses = 0
        for step, batch in enumerate(eval_dataloader):  # noqa: B007 - read after the loop: the batch count
            batch = to_device(batch, device)
            with torch.no_grad():
                outputs = model(**batch)
            losses += outputs.loss.float()
        losses = get_all_reduce_mean(losses / (step + 1))
        return torch.exp(losses).item(), losses.item()

    optimizer_grouped_parameters = get_optimizer_grouped_parameters(model, args.weight_decay)
    AdamOptimizer = DeepSpeedCPUAdam if args.offload else FusedAdam
    optimizer = AdamOptimizer(optimizer_grouped_parameters, lr=args.learning_rate, betas=(0.9, 0.95))
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    lr_scheduler = transformers.get_scheduler(
        name="cosine",
        optimizer=optimizer,
        num_warmup_steps=2,
        num_training_steps=args.num_train_epochs * num_update_steps_per_epoch,
    )
    model, optimizer, _, lr_scheduler = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        args=args,
        config=ds_config,
        lr_scheduler=lr_scheduler,
        dist_init_required=True,
    )
    model.gradient_checkpointing_enable() if args.gradient_checkpointing else None
    perplexity_before, _ = evaluation(model, eval_dataloader)
    losses = []
    for _epoch in range(args.num_train_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            batch = to_device(batch, device)
            outputs = model(**batch, use_cache=False)
            model.backward(outputs.loss)
            model.step()
            losses.append(outputs.loss.item())
            if torch.distributed.get_rank() == 0 and step == 0:
                print_throughput(model.model, args, 0.0, args.global_rank)
        model.tput_timer.update_epoch_count()
    perplexity_after, _ = evaluation(model, eval_dataloader)
    saved = None
    if args.global_rank == 0 and stage < 3:
        saved = save_hf_format(model, args, sub_folder=f"stage{stage}")
    result = {
        "stage": stage,
        "losses": losses,
        "ppl_before": perplexity_before,
        "ppl_after": perplexity_after,
        "lr": lr_scheduler.get_last_lr()[0],
        "saved_numel": saved,
        "numel": sum(p.numel() for p in model.module.parameters()) if stage < 3 else None,
        "epochs": model.tput_timer.epoch_count,
    }
    model.destroy()
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--per_device_train_batch_size", type=int, default=4)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--num_train_epochs", type=int, default=2)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--seed", type=int, default=1234)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    if args.local_rank == -1:
        args.local_rank = int(os.environ.get("LOCAL_RANK", -1))  # torchrun passes it in the environment
    if args.local_rank == -1:
        device = torch.device(get_accelerator().device_name())
    else:
        get_accelerator().set_device(args.local_rank)
        device = torch.device(get_accelerator().device_name(), args.local_rank)
        deepspeed.init_distributed()
    args.global_rank = torch.distributed.get_rank()
    for stage in [int(s) for s in args.stages.split(",")]:
        result = train(args, stage, device)
        print_rank_0("RESULT " + json.dumps(result), args.global_rank)


if __name__ == "__main__":
    main()
