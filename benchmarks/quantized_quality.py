"""What quantized weights and speculative decoding do on a model that has learned something: the
byte-level Llama that scripts/train_stdlib_gpt.py trains on the Python standard library.

    python scripts/train_stdlib_gpt.py --out /tmp/stdlib_gpt
    python benchmarks/quantized_quality.py --model /tmp/stdlib_gpt --out docs/bench/quantized_quality

Perplexity per byte on the held-out files (the script's data.json: every 20th standard-library file,
--windows windows of 256 bytes, evenly spaced), computed by zeroshard inference engines whose
weights are fp32, int8 (groups of 64) and int4 (groups of 64 and of 128; each also with
`zeroshard.packed_matmul`, the Linear layers multiplying by the packed weights), all loaded with
`from_pretrained` into the quantized store. Then speculative decoding, greedy, from --prompts
held-out prompts of 64 bytes, --new-tokens each, with the fp32 target streamed from the NVMe store:
the draft the script trained (2 layers, width 256) and the target's own 4-bit copy
(`resident_draft`); per draft the share of proposals kept, the tokens per pass over the target's
weights, and whether every token equals plain greedy decoding of the unsharded model.
Outputs OUT.txt and OUT.json.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch

CONTEXT = 256


def held_out(model_dir: Path) -> torch.Tensor:
    data = json.loads((model_dir / "data.json").read_text())
    text = b"".join(Path(p).read_bytes() for p in data["held_out"])
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def windows(data: torch.Tensor, count: int, length: int) -> list[torch.Tensor]:
    starts = torch.linspace(0, len(data) - length - 1, count).long().tolist()
    return [data[s : s + length] for s in starts]


@torch.no_grad()
def perplexity(engine, batches: list[torch.Tensor]) -> float:
    losses = [engine(input_ids=b, labels=b).loss.item() * len(b) for b in batches]
    return math.exp(sum(losses) / sum(len(b) for b in batches))


def config(bits: int | None, group: int, store: dict, packed: bool = False) -> dict:
    out: dict = {"zero_optimization": {"stage": 3, "offload_param": store, "stage3_param_persistence_threshold": 0}}
    if bits is not None:
        out["weight_quantization"] = {"quantized_initialization": {"num_bits": bits, "group_size": group}}
    if packed:
        out["zeroshard"] = {"packed_matmul": True}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="scripts/train_stdlib_gpt.py's --out")
    parser.add_argument("--windows", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--nvme", type=Path, default=Path(tempfile.gettempdir()) / "quantized_quality_swap")
    parser.add_argument("--out", type=Path, default=Path("quantized_quality"))
    args = parser.parse_args()
    import transformers

    from zeroshard.compat.inference import from_pretrained
    from zeroshard.inference import PassCounter, resident_draft, speculation_report

    torch.manual_seed(0)
    target_dir, draft_dir = args.model / "target", args.model / "draft"
    data = held_out(args.model)
    batches = list(torch.stack(windows(data, args.windows, CONTEXT)).split(16))
    rows: list[dict] = []
    cpu = {"device": "cpu"}
    fp32 = None
    for bits, group, packed in (
        (None, 0, False),
        (8, 64, False),
        (4, 64, False),
        (4, 128, False),
        (4, 64, True),
        (4, 128, True),
    ):
        engine = from_pretrained(target_dir, config(bits, group, cpu, packed))
        store = engine.placement.param_store
        ppl = perplexity(engine, batches)
        fp32 = ppl if bits is None else fp32
        rows.append(
            {
                "weights": "fp32" if bits is None else f"int{bits}, group {group}" + (", packed" if packed else ""),
                "perplexity": ppl,
                "delta": ppl / fp32 - 1 if fp32 else 0.0,
                "store_bytes": getattr(store, "packed_bytes", sum(g.master.numel() * 4 for g in engine.groups)),
                "packed_layers": len(engine.inference.packed.layers) if engine.inference.packed is not None else 0,
            }
        )
        engine.destroy()
    unsharded = transformers.AutoModelForCausalLM.from_pretrained(target_dir).eval()
    prompts = windows(data, args.prompts, 64)
    speculation: list[dict] = []
    nvme = {"device": "nvme", "nvme_path": str(args.nvme)}
    for name in ("trained draft", "own int4 copy"):
        engine = from_pretrained(target_dir, config(None, 0, nvme))
        draft = (
            transformers.AutoModelForCausalLM.from_pretrained(draft_dir).eval()
            if name == "trained draft"
            else resident_draft(target_dir, num_bits=4, group_size=64)
        )
        draft_module = getattr(draft, "module", draft)
        totals = {"new_tokens": 0, "target_passes": 0, "draft_proposals": 0}
        equal, seconds = True, 0.0
        for prompt in prompts:
            ids = prompt[None]
            kwargs = dict(
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                do_sample=False,
                attention_mask=torch.ones_like(ids),
            )
            passes, proposals = PassCounter(engine.module), PassCounter(draft_module)
            started = time.perf_counter()
            tokens = engine.generate(ids, assistant_model=draft, **kwargs)
            seconds += time.perf_counter() - started
            passes.close()
            proposals.close()
            equal &= torch.equal(tokens, unsharded.generate(ids, **kwargs))
            totals["new_tokens"] += tokens.shape[1] - ids.shape[1]
            totals["target_passes"] += passes.passes
            totals["draft_proposals"] += proposals.passes
        report = speculation_report(totals["new_tokens"], totals["target_passes"], totals["draft_proposals"])
        speculation.append({"draft": name, **report, "tokens_equal_greedy": equal, "seconds": seconds})
        if hasattr(draft, "destroy"):
            draft.destroy()
        engine.destroy()
    trained = json.loads((args.model / "data.json").read_text())
    command = f"python benchmarks/quantized_quality.py --model {args.model} --out {args.out}"
    lines = [
        f"$ {command}",
        f"model: {target_dir} (scripts/train_stdlib_gpt.py; held-out perplexity at the end of training "
        f"{trained['perplexity']['target']:.3f}), {sum(p.numel() for p in unsharded.parameters()) / 1e6:.2f}M parameters",
        f"held-out: {len(trained['held_out'])} standard-library files, {args.windows} windows of {CONTEXT} bytes",
        "",
        f"{'weights':<24} {'perplexity/byte':>15} {'vs fp32':>8} {'store MB':>9} {'packed layers':>13}",
    ]
    for row in rows:
        lines.append(
            f"{row['weights']:<24} {row['perplexity']:>15.4f} {100 * row['delta']:>+7.2f}% {row['store_bytes'] / 1e6:>9.2f} {row['packed_layers']:>13}"
        )
    lines += [
        "",
        f"speculative greedy decoding, fp32 target streamed from NVMe: {args.prompts} held-out prompts of 64 bytes, "
        f"{args.new_tokens} new tokens each",
        f"{'draft':<14} {'kept':>6} {'tokens/pass':>11} {'passes':>6} {'proposals':>9} {'= greedy':>8}",
    ]
    for row in speculation:
        lines.append(
            f"{row['draft']:<14} {100 * row['acceptance']:>5.1f}% {row['tokens_per_pass']:>11.2f} "
            f"{row['target_passes']:>6} {row['draft_proposals']:>9} {'yes' if row['tokens_equal_greedy'] else 'NO':>8}"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".txt").write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps({"perplexity": rows, "speculation": speculation}, indent=1))


if __name__ == "__main__":
    main()
