"""ZeRO-Inference against Accelerate's disk offload: generate with a model whose weights are twice the
memory the process may use.

    python benchmarks/zero_inference.py --out docs/bench/zero_inference

One command does everything: builds a random-weight Llama (default 36 layers, width 1024, vocab 32000:
528M parameters, 2.1 GB of fp32) with save_pretrained under --model-dir (kept for the next run), measures
the disk with `dd` (O_DIRECT read), then runs each system in its own process whose RLIMIT_DATA (data
segment + anonymous memory, set before Python starts) is --cap (default: half the weights):

  * zeroshard: `from_pretrained` straight into the NVMe store (`offload_param.device = nvme`), stage 3,
    prefetch of the next layer; `engine.module.generate`. Every weight streams from the disk.
  * zeroshard-resident: the same, with `offload_param.max_in_cpu` = the CPU budget accelerate gets
    (below) less the prefetch window (the units read ahead are anonymous buffers, which the cap
    counts), in elements: the first layers stay in memory, the rest stream.
  * zeroshard-resident-buffered: the same with `zeroshard.nvme_io`
    "buffered": the store's aligned reads go through the page cache instead of O_DIRECT.
  * zeroshard-int8, zeroshard-int4: the first system with `weight_quantization.quantized_initialization`
    (groups of 64, with a minimum): the store holds and reads packed 8- or 4-bit weights, dequantized
    layer by layer after each read.
  * zeroshard-int4-packed: zeroshard-int4 with `zeroshard.packed_matmul`: the Linear layers multiply
    by the packed weights (torch's int4 kernel, bf16 activations) and the embedding looks up its rows
    in them, with no dequantized copy of those matrices.
  * zeroshard-speculative (batch 1): the first system with speculative decoding, the model's own int4
    copy kept in memory as the draft (`resident_draft`); zeroshard-speculative-draft: the model of
    --draft-dir as the draft (kept in memory, fp32).
  * accelerate: transformers `from_pretrained(device_map="auto", max_memory={"cpu": ...},
    offload_folder=...)`: what fits in the CPU budget stays resident, the rest is read from the
    checkpoint's safetensors files at each forward (accelerate's disk offload).

Both generate the same prompts (random token ids, --prompt-len long) at every --batches size,
greedily, --new-tokens each, after a one-token warm-up. The page cache would otherwise keep a 2 GB
model in this 24 GB machine's RAM, so that a "disk" run reads RAM: after every generated token both
processes drop the page cache of every file holding weights (posix_fadvise DONTNEED on the checkpoint,
and the NVMe store does it for its own files), which is what a model larger than RAM gets. Measured per
batch size: tokens/s (batch x new tokens / wall time of generate), bytes read from the block device
(/proc/self/io read_bytes) per second as a fraction of dd's, the machine's 1-minute load average
before and after each system's process (this machine is shared: absolute times move with it), peak RSS (VmHWM, reset before each
generate through /proc/self/clear_refs) with MALLOC_MMAP_THRESHOLD_=65536 in both (glibc returns freed
buffers), and whether the tokens equal those of the unsharded model (computed without a cap, in this
process; for the quantized systems, of the unsharded model whose matrices went through the same
quantization), bytes read per generated position, and for the speculative systems the passes over the
weights and the share of the draft's proposals kept. `--pretrained` takes --model-dir as it is (a
trained model, e.g. scripts/train_stdlib_gpt.py's target) instead of building the random one, and
`--prompts-from DATA_JSON` takes byte-level prompts from the held-out files that script lists.
Outputs: OUT.json, OUT.txt (table and command), OUT.png (tokens/s against batch size).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "MALLOC_MMAP_THRESHOLD_": "65536",
    "TOKENIZERS_PARALLELISM": "false",
}


# -- the model and the disk ---------------------------------------------------------------------------------
def build_model(args) -> int:
    """Save the random-weight model once; returns its bytes of weights."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    if args.pretrained:
        import safetensors

        total = 0
        for path in args.model_dir.glob("*.safetensors"):
            with safetensors.safe_open(path, "pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    total += math.prod(sl.get_shape()) * 4
        return total
    marker = args.model_dir / "zero_inference.json"
    wanted = config.to_dict()
    if marker.is_file() and json.loads(marker.read_text()) == {k: wanted[k] for k in json.loads(marker.read_text())}:
        return json.loads((args.model_dir / "weights_bytes").read_text())
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(args.model_dir, max_shard_size="500MB")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    (args.model_dir / "weights_bytes").write_text(json.dumps(weights))
    marker.write_text(
        json.dumps({k: wanted[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")})
    )
    return weights


def dd_read(path: Path, megabytes: int = 1024) -> float:
    """Sequential read with O_DIRECT (no page cache), GB/s."""
    target = path / "dd-probe.bin"
    subprocess.run(
        ["dd", "if=/dev/urandom", f"of={target}", "bs=16M", f"count={megabytes // 16}", "oflag=direct"],
        capture_output=True,
        check=True,
    )
    result = subprocess.run(
        ["dd", f"if={target}", "of=/dev/null", "bs=16M", "iflag=direct"], capture_output=True, text=True, check=True
    )
    target.unlink()
    match = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", result.stderr)
    return int(match.group(1)) / float(match.group(2)) / 1e9


def prompts(args, batch: int):
    import torch

    if args.prompts_from is not None:  # byte-level: windows of the held-out text
        held = json.loads(args.prompts_from.read_text())["held_out"]
        text = b"".join(Path(p).read_bytes() for p in held)
        data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        starts = torch.linspace(0, len(data) - args.prompt_len - 1, batch).long()
        return torch.stack([data[s : s + args.prompt_len] for s in starts.tolist()])
    generator = torch.Generator().manual_seed(1000 + batch)
    return torch.randint(2, args.vocab, (batch, args.prompt_len), generator=generator)


QUANTIZED = {"zeroshard-int8": "int8", "zeroshard-int4": "int4", "zeroshard-int4-packed": "int4-packed"}
BITS = {"int8": 8, "int4": 4, "int4-packed": 4}
SPECULATIVE = ("zeroshard-speculative", "zeroshard-speculative-draft")


def batches_of(system: str, args) -> list[int]:
    """Speculative decoding takes one sequence at a time (transformers refuses batches)."""
    return [1] if system in SPECULATIVE else args.batches


def reference_tokens(args, mode: str | None = None) -> dict[int, list]:
    """The unsharded model's greedy tokens for every batch (no cap: this process has the RAM), kept
    beside the model for the next run with the same prompts; `mode` (int8, int4, int4-packed): of the
    model whose matrices went through the quantization the store applies (groups of 64, with a
    minimum), and for int4-packed whose layers multiply as the engine's do (`PackedMatmuls.of_model`)."""
    import torch
    import transformers

    suffix = f"-{mode}" if mode else ""
    source = "-held" if args.prompts_from is not None else ""
    cache = args.model_dir / f"reference-p{args.prompt_len}-n{args.new_tokens}{source}{suffix}.json"
    out = {int(k): v for k, v in json.loads(cache.read_text()).items()} if cache.is_file() else {}
    missing = [b for b in args.batches if b not in out]
    if missing:
        torch.set_num_threads(args.threads)
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir).eval()
        if mode == "int4-packed":
            from zeroshard.inference.packed import PackedMatmuls
            from zeroshard.inference.quantization import QuantSpec

            PackedMatmuls.of_model(model, QuantSpec(4, 64))
        elif mode:
            from zeroshard.inference.quantization import QuantSpec, dequantize, quantize

            with torch.no_grad():
                for param in model.parameters():
                    if param.dim() >= 2:
                        param.copy_(dequantize(quantize(param, QuantSpec(BITS[mode], 64))))
        for batch in missing:
            prompt = prompts(args, batch)
            out[batch] = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=False,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
            ).tolist()
        cache.write_text(json.dumps(out))
    return out


# -- one capped process per system ------------------------------------------------------------------------
class DropPageCache:
    """A generate() streamer that, at every token, drops the page cache of the files holding weights."""

    def __init__(self, files):
        self.fds = [os.open(f, os.O_RDONLY) for f in files]

    def put(self, value) -> None:
        for fd in self.fds:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def end(self) -> None:
        self.put(None)


def _status(key: str) -> int:
    return int(open("/proc/self/status").read().split(f"{key}:")[1].split()[0]) * 1024


def _read_bytes() -> int:
    return int(dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())["read_bytes"])


def kv_cache_mb(args) -> int:
    """The KV cache of the largest batch at its longest (fp32 keys and values, every layer): it grows
    with the batch, so a fixed allowance that fits batch 1 does not fit batch 16 under the cap."""
    positions = max(args.batches) * (args.prompt_len + args.new_tokens)
    return args.layers * 2 * positions * args.hidden * 4 // 2**20  # key/value heads x head size = hidden


def cpu_budget_mb(args) -> int:
    """MiB of weights a system may keep in memory: what is left of the cap after this runtime, less
    room for activations and loading (300 MiB) and for the KV cache (or --accelerate-cpu-mb)."""
    if args.accelerate_cpu_mb is not None:
        return args.accelerate_cpu_mb
    return max(0, (args.cap - _status("VmData")) // 2**20 - 300 - kv_cache_mb(args))


def load(system: str, args):
    import torch
    import transformers

    if system.startswith("zeroshard"):
        from zeroshard.compat.inference import from_pretrained

        # Units: every decoder layer, and inside it every Linear, and the embedding: so the LM head and
        # the embedding (131 MB each here) are gathered only while they compute, not for the whole pass.
        # Prefetch: about three decoder layers (12.8M elements each) ahead, read by the store's two readers.
        offload = {"device": "nvme", "nvme_path": str(args.nvme)}
        if system.startswith("zeroshard-resident"):  # accelerate's CPU budget, in fp32 elements, less the window
            # The units read ahead are anonymous buffers, which the cap counts ([Note: where a swap
            # file's tensor lies] in offload/swapfile.py): the budget holds them too.
            window_mb = args.prefetch * 4 // 2**20
            resident_mb = max(0, cpu_budget_mb(args) - window_mb)
            offload["max_in_cpu"] = resident_mb * 2**20 // 4
            print(
                f"zeroshard: max_in_cpu {offload['max_in_cpu']} elements ({resident_mb} MiB: the "
                f"{cpu_budget_mb(args)} MiB budget less the {window_mb} MiB prefetch window)",
                file=sys.stderr,
            )
        config: dict = {
            "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": args.prefetch, "offload_param": offload},
            "zeroshard": {
                "wrap_modules": ["LlamaDecoderLayer", "Embedding", "Linear"],
                "nvme_io": "buffered" if system.endswith("-buffered") else "direct",
            },
        }
        if system in QUANTIZED:
            config["weight_quantization"] = {
                "quantized_initialization": {"num_bits": BITS[QUANTIZED[system]], "group_size": 64}
            }
            config["zeroshard"]["packed_matmul"] = QUANTIZED[system] == "int4-packed"
        engine = from_pretrained(args.model_dir, config)
        return engine, getattr(engine.placement.param_store, "inner", engine.placement.param_store)
    budget = cpu_budget_mb(args)
    offload = tempfile.mkdtemp(dir=args.nvme)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model_dir,
        device_map="auto",
        max_memory={"cpu": f"{budget}MiB"},
        offload_folder=offload,
        dtype=torch.float32,
    )
    device_map = getattr(model, "hf_device_map", {})  # absent when everything fits the budget
    on_disk = sum(1 for v in device_map.values() if v == "disk")
    print(
        f"accelerate: {budget} MiB CPU budget, {on_disk} of {len(device_map)} device-map entries on disk",
        file=sys.stderr,
    )
    return model.eval(), None


