"""Shards of a step's prompt groups: the plan, the seeds, and merging the shards' batches for the learner."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model

from sparserl.rollout.batch import KVStats, RolloutBatch, SamplingConfig
from sparserl.rollout.dispatch.local import LocalRollouts
from sparserl.rollout.dispatch.scheduler import request_seed
from sparserl.rollout.dispatch.shards import concat_rollouts, plan_shards
from sparserl.rollout.dispatch.spec import SamplerSpec
from sparserl.rollout.engine.engine import RolloutEngine


def test_shards_hold_whole_groups_in_order_and_the_first_ones_take_the_remainder():
    prompts = [[g] for g in range(5) for _ in range(3)]  # 5 groups of 3 rows
    plan = plan_shards(prompts, group_size=3, shards=2, step_seed=11)
    assert [s.prompts for s in plan] == [[[0]] * 3 + [[1]] * 3 + [[2]] * 3, [[3]] * 3 + [[4]] * 3]
    assert [s.index for s in plan] == [0, 1]
    with pytest.raises(ValueError):
        plan_shards(prompts, group_size=3, shards=6, step_seed=11)  # more shards than groups


def test_every_row_of_a_step_has_its_own_seed_whatever_the_shards():
    prompts = [[g] for g in range(4) for _ in range(2)]
    one, two = plan_shards(prompts, 2, 1, step_seed=5), plan_shards(prompts, 2, 2, step_seed=5)
    assert one[0].seeds == two[0].seeds + two[1].seeds == [request_seed(5, row) for row in range(8)]
    seeds = {request_seed(step, row) for step in range(100) for row in range(8)}
    assert len(seeds) == 800 and all(0 <= s < 2 ** 63 for s in seeds)


def _batch(prompt_rows, response_rows, logprob, peak=10, rows_in_flight=0):
    """A hand-written batch: prompts left-padded with 0, responses right-padded with 0."""
    width = max(map(len, prompt_rows))
    span = max(map(len, response_rows))
    prompt_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompt_rows])
    response_ids = torch.tensor([r + [0] * (span - len(r)) for r in response_rows])
    response_mask = torch.tensor([[1.0] * len(r) + [0.0] * (span - len(r)) for r in response_rows])
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_ids != 0, response_ids=response_ids,
                        response_mask=response_mask, sampler_logprobs=response_mask * logprob,
                        prompt_lengths=torch.tensor([len(p) for p in prompt_rows]),
                        response_lengths=torch.tensor([len(r) for r in response_rows]),
                        ended=torch.tensor([True] * len(prompt_rows)), rollout_seconds=1.0,
                        kv=KVStats(kv_peak_bytes=peak, kv_dense_bytes=2 * peak, compressions=1,
                                   rows_in_flight=rows_in_flight or len(prompt_rows),
                                   kept_tokens=torch.ones(len(prompt_rows)),
                                   evicted_tokens=torch.zeros(len(prompt_rows))))


def test_merged_shards_are_padded_to_the_widest_prompt_and_response():
    a = _batch([[5, 6, 7]], [[8]], -1.0, peak=10)
    b = _batch([[9], [3, 4]], [[2, 2, 2], [1]], -2.0, peak=15)
    merged = concat_rollouts([a, b], pad_token_id=0)
    assert merged.prompt_ids.tolist() == [[5, 6, 7], [0, 0, 9], [0, 3, 4]]
    assert merged.prompt_mask.tolist() == [[True] * 3, [False, False, True], [False, True, True]]
    assert merged.response_ids.tolist() == [[8, 0, 0], [2, 2, 2], [1, 0, 0]]
    assert merged.sampler_logprobs.tolist() == [[-1, 0, 0], [-2, -2, -2], [-2, 0, 0]]
    assert merged.response_lengths.tolist() == [1, 3, 1] and merged.prompt_lengths.tolist() == [3, 1, 2]
    # Memory figures are per sampler: the shards ran one after the other (or each on a worker of its own),
    # so the most held at once is the larger shard's, not the sum; counts add up.
    assert merged.kv.kv_peak_bytes == 15 and merged.kv.kv_dense_bytes == 30 and merged.kv.rows_in_flight == 2
    assert merged.kv.compressions == 2
    assert merged.kv.kept_tokens.tolist() == [1, 1, 1]
    assert concat_rollouts([a], pad_token_id=0) is a


def test_shards_change_no_sampled_token():
    """The step's rows are the same sampled as one shard or as two (each row has its own seed, and
    every shard pads to the step's prompt width)."""
    model, tokenizer = make_tiny_model()
    prompts = [[5, 6, 7]] * 2 + [[8, 9]] * 2 + [[10]] * 2
    sampling = SamplingConfig(max_new_tokens=6, eos_token_id=None, pad_token_id=tokenizer.pad_token_id,
                              prompt_width=3)
    sampler = LocalRollouts(model)
    whole = sampler.generate(plan_shards(prompts, 2, 1, step_seed=7), sampling, SamplerSpec())
    split = sampler.generate(plan_shards(prompts, 2, 2, step_seed=7), sampling, SamplerSpec())
    assert [len(s) for s in split.shards] == [4, 2]
    merged = concat_rollouts(split.shards, tokenizer.pad_token_id)
    assert torch.equal(merged.response_ids, whole.shards[0].response_ids)
    assert torch.allclose(merged.sampler_logprobs, whole.shards[0].sampler_logprobs, atol=1e-5)


def test_both_samplers_implement_the_one_contract():
    """The engine and the speculative sampler are both `Sampler`s: the scheduler and the dispatch call nothing
    else of them."""
    import inspect

    from sparserl.rollout.sampler import Sampler
    from sparserl.rollout.speculative.sampler import SpeculativeSampler

    model, tokenizer = make_tiny_model()
    sampling = SamplingConfig(max_new_tokens=3, eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
    for sampler in (RolloutEngine(model), SpeculativeSampler(model, None, draft_tokens=2)):
        assert isinstance(sampler, Sampler)
        inspect.signature(sampler.generate).bind([[5, 6]], sampling, seeds=[1], on_step=None, max_rows=None)
        batch = sampler.generate([[5, 6], [7]], sampling, seeds=[1, 2], max_rows=2)
        assert batch.response_ids.shape == (2, 3) and sampler.row_bytes(2, 3) > 0
    assert SpeculativeSampler.refills_rows is False and RolloutEngine(model).refills_rows is True
