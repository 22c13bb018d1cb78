"""ZeRO-Inference: generate with a model larger than memory, with no config and no engine.

    from zeroshard import NVMeOffload
    from zeroshard.inference import QuantSpec, from_pretrained, resident_draft

    model = from_pretrained("path/to/model", offload=NVMeOffload("/local_nvme"), quantize=QuantSpec(4))
    tokens = model.generate(input_ids, max_new_tokens=32)

The weights live as stage-3 shards in host memory or NVMe files (the offload policies of
`zeroshard.shard`: `zeroshard.CPUOffload(params=True)`, `zeroshard.NVMeOffload(path)`), optionally quantized group-wise to 8
or 4 bits, and each forward gathers one unit at a time. The modules, from the entry point down:

  sharded.py             `shard()` and `InferenceModel`: the entry point, built on the core
  pretrained.py          `from_pretrained`: a Hugging Face checkpoint straight into the store
  speculative.py         `resident_draft`: speculative decoding with a quantized draft in memory
  speculative_in_step.py speculative decoding on several stage-3 ranks, kept in step
  generate.py            transformers' `generate` on a sharded model, safe on several ranks
  packed.py              Linear layers that multiply by their 4-bit weights as stored
  store.py               `QuantizedStore`: the weights kept packed in a CPU or NVMe store
  int4.py                4-bit weights in the layout of torch's int4 CPU matmul
  quantization.py        `QuantSpec`: group-wise 8- and 4-bit weight quantization, the arithmetic

DeepSpeed's config reaches the same entry point through `zeroshard.initialize` without an
optimizer (compat/inference.py). transformers is imported only where a checkpoint is read.
"""

from zeroshard.inference.pretrained import from_pretrained
from zeroshard.inference.quantization import QuantSpec
from zeroshard.inference.sharded import InferenceModel, shard
from zeroshard.inference.speculative import PassCounter, resident_draft, speculation_report

__all__ = [
    "InferenceModel",
    "PassCounter",
    "QuantSpec",
    "from_pretrained",
    "resident_draft",
    "shard",
    "speculation_report",
]
