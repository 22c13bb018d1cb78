"""Naming the missing ranks ([Note: naming the missing ranks] in core/liveness.py), in one process:
a listening socket is alive, a closed port is gone, a rank without an address never started."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist

from zeroshard.core import liveness


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
