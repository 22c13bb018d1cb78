"""MiCS checkpoints: an engine with `mics_shard_size` k shards its states over partition
groups of k ranks and replicates them across the N/k groups ([Note: ZeRO++ and MiCS] in
core/unit.py). Its checkpoint is a plain zeroshard checkpoint at k ranks, written by one replica
group ([Note: checkpoints of replicated shards] in checkpoint/save.py).

4 ranks, k = 2, the tiny GPT in fp32, the same global batch of 12 samples however many ranks share
it (tests/checkpoint_helpers.py's global batch): trained 2 steps, saved, trained 3 more (the
continuous run). Then
  * a fresh MiCS engine that loads it trains on bit for bit as the continuous run (AdamW and SGD
    with momentum; also from the middle of gradient accumulation, whose gradients plain stage 3
    refuses, naming both layouts);
  * the checkpoint has two shard files, written by ranks 0 and 1 only, and says world_size 2,
    replicas 2: no byte is written twice;
  * plain stage 3 at 4 ranks, plain stage 3 and stage 1 at 2 ranks, and MiCS k = 2 at 2 ranks load
    it, and what they save again holds the same masters, optimizer state, steps and schedule bit
    for bit; a plain stage-3 checkpoint loads into MiCS the same way;
  * continued training after a change of layout matches the continuous run within RTOL = 1e-6
    (test_checkpoint_reshard's tolerance, with SGD for the same reason: only the summation order of
    the gradient reduction differs -- MiCS reduces in two steps, reduce-scatter over k and then
    all-reduce over the replicas), and bit for bit where the reduction is the same (MiCS k = 2 at
    2 ranks is plain stage 3);
  * the full weights of a MiCS engine (full_state_dict, gathered inside its partition group) and
    of its checkpoint (`consolidate`) are its parameters, bit for bit;
  * a failure while saving, on a rank that writes a shard or on one that does not, is a
    CheckpointError on every rank naming that rank, and nothing is published.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.checkpoint_helpers import (
    GLOBAL_BATCH,
    OPTIMIZERS,
    assert_close_run,
    assert_equal_params,
    build_engine,
    check_same_states,
    full_params,
    rank_batch,
    train_global_steps,
)
from tests.harness import run_distributed, subtests
from tests.reference import gpt_loss
from zeroshard.checkpoint import CheckpointError, consolidate, full_state_dict, save as save_module

BEFORE, AFTER = 2, 3
K = 2


def _engine(optimizer: str, world: int, *, mics: int | None = None, stage: int = 3, seed: int = 0, gas: int = 1):
    zero = {"mics_shard_size": mics} if mics is not None else {}
    return build_engine(
        stage, seed=seed, gas=gas, micro=GLOBAL_BATCH // world // gas, optimizer_fn=OPTIMIZERS[optimizer], zero=zero
    )


def _exactly(ours: dict, ref: dict, what: str) -> None:
    assert ours["losses"] == ref["losses"], f"{what}: losses {ours['losses']} != {ref['losses']}"
    assert_equal_params(ours["params"], ref["params"], what)


def _shard_bytes(directory: str) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(Path(directory).glob("rank_*.safetensors"))}


# ---------------------------------------------------------------- 4 ranks


def _four_worker(rank: int, world: int, *, root: str) -> dict:
    continuous, plain_continuous = {}, {}  # the runs that saved mics-*/ and plain-*/, trained on
    for optimizer in OPTIMIZERS:
        for name, mics, runs in (("mics", K, continuous), ("plain", None, plain_continuous)):
            engine = _engine(optimizer, world, mics=mics)
            train_global_steps(engine, 0, BEFORE)
            engine.save_checkpoint(f"{root}/{name}-{optimizer}", tag="base")
            runs[optimizer] = train_global_steps(engine, BEFORE, AFTER)
            engine.destroy()

    def files():
        manifest = json.loads(Path(f"{root}/mics-sgd/base/manifest.json").read_text())
        assert (manifest["world_size"], manifest["replicas"], manifest["stage"]) == (K, world // K, 3), manifest
        mics, plain = _shard_bytes(f"{root}/mics-sgd/base"), _shard_bytes(f"{root}/plain-sgd/base")
        assert list(mics) == ["rank_00000.safetensors", "rank_00001.safetensors"], mics
        assert len(plain) == world
        # One copy of the states: k files of twice a plain 4-rank file's tensors (headers aside).
        assert abs(sum(mics.values()) - sum(plain.values())) < 0.01 * sum(plain.values()), (mics, plain)
        return {"mics": mics, "plain": plain}

    def resume(optimizer):
        engine = _engine(optimizer, world, mics=K, seed=5)
        engine.load_checkpoint(f"{root}/mics-{optimizer}")
        again = engine.save_checkpoint(f"{root}/mics-again-{optimizer}", tag="again")
        check_same_states(engine, again, f"{root}/mics-{optimizer}/base", "MiCS -> MiCS")
        _exactly(train_global_steps(engine, BEFORE, AFTER), continuous[optimizer], f"MiCS resume ({optimizer})")
        engine.destroy()

    def across(optimizer, source, mics, seed, what, reference):
        """`source`'s checkpoint into the other layout at 4 ranks: the same states saved again, and
        with SGD the same run within RTOL (the module docstring says why not AdamW)."""
        engine = _engine(optimizer, world, mics=mics, seed=seed)
        engine.load_checkpoint(f"{root}/{source}-{optimizer}")
        again = engine.save_checkpoint(f"{root}/{source}-across-{optimizer}", tag="again")
        check_same_states(engine, again, f"{root}/{source}-{optimizer}/base", what)
        if optimizer == "sgd":
            assert_close_run(train_global_steps(engine, BEFORE, AFTER), reference[optimizer], what)
        engine.destroy()

    def mics_into_plain(optimizer):
        across(optimizer, "mics", None, 6, "MiCS -> stage 3 at 4 ranks", continuous)

    def plain_into_mics(optimizer):
        across(optimizer, "plain", K, 7, "stage 3 at 4 ranks -> MiCS", plain_continuous)

    def full_weights():
        """The full model of a MiCS engine (gathered inside a partition group) and of its checkpoint."""
        engine = _engine("sgd", world, mics=K, seed=10)
        engine.load_checkpoint(f"{root}/mics-sgd")
        full, params = full_state_dict(engine), full_params(engine)
        engine.destroy()
        if rank == 0:
            assert_equal_params({n: full[n] for n in params}, params, "full_state_dict under MiCS")
            consolidate(f"{root}/mics-sgd", f"{root}/mics-sgd.safetensors")
            offline = load_file(f"{root}/mics-sgd.safetensors")
            assert_equal_params({n: offline[n] for n in params}, params, "consolidated MiCS checkpoint")

    def mid_accumulation():
        """Saved after the first of 2 micro steps: the gradients accumulated so far load too."""

        def micro_steps(engine, first, count):
            losses = []
            for index in range(first, first + count):
                loss = gpt_loss(engine, *rank_batch(index, engine.global_rank, world))
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            return {"losses": losses, "params": full_params(engine)}

        engine = _engine("adamw", world, mics=K, gas=2)
        micro_steps(engine, 0, 3)
        engine.save_checkpoint(f"{root}/mics-mid", tag="mid")
        reference = micro_steps(engine, 3, 3)
        engine.destroy()
        engine = _engine("adamw", world, mics=K, gas=2, seed=8)
        engine.load_checkpoint(f"{root}/mics-mid")
        _exactly(micro_steps(engine, 3, 3), reference, "MiCS resume mid-accumulation")
        engine.destroy()
        # Its gradients were reduced over 4 ranks in partitions of 2: plain stage 3 refuses them.
        engine = _engine("adamw", world, gas=2)
        try:
            engine.load_checkpoint(f"{root}/mics-mid")
            raised = None
        except CheckpointError as error:
            raised = str(error)
        engine.destroy()
        assert raised is not None and "4 ranks (mics_shard_size 2)" in raised and "not 4 ranks," in raised, raised

    def save_fails(failing_rank):
        engine = _engine("sgd", world, mics=K)
        owner, name = (save_module, "write_safetensors") if failing_rank < K else (save_module, "optimizer_states")
        original = getattr(owner, name)

        def fault(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        if rank == failing_rank:
            setattr(owner, name, fault)
        try:
            engine.save_checkpoint(f"{root}/fails-{failing_rank}", tag="t")
            raised = None
        except CheckpointError as error:
            raised = str(error)
        finally:
            setattr(owner, name, original)
        engine.destroy()
        # a shard writer names its file ("writing .../rank_0000r.safetensors: OSError: ..."), the others the error
        assert raised is not None and f"failed on rank [{failing_rank}]: " in raised, raised
        assert "OSError: [Errno 28]" in raised and ("writing " in raised) == (failing_rank < K), raised
        assert not any(Path(f"{root}/fails-{failing_rank}").iterdir()), "something was published"

    cases = [dict(case="files")] + [
        dict(case=c, optimizer=o) for c in ("resume", "mics_into_plain", "plain_into_mics") for o in OPTIMIZERS
    ]
    cases += [dict(case="full_weights"), dict(case="mid_accumulation")] + [
        dict(case="save_fails", failing_rank=r) for r in (1, 3)
    ]
    functions = {
        "files": files,
        "resume": resume,
        "mics_into_plain": mics_into_plain,
        "plain_into_mics": plain_into_mics,
        "full_weights": full_weights,
        "mid_accumulation": mid_accumulation,
        "save_fails": save_fails,
    }
    results = subtests(cases, lambda case, **kwargs: functions[case](**kwargs))
    return {"continuous": continuous, "bytes": results[0]}


# ---------------------------------------------------------------- 2 ranks


def _two_worker(rank: int, world: int, *, root: str, continuous: dict) -> None:
    """The 4-rank MiCS checkpoint at 2 ranks: plain stage 3 and MiCS k = 2 (the same engine, bit
    for bit), and stage 1."""
    runs = {}

    def case(optimizer, mics, stage):
        engine = _engine(optimizer, world, mics=mics, stage=stage, seed=9)
        engine.load_checkpoint(f"{root}/mics-{optimizer}")
        again = engine.save_checkpoint(f"{root}/w2-{mics}-{stage}-{optimizer}", tag="again")
        what = f"MiCS at 4 ranks -> {'MiCS k=2' if mics else f'stage {stage}'} at 2 ranks ({optimizer})"
        check_same_states(engine, again, f"{root}/mics-{optimizer}/base", what)
        result = train_global_steps(engine, BEFORE, AFTER)
        engine.destroy()
        if optimizer == "sgd":
            assert_close_run(result, continuous[optimizer], what)
        if (optimizer, stage) in runs:  # MiCS k = world is plain stage 3
            _exactly(result, runs[(optimizer, stage)], what)
        runs[(optimizer, stage)] = result

    subtests([dict(optimizer=o, mics=m, stage=s) for o in OPTIMIZERS for m, s in ((None, 3), (K, 3), (None, 1))], case)


@pytest.mark.slow
def test_mics_checkpoints(tmp_path):
    root = str(tmp_path)
    four = run_distributed(_four_worker, 4, timeout=400, root=root)[0]
    print(f"shard bytes: {four['bytes']}")
    run_distributed(_two_worker, 2, timeout=300, root=root, continuous=four["continuous"])