def _store_io(store) -> dict:
    """The NVMe store's own count of the bytes it read and wrote and of the time its requests were
    in flight (offload/blockio.py IOClock); empty for accelerate."""
    nvme = getattr(store, "nvme", store)  # ResidentFirstStore streams through its NVMe store
    return nvme.io.clock.snapshot() if nvme is not None else {}


def draft_of(system: str, args):
    """The draft a speculative system keeps in memory; None for the others."""
    if system == "zeroshard-speculative":
        from zeroshard.inference import resident_draft

        # Every Linear and the embedding a unit of its own: the draft's fp32 copy of its LM head (131 MB
        # here) exists only while the head computes.
        return resident_draft(
            args.model_dir, num_bits=4, group_size=64, wrap_modules=["LlamaDecoderLayer", "Embedding", "Linear"]
        )
    if system == "zeroshard-speculative-draft":
        import transformers

        return transformers.AutoModelForCausalLM.from_pretrained(args.draft_dir).eval()
    return None


def child(system: str, args) -> None:
    """Runs under the cap (set by the parent before exec); one JSON line per batch size on stdout."""
    import torch

    from zeroshard.inference import PassCounter

    torch.set_num_threads(args.threads)
    model, store = load(system, args)
    draft = draft_of(system, args)
    extra = {"assistant_model": draft} if draft is not None else {}
    io_mode = getattr(getattr(store, "nvme", store), "io_mode", None)
    files = sorted(args.model_dir.glob("*.safetensors"))
    drop = DropPageCache(files)
    drop.put(None)
    warm = prompts(args, 1)
    model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=1, do_sample=False, **extra)
    for batch in batches_of(system, args):
        prompt = prompts(args, batch)
        passes = PassCounter(getattr(model, "module", model))
        proposals = PassCounter(getattr(draft, "module", draft)) if draft is not None else None
        drop.put(None)
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # resets VmHWM to the current RSS
        io_before = _store_io(store)
        read_before, started = _read_bytes(), time.perf_counter()
        tokens = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            streamer=drop,
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            **extra,
        )
        seconds = time.perf_counter() - started
        passes.close()
        read = _read_bytes() - read_before
        io = {k: v - io_before[k] for k, v in _store_io(store).items()}
        print(
            json.dumps(
                {
                    "system": system,
                    "batch": batch,
                    "seconds": seconds,
                    "tokens_per_s": batch * args.new_tokens / seconds,
                    "read_bytes": read,
                    "read_gb_s": read / seconds / 1e9,
                    "peak_rss": _status("VmHWM"),
                    "store_io": io,
                    "io_mode": io_mode,
                    "store_read_gb_s": io["read_bytes"] / io["read_busy_s"] / 1e9 if io.get("read_busy_s") else None,
                    "tokens": tokens.tolist(),
                    "passes": passes.passes,
                    "proposals": proposals.passes if proposals is not None else None,
                }
            ),
            flush=True,
        )
        if proposals is not None:
            proposals.close()


