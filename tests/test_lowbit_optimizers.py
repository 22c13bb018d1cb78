"""torchao's block-wise low-bit optimizers (AdamW8bit, AdamW4bit, AdamWFp8) under ZeRO, against DDP
with the same optimizer class.

Each parameter lies whole in its owner's slice and is stepped there as a tensor of its own shape
([Note: block-wise optimizer states] in core/optim/lowbit.py), so every quantization block and
scale is the one DDP's optimizer makes: at 2 ranks fp32, bit for bit at every stage, with CPU
and NVMe offload too (with NVMe the states live in swap files). Their state saves by parameter name
(codes and scales, exactly) and resumes at another stage and world size, also into swap files.
torchao compiles its update (torch.compile) for each parameter shape; one parity case runs it so, as
users do, on a model of two shapes, and the others eagerly (`tests.zs_common.torch_compile`), DDP's
side as zeroshard's. The distributed cases run AdamW8bit and AdamW4bit; the flat form of all three
classes is checked in one process.
"""

from __future__ import annotations

import tempfile

import pytest
import torch

from tests.checkpoint_helpers import reloads_unchanged_at_stage_2, resumes_at_stage_1
from tests.harness import run_distributed, subtests
from tests.reference import gpt_batches, train_ddp
from tests.zs_common import assert_close, gpt_model_fn, make_config, torch_compile, train_engine
from zeroshard.core.optim import lowbit
from zeroshard.tools.models.gpt import tiny_gpt_config

STEPS = 3
CONFIG = tiny_gpt_config()
LR = 1e-2


def _torchao(name: str):
    """torchao's optimizer class `name` (the `lowbit` extra, which make venv installs), imported where
    used, so that collecting the suite does not import torchao in every pytest worker."""
    import torchao.optim

    return getattr(torchao.optim, name)


def _optimizer(name: str):
    def build(params):
        return _torchao(name)(params, lr=LR, weight_decay=0.1)

    return build


def _blockwise_params(engine) -> int:
    """Parameters whose moments this rank keeps block-wise."""
    return sum(lowbit.is_blockwise(state.get("exp_avg")) for state in engine.optimizer.state.values())


def _parity_case(name: str, stage: int, offload: str = "", io: str | None = None) -> None:
    """`io`: zeroshard.nvme_io ("direct": the store reads states into buffers ahead of the update
    and writes them back with aligned writes; default "mapped"). torchao's update runs eagerly."""
    batches = gpt_batches(CONFIG, batch_size=4)
    with torch_compile(False):
        ref = train_ddp(
            gpt_model_fn(), batches, optimizer_fn=_optimizer(name), steps=STEPS, reduce_every_micro_step=stage >= 2
        )
        with tempfile.TemporaryDirectory(prefix="zs-lowbit-") as nvme_path:
            where = {"device": offload, "nvme_path": nvme_path} if offload == "nvme" else {"device": offload}
            zero: dict = {"offload_optimizer": where} if offload else {}
            if offload and stage == 3:
                zero["offload_param"] = where
            config = make_config(stage, **zero)
            if io is not None:
                config["zeroshard"]["nvme_io"] = io
            ours = train_engine(gpt_model_fn(), batches, config=config, optimizer_fn=_optimizer(name), steps=STEPS)
    assert_close(ours, ref, exact=True, what=f"{name} stage {stage} offload {offload or 'none'} {io or ''}")
    if offload == "nvme":  # the moments are in the swap files: in memory only the step counters (0-d)
        assert ours["memory"]["optimizer"] <= 8 * 4 * 100, ours["memory"]


def _mlp():
    """Two parameter shapes, so two compiled graphs per rank: a 64x64 weight, moments block-wise,
    and a bias under torchao's 4096-element minimum, fp32 moments."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64))


def _mlp_batches(step: int, micro: int, rank: int):
    inputs = torch.randn(4, 64, generator=torch.Generator().manual_seed(100 * step + 10 * micro + rank))
    return inputs, inputs.flip(-1)


def _mse(model, inputs, targets):
    return torch.nn.functional.mse_loss(model(inputs), targets)


def _compiled_case(name: str, stage: int) -> None:
    """torchao's update compiled, as users run it, on zeroshard's whole-parameter views: the same
    steps as DDP's compiled ones, bit for bit."""
    with torch_compile(True):
        ref = train_ddp(_mlp, _mlp_batches, optimizer_fn=_optimizer(name), steps=STEPS, loss_fn=_mse)
        ours = train_engine(
            _mlp, _mlp_batches, config=make_config(stage), optimizer_fn=_optimizer(name), steps=STEPS, loss_fn=_mse
        )
    assert_close(ours, ref, exact=True, what=f"{name} stage {stage}, compiled")


def _parity_worker(rank: int, world_size: int, cases: list) -> None:
    subtests([dict(name="AdamW8bit", stage=3)], _compiled_case)
    subtests(cases, _parity_case)


@pytest.mark.slow
def test_blockwise_optimizers_match_ddp_at_every_stage():
    # AdamWFp8 steps whole parameters the same way; what differs, its codes' layout in a checkpoint,
    # is checked in one process below.
    cases = [dict(name="AdamW8bit", stage=s) for s in (1, 2, 3)]
    cases += [dict(name="AdamW8bit", stage=3, offload="cpu"), dict(name="AdamW4bit", stage=3)]
    cases += [dict(name="AdamW8bit", stage=3, offload="nvme"), dict(name="AdamW8bit", stage=1, offload="nvme")]
    cases += [dict(name="AdamW4bit", stage=3, offload="nvme", io="direct")]
    run_distributed(_parity_worker, 2, timeout=600, cases=cases)


