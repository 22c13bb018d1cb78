"""What dequantizing a token's weights costs on this machine, beside the compute of that token.

    python benchmarks/dequantize.py --out docs/bench/dequantize.txt

For the Llama of benchmarks/zero_inference.py (36 layers, width 1024, MLP 2816, vocab 32000: 528M
parameters), every matrix of one forward is packed as the quantized store packs it (int8 and int4,
groups of 64, with a minimum) and dequantized into fp32 buffers of its own, as a streamed token
does: once into fresh buffers (the first write faults each page in) and once more into the same
buffers. Then one greedy token of that model held unsharded in memory (`generate`, batch 1, after a
warm-up): the compute a token needs once its weights are in fp32. 2 threads, one process, nothing
streamed; the figures bound what quantized streaming can gain here.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from zeroshard.inference.quantization import QuantSpec
from zeroshard.inference.store import Scratch, pack, plan, unpack


def matrices(layers: int, hidden: int, mlp: int, vocab: int) -> list[tuple[int, int]]:
    one = [(hidden, hidden)] * 4 + [(mlp, hidden), (mlp, hidden), (hidden, mlp)]
    return one * layers + [(vocab, hidden)] * 2


def dequantize_token(shapes, bits: int) -> tuple[float, float]:
    """(seconds into fresh buffers, seconds into the same buffers again)."""
    spec = QuantSpec(bits, 64)
    packed = {}
    for shape in set(shapes):
        weight = torch.randn(shape).reshape(-1)
        pieces, nbytes = plan(weight.numel(), [(0, torch.Size(shape))], spec)
        blob = torch.zeros(nbytes, dtype=torch.uint8)
        pack(weight, pieces, spec, blob)
        packed[shape] = (blob, pieces)
    outs = [torch.empty(rows * cols) for rows, cols in shapes]
    scratch = Scratch()  # as the store's dequantizing thread keeps one
    times = []
    for _ in range(2):
        started = time.perf_counter()
        for shape, out in zip(shapes, outs):
            unpack(*packed[shape], spec, out, scratch)
        times.append(time.perf_counter() - started)
    return times[0], times[1]


def compute_token(layers: int, hidden: int, mlp: int, vocab: int) -> float:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    prompt = torch.randint(2, vocab, (1, 16))
    kwargs = dict(do_sample=False, attention_mask=torch.ones_like(prompt))
    model.generate(prompt, max_new_tokens=2, **kwargs)
    started = time.perf_counter()
    model.generate(prompt, max_new_tokens=8, min_new_tokens=8, **kwargs)
    return (time.perf_counter() - started) / 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = (36, 1024, 2816, 32000)
    shapes = matrices(*shape)
    lines = [
        "$ python benchmarks/dequantize.py" + (f" --out {args.out}" if args.out else ""),
        f"model: Llama 36 x 1024, MLP 2816, vocab 32000: {sum(r * c for r, c in shapes) / 1e6:.0f}M weights in "
        f"{len(shapes)} matrices; {args.threads} threads",
    ]
    for bits in (8, 4):
        fresh, reused = dequantize_token(shapes, bits)
        lines.append(
            f"int{bits} dequantize a token's matrices: {fresh:.3f} s into fresh buffers, {reused:.3f} s reused"
        )
    lines.append(f"fp32 compute of one token in memory (generate, batch 1): {compute_token(*shape):.3f} s")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
