"""The DeepSpeed-shaped surface: `initialize`, the engine facade, optimizer and scheduler factories,
`zero.Init` / `GatheredParameters`, activation checkpointing — each a thin layer over the core.

`zeroshard/__init__.py` re-exports it so that `import zeroshard as deepspeed` works, and
`paths.py` makes DeepSpeed's module paths (`deepspeed.zero`, `deepspeed.checkpointing`, ...)
importable under `zeroshard.`.
"""