def run_capped(system: str, args, argv: list[str], capped: bool = True) -> list[dict]:
    """One process for `system`, under the cap (or, `capped=False`, with the same settings and no cap)."""

    def cap():
        resource.setrlimit(resource.RLIMIT_DATA, (args.cap, args.cap))

    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=str(ROOT / "src"), **ENV)
    command = [sys.executable, __file__, *argv, "--child", system, "--cap", str(args.cap)]
    load_before, started = os.getloadavg()[0], time.perf_counter()
    result = subprocess.run(
        command, capture_output=True, text=True, env=env, preexec_fn=cap if capped else None, timeout=args.timeout
    )
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    notes = [line for line in result.stderr.splitlines() if line.startswith(("accelerate:", "zeroshard:", "INFO"))]
    if len(rows) < len(batches_of(system, args)):
        tail = "\n".join(result.stderr.strip().splitlines()[-6:])
        rows.append({"system": system, "error": f"exit code {result.returncode}: {tail}"})
    load = [load_before, os.getloadavg()[0]]  # this machine's 1-minute load average, before and after
    for row in rows:
        row["process_s"], row["notes"], row["capped"], row["load"] = time.perf_counter() - started, notes, capped, load
    return rows


def run_system(system: str, args, argv: list[str]) -> list[dict]:
    """Under the cap; a system that cannot run under it runs again without it (same CPU budget and
    prompts), so its speed and its real peak memory can still be set beside the others': Accelerate,
    and the speculative systems, whose draft in memory comes on top of the streamed model's budget."""
    rows = run_capped(system, args, argv)
    if rows and "error" in rows[0] and (not system.startswith("zeroshard") or system in SPECULATIVE):
        rows += run_capped(system, args, argv, capped=False)
    return rows


