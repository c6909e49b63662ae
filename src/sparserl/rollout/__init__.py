"""The rollout side: everything that samples, and nothing that learns (a Ray worker carries only this).

Rooms, each answering one question:

    engine/       where is a token drawn, where do rows join and leave      token_draws, decode_loop, engine
    sparsity/     where is the cache compressed, what is attended           eviction, policies/, block_sparse,
                                                                            budgets, replay, settings
    speculative/  how does a draft get verified                             sampler, drafts/, stats
    dispatch/     how many rows run at once, where do shards go             scheduler, shards, spec, local,
                                                                            ray_workers, backends

and the floor every room reads: `sampler.py` (the one contract a sampler implements), `batch.py` (sampling
settings, the sampled batch, the eviction record, the KV figures), `cache.py` and `cache_layer.py` (the buffer
cache and its layers), `arena.py` (storages that outlast a rollout, for a captured step's tensors), `quantization.py`
(fp8 and int8 KV storage, and its replay), `acceptance.py` (Sparrow's α), `adapter.py` (DistillSparse's sampler adapter) and `sizes.py` (memory sizes as users write them).
Arrows point from the top of that list down: dispatch → speculative → engine → sparsity → the floor.
"""
