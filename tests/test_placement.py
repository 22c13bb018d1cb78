"""Where offloaded model states live ([Note: master placement] in core/shard.py).

The placement is asked of the stores themselves (`Store.holds`): with optimizer offload the fp32
master and every optimizer state tensor are the store's, the reduced gradient shards (stages 2/3) too,
whatever the compute dtype — unless the compute device can step the store's memory in place (a CPU
machine), where an fp32 master stays the parameter storage (zero copy). A GPU cannot be had in CI, so
the GPU's view of host memory is modelled by stores that answer `addressable_from(device)` with False:
the code path is then exactly the GPU's (separate master in the store, step there, values copied back
to the device parameters or the stage-3 compute shard), on CPU tensors. Every case also trains
bit-for-bit like the same run without offload (fp32 and bf16, 2 gloo ranks).
"""

from __future__ import annotations

import os

import pytest
import torch

import zeroshard
from tests.harness import grid, run_distributed, subtests
from tests.reference import gpt_batches, gpt_loss
from tests.zs_common import adamw, gpt_model_fn
from zeroshard.core.placement import Placement
from zeroshard.core.policy import PrecisionPolicy
from zeroshard.offload import CPUStore, NVMeStore
from zeroshard.tools.models.gpt import tiny_gpt_config

STEPS = 3
BATCHES = gpt_batches(tiny_gpt_config(), batch_size=4)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class HostSeenFromGPU(CPUStore):
    """Host memory as a GPU sees it: not addressable by the compute device."""

    def addressable_from(self, device: torch.device) -> bool:
        return False


class FilesSeenFromGPU(NVMeStore):
    def addressable_from(self, device: torch.device) -> bool:
        return False


def _store(kind: str, foreign: bool, rank: int, tmp: str):
    if kind == "cpu":
        return HostSeenFromGPU() if foreign else CPUStore()
    cls = FilesSeenFromGPU if foreign else NVMeStore
    return cls(os.path.join(tmp, f"nvme-{foreign}"), rank, bytes_needed=1 << 20)


def _train(stage: int, dtype: str, placement: Placement | None):
    model = gpt_model_fn()()
    precision = PrecisionPolicy(DTYPES[dtype], DTYPES[dtype])
    sharded = zeroshard.shard(
        model,
        adamw(model.parameters()),
        stage=stage,
        precision=precision,
        offload=placement,
        communication=zeroshard.CommunicationPolicy(timeout_s=60),
    )
    losses = []
    for step in range(STEPS):
        loss = gpt_loss(sharded, *BATCHES(step, 0, sharded.comm.rank))
        sharded.backward(loss)
        sharded.step()
        losses.append(loss.item())
    with sharded.gathered_parameters(list(model.parameters())):
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return sharded, losses, params


def _placement_case(stage: int, dtype: str, kind: str, foreign: bool, rank: int, tmp: str) -> dict:
    store = _store(kind, foreign, rank, tmp)
    sharded, losses, params = _train(stage, dtype, Placement(optimizer_store=store))
    what = f"stage {stage} {dtype} {kind} {'seen from a GPU' if foreign else 'on CPU'}"
    groups = [g for g in sharded._groups if g.trainable]
    separate = foreign or dtype != "fp32"  # [Note: master placement]
    for group in groups:
        assert store.holds(group.master) == separate, f"{what}: master held by the store? {not separate}"
        assert group.master.dtype == torch.float32
        if not separate:
            assert group.master_is_parameter_storage(), f"{what}: fp32 master on CPU must be zero copy"
        if stage >= 2:
            assert store.holds(group.grad_shard), f"{what}: gradient shard not in the store"
        if stage == 3:
            assert (group.compute_shard is not None) == foreign, f"{what}: compute shard"
            if foreign:
                assert group.compute_shard.dtype == DTYPES[dtype]
                assert torch.equal(group.compute_shard.float(), group.master.to(DTYPES[dtype]).float()), (
                    f"{what}: compute shard does not follow the master"
                )
        elif stage in (1, 2) and separate:
            start, end = group.opt_range  # the device parameters took the updated master
            assert torch.equal(group.full[start:end], group.master.to(DTYPES[dtype])), what
    states = [
        v for s in sharded.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() == 1
    ]
    assert states and all(store.holds(v) for v in states), f"{what}: optimizer state outside the store"
    report = sharded.memory_report()
    held_master = sum(g.master.numel() * 4 for g in groups if store.holds(g.master))
    if kind == "cpu":  # host memory is real memory: a separate master is counted, a view is not
        trainable_master = sum(g.state_bytes()["master"] for g in groups)
        assert trainable_master == held_master, f"{what}: master bytes {trainable_master} != {held_master}"
    else:
        assert report["offloaded_nvme"] == store.bytes_held > 0, what
    sharded.destroy()
    return {"losses": losses, "params": params, "report": report}


