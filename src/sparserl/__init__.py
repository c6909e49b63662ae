"""sparserl: reinforcement learning of language models with sparse (KV-compressed) rollouts."""

__version__ = "0.1.0"