def _resume_worker(rank: int, world_size: int, directory: str) -> None:
    with torch_compile(False):
        resumes_at_stage_1(directory, _optimizer("AdamW8bit"), _blockwise_params)


def _nvme_resume_worker(rank: int, world_size: int, directory: str, swap: str) -> None:
    """The states in swap files ([Note: whole-parameter states in a store]): saved from them, loaded
    into them at another stage."""
    nvme = {"device": "nvme", "nvme_path": swap}
    zero = ({"offload_optimizer": nvme, "offload_param": nvme}, {"offload_optimizer": nvme})
    with torch_compile(False):
        resumes_at_stage_1(directory, _optimizer("AdamW8bit"), _blockwise_params, zero)


def _reshard_worker(rank: int, world_size: int, directory: str, again: str) -> None:
    with torch_compile(False):
        reloads_unchanged_at_stage_2(directory, again, _optimizer("AdamW8bit"))


@pytest.mark.slow
def test_blockwise_state_resumes_at_another_stage_and_world_size(tmp_path):
    directory = str(tmp_path / "ckpt")
    run_distributed(_resume_worker, 2, timeout=600, directory=directory)
    run_distributed(_reshard_worker, 1, timeout=600, directory=directory, again=str(tmp_path / "again"))
    nvme = str(tmp_path / "nvme")
    run_distributed(_nvme_resume_worker, 2, timeout=600, directory=nvme, swap=str(tmp_path / "swap"))


def test_a_blockwise_state_round_trips_through_its_flat_form():
    """codes and scales, not dequantized values: a block whose largest magnitude is negative comes back
    with its own scale (requantizing the dequantized values would not)."""
    for name in ("AdamW8bit", "AdamW4bit", "AdamWFp8"):
        param = torch.nn.Parameter(torch.zeros(64, 128))
        optimizer = _torchao(name)([param])
        for key in ("exp_avg", "exp_avg_sq"):
            values = torch.randn(64, 128) if key == "exp_avg" else torch.rand(64, 128)
            largest = 10.0 + torch.arange(param.numel() // optimizer.block_size)  # a scale per block
            values.view(-1, optimizer.block_size)[:, 0] = -largest if key == "exp_avg" else largest
            state = lowbit.new_buffer(optimizer, param, key)
            state.copy_(values)
            pieces = lowbit.flat_pieces(key, state)
            assert all(p.shape == (param.numel(),) for p in pieces.values()), name
            back = lowbit.rebuild(optimizer, param, key, pieces)
            assert torch.equal(back.dequantize(), state.dequantize()), (name, key)
            # codes, one fp32 scale per block and the code map (1 KiB for 8 bits), not 4 bytes per element
            assert lowbit.state_nbytes(state) <= param.numel() * 1.02 + 1024, (name, lowbit.state_nbytes(state))
        other = _torchao(name)([param], block_size=optimizer.block_size * 2)
        with pytest.raises(ValueError, match="block_size"):
            lowbit.rebuild(other, param, "exp_avg_sq", lowbit.flat_pieces("exp_avg_sq", state))
        with pytest.raises(ValueError, match="saved by another optimizer"):  # bitsandbytes' AdamW8bit: state2
            lowbit.rebuild(optimizer, param, "state2", lowbit.flat_pieces("state2", state))


def test_a_copy_before_the_update_puts_blockwise_states_back():
    """on_failed_update="copy": the snapshot copies torchao's states (which implement no clone) and
    restores their codes and scales in place."""
    from zeroshard.core.optim.masked import SlotStates
    from zeroshard.core.optim.rollback import Snapshot

    param = torch.nn.Parameter(torch.zeros(64, 128))
    optimizer = _torchao("AdamW8bit")([param])
    state = {key: lowbit.new_buffer(optimizer, param, key) for key in ("exp_avg", "exp_avg_sq")}
    state["exp_avg"].copy_(torch.randn(64, 128))
    state["exp_avg_sq"].copy_(torch.rand(64, 128))
    optimizer.state[param] = state
    before = {key: value.dequantize() for key, value in state.items()}
    snapshot = Snapshot(optimizer, SlotStates())
    snapshot.keep(type("Group", (), {"master": param.detach().view(-1)})(), [param])
    for value in state.values():
        value.copy_(torch.ones(64, 128))
    snapshot.restore()
    assert all(optimizer.state[param][key] is value for key, value in state.items())  # in place
    for key, value in before.items():
        assert torch.equal(optimizer.state[param][key].dequantize(), value), key
    assert snapshot.nbytes == param.numel() * 4 + sum(lowbit.state_nbytes(v) for v in state.values())


def test_the_nvme_free_space_check_counts_blockwise_moments_as_the_optimizer_keeps_them():
    """The bound an NVMe store checks free space against: the bytes the states hold after a step
    (codes, block scales, code maps; fp32 moments for a parameter too small to quantize), not
    AdamW's 8 per element."""
    from zeroshard.offload.policy import state_bytes_per_element

    for name in ("AdamW8bit", "AdamW4bit"):
        params = [torch.nn.Parameter(torch.zeros(256, 512)), torch.nn.Parameter(torch.zeros(10))]
        optimizer = _torchao(name)(params)
        for param in params:
            param.grad = torch.ones_like(param)
        with torch_compile(False):
            optimizer.step()
        held = sum(lowbit.state_nbytes(v) for s in optimizer.state.values() for v in s.values() if v.dim() > 0)
        bound = state_bytes_per_element(optimizer) * sum(p.numel() for p in params)
        assert held <= bound <= held * 1.001, (name, held, bound)
        assert state_bytes_per_element(optimizer) < (2.1 if name == "AdamW8bit" else 1.1), name
