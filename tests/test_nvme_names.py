"""NVMe swap directories under tensor parallelism: ranks that share a dp rank but differ in tp never
share a directory or a file, each directory names its (dp, tp, pp), and the reclaim of a dead
process's directory ([Note: swap files of dead processes] in offload/cleanup.py) removes that one
only, never the live peer with the same dp rank.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from torch.distributed.device_mesh import init_device_mesh

import zeroshard
from tests import mesh_models as mm
from tests.harness import run_distributed
from tests.tp_helpers import dtensor_model
from zeroshard.offload import NVMeStore

SRC = str(Path(zeroshard.__file__).resolve().parent.parent)
_NAME = re.compile(r"zeroshard-\d+-(rank\d+-tp\d+-pp\d+)-[0-9a-f]{8}")


def _worker(rank, world_size, *, nvme: str):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = dtensor_model(mesh)
    config = {
        "train_micro_batch_size_per_gpu": mm.BATCH,
        "zeroshard": {"comm_timeout_s": 120},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
    }
    engine, *_ = zeroshard.initialize(model=model, optimizer=mm.adamw(model.parameters()), mesh=mesh, config=config)
    engine.backward(mm.mse(engine, *mm.batches(0, 0, mesh.get_local_rank("dp"))))
    engine.step()
    root = engine.placement.optimizer_store.root
    files = sorted(str(p) for p in root.glob("*.swp"))
    engine.comm.barrier("listed")
    engine.destroy()
    return {"root": root.name, "files": files, "dp": mesh.get_local_rank("dp"), "tp": mesh.get_local_rank("tp")}


def test_ranks_sharing_a_dp_rank_never_share_swap_files(tmp_path):
    reports = run_distributed(_worker, 4, timeout=300, nvme=str(tmp_path / "nvme"))
    names = [_NAME.fullmatch(r["root"]) for r in reports]
    assert all(names), [r["root"] for r in reports]
    labels = [m.group(1) for m in names]
    assert labels == [f"rank{r['dp']}-tp{r['tp']}-pp0" for r in reports], labels
    assert len(set(labels)) == 4, f"two ranks of the grid name their swap directory alike: {labels}"
    files = [f for r in reports for f in r["files"]]
    assert files and len(set(files)) == len(files), "two ranks share a swap file"
    assert not list((tmp_path / "nvme").iterdir()), "destroy() removed every directory"


_HOLDER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {src!r})
    import torch
    from zeroshard.offload import NVMeStore
    store = NVMeStore({nvme!r}, 0, 1 << 20, threads=1, coordinate={{"tp": 1, "pp": 0}})
    store.tensor("x", 1000, torch.float32)
    print(store.root, flush=True)
    sys.stdin.readline()
""")


def test_reclaim_removes_the_dead_tp_peer_only(tmp_path):
    nvme = tmp_path / "nvme"
    live = NVMeStore(nvme, 0, 1 << 20, threads=1, coordinate={"tp": 0, "pp": 0})  # dp 0, tp 0: alive
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER.format(src=SRC, nvme=str(nvme))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    dead = Path(proc.stdout.readline().strip())
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    try:
        assert dead.is_dir() and "-rank0-tp1-pp0-" in dead.name, dead
        later = NVMeStore(nvme, 0, 1 << 20, threads=1, coordinate={"tp": 1, "pp": 0})  # the next run's dp 0, tp 1
        try:
            assert not dead.exists(), "the dead tp peer's directory was reclaimed"
            assert live.root.is_dir(), "the live rank with the same dp rank kept its directory"
            assert sorted(p.name for p in nvme.iterdir()) == sorted([live.root.name, later.root.name])
        finally:
            later.destroy()
    finally:
        live.destroy()
