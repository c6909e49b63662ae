"""One GRPO update at 8 × 512 response tokens on a tiny Llama with a 128k vocabulary, then the
acceptance rate α of a sparse rollout of the same size (rebuilt by the replay); prints peak RSS (MiB).

Run by tests/test_logprob_chunks.py in a fresh process, with `chunked` or `unchunked` as argument.
"""

import resource
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sparserl.learner.alpha import rollout_alpha_metrics
from sparserl.learner.grpo import ppo_loss, token_coefficients
from sparserl.model import forward
from sparserl.rollout.batch import SamplingConfig
from sparserl.rollout.engine.engine import RolloutEngine
from sparserl.rollout.sparsity.eviction import KVCompression

torch.set_num_threads(1)
if sys.argv[1] == "unchunked":
    forward.LOGIT_CHUNK_BYTES = 1 << 60  # one chunk: the whole [N, T, V] at once
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=128_000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))
rows, prompt, response = 8, 16, 512
ids = torch.randint(0, 128_000, (rows, prompt + response))
mask = torch.ones_like(ids)
logp_old = forward.batched_logprobs(model, ids, mask, prompt, rows)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
logp_new, _ = forward.response_logprobs(model, ids, mask, prompt)
terms = ppo_loss(logp_new, logp_old, torch.randn(rows), torch.ones_like(logp_new),
                 token_coefficients(torch.ones_like(logp_new), "seq-mean-token-mean"), 0.2, 0.2)
terms.loss.backward()
optimizer.step()
if sys.argv[1] == "chunked":  # the unchunked run only shows that the bound separates the update's two paths
    # Kept whole, the sampler's distributions alone would be [8, 512, 128k] floats, 2 GB: past the bound.
    with torch.no_grad():
        compression = KVCompression("rkv", budget=64, window=8, interval=16)
        batch = RolloutEngine(model, compression, record_distributions=True).generate(
            ids[:, :prompt].tolist(), SamplingConfig(response, 1.0, eos_token_id=None), torch.Generator().manual_seed(0))
        assert batch.sampler_distribution is None and batch.response_mask.sum() == rows * response
        assert rollout_alpha_metrics(model, [batch], 1.0, 64, micro_batch_size=rows)["alpha_tail_tokens"] > 0
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