def _worker(rank: int, world: int, tmp: str) -> list:
    tmp = os.path.join(tmp, f"rank{rank}")
    os.makedirs(tmp, exist_ok=True)
    reference = {}

    def case(stage, dtype, kind, foreign):
        if (stage, dtype) not in reference:
            sharded, losses, params = _train(stage, dtype, None)
            sharded.destroy()
            reference[stage, dtype] = (losses, params)
        out = _placement_case(stage, dtype, kind, foreign, rank, tmp)
        losses, params = reference[stage, dtype]
        what = f"stage {stage} {dtype} {kind} foreign={foreign}"
        assert out["losses"] == losses, f"{what}: losses differ from no offload {out['losses']} {losses}"
        for name, value in params.items():
            assert torch.equal(out["params"][name], value), f"{what}: '{name}' differs from no offload"
        return out["report"]

    return subtests(grid(stage=[1, 2, 3], dtype=["fp32", "bf16"], kind=["cpu", "nvme"], foreign=[True, False]), case)


@pytest.mark.slow
def test_offload_placement_by_device(tmp_path):
    reports = run_distributed(_worker, 2, timeout=600, tmp=str(tmp_path))
    assert len(reports[0]) == 24


def _param_store_worker(rank: int, world: int, tmp: str) -> None:
    """Stage 3 with offload_param: the param store holds the shard, which is also the master."""
    for dtype in ("fp32", "bf16"):
        params_home = CPUStore()
        placement = Placement(optimizer_store=HostSeenFromGPU(), param_store=params_home)
        sharded, _, _ = _train(3, dtype, placement)
        for group in sharded._groups:
            assert params_home.holds(group.master) and group.compute_shard is None, dtype
            assert group.gather_input().dtype == DTYPES[dtype]
        sharded.destroy()


def test_param_offload_keeps_master_in_param_store(tmp_path):
    run_distributed(_param_store_worker, 2, timeout=300, tmp=str(tmp_path))


# -- collectives on the communicator's device ([Note: staging host tensors] in core/staging.py) -------------
def _collectives(comm, rank: int, world: int, async_op: bool) -> dict:
    """Every tensor collective once, on CPU tensors; results by name."""
    out = {}
    shard = torch.arange(3, dtype=torch.float32) + 10 * rank
    gathered = torch.full((3 * world,), -1.0)
    handle = comm.all_gather(gathered, shard, "test: all-gather", async_op=async_op)
    if async_op:
        out["gather_before_wait"] = gathered.clone()
        handle.wait()
    out["all_gather"] = gathered
    out["caller_pointers"] = {gathered.data_ptr(), shard.data_ptr()}
    full = torch.arange(4.0 * world) * (rank + 1)
    reduced = torch.full((4,), -1.0)
    handle = comm.reduce_scatter(reduced, full, "test: reduce-scatter", async_op=async_op)
    if async_op:
        handle.wait()
    out["reduce_scatter"] = reduced
    in_place = torch.arange(4.0 * world) * (rank + 1)  # stage 1: the output is a slice of the input
    comm.reduce_scatter(in_place[4 * rank : 4 * (rank + 1)], in_place, "test: in-place reduce-scatter")
    out["in_place"] = in_place
    for op in ("sum", "max"):
        value = torch.tensor([1.0 + rank, 5.0 - rank], dtype=torch.float64)
        comm.all_reduce(value, f"test: all-reduce {op}", op=op)
        out[op] = value
    value = torch.tensor([7.0 * (rank + 1)])
    comm.broadcast(value, 1, "test: broadcast from rank 1")
    out["broadcast"] = value
    comm.barrier("test: barrier")
    return out


