"""The tiny GPT and the DDP reference trainer (the oracle every zeroshard feature is compared with)."""

import math

import pytest
import torch
import torch.distributed as dist

from tests.harness import grid, run_distributed, subtests
from tests.reference import gpt_batches, gpt_loss, train_ddp, train_single
from tests.zs_common import adamw, relative_error
from zeroshard.tools.models import GPT, GPTConfig, tiny_gpt_config

GPT2_SMALL = dict(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)


def _tiny_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(tiny_gpt_config())


def _adam(params):
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)


# ---------------------------------------------------------------- the model, in one process


def test_parameter_count_is_gpt2s():
    with torch.device("meta"):  # shapes only: no 500 MB allocation
        tied = GPT(GPTConfig(**GPT2_SMALL))
        untied = GPT(GPTConfig(**GPT2_SMALL, tie_weights=False))
    assert tied.num_parameters() == 124_439_808
    assert untied.num_parameters() == 124_439_808 + 50257 * 768


def test_parameter_count_formula_without_bias():
    c = tiny_gpt_config(bias=False, tie_weights=False)
    per_block = 2 * c.n_embd + 3 * c.n_embd**2 + c.n_embd**2 + 8 * c.n_embd**2  # LNs, qkv, proj, mlp
    expected = (c.vocab_size + c.block_size) * c.n_embd + c.n_layer * per_block + c.n_embd + c.vocab_size * c.n_embd
    assert GPT(c).num_parameters() == expected


def test_tied_head_is_the_embedding_parameter():
    model = _tiny_model()
    assert model.lm_head.weight is model.tok_emb.weight
    names = [n for n, _ in model.named_parameters()]
    assert "tok_emb.weight" in names and "lm_head.weight" not in names
    assert GPT(tiny_gpt_config(tie_weights=False)).lm_head.weight is not None


def test_forward_shapes_loss_and_deterministic_init():
    model, cfg = _tiny_model(), tiny_gpt_config()
    idx, targets = gpt_batches(cfg, batch_size=3)(0, 0, 0)
    logits = model(idx)
    assert logits.shape == (3, cfg.block_size, cfg.vocab_size)
    logits2, loss = model(idx, targets)
    assert torch.equal(logits, logits2)
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.5  # near-uniform predictions at init
    for a, b in zip(model.parameters(), _tiny_model().parameters()):
        assert torch.equal(a, b)
    std = model.blocks[0].attn.proj.weight.std().item()
    assert std < 0.02 / math.sqrt(2 * cfg.n_layer) * 1.2  # GPT-2's scaled residual init
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, cfg.block_size + 1, dtype=torch.long))


def test_generate():
    model = _tiny_model()
    prompt = torch.tensor([[1, 2, 3]])
    greedy = model.generate(prompt, 20, temperature=0)  # longer than block_size: the context is cropped
    assert greedy.shape == (1, 23) and torch.equal(greedy[:, :3], prompt)
    assert torch.equal(greedy, model.generate(prompt, 20, temperature=0))
    torch.manual_seed(0)
    sampled = model.generate(prompt, 5, temperature=1.0, top_k=3)
    assert sampled.shape == (1, 8) and int(sampled.max()) < model.config.vocab_size


@pytest.fixture
def one_thread():
    # Two intra-op threads on a 2-core machine shared with other test processes run ~4x slower than one.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_train_single_learns(one_thread):
    cfg = tiny_gpt_config()
    out = train_single(_tiny_model, gpt_batches(cfg), optimizer_fn=_adam, steps=15, record_params=True)
    first, last = out["losses"][0][0], out["losses"][-1][0]
    assert last < first - 0.5, (first, last)  # counting sequences are learnable
    assert len(out["params_per_step"]) == 15 and torch.equal(
        out["params_per_step"][-1]["tok_emb.weight"], out["params"]["tok_emb.weight"]
    )


# ---------------------------------------------------------------- DDP reference, 2 ranks, one spawn


def _flat(tensors: dict) -> torch.Tensor:
    return torch.cat([t.flatten() for _, t in sorted(tensors.items())])  # 1-D, all values


def _same_on_every_rank(tensors: dict) -> bool:
    mine = _flat(tensors)
    theirs = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(theirs, mine)
    return all(torch.equal(mine, t) for t in theirs)


