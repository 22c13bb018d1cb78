"""The demo training job behind `zeroshard train` (README: `make demo`): a character-level GPT trained on
text that every Python installation carries, its own standard library's source."""
