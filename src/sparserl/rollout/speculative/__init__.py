"""Lossless speculative rollouts: how a draft is verified and emitted (`sampler.py`), what the drafts read
(`drafts.py`), and what the speculation did (`stats.py`)."""