def _staging_worker(rank: int, world: int) -> dict:
    from zeroshard.core import comm as comm_module
    from zeroshard.core.comm import Communicator

    seen = set()  # data pointers of what the all-gather is handed: gloo's, or at two gloo ranks the exchange
    real, real_pairwise = comm_module._all_gather, comm_module._PairwiseAllGather

    def recording(out, shard, **kwargs):
        seen.update((out.data_ptr(), shard.data_ptr()))
        return real(out, shard, **kwargs)

    def recording_pairwise(out, shard, *args):
        seen.update((out.data_ptr(), shard.data_ptr()))
        return real_pairwise(out, shard, *args)

    # ours, not torch's: the names comm.py calls ([Note: all-gather on gloo])
    comm_module._all_gather, comm_module._PairwiseAllGather = recording, recording_pairwise
    try:
        comm = Communicator(60, check_collectives=True)
        plain = _collectives(comm, rank, world, async_op=False)
        assert comm.counter.staged == 0, "tensors on the communicator's device are never staged"
        assert plain.pop("caller_pointers") <= seen, "unstaged: the backend gets the caller's tensors"
        # The communicator's device is not where the caller's tensors are, as for NCCL and a host
        # tensor. torch.device("cpu", 0) is CPU memory, so gloo still runs, but it is not the
        # callers' torch.device("cpu"): every argument takes the staging path.
        comm.device = torch.device("cpu", 0)
        seen.clear()
        for async_op in (False, True):
            seen.clear()
            staged = _collectives(comm, rank, world, async_op=async_op)
            assert not staged.pop("caller_pointers") & seen, "staged: the backend gets temporaries"
            for name, value in plain.items():
                assert torch.equal(staged[name], value), (name, staged[name], value)
        # An async staged output is written only when waited for: the caller's tensor is untouched.
        assert torch.equal(staged["gather_before_wait"], torch.full((3 * world,), -1.0))
        staged_bytes = comm.counter.staged
        comm.destroy()
    finally:
        comm_module._all_gather, comm_module._PairwiseAllGather = real, real_pairwise
    return {"staged_bytes": staged_bytes, "plain": plain}


def test_collectives_stage_tensors_off_the_communicators_device():
    reports = run_distributed(_staging_worker, 2, timeout=120)
    world = 2
    # Per pass: all-gather in 12 + out 24 (the consistency-check tags are born on the device), reduce-
    # scatter in 32 + out 16, in place 32 + 16, two all-reduces 2 x (16 + 16), broadcast 4 (src: in;
    # others: out), barrier 4 + 4; two passes (sync, async).
    per_pass = (12 + 24) + (32 + 16) + (32 + 16) + 2 * (16 + 16) + 4 + (4 + 4)
    assert [r["staged_bytes"] for r in reports] == [2 * per_pass] * world, reports
    plain = reports[0]["plain"]
    assert plain["all_gather"].tolist() == [0, 1, 2, 10, 11, 12]
    assert plain["sum"].tolist() == [3.0, 9.0] and plain["max"].tolist() == [2.0, 5.0]
    assert plain["broadcast"].tolist() == [14.0]


def test_only_a_store_in_files_trims_the_heap(tmp_path, monkeypatch):
    """[Note: trimming the heap]: a placement with a store in files hands the freed heap back; one
    with stores in memory, or none, leaves it alone."""
    calls = []
    monkeypatch.setattr("zeroshard.core.placement.trim_heap", lambda: calls.append(1))
    Placement().trim_heap()
    Placement(optimizer_store=CPUStore()).trim_heap()
    assert calls == []
    store = NVMeStore(tmp_path, rank=0, bytes_needed=1 << 20)
    try:
        Placement(optimizer_store=CPUStore(), param_store=store).trim_heap()
    finally:
        store.destroy()
    assert calls == [1]
