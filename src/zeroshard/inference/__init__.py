"""ZeRO-Inference: generate with a model larger than memory, the weights' stage-3 shards kept in
host memory or NVMe files (optionally quantized to 8 or 4 bits), gathered one unit at a time."""
