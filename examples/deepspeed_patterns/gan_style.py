"""A GAN trained the way DeepSpeedExamples' training/gan/gan_deepspeed_train.py trains it: two engines
(discriminator D and generator G) built from client Adam optimizers with a config that also has an
`optimizer` section, the modules called directly (`netD(real)`), two `engine.backward` calls for D
per step, and G's loss flowing back through D's parameters. Synthetic "images" (6-D points); only
the import differs. DeepSpeed runs this at stages 0-2; at stage 3 zeroshard stops with the cause.

    torchrun --nproc_per_node 2 examples/deepspeed_patterns/gan_style.py --stages 0,1,2,3
"""

import argparse
import json

import torch
import torch.nn as nn

import zeroshard as deepspeed


class Generator(nn.Module):
    def __init__(self, nz=4, ngf=16, nc=6):
        super().__init__()
        self.main = nn.Sequential(nn.Linear(nz, ngf), nn.BatchNorm1d(ngf), nn.ReLU(True), nn.Linear(ngf, nc), nn.Tanh())

    def forward(self, x):
        return self.main(x)


class Discriminator(nn.Module):
    def __init__(self, ndf=16, nc=6):
        super().__init__()
        self.main = nn.Sequential(nn.Linear(nc, ndf), nn.LeakyReLU(0.2, inplace=True), nn.Linear(ndf, 1), nn.Sigmoid())

    def forward(self, x):
        return self.main(x).view(-1, 1).squeeze(1)


def weights_init(m):
    if isinstance(m, nn.Linear):
        m.weight.data.normal_(0.0, 0.02)
    elif isinstance(m, nn.BatchNorm1d):
        m.weight.data.normal_(1.0, 0.02)
        m.bias.data.fill_(0)


def get_argument_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batchSize", type=int, default=16)
    parser.add_argument("--nz", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.0002)
    parser.add_argument("--beta1", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--manualSeed", type=int, default=999)
    # DeepSpeedExamples' default is 0, with the deepspeed launcher passing --local_rank; torchrun passes
    # only LOCAL_RANK, and initialize() refuses an args.local_rank that differs from it (as DeepSpeed does)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--stages", default="0,1,2")
    return parser


def train(args, stage):
    torch.manual_seed(args.manualSeed)
    netG, netD = Generator(args.nz), Discriminator()
    netG.apply(weights_init)
    netD.apply(weights_init)
    criterion = nn.BCELoss()
    real_label, fake_label = 1.0, 0.0
    optimizerD = torch.optim.Adam(netD.parameters(), lr=args.lr, betas=(args.beta1, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=args.lr, betas=(args.beta1, 0.999))
    config = {
        "train_batch_size": args.batchSize * torch.distributed.get_world_size(),
        "optimizer": {"type": "Adam", "params": {"lr": 0.0002, "betas": [0.5, 0.999], "eps": 1e-8}},
        "steps_per_print": 10,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    model_engineD, optimizerD, _, _ = deepspeed.initialize(
        args=args, model=netD, model_parameters=netD.parameters(), optimizer=optimizerD, config=config
    )
    model_engineG, optimizerG, _, _ = deepspeed.initialize(
        args=args, model=netG, model_parameters=netG.parameters(), optimizer=optimizerG, config=config
    )
    generator = torch.Generator().manual_seed(torch.distributed.get_rank())
    history = []
    try:
        for _i in range(args.steps):
            real = torch.randn(args.batchSize, 6, generator=generator) * 0.3 + 0.5
            netD.zero_grad()
            label = torch.full((args.batchSize,), real_label)
            output = netD(real)
            errD_real = criterion(output, label)
            model_engineD.backward(errD_real)
            noise = torch.randn(args.batchSize, args.nz, generator=generator)
            fake = netG(noise)
            label.fill_(fake_label)
            output = netD(fake.detach())
            errD_fake = criterion(output, label)
            model_engineD.backward(errD_fake)
            errD = errD_real + errD_fake
            model_engineD.step()
            netG.zero_grad()
            label.fill_(real_label)
            output = netD(fake)
            errG = criterion(output, label)
            model_engineG.backward(errG)
            model_engineG.step()
            history.append([errD.item(), errG.item()])
        error = None
    except RuntimeError as exc:
        error = str(exc)
    model_engineD.destroy()
    model_engineG.destroy()
    return {"stage": stage, "history": history, "error": error}


def main():
    parser = get_argument_parser()
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed()
    for stage in [int(s) for s in args.stages.split(",")]:
        result = train(args, stage)
        if torch.distributed.get_rank() == 0:
            print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
