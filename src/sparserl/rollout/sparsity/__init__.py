"""Sparsity: where the cache is compressed (`eviction.py`, with one KV policy per file in `policies/`), Sparrow's
block-sparse attention (`block_sparse.py`), budgets that grow with the cached length (`budgets.py`), the exact
replay of a sparse sampler (`replay.py`), and the sparsity a config asks for (`settings.py`)."""