def _exactly_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _reference_worker(rank, world_size):
    cfg = tiny_gpt_config()
    batches = gpt_batches(cfg, batch_size=2)

    def one_case(grad_accum, reduce_every_micro_step, clip):
        kw = dict(
            optimizer_fn=_adam,
            steps=3,
            grad_accum=grad_accum,
            clip=clip,
            reduce_every_micro_step=reduce_every_micro_step,
            record_grads=True,
        )
        ddp = train_ddp(_tiny_model, batches, **kw)
        single = train_single(_tiny_model, batches, world_size=world_size, **kw)
        # DDP leaves every rank with the same gradients, hence the same parameters.
        assert all(_same_on_every_rank(g) for g in ddp["grads_per_step"])
        assert _same_on_every_rank(ddp["params"])
        # At N = 2 the one-process emulation is bit-for-bit DDP (a + b is exact in either order).
        assert ddp["grad_norms"] == single["grad_norms"]
        assert all(_exactly_equal(a, b) for a, b in zip(ddp["grads_per_step"], single["grads_per_step"]))
        assert _exactly_equal(ddp["params"], single["params"])
        if rank == 0:
            assert ddp["losses"] == single["losses"]
        assert [len(m) for m in ddp["losses"]] == [grad_accum] * 3
        if clip:
            clipped = [_flat(g).double().norm().item() for g in ddp["grads_per_step"]]
            assert all(n > clip for n in ddp["grad_norms"])
            assert clipped == pytest.approx([clip] * 3, rel=1e-4)
        return ddp

    cases = grid(grad_accum=[1, 2], reduce_every_micro_step=[False, True], clip=[0.0, 0.05])
    results = subtests(cases, one_case)
    # Losses fall over a few more steps with a schedule.
    sched = train_ddp(
        _tiny_model,
        batches,
        optimizer_fn=_adam,
        steps=20,
        lr_scheduler_fn=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 10, gamma=0.5),
    )
    return {"cases": cases, "results": results, "sched_losses": sched["losses"]}


def test_ddp_reference_at_world_2():
    per_rank = run_distributed(_reference_worker, 2)
    rank0 = per_rank[0]
    by_case = {tuple(c.values()): r for c, r in zip(rank0["cases"], rank0["results"])}
    # The two accumulation schemes are the same math in a different order: close, not equal.
    for clip in (0.0, 0.05):
        local, reduced = by_case[(2, False, clip)], by_case[(2, True, clip)]
        for name, g in local["grads_per_step"][0].items():
            torch.testing.assert_close(g, reduced["grads_per_step"][0][name], rtol=1e-5, atol=1e-8)
        for name, p in local["params"].items():  # Adam turns last-bit differences of tiny grads into ~lr
            torch.testing.assert_close(p, reduced["params"][name], rtol=1e-4, atol=1e-5)
    losses = [m[0] for m in rank0["sched_losses"]]
    assert losses[-1] < losses[0] - 0.5, losses
    assert per_rank[0]["sched_losses"] != per_rank[1]["sched_losses"]  # ranks saw different data


def test_only_the_key_bias_amplifies_a_one_ulp_difference(one_thread):
    """[Note: the key bias has no gradient] in tests/zs_common.py, measured: every initial weight nudged
    one ulp, 5 AdamW steps; the key third of each fused qkv bias ends far apart, every other tensor (and the
    rest of the bias) stays within 1e-5 of its norm."""

    def model_fn(nudge: bool):
        def build():
            model = _tiny_model()
            if nudge:
                with torch.no_grad():
                    for p in model.parameters():
                        p.copy_(torch.nextafter(p, torch.full_like(p, math.inf)))
            return model

        return build

    batches = gpt_batches(tiny_gpt_config(), batch_size=4)
    runs = [train_single(model_fn(n), batches, optimizer_fn=adamw, steps=5, loss_fn=gpt_loss) for n in (False, True)]
    errors = {  # name: (over the whole tensor, without the key bias)
        name: (
            float((runs[1]["params"][name] - ref).norm() / ref.norm()),
            relative_error(name, runs[1]["params"][name], ref),
        )
        for name, ref in runs[0]["params"].items()
    }
    biases = [name for name in errors if name.endswith("attn.qkv.bias")]
    assert biases
    assert all(errors[name][0] > 1e-4 for name in biases), {n: errors[n] for n in biases}
    assert max(kept for _, kept in errors.values()) < 1e-5, errors
