"""Naming the missing ranks ([Note: naming the missing ranks] in core/liveness.py), in one process:
a listening socket is alive, a closed port is gone, a rank without an address never started. The
start-up gate ([Note: start-up skew]) on 2 ranks: a live rank that reaches the engine later than
comm_timeout_s is waited for, a rank gone before it fails the start-up at once."""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import zeroshard
from tests.harness import run_distributed, run_distributed_expect_failure
from tests.reference import gpt_batches, gpt_loss
from tests.zs_common import gpt_model_fn, make_config
from zeroshard.core import liveness
from zeroshard.tools.models.gpt import tiny_gpt_config


def test_probe_tells_alive_gone_and_never_started():
    listening = socket.create_server(("127.0.0.1", 0))
    closed = socket.create_server(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()  # nothing listens there: the kernel refuses, as for a process that died
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    store.set("1", f"127.0.0.1:{listening.getsockname()[1]}")
    store.set("2", f"127.0.0.1:{closed_port}")
    try:
        message = liveness._diagnose(store, [0, 1, 2, 3], me=0)
    finally:
        listening.close()
    assert message.startswith("missing ranks: rank 2 gone (process dead: 127.0.0.1 refused"), message
    assert "rank 3 never reached zeroshard's start-up" in message and "rank 1" not in message, message
    assert liveness._diagnose(store, [0, 1], me=0).startswith("missing ranks: rank 1 gone"), "closed now"


def test_every_rank_alive_says_so():
    listening = socket.create_server(("127.0.0.1", 0))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    store.set("1", f"127.0.0.1:{listening.getsockname()[1]}")
    try:
        assert liveness._diagnose(store, [0, 1], me=0).startswith("missing ranks: none"), "rank 1 listens"
    finally:
        listening.close()


GATE_TIMEOUT_S = 1.0  # comm_timeout_s in the gate cases: far below how late a rank arrives


def _gate_engine(comm_timeout_s: float):
    model = gpt_model_fn()()
    config = make_config(2)
    config["zeroshard"]["comm_timeout_s"] = comm_timeout_s
    engine, *_ = zeroshard.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
    return engine


def _late_rank_worker(rank: int, world: int) -> float:
    liveness.announce(rank, 60.0)  # as zeroshard.init_distributed does under torchrun, before the wait
    if rank == 1:
        time.sleep(4 * GATE_TIMEOUT_S)  # loading something the other rank does not
    engine = _gate_engine(GATE_TIMEOUT_S)
    inputs, targets = gpt_batches(tiny_gpt_config())(0, 0, rank)
    loss = gpt_loss(engine, inputs, targets)
    engine.backward(loss)
    engine.step()
    engine.destroy()
    return loss.item()


def test_a_live_rank_later_than_comm_timeout_is_waited_for_at_start_up():
    losses = run_distributed(_late_rank_worker, 2, timeout=120)
    assert all(loss == loss and loss > 0 for loss in losses), losses


def _gone_rank_worker(rank: int, world: int) -> dict:
    _gate_engine(60.0).destroy()  # every rank has published its liveness address
    if rank == 1:
        os._exit(0)  # the machine's process dies between two engines
    started = time.monotonic()
    try:
        _gate_engine(60.0)
    except zeroshard.CollectiveError as error:
        return {"seconds": time.monotonic() - started, "message": str(error)}
    return {"seconds": time.monotonic() - started, "message": "no error"}


def test_a_rank_gone_before_the_engine_fails_the_start_up_within_seconds_not_comm_timeout():
    report = run_distributed_expect_failure(_gone_rank_worker, 2, timeout=120)[0]
    assert report.ok, report.describe()
    seen = report.value
    assert "waiting for every rank at start-up failed" in seen["message"], seen
    assert "rank 1 gone" in seen["message"], seen
    assert seen["seconds"] < 15, seen  # probed every liveness.GATE_PROBE_S; comm_timeout_s is 60 s
