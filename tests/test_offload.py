"""Offload of optimizer states / masters / stage-3 parameters to CPU memory or NVMe files.

Parity: every offload setting trains bit-for-bit like the same run without offload (fp32, 2 ranks,
10 steps). Failures: an unwritable path, too little free space, a truncated or deleted swap file
are errors that name the path, raised before anything is updated.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

import zeroshard
from tests.harness import run_distributed, subtests
from tests.reference import gpt_batches
from tests.zs_common import adamw, assert_close, gpt_model_fn, make_config, train_engine
from zeroshard.offload import StoreError
from zeroshard.tools.models.gpt import tiny_gpt_config

STEPS = 10
BATCHES = gpt_batches(tiny_gpt_config(), batch_size=4)


def _offload_config(
    stage, optimizer_device, param_device, nvme_path, sub_group_size=None, precision=None, nvme_io=None
):
    config = make_config(stage)
    if nvme_io:  # the NVMe store's path for the optimizer stream (offload/blockio.py); default "mapped"
        config.setdefault("zeroshard", {})["nvme_io"] = nvme_io
    zero = config["zero_optimization"]
    if optimizer_device:
        zero["offload_optimizer"] = {"device": optimizer_device, "nvme_path": nvme_path}
    if param_device:
        zero["offload_param"] = {"device": param_device, "nvme_path": nvme_path}
    if sub_group_size:
        zero["sub_group_size"] = sub_group_size
    if precision:
        config[precision] = {"enabled": True}
    return config


def _parity(stage, optimizer_device, param_device, tmp, sub_group_size=None, precision=None, nvme_io=None):
    nvme = os.path.join(tmp, f"nvme-{stage}-{optimizer_device}-{param_device}-{sub_group_size}-{nvme_io}")
    plain = train_engine(
        gpt_model_fn(),
        BATCHES,
        config=_offload_config(stage, None, None, nvme, None, precision),
        steps=STEPS,
        record_params=True,
    )
    offloaded = train_engine(
        gpt_model_fn(),
        BATCHES,
        steps=STEPS,
        record_params=True,
        config=_offload_config(stage, optimizer_device, param_device, nvme, sub_group_size, precision, nvme_io),
    )
    what = (
        f"stage {stage} optimizer->{optimizer_device} params->{param_device} sub-group {sub_group_size} "
        f"nvme_io {nvme_io}"
    )
    assert_close(offloaded, plain, exact=True, what=what)
    leftovers = list(Path(nvme).glob("zeroshard-*")) if os.path.isdir(nvme) else []
    assert not leftovers, f"swap files left after destroy(): {leftovers}"


def _engine(config):
    model = gpt_model_fn()()
    engine, *_ = zeroshard.initialize(model=model, optimizer=adamw(model.parameters()), config=config)
    return engine


def _one_step(engine, step=0):
    _, loss = engine(*BATCHES(step, 0, engine.global_rank))
    engine.backward(loss)
    engine.step()


def _damage(kind: str, tmp: str) -> str:
    nvme = os.path.join(tmp, f"damage-{kind}")
    engine = _engine(_offload_config(3, "nvme", "nvme", nvme))
    _one_step(engine)
    files = sorted(Path(nvme).glob("zeroshard-*/*.swp"))
    assert files, "the NVMe store writes its files under nvme_path"
    state_file = next(f for f in files if "exp_avg_sq" in f.name)
    masters = [g.master.clone() for g in engine.groups]
    if kind == "truncated":
        os.truncate(state_file, state_file.stat().st_size // 2)
    else:
        state_file.unlink()
    _, loss = engine(*BATCHES(1, 0, engine.global_rank))
    engine.backward(loss)
    with pytest.raises(StoreError) as info:
        engine.step()
    assert str(state_file) in str(info.value) and kind.split()[0][:7] in str(info.value), str(info.value)
    assert all(torch.equal(a, g.master) for a, g in zip(masters, engine.groups)), "masters untouched"
    engine.destroy()
    assert not list(Path(nvme).glob("zeroshard-*")), "files removed by destroy()"
    return str(info.value)


def _bad_path(kind: str, tmp: str) -> str:
    if kind == "unwritable":
        blocker = os.path.join(tmp, "a-file")
        Path(blocker).write_text("not a directory")
        nvme = os.path.join(blocker, "nvme")
        with pytest.raises(StoreError, match="not writable") as info:
            _engine(_offload_config(3, "nvme", None, nvme))
        assert nvme in str(info.value)
        return str(info.value)
    real = shutil.disk_usage
    shutil.disk_usage = lambda path: real(path)._replace(free=1000)  # a nearly full disk
    try:
        with pytest.raises(StoreError, match="GB free") as info:
            _engine(_offload_config(3, "nvme", "nvme", os.path.join(tmp, "full")))
    finally:
        shutil.disk_usage = real
    return str(info.value)


def _worker(rank: int, world: int, tmp: str) -> dict:
    tmp = os.path.join(tmp, f"rank{rank}")
    os.makedirs(tmp, exist_ok=True)
    cases = [
        dict(stage=1, optimizer_device="cpu", param_device=None),
        dict(stage=2, optimizer_device="nvme", param_device=None),
        dict(stage=3, optimizer_device="cpu", param_device="cpu"),
        dict(stage=3, optimizer_device="nvme", param_device=None),
        dict(stage=3, optimizer_device=None, param_device="nvme"),
        dict(stage=3, optimizer_device="nvme", param_device="nvme"),
        dict(stage=3, optimizer_device="nvme", param_device="nvme", sub_group_size=1000),
        dict(stage=2, optimizer_device="nvme", param_device=None, precision="bf16"),
        dict(stage=3, optimizer_device="nvme", param_device="nvme", precision="bf16"),
        # the aligned paths of the optimizer stream (staged sub-groups), bit-exact too
        dict(stage=2, optimizer_device="nvme", param_device=None, nvme_io="direct"),
        dict(stage=3, optimizer_device="nvme", param_device="nvme", sub_group_size=1000, nvme_io="direct"),
        dict(stage=3, optimizer_device="nvme", param_device="nvme", nvme_io="buffered"),
    ]
    subtests([dict(c, tmp=tmp) for c in cases], _parity)
    damage = subtests([dict(kind=k, tmp=tmp) for k in ("truncated", "missing")], _damage)
    paths = subtests([dict(kind=k, tmp=tmp) for k in ("unwritable", "full disk")], _bad_path)
    return {"damage": damage, "paths": paths}


@pytest.mark.slow
def test_offload_parity_and_failures(tmp_path):
    reports = run_distributed(_worker, 2, timeout=600, tmp=str(tmp_path))
    assert "truncated" in reports[0]["damage"][0] and "missing" in reports[0]["damage"][1]
