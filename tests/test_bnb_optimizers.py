"""bitsandbytes' 8-bit AdamW under ZeRO, against DDP with the same optimizer class.

bitsandbytes' 8-bit optimizers quantize each moment in blocks of 256 elements of the parameter, as
torchao's do, so zeroshard steps each parameter whole on its owner ([Note: bitsandbytes' 8-bit
states] in core/optim/lowbit.py): at 2 ranks fp32, bit for bit at every stage and with CPU or NVMe
offload. Their state saves by parameter name (codes and block scales, exactly) and resumes at another stage
and world size.
"""

from __future__ import annotations

import pytest
import torch

from tests.checkpoint_helpers import reloads_unchanged_at_stage_2, resumes_at_stage_1
from tests.extras import needs
from tests.harness import run_distributed, subtests
from tests.reference import gpt_batches, train_ddp
from tests.zs_common import assert_close, gpt_model_fn, make_config, train_engine
from zeroshard.core.optim import lowbit
from zeroshard.tools.models.gpt import tiny_gpt_config

pytestmark = needs("bitsandbytes", extra="lowbit")

STEPS = 3
CONFIG = tiny_gpt_config()
LR = 1e-2


def _adamw8bit(params):
    import bitsandbytes

    return bitsandbytes.optim.AdamW8bit(params, lr=LR, weight_decay=0.1)


def _quantized_params(engine) -> int:
    """Parameters whose moments this rank keeps in 8 bits."""
    return sum(lowbit._is_bnb_codes(state.get("state1")) for state in engine.optimizer.state.values())


def _parity(stage: int, offload: str = "", swap: str = "") -> None:
    """`offload`: "cpu" or "nvme" (optimizer states, and parameters, in files under `swap`)."""
    batches = gpt_batches(CONFIG, batch_size=4)
    ref = train_ddp(gpt_model_fn(), batches, optimizer_fn=_adamw8bit, steps=STEPS, reduce_every_micro_step=stage >= 2)
    where = {"device": offload, **({"nvme_path": swap} if offload == "nvme" else {})}
    zero: dict = {"offload_optimizer": where, "offload_param": where} if offload else {}
    ours = train_engine(
        gpt_model_fn(), batches, config=make_config(stage, **zero), optimizer_fn=_adamw8bit, steps=STEPS
    )
    assert_close(ours, ref, exact=True, what=f"bitsandbytes AdamW8bit stage {stage} offload {offload or 'none'}")
    if offload == "nvme":  # codes, block scales and code maps in swap files; the step counts are ints
        assert ours["memory"]["optimizer"] == 0, ours["memory"]


def _two_ranks(rank: int, world_size: int, directory: str) -> None:
    cases = [dict(stage=s) for s in (1, 2, 3)]
    cases += [dict(stage=3, offload="cpu"), dict(stage=3, offload="nvme", swap=directory + "-swap")]
    subtests(cases, _parity)
    resumes_at_stage_1(directory, _adamw8bit, _quantized_params)


def _reshard(rank: int, world_size: int, directory: str, again: str) -> None:
    reloads_unchanged_at_stage_2(directory, again, _adamw8bit)


@pytest.mark.slow
def test_bitsandbytes_adamw8bit_matches_ddp_and_resumes_at_another_stage_and_world_size(tmp_path):
    directory = str(tmp_path / "ckpt")
    run_distributed(_two_ranks, 2, timeout=600, directory=directory)
    run_distributed(_reshard, 1, timeout=600, directory=directory, again=str(tmp_path / "again"))


def test_a_bitsandbytes_state_round_trips_through_its_flat_form():
    """codes and one scale per block of 256 (the last one short), not dequantized values; the code
    maps are the optimizer's own; `step` comes back an int."""
    import bitsandbytes

    param = torch.nn.Parameter(torch.randn(50, 100))  # 5000 elements: 20 blocks, the last of 136
    optimizer = bitsandbytes.optim.AdamW8bit([param], lr=LR)
    for _ in range(2):
        param.grad = torch.randn_like(param)
        optimizer.step()
    state = optimizer.state[param]
    assert state["state1"].dtype == torch.uint8 and state["absmax1"].numel() == 20
    pieces = lowbit.entry_pieces(state)
    assert set(pieces) == {"state1.codes", "state1.scale", "state2.codes", "state2.scale"}
    assert all(p.shape == (param.numel(),) for p in pieces.values())
    back: dict = {}
    for key in ("state1", "state2"):
        back.update(lowbit.rebuild_bnb(optimizer, param, key, pieces))
    for key in ("state1", "state2", "absmax1", "absmax2", "qmap1", "qmap2"):
        assert torch.equal(back[key], state[key]), key
    assert lowbit.own_scalars(optimizer, {"step": torch.tensor(2.0)}) == {"step": 2}
    scale = pieces["state1.scale"].clone()
    scale[3] += 1.0  # two scales in one block
    with pytest.raises(ValueError, match="one scale per block of 256"):
        lowbit.rebuild_bnb(optimizer, param, "state1", {**pieces, "state1.scale": scale})
    with pytest.raises(ValueError, match="saved by another optimizer"):  # torchao's AdamW8bit has the same name
        lowbit.rebuild_bnb(
            optimizer, param, "exp_avg", {"exp_avg.codes": pieces["state1.codes"], "exp_avg.scale": scale}
        )
    assert lowbit.quantizes(optimizer, param.shape) and not lowbit.quantizes(optimizer, torch.Size([64, 63]))
