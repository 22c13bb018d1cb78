"""Huge pages under the buffers zeroshard makes each step ([Note: huge pages] in core/pages.py):
counted in page faults, the cost they remove, and in the kernel's own accounting (smaps)."""
from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest
import torch

from zeroshard.core import pages
from zeroshard.core.group import FlatGroup
from zeroshard.core.policy import stage_policy
from zeroshard.core.precision import PrecisionPolicy
from zeroshard.core.rollback import Snapshot

needs_madvise = pytest.mark.skipif(not pages.advised(), reason="this kernel's THP mode is not 'madvise' "
                                   "(or ZEROSHARD_HUGE_PAGES=0): nothing is advised here")
MB = 1 << 20


def _faults(make) -> tuple[int, torch.Tensor]:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    out = make()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, out


def _huge_kb(tensor: torch.Tensor) -> int:
    """AnonHugePages of the mapping that holds `tensor`'s middle byte, from /proc/self/smaps (the
    advice splits the mapping: its unaligned ends are mappings of their own)."""
    address, inside = tensor.data_ptr() + tensor.numel() * tensor.element_size() // 2, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


@needs_madvise
def test_a_fresh_copy_faults_once_per_huge_page():
    source = torch.randn(64 * MB // 4)
    plain, copy = _faults(lambda: source.clone())
    advised, huge = _faults(lambda: pages.clone(source))
    assert torch.equal(huge, source) and torch.equal(copy, source)
    assert plain > 64 * MB // 4096 // 2, f"torch's clone faulted {plain} times for 64 MiB of 4 KiB pages"
    # 32 huge pages, plus the two unaligned ends (< 2 MiB each) as 4 KiB pages.
    assert advised < 32 + 2 * 512 + 64, f"{advised} faults for 64 MiB advised (4 KiB pages: {plain})"
    assert _huge_kb(huge) >= 60 * 1024, "the kernel should report the advised interior as huge pages"


@needs_madvise
def test_zeros_and_regrown_storage_are_advised_too():
    count, zeros = _faults(lambda: pages.zeros(32 * MB // 4, torch.float32, "cpu"))
    assert count < 16 + 2 * 512 + 64 and not zeros.any()
    zeros.untyped_storage().resize_(0)  # a stage-3 buffer after its unit is resharded
    count, _ = _faults(lambda: (pages.regrow(zeros, 32 * MB), zeros.fill_(1.0)))
    assert count < 16 + 2 * 512 + 64 and bool((zeros == 1.0).all())


def test_small_and_non_cpu_tensors_are_left_alone():
    small = torch.ones(1000)
    assert pages.advise(small) is small and pages.clone(small).tolist() == small.tolist()
    assert pages.advise(torch.empty(MB, device="meta")).device.type == "meta"
    strided = torch.arange(12.0).view(3, 4).t()  # a copy is contiguous whatever the source's strides
    assert pages.clone(strided).is_contiguous() and torch.equal(pages.clone(strided), strided)


def test_the_environment_turns_it_off():
    code = "from zeroshard.core import pages; print(pages.advised())"
    env = {**os.environ, "ZEROSHARD_HUGE_PAGES": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@needs_madvise
def test_the_buffers_made_each_step_are_advised():
    """A stage-3 unit's gathered buffer, a stage-2 full gradient and gradient shard, the step's copy."""
    numel = 8 * MB // 4
    params = [torch.nn.Parameter(torch.randn(numel))]
    group = FlatGroup(["w"], params, policy=stage_policy(3), precision=PrecisionPolicy(torch.float32, torch.float32),
                      world_size=2, rank=0, reshards=True, optimizer_group=0)
    group.free_full()
    count, full = _faults(lambda: group.new_full().fill_(0.5))
    assert count < 4 + 2 * 512 + 64, f"{count} faults filling an 8 MiB gathered buffer"
    count, _ = _faults(lambda: group.zeros_full_grad())
    assert count < 4 + 2 * 512 + 64
    optimizer = torch.optim.AdamW([group.master])
    group.master.grad = torch.ones_like(group.master)
    optimizer.step()
    snapshot = Snapshot(optimizer, type("Slots", (), {"diverged": {}})(), None)
    count, _ = _faults(lambda: snapshot.keep(group, [group.master]))
    assert count < 3 * (2 + 2 * 512) + 64, f"{count} faults copying 12 MiB of master and Adam state"
