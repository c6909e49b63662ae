"""Lossless speculative rollouts: the rounds of drafting and verifying (`sampler.py`), their static steps
(`steps.py`) and the state they advance (`rows.py`), what the drafts read (`drafts/`), and what the speculation did
(`stats.py`)."""