# -- report -------------------------------------------------------------------------------------------------
def report(args, weights: int, dd: float, references: dict, rows: list[dict], command: str) -> str:
    if args.pretrained:  # the model's own shape
        shape = json.loads((args.model_dir / "config.json").read_text())
        args.layers, args.hidden = shape["num_hidden_layers"], shape["hidden_size"]
        args.intermediate, args.vocab = shape["intermediate_size"], shape["vocab_size"]
    lines = [
        f"$ {command}",
        "(a system marked 'uncapped' failed under the cap and ran again without it, same settings)",
        f"model: Llama, {args.layers} layers, width {args.hidden}, MLP {args.intermediate}, vocab {args.vocab}: "
        f"{weights / 1e9:.2f} GB of fp32 weights; cap RLIMIT_DATA = {args.cap / 1e9:.2f} GB "
        f"({args.cap / weights:.2f} x the weights)",
        f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, greedy; {args.threads} threads; "
        f"dd O_DIRECT read: {dd:.2f} GB/s",
        "disk GB/s: bytes the block layer read per second of generate; busy GB/s: the NVMe store's bytes "
        "per second its reads were in flight",
        "",
        "GB/pos: bytes read per generated position (for the whole batch); passes: forwards over the "
        "weights; kept: the draft's proposals kept",
        "",
        f"{'system':<27} {'batch':>5} {'tokens/s':>9} {'s':>7} {'disk GB/s':>9} {'of dd':>6} "
        f"{'busy GB/s':>9} {'of dd':>6} {'GB/pos':>7} {'peak RSS GB':>11} {'< cap':>5} {'tokens = unsharded':>18} "
        f"{'passes':>6} {'kept':>5} {'load':>9}",
    ]
    for row in rows:
        name = row["system"] + ("" if row.get("capped", True) else " uncapped")
        if "error" in row:
            lines.append(f"{name} failed: {row['error'].splitlines()[-1]}")
            continue
        same = row["tokens"] == references[QUANTIZED.get(row["system"])][row["batch"]]
        busy = row.get("store_read_gb_s")
        busy_text = f"{busy:>9.2f} {busy / dd:>6.0%}" if busy else f"{'-':>9} {'-':>6}"
        new_tokens = row["batch"] * args.new_tokens
        mode = QUANTIZED.get(row["system"])
        equal = ("yes" if same else "NO") + (f" ({mode})" if mode else "")
        kept = f"{(new_tokens - row['passes']) / row['proposals']:>5.0%}" if row.get("proposals") else f"{'-':>5}"
        lines.append(
            f"{name:<27} {row['batch']:>5} {row['tokens_per_s']:>9.3f} {row['seconds']:>7.1f} "
            f"{row['read_gb_s']:>9.2f} {row['read_gb_s'] / dd:>6.0%} {busy_text} "
            f"{row['read_bytes'] / args.new_tokens / 1e9:>7.3f} "
            f"{row['peak_rss'] / 1e9:>11.2f} {'yes' if row['peak_rss'] < args.cap else 'NO':>5} "
            f"{equal:>18} "
            f"{row.get('passes', 0):>6} {kept} {row['load'][0]:>4.1f}-{row['load'][1]:<4.1f}"
        )
    modes = sorted({f"{r['system']}: {r['io_mode']}" for r in rows if r.get("io_mode")})
    lines += (
        [
            f"NVMe store I/O path: {', '.join(modes)} (direct = O_DIRECT; buffered = through the page cache: zeroshard.nvme_io, or the file system refused O_DIRECT)"
        ]
        if modes
        else []
    )
    for system in dict.fromkeys(r["system"] for r in rows if r["system"].startswith("zeroshard")):
        speedups = []
        for batch in batches_of(system, args):
            ours = [r for r in rows if r.get("batch") == batch and r["system"] == system and "error" not in r]
            theirs = [r for r in rows if r.get("batch") == batch and r["system"] == "accelerate" and "error" not in r]
            if ours and theirs:
                speedups.append(f"batch {batch}: {ours[0]['tokens_per_s'] / theirs[0]['tokens_per_s']:.1f}x")
        lines += [f"{system} / accelerate tokens/s: " + ", ".join(speedups)] if speedups else []
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, title: str, cap_ratio: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'zeroshard[plot]'): no chart", file=sys.stderr)
        return
    figure, axis = plt.subplots(figsize=(6, 4))
    for system, marker in (
        ("zeroshard", "o"),
        ("zeroshard-resident", "^"),
        ("zeroshard-resident-buffered", "v"),
        ("zeroshard-int8", "D"),
        ("zeroshard-int4", "d"),
        ("zeroshard-int4-packed", "X"),
        ("zeroshard-speculative", "*"),
        ("zeroshard-speculative-draft", "P"),
        ("accelerate", "s"),
    ):
        ok = [r for r in rows if r.get("system") == system and "error" not in r]
        points = sorted((r["batch"], r["tokens_per_s"]) for r in ok)
        if points:
            capped = all(r.get("capped", True) for r in ok)
            axis.plot(*zip(*points), marker=marker, label=system + ("" if capped else " (no cap: fails under it)"))
    axis.set_xscale("log", base=2)
    axis.set_xlabel("batch size (sequences generated together)")
    axis.set_ylabel("generated tokens / s")
    axis.set_title(f"{title}, process capped at {cap_ratio:.2f} of it (RLIMIT_DATA)")
    axis.grid(True, alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "zero_inference_model")
    parser.add_argument(
        "--nvme",
        type=Path,
        default=Path(tempfile.gettempdir()) / "zero_inference_swap",
        help="directory of the NVMe store and of accelerate's offload folder",
    )
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 4, 16])
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--prefetch",
        type=int,
        default=40_000_000,
        help="zeroshard's stage3_prefetch_bucket_size in elements (default: about three layers)",
    )
    parser.add_argument("--cap", type=int, default=None, help="RLIMIT_DATA bytes (default: half the weights)")
    parser.add_argument(
        "--accelerate-cpu-mb",
        type=int,
        default=None,
        help="accelerate's max_memory for the CPU (default: what the cap leaves, less 300 MiB and the KV cache)",
    )
    parser.add_argument(
        "--systems",
        default="zeroshard,zeroshard-resident,zeroshard-resident-buffered,zeroshard-int8,zeroshard-int4,"
        "zeroshard-speculative,accelerate",
    )
    parser.add_argument("--pretrained", action="store_true", help="use --model-dir as it is (no random model)")
    parser.add_argument("--draft-dir", type=Path, help="the draft of zeroshard-speculative-draft (save_pretrained)")
    parser.add_argument("--prompts-from", type=Path, help="scripts/train_stdlib_gpt.py's data.json: byte prompts")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--out", type=Path, default=Path("zero_inference"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args)
    argv = [a for a in sys.argv[1:]]
    args.model_dir.mkdir(parents=True, exist_ok=True)
    args.nvme.mkdir(parents=True, exist_ok=True)
    weights = build_model(args)
    args.cap = args.cap or weights // 2
    dd = dd_read(args.nvme)
    systems = args.systems.split(",")
    references = {
        mode: reference_tokens(args, mode) for mode in {None} | {QUANTIZED[s] for s in systems if s in QUANTIZED}
    }
    rows = [row for system in systems for row in run_system(system, args, argv)]
    command = "python benchmarks/zero_inference.py " + " ".join(argv)
    text = report(args, weights, dd, references, rows, command)
    sys.stdout.write(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".txt").write_text(text)
    args.out.with_suffix(".json").write_text(
        json.dumps(
            {
                "command": command,
                "weights_bytes": weights,
                "cap": args.cap,
                "dd_read_gb_s": dd,
                "rows": rows,
                "reference": {str(k): v for k, v in references[None].items()},
            },
            indent=1,
        )
    )
    plot(rows, args.out.with_suffix(".png"), f"{weights / 1e9:.2f} GB model", args.cap / weights)


if __name__ == "__main__":
    main()
