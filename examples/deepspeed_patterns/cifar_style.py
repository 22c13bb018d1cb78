"""A CIFAR-10 classifier trained the way DeepSpeedExamples' training/cifar/cifar10_deepspeed.py trains
it, on synthetic images (no download), at each ZeRO stage given. Only the import differs from a
DeepSpeed script.

    torchrun --nproc_per_node 2 examples/deepspeed_patterns/cifar_style.py --stages 0,1,2,3
"""

import argparse
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import zeroshard as deepspeed
from zeroshard.accelerator import get_accelerator
from zeroshard.moe.utils import split_params_into_different_moe_groups_for_optimizer


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--stages", type=str, default="0,1,2,3")
    parser.add_argument("--dtype", default="fp32", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--moe-param-group", default=True, action="store_true")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def get_ds_config(args, stage):
    return {
        "train_batch_size": 16,
        "steps_per_print": 2000,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 10},
        },
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {
            "enabled": args.dtype == "fp16",
            "fp16_master_weights_and_grads": False,
            "loss_scale": 0,
            "loss_scale_window": 500,
            "hysteresis": 2,
            "min_loss_scale": 1,
            "initial_scale_power": 15,
        },
        "wall_clock_breakdown": False,
        "zero_optimization": {
            "stage": stage,
            "allgather_partitions": True,
            "reduce_scatter": True,
            "allgather_bucket_size": 50000000,
            "reduce_bucket_size": 50000000,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "cpu_offload": False,
        },
    }


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def synthetic_cifar(n, seed):
    """Images whose class is readable from the mean colour, so that a few steps learn something."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = torch.randn(n, 3, 32, 32, generator=g) * 0.5 + labels.view(-1, 1, 1, 1) / 5.0 - 1.0
    return TensorDataset(images, labels)


def test(model_engine, testset, local_device, target_dtype):
    testloader = torch.utils.data.DataLoader(testset, batch_size=8, shuffle=False)
    correct, total = 0, 0
    model_engine.eval()
    with torch.no_grad():
        for images, labels in testloader:
            if target_dtype is not None:
                images = images.to(target_dtype)
            outputs = model_engine(images.to(local_device))
            _, predicted = torch.max(outputs.data, 1)
            total += labels.size(0)
            correct += (predicted == labels.to(local_device)).sum().item()
    model_engine.train()
    return correct / total


def train(args, stage):
    torch.manual_seed(0)
    if torch.distributed.get_rank() != 0:
        torch.distributed.barrier()  # rank 0 "downloads" first
    trainset, testset = synthetic_cifar(256, 0), synthetic_cifar(64, 1)
    if torch.distributed.get_rank() == 0:
        torch.distributed.barrier()
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    if args.moe_param_group:
        parameters = split_params_into_different_moe_groups_for_optimizer(
            {"params": [p for p in net.parameters()], "name": "parameters"}
        )
    model_engine, optimizer, trainloader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset, config=get_ds_config(args, stage)
    )
    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half
    criterion = nn.CrossEntropyLoss()
    losses = []
    for _epoch in range(args.epochs):
        for _i, data in enumerate(trainloader):
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
    accuracy = test(model_engine, testset, local_device, target_dtype)
    if local_rank == 0:
        print(
            "RESULT "
            + json.dumps(
                {
                    "stage": stage,
                    "losses": losses,
                    "accuracy": accuracy,
                    "lr": model_engine.get_lr()[0],
                    "steps": model_engine.global_steps,
                }
            ),
            flush=True,
        )
    model_engine.destroy()


def main():
    args = add_argument()
    deepspeed.init_distributed()
    get_accelerator().set_device(int(os.environ.get("LOCAL_RANK")))
    for stage in [int(s) for s in args.stages.split(",")]:
        train(args, stage)


if __name__ == "__main__":
    main()
