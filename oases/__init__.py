"""oases: GPT/LLaMA training with overlapped tensor parallelism."""

__version__ = "0.1.0"
