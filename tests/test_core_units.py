"""Single-process unit tests of the core's bookkeeping: nothing here needs a process group."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from zeroshard.core.comm import ByteCounter
from zeroshard.core.flat import FlatLayout
from zeroshard.core.group import FlatGroup
from zeroshard.core.placement import Placement, Store
from zeroshard.core.policy import STAGES, PrecisionPolicy, Reduction, StagePolicy, stage_policy
from zeroshard.offload import CPUStore, NVMeStore


def test_flat_layout_offsets_padding_and_views():
    layout = FlatLayout(["a", "b", "c"], [torch.Size([2, 3]), torch.Size([5]), torch.Size([])], world_size=4)
    assert [s.offset for s in layout.slots] == [0, 6, 11] and layout.numel == 12
    assert (layout.shard_numel, layout.padded_numel) == (3, 12)
    layout = FlatLayout(["a", "b"], [torch.Size([2, 3]), torch.Size([5])], world_size=4)  # 11 -> 12
    assert (layout.numel, layout.shard_numel, layout.padded_numel) == (11, 3, 12)
    assert [layout.shard_range(r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    full = layout.flatten([torch.arange(6.0).view(2, 3), torch.arange(6.0, 11.0)], torch.float32)
    assert full.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0], "zero padding at the end"
    a, b = layout.views(full)
    assert a.shape == (2, 3) and b.shape == (5,) and a.data_ptr() == full.data_ptr()
    b.add_(1)
    assert full[6].item() == 7.0, "views write through to the flat buffer"


def test_pieces_in_cut_parameters_at_shard_boundaries():
    layout = FlatLayout(["a", "b"], [torch.Size([4]), torch.Size([3])], world_size=3)  # 7 -> shard 3
    pieces = [[(s.name, lo, hi) for s, lo, hi in layout.pieces_in(*layout.shard_range(r))] for r in range(3)]
    assert pieces == [[("a", 0, 3)], [("a", 3, 4), ("b", 0, 2)], [("b", 2, 3)]]
    assert list(layout.pieces_in(7, 9)) == [], "padding holds no parameter"


def _group(stage: int, world: int = 2, rank: int = 0, dtype=torch.float32):
    params = [nn.Parameter(torch.arange(6.0).view(2, 3)), nn.Parameter(torch.ones(3))]
    return params, FlatGroup(
        ["w", "b"],
        params,
        policy=stage_policy(stage),
        precision=PrecisionPolicy(dtype, dtype),
        world_size=world,
        rank=rank,
        reshards=stage == 3,
        optimizer_group=0,
    )


@pytest.mark.parametrize("stage", range(4))
def test_group_master_and_gradient_storage_follow_the_policy(stage):
    params, group = _group(stage, world=2, rank=1)
    assert group.reduction is STAGES[stage].reduction
    expected_master = group.layout.padded_numel if stage == 0 else group.layout.shard_numel
    assert group.master.numel() == expected_master
    # Stages 2/3: no gradient shard until the first reduction ([Note: gradient shard lifetime]).
    assert (group.full_grad is not None) == (stage <= 1) and group.grad_shard is None
    assert group.grad().numel() == (group.layout.padded_numel if stage <= 1 else group.layout.shard_numel)
    if stage < 3:
        assert group.master_is_view_of_full(), "fp32 masters are the parameter buffer at stages 0-2 (no copy)"
        assert params[0].data_ptr() == group.full.data_ptr()
    else:
        assert params[0].numel() == 0, "stage 3 keeps only the shard between uses"


def test_stage3_regathers_into_the_same_storage():
    params, group = _group(3)
    first = group.new_full()
    storage = first.untyped_storage().data_ptr()
    group.point_params_at_full()
    group.free_full()
    assert first.untyped_storage().size() == 0 and params[0].numel() == 0, "freeing resizes the storage to 0"
    again = group.new_full()
    assert again is first and again.untyped_storage().size() == group.layout.padded_numel * 4
    assert again.untyped_storage().data_ptr() != 0 and storage != 0


def test_policy_chooses_the_reduction():
    assert [STAGES[s].reduction for s in range(4)] == [
        Reduction.ALL_REDUCE,
        Reduction.REDUCE_SCATTER_IN_PLACE,
        Reduction.REDUCE_SCATTER_TO_SHARD,
        Reduction.REDUCE_SCATTER_TO_SHARD,
    ]
    assert [STAGES[s].stage for s in range(4)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="requires sharding gradients"):
        StagePolicy(True, False, True)
    with pytest.raises(ValueError, match="allowed: 0, 1, 2, 3"):
        stage_policy(4)


def test_byte_counter_uses_the_papers_convention():
    counter = ByteCounter(world_size=4)
    counter.add("all_reduce", 100)
    counter.add("reduce_scatter", 100)
    counter.add("all_gather", 100)
    counter.add("control", 8)
    assert dict(counter.paper) == {"all_reduce": 200, "reduce_scatter": 100, "all_gather": 100, "control": 8}
    assert counter.wire["all_reduce"] == pytest.approx(150.0), "a ring sends (N-1)/N of it"
    assert counter.data_bytes() == 400, "control traffic is not model-state traffic"


def test_stores_satisfy_the_placement_protocol(tmp_path):
    cpu = CPUStore()
    nvme = NVMeStore(tmp_path, rank=0, bytes_needed=1 << 16)
    for store in (cpu, nvme):
        assert isinstance(store, Store)
        tensor = store.tensor("x", 16, torch.float32)
        assert store.holds(tensor) and not store.holds(torch.zeros(16))
        tensor.add_(1)
        store.release([tensor])
        store.wait()
        store.prefetch([tensor])
        assert tensor.sum().item() == 16.0
    assert cpu.resident(cpu.tensor("y", 1, torch.float32)) and nvme.offloaded_bytes == 16 * 4
    placement = Placement(optimizer_store=nvme, param_store=nvme)
    assert placement.stores() == [nvme], "a store shared by both roles is listed once"
    placement.destroy()
    assert not any(tmp_path.iterdir()), "destroy removes the swap files"


def test_collective_tags_carry_what_each_rank_runs():
    from zeroshard.core import consistency
    from zeroshard.core.comm import KINDS

    same = [consistency.encode(2, 64, "all-gather of unit 'blocks.0' parameters (forward)", torch.device("cpu"))] * 2
    assert consistency.all_agree(torch.cat(same))
    other = consistency.encode(2, 64, "all-gather of unit 'blocks.1' parameters (forward)", torch.device("cpu"))
    tags = torch.cat([same[0], other])
    assert not consistency.all_agree(tags), "same kind and size, another unit: a divergence"
    assert consistency.describe(tags, KINDS) == [
        f"{KINDS[2]} of 64 bytes for all-gather of unit 'blocks.0' parameters (forward)",
        f"{KINDS[2]} of 64 bytes for all-gather of unit 'blocks.1' parameters (forward)",
    ]
    long = "x" * 500
    assert len(consistency.encode(0, 1, long, torch.device("cpu"))) == consistency.TAG_BYTES
    assert not consistency.all_agree(
        torch.cat(
            [
                consistency.encode(0, 1, long, torch.device("cpu")),
                consistency.encode(0, 1, long + "y", torch.device("cpu")),
            ]
        )
    ), "descriptions longer than the carried text still differ by their hash"


def test_a_large_untied_head_is_a_unit_of_its_own():
    """[Note: the head is a unit] (wrap.py): only a large head, used nowhere else, and only by default."""
    from zeroshard.compat.activation_checkpointing import apply_activation_checkpointing
    from zeroshard.core.wrap import ROOT, unit_modules
    from zeroshard.tools.models.gpt import GPT, tiny_gpt_config

    def names(wrap=None, **overrides):
        with torch.device("meta"):
            model = GPT(tiny_gpt_config(**overrides))
        return [name for name, _ in unit_modules(model, wrap)]

    assert names(tie_weights=False, vocab_size=512) == ["blocks.0", "blocks.1", "lm_head", ROOT]
    assert names(tie_weights=True, vocab_size=512)[-2:] == ["blocks.1", ROOT], "tied: the embedding uses it"
    assert names(tie_weights=False)[-2:] == ["blocks.1", ROOT], "64 x 32 is under half a block"
    assert "lm_head" not in names(["Block"], tie_weights=False, vocab_size=512), "wrap_modules decides alone"
    torch.manual_seed(0)
    model = GPT(tiny_gpt_config(tie_weights=False, vocab_size=512))
    assert apply_activation_checkpointing(model) == ["blocks.0", "blocks.1"], "a leaf gains nothing from it"


@pytest.mark.parametrize("stage", [0, 1])
def test_a_zeroed_gradient_buffer_reads_as_zeros_until_a_gradient_is_copied_in(stage):
    """[Note: zeroed when first read] in group.py: zero_grads leaves the stale values in the
    buffer of stages 0/1 and only marks it; every way of reading it sees zeros where no gradient came."""
    params, group = _group(stage)
    w, b = torch.full((2, 3), 2.0), torch.full((3,), 3.0)
    group.add_grad(0, w)
    group.add_grad(1, b)
    assert group.full_grad[:9].tolist() == [2.0] * 6 + [3.0] * 3, "a fresh buffer's first gradients add to zeros"
    group.zero_grads()
    assert group.full_grad[:6].tolist() == [2.0] * 6, "the values stay (the buffer is only marked)"
    group.add_grad(1, b)  # only the bias gets a gradient in the next backward: copied, not added
    group.add_grad(1, b)  # a second use of it adds
    assert group.grad()[:9].tolist() == [0.0] * 6 + [6.0] * 3, "the weight's slot reads as zeros"
    group.zero_grads()
    start, end = group.opt_range
    expected = ([0.0] * group.layout.padded_numel)[start:end]
    assert group.grad_for_optimizer().tolist() == expected, "a step without a backward reads zeros"
    group.add_grad(0, w)
    assert group.full_grad[:6].tolist() == [2.0] * 6, "after being read, the buffer is zeros again: add"


@pytest.mark.parametrize("stage", range(4))
def test_the_pre_divide_in_the_copy_is_the_copy_then_the_divide(stage):
    """[Note: the pre-divide in the copy] in group.py: gradients copied in times 1/N, the
    others (accumulated in an earlier micro-step, another dtype) multiplied by prescale, equal bit
    for bit to copying everything in and multiplying the buffer, at N = 2 and N = 3."""
    torch.manual_seed(0)
    w, b, w2 = torch.randn(2, 3), torch.randn(3), torch.randn(2, 3)
    for world in (2, 3):
        scale = 1.0 / world
        _, plain = _group(stage, world=world)
        _, fused = _group(stage, world=world)
        plain.zero_grads()  # a window after the first: stages 0/1 then mark their kept buffer unwritten
        fused.zero_grads()
        plain.add_grad(1, b)  # an earlier micro-step of the window: the bias only, unscaled
        plain.add_grad(0, w)
        plain.add_grad(1, b.bfloat16())
        plain.complete_full_grad()
        plain.full_grad.mul_(scale)
        fused.add_grad(1, b)
        fused.add_grad(0, w, scale=scale)  # first in the window: copied times 1/N
        fused.add_grad(1, b.bfloat16(), scale=scale)  # already written: added, scaled by prescale
        assert fused._scaled == [True, False]
        fused.complete_full_grad()
        fused.prescale(scale)
        assert torch.equal(plain.full_grad, fused.full_grad) and fused._scaled is None, world
        # A second gradient into a slot already scaled in the same backward (a pipeline's micro-batches).
        _, twice = _group(stage, world=world)
        twice.add_grad(0, w, scale=scale)
        twice.add_grad(0, w2, scale=scale)
        twice.complete_full_grad()
        twice.prescale(scale)
        expected = (w + w2).reshape(-1) * scale
        # N = 3: a/3 + b/3 against (a + b)/3, one rounding of the terms apart (they are O(1) here).
        close = torch.equal if world == 2 else functools.partial(torch.allclose, rtol=0, atol=1e-6)
        assert close(twice.full_grad[:6], expected), world
