"""Models used by zeroshard's tests, demo and benchmarks. They know nothing about sharding."""

from zeroshard.tools.models.gpt import GPT, Block, GPTConfig, tiny_gpt_config

__all__ = ["GPT", "Block", "GPTConfig", "tiny_gpt_config"]
