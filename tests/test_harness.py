"""The multi-process harness itself: values come back, failures and hangs are reported, nothing leaks."""

import os
import sys
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from tests.harness import (
    PRELOAD_VAR,
    grid,
    kept_rank_pids,
    run_distributed,
    run_distributed_expect_failure,
    send_note,
    subtests,
)


def _spawned_ranks() -> list[psutil.Process]:
    """Our rank processes still alive, other than the groups kept for later calls (the resource
    tracker that spawn starts is not one of them)."""
    alive, kept = [], set(kept_rank_pids())
    for child in psutil.Process().children(recursive=True):
        try:
            if child.pid in kept:
                continue
            if "spawn_main" in " ".join(child.cmdline()) and child.status() != psutil.STATUS_ZOMBIE:
                alive.append(child)
        except psutil.NoSuchProcess:
            pass
    return alive


# ---------------------------------------------------------------- workers (module level: spawn pickles them)


def _all_reduce_worker(rank, world_size, *, scale):
    t = torch.tensor([float(rank + 1)]) * scale
    dist.all_reduce(t)

    def case(op, size):
        x = torch.full((size,), float(rank + 1))
        dist.all_reduce(x, op=op)
        return x[0].item()

    per_case = subtests(grid(op=[dist.ReduceOp.SUM, dist.ReduceOp.MAX], size=[1, 1000]), case)
    env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "ZS_FLAG")}
    return {"sum": t, "cases": per_case, "env": env, "threads": torch.get_num_threads()}


def _raise_on_rank1(rank, world_size):
    if rank == 1:
        raise ValueError("rank one exploded on purpose")
    dist.barrier()  # rank 0 waits for a peer that is gone: gloo raises "Connection closed by peer"
    return rank


def _subtests_with_one_bad_case(rank, world_size):
    def case(k):
        x = torch.tensor([float(k)])
        dist.all_reduce(x)
        assert not (k == 2 and rank == 1), f"case k={k} is wrong on rank {rank}"
        return x.item()

    return subtests(grid(k=[1, 2, 3, 4]), case)


def _hang_on_rank1(rank, world_size):
    if rank == 1:
        send_note("about to sleep forever")
        time.sleep(3600)
    dist.barrier()


def _four_outcomes(rank, world_size):
    # No collectives, so each rank's outcome is independent of the others'. The rank that dies waits
    # until the others are past start-up: a peer gone while gloo still connects fails that rank's start.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    store.set(f"outcomes/started/{rank}", "1")
    if rank == 1:
        raise KeyError("bad key")
    if rank == 2:
        time.sleep(3600)
    if rank == 3:
        store.wait([f"outcomes/started/{r}" for r in range(world_size)])
        os._exit(3)
    return "fine"


def _change_the_process(rank, world_size, *, dtype):
    seen = {
        "flag": os.environ.get("ZS_LEFT_BEHIND"),
        "dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "random": torch.rand(1).item(),
        "pid": os.getpid(),
    }
    os.environ["ZS_LEFT_BEHIND"] = "yes"
    torch.set_default_dtype(dtype)
    torch.set_grad_enabled(False)
    torch.rand(5)
    return seen


def _destroy_the_group(rank, world_size):
    dist.destroy_process_group()
    return os.getpid()


# ---------------------------------------------------------------- tests


def test_values_env_and_subtests_at_world_2():
    reports = run_distributed(_all_reduce_worker, 2, scale=2.0, env={"ZS_FLAG": "on"})
    assert len(reports) == 2
    for rank, r in enumerate(reports):
        assert torch.equal(r["sum"], torch.tensor([6.0]))  # 2*1 + 2*2
        assert r["cases"] == [3.0, 3.0, 2.0, 2.0]  # grid order: (SUM,1), (SUM,1000), (MAX,1), (MAX,1000)
        assert r["env"] == {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "MASTER_PORT": r["env"]["MASTER_PORT"],
            "ZS_FLAG": "on",
        }
        assert r["threads"] == 1
    assert "ZS_FLAG" not in os.environ  # env is set for the children only


@pytest.mark.slow
def test_values_at_world_4():
    reports = run_distributed(_all_reduce_worker, 4, scale=1.0)  # the suite's kept 4 ranks, when alive
    assert [r["sum"].item() for r in reports] == [10.0] * 4
    assert [r["cases"] for r in reports] == [[10.0, 10.0, 4.0, 4.0]] * 4


def test_a_failing_rank_raises_with_its_traceback():
    start = time.time()
    with pytest.raises(AssertionError) as info:
        run_distributed(_raise_on_rank1, 2, timeout=600)
    text = str(info.value)
    assert "rank 1: raised ValueError" in text and "ValueError: rank one exploded on purpose" in text
    assert "in _raise_on_rank1" in text and "Traceback" in text
    assert time.time() - start < 120  # a failure does not wait for the 600 s timeout
    assert _spawned_ranks() == []


def test_subtests_name_the_failing_case_and_run_the_others():
    with pytest.raises(AssertionError) as info:
        run_distributed(_subtests_with_one_bad_case, 2)
    text = str(info.value)
    assert "1 of 4 sub-cases failed" in text  # k = 3, 4 still ran after k = 2 failed
    assert "sub-case {'k': 2} failed on ranks [1]" in text
    assert "case k=2 is wrong on rank 1" in text
    assert "(passed on this rank)" in text  # rank 0 reports the same failure


