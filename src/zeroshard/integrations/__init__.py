"""Integrations with other training frameworks, each an optional extra that the core never imports:

- `zeroshard.integrations.hf` (`pip install zeroshard[hf]`): `ZeroShardTrainer`, a transformers
  `Trainer` on a zeroshard engine, and `generate` for sharded engines;
- `zeroshard.integrations.lightning` (`pip install zeroshard[lightning]`): `ZeroShardStrategy`, a
  PyTorch Lightning strategy.

See docs/integrations.md.
"""