@pytest.mark.slow
def test_a_hang_is_killed_at_the_timeout_with_its_stack():
    start = time.time()
    with pytest.raises(AssertionError) as info:
        run_distributed(_hang_on_rank1, 2, timeout=4)
    elapsed = time.time() - start
    text = str(info.value)
    assert "rank 1: did not report within the 4 s timeout" in text
    assert "about to sleep forever" in text  # the note sent before hanging
    assert "in _hang_on_rank1" in text  # faulthandler's stack dump says where it hung
    assert elapsed >= 4  # no upper bound: starting ranks on a loaded machine may take a while
    assert _spawned_ranks() == []


@pytest.mark.slow
def test_expect_failure_returns_every_outcome():
    reports = run_distributed_expect_failure(_four_outcomes, 4, timeout=4)
    ok, raised, hung, died = reports
    assert ok.ok and ok.value == "fine"
    assert not raised.ok and raised.exc_type == "KeyError" and "bad key" in raised.message
    assert "in _four_outcomes" in raised.traceback
    assert not hung.reported and "did not report within the 4 s timeout" in hung.message
    assert not died.reported and "exited with code 3 before reporting" in died.message
    assert not any(psutil.pid_exists(r.pid) and psutil.Process(r.pid).status() != psutil.STATUS_ZOMBIE for r in reports)
    assert _spawned_ranks() == []


@pytest.mark.slow
def test_kept_ranks_take_the_next_call_with_the_process_put_back():
    first = run_distributed(_change_the_process, 2, dtype=torch.float64)
    second = run_distributed(_change_the_process, 2, dtype=torch.float64)
    assert [r["pid"] for r in first] == [r["pid"] for r in second]  # the same processes
    assert set(kept_rank_pids()) >= {r["pid"] for r in second}
    for seen in second:  # nothing the first call changed is visible to the second
        assert seen["flag"] is None and seen["dtype"] == torch.float32 and seen["grad"]
    assert [r["random"] for r in first] == [r["random"] for r in second]  # the RNG state as it started
    fresh = run_distributed(_change_the_process, 2, dtype=torch.float64, fresh=True)
    assert not {r["pid"] for r in fresh} & {r["pid"] for r in second}


def test_a_worker_that_destroys_the_process_group_retires_its_ranks():
    pids = run_distributed(_destroy_the_group, 2)
    assert not set(pids) & set(kept_rank_pids())
    after = run_distributed(_change_the_process, 2, dtype=torch.float32)
    assert not set(pids) & {r["pid"] for r in after}


def test_an_unpicklable_worker_is_rejected_before_spawning():
    with pytest.raises(TypeError, match="module level"):
        run_distributed(lambda rank, world_size: rank, 2)


def test_subtests_in_one_process():
    assert subtests([{"a": 1}, {"a": 2}], lambda a: a * 10) == [10, 20]
    with pytest.raises(AssertionError, match=r"sub-case \{'a': 2\} failed on ranks \[0\]"):
        subtests([{"a": 1}, {"a": 2}], lambda a: 1 / (a - 2))


def _malloc_worker(rank, world_size):
    """How many of 64 mallocs of 96 KiB are served by mmap (glibc's chunk header: IS_MMAPPED, 0x2;
    malloc maps only what the heap's top cannot give), and whether this rank was forked from the
    fork server rather than spawned."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    pointers = [libc.malloc(96 * 1024) for _ in range(64)]
    size_t = ctypes.sizeof(ctypes.c_size_t)
    mapped = sum(bool(ctypes.c_size_t.from_address(p - size_t).value & 0x2) for p in pointers)
    for pointer in pointers:
        libc.free(ctypes.c_void_p(pointer))
    return {"mapped": mapped, "forked": "spawn_main" not in " ".join(psutil.Process().cmdline())}


def test_a_forked_rank_takes_the_mmap_threshold_of_its_env():
    """MALLOC_MMAP_THRESHOLD_ is read at a process's start; a forked rank sets it with mallopt, so the
    memory tests' groups need no spawned ranks. glibc's default threshold is 128 KiB."""
    fixed = run_distributed(_malloc_worker, 2, env={"MALLOC_MMAP_THRESHOLD_": "65536"})
    assert all(r["forked"] and r["mapped"] >= 32 for r in fixed), fixed  # some come from free heap space
    default = run_distributed(_malloc_worker, 2)
    assert all(r["forked"] and r["mapped"] == 0 for r in default), default


def _preloaded_worker(rank, world_size):
    return {"preloaded": "tabnanny" in sys.modules, "forked": "spawn_main" not in " ".join(psutil.Process().cmdline())}


def test_a_groups_preload_list_is_imported_by_a_fork_server_of_its_own():
    """[Note: a fork server per preload list]: ranks of a group that names modules in PRELOAD_VAR are
    forked with them imported; the other groups' ranks come from the standard server, without them."""
    preloaded = run_distributed(_preloaded_worker, 2, env={PRELOAD_VAR: "tabnanny"}, fresh=True)
    assert all(r["forked"] and r["preloaded"] for r in preloaded), preloaded
    plain = run_distributed(_preloaded_worker, 2, fresh=True)
    assert all(r["forked"] and not r["preloaded"] for r in plain), plain


def test_every_serial_test_is_in_a_module_make_test_runs_alone():
    """`make test` runs the tests marked `serial` from the modules its SERIAL_TESTS names (collecting
    only those is 10 s less on the critical path): a serial test elsewhere would run in no phase."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    (listed,) = re.findall(r"^SERIAL_TESTS := (.+?)(?:\s+#.*)?$", (root / "Makefile").read_text(), re.M)
    holding = {
        f"tests/{path.name}"
        for path in (root / "tests").glob("test_*.py")
        if re.search(r"^@pytest\.mark\.serial$", path.read_text(), re.M)
    }
    assert holding == set(listed.split()), (holding, listed)
