"""Lossless speculative rollouts (issue 26), checked against independent computations: the dense
engine's rollout, the dense model's own teacher-forced forward, and chi-square tests of sampled
token frequencies against the dense model's exact probabilities."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from sparserl.config.schema import load_config
from sparserl.errors import ConfigError
from sparserl.model.loading import builtin_model_config
from sparserl.rollout.batch import SamplingConfig
from sparserl.rollout.engine.engine import RolloutEngine
from sparserl.rollout.sparsity.block_sparse import BlockSparsity
from sparserl.rollout.speculative import sampler as speculative
from sparserl.rollout.speculative import steps as speculative_steps
from sparserl.rollout.speculative.drafts import WindowDraft, draft_from_config
from sparserl.rollout.speculative.sampler import SpeculativeSampler
from sparserl.rollout.speculative.stats import AdaptiveDraftLength

VOCAB = 11
PROMPT_LEN = 24
# The draft attends to 3 pages of 2 tokens (the first and the 2 most recent) out of ~14 in every layer:
# a draft genuinely different from the dense model (acceptance about 0.6 on the model below).
SPARSE_DRAFT = BlockSparsity(budget=6, page_size=2, dense_layers=0)
LEVEL = 0.01  # each chi-square test rejects a correct sampler with this probability (fixed seeds: deterministic)


def _tiny_llama(vocab: int, scale: float):
    """A float64 random 2-layer Llama; weights scaled by `scale` (3: next-token distributions far from
    uniform and attention sharp enough for a sparse draft to differ; 1: near uniform)."""
    torch.manual_seed(0)
    config = builtin_model_config(vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2)
    tiny = LlamaForCausalLM(config).double().eval()
    with torch.no_grad():
        for parameter in tiny.parameters():
            parameter.mul_(scale)
    return tiny


@pytest.fixture(scope="module")
def model():
    return _tiny_llama(VOCAB, 3.0)


def _prompts(rows: int, seed: int = 1) -> list[list[int]]:
    """`rows` prompts of PROMPT_LEN tokens (one length: the teacher-forced forward needs no padding)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (rows, PROMPT_LEN), generator=generator).tolist()


@torch.no_grad()
def _dense_next(model, sequences: torch.Tensor) -> torch.Tensor:
    """The dense model's next-token probabilities `[R, V]` after each of `sequences [R, S]` (plain forward)."""
    return model(input_ids=sequences).logits[:, -1].softmax(dim=-1)


def _chi_square_p_value(counts: torch.Tensor, probabilities: torch.Tensor) -> float:
    """P-value of Pearson's chi-square of `counts` against `probabilities` (cells expecting fewer than
    5 draws pooled into one), from the chi-square survival function Q(k/2, x/2)."""
    expected = probabilities.double().flatten() * counts.sum()
    counts = counts.double().flatten()
    small = expected < 5
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    counts = torch.cat([counts[~small], counts[small].sum()[None]])
    if expected[-1] == 0:
        expected, counts = expected[:-1], counts[:-1]
    statistic = ((counts - expected) ** 2 / expected).sum()
    freedom = len(expected) - 1
    return float(torch.special.gammaincc(torch.tensor(freedom / 2.0), statistic / 2))


def test_dense_draft_is_the_dense_rollout_token_for_token(model):
    """A draft attending densely is the verifier: every draft accepted, the rollout the engine's."""
    prompts = [p[: 6 + 3 * i] for i, p in enumerate(_prompts(5))]  # left padding: prompts of 5 lengths
    seeds = [101, 202, 303, 404, 505]
    for temperature in (1.0, 0.0):
        sampling = SamplingConfig(max_new_tokens=30, temperature=temperature, eos_token_id=3)
        dense = RolloutEngine(model).generate(prompts, sampling, seeds=seeds)
        assert dense.ended.any() and not dense.ended.all()  # EOS ends some rows, others run to the limit
        for gamma in (1, 4):
            batch = SpeculativeSampler(model, None, draft_tokens=gamma).generate(prompts, sampling, seeds=seeds)
            assert torch.equal(batch.response_ids, dense.response_ids)
            assert torch.equal(batch.response_lengths, dense.response_lengths)
            assert torch.equal(batch.ended, dense.ended)
            # The engine records float32 log-probs (its draws work in float32); ours keep float64.
            torch.testing.assert_close(batch.sampler_logprobs, dense.sampler_logprobs.double(), atol=2e-6, rtol=0)
            assert batch.speculation.acceptance_rate == 1.0


def test_recorded_logprobs_are_the_dense_models_teacher_forced(model):
    sampling = SamplingConfig(max_new_tokens=40, temperature=0.7, eos_token_id=2)
    batch = SpeculativeSampler(model, SPARSE_DRAFT, draft_tokens=3).generate(_prompts(12), sampling,
                                                                            seeds=list(range(12)))
    assert batch.speculation.accepted < batch.speculation.compared  # the draft was rejected somewhere
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids).logits[:, PROMPT_LEN - 1:-1] / 0.7
    expected = logits.log_softmax(dim=-1).gather(2, batch.response_ids[..., None]).squeeze(2)
    mask = batch.response_mask.bool()
    torch.testing.assert_close(batch.sampler_logprobs[mask], expected[mask], atol=1e-9, rtol=0)
    assert batch.replayable and batch.sampler_distribution is None


def test_greedy_with_a_sparse_draft_is_dense_greedy(model):
    prompts = _prompts(6)
    sampling = SamplingConfig(max_new_tokens=40, temperature=0.0, eos_token_id=None)
    dense = RolloutEngine(model).generate(prompts, sampling, seeds=list(range(6)))
    batch = SpeculativeSampler(model, SPARSE_DRAFT, draft_tokens=4).generate(prompts, sampling, seeds=list(range(6)))
    assert batch.speculation.accepted < batch.speculation.compared
    assert torch.equal(batch.response_ids, dense.response_ids)


def test_sampled_tokens_follow_the_dense_distribution(model):
    """Several thousand draws of the first three tokens after one prompt. Token 1 comes from the
    prefill; with γ = 2 tokens 2 and 3 are draft tokens accepted, or residual draws after a rejection
    (token 3 also after an accepted token 2). Their joint and marginal frequencies must pass a
    chi-square test at LEVEL against the dense model's exact probabilities, while the lossy sparse
    sampler (the same block attention, no verification) fails the same test."""
    rows = 4000
    prompt = _prompts(1)[0]
    sampling = SamplingConfig(max_new_tokens=4, temperature=1.0)
    batch = SpeculativeSampler(model, SPARSE_DRAFT, draft_tokens=2).generate([prompt] * rows, sampling,
                                                                            seeds=list(range(rows)))
    stats = batch.speculation
    assert 0.1 < 1 - stats.acceptance_rate < 0.9  # rejections and accepted runs both common
    # Exact dense probabilities: p(x1), p(x2 | x1) for every x1, p(x3 | x1, x2) for every (x1, x2).
    base = torch.tensor(prompt)
    first = _dense_next(model, base[None])[0]
    pairs = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))
    second = _dense_next(model, torch.cat([base.expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], dim=1))
    third = _dense_next(model, torch.cat([base.expand(len(pairs), -1), pairs], dim=1)).view(VOCAB, VOCAB, VOCAB)
    joint = first[:, None] * second  # P(x1, x2)
    marginal_third = (joint[..., None] * third).sum(dim=(0, 1))

    def frequencies(ids):
        return (torch.bincount(ids[:, 0] * VOCAB + ids[:, 1], minlength=VOCAB ** 2).view(VOCAB, VOCAB),
                torch.bincount(ids[:, 2], minlength=VOCAB))

    pair_counts, third_counts = frequencies(batch.response_ids)
    assert _chi_square_p_value(pair_counts, joint) > LEVEL
    assert _chi_square_p_value(third_counts, marginal_third) > LEVEL
    second_given_top = pair_counts[first.argmax()]  # token 2 after the likeliest token 1: a conditional
    assert _chi_square_p_value(second_given_top, second[first.argmax()]) > LEVEL

    lossy = RolloutEngine(model, SPARSE_DRAFT, record_evictions=False).generate([prompt] * rows, sampling,
                                                                              seeds=list(range(rows)))
    lossy_pairs, lossy_third = frequencies(lossy.response_ids)
    assert _chi_square_p_value(lossy_pairs, joint) < LEVEL  # the test can tell a sparse sampler from dense


@torch.no_grad()
def _response_probabilities(model, prompt: list[int], length: int, eos: int, temperature: float) -> dict:
    """{response: probability} of every response the dense model at `temperature` can give `prompt`
    (ended by EOS or at `length` tokens), by brute-force enumeration in float64."""
    done, frontier = {}, {(): 1.0}
    for depth in range(length):
        prefixes = list(frontier)
        logits = model(input_ids=torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1]
        for prefix, weight, row in zip(prefixes, list(frontier.values()), (logits / temperature).softmax(-1)):
            for token, probability in enumerate(row.tolist()):
                response = prefix + (token,)
                if token == eos or depth == length - 1:
                    done[response] = done.get(response, 0.0) + weight * probability
                else:
                    frontier[response] = weight * probability
            del frontier[prefix]
    return done


@pytest.mark.parametrize("draft", [BlockSparsity(budget=4, page_size=2, dense_layers=0), WindowDraft(budget=4, sink=1)],
                         ids=["block", "window"])
def test_whole_responses_follow_the_dense_distribution(draft, monkeypatch):
    """Every token of the response, the bonus tokens and the rounds after a compaction included: the
    frequencies of whole responses (vocabulary 3 with EOS, up to 8 tokens, two prompts of different
    lengths in alternate rows, rows ending mid-round) pass a chi-square against the dense model's
    exact probabilities, enumerated by brute force."""
    vocab, eos, length, temperature, rows = 3, 2, 8, 0.7, 12000
    tiny = _tiny_llama(vocab, 3.0)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, vocab, (9,), generator=generator).tolist(),
               torch.randint(0, vocab, (5,), generator=generator).tolist()]
    compactions = []
    monkeypatch.setattr(speculative, "compact", lambda cache, real=speculative.compact: compactions.append(1) or
                        real(cache))
    batch = SpeculativeSampler(tiny, draft, draft_tokens=3).generate(
        [prompts[i % 2] for i in range(rows)], SamplingConfig(length, temperature, eos_token_id=eos),
        seeds=list(range(rows)))
    assert compactions and 0.2 < batch.speculation.acceptance_rate < 0.95  # the draft differs from dense
    for which, prompt in enumerate(prompts):
        exact = _response_probabilities(tiny, prompt, length, eos, temperature)
        counts = {}
        for ids, n in zip(batch.response_ids[which::2], batch.response_lengths[which::2]):
            response = tuple(ids[:n].tolist())
            counts[response] = counts.get(response, 0) + 1
        assert set(counts) <= set(exact)
        order = list(exact)
        assert _chi_square_p_value(torch.tensor([float(counts.get(r, 0)) for r in order]),
                                   torch.tensor([exact[r] for r in order])) > LEVEL


def test_rows_batch_together_whatever_they_accept(model, monkeypatch):
    """One batch of rows with prompts of different lengths that accept different numbers of tokens in
    the same rounds, end on EOS or at the length limit, through buffer compactions: every row's
    log-probs are still the dense model's on its own sequence (left padding and all)."""
    compactions, compact = [], speculative.compact
    monkeypatch.setattr(speculative, "compact", lambda cache: compactions.append(1) or compact(cache))
    accepted_per_round, accept = [], speculative_steps.accept
    monkeypatch.setattr(speculative_steps, "accept",
                        lambda *args: (lambda out: accepted_per_round.append(out[1]) or out)(accept(*args)))
    prompts = [p[: 8 + 2 * i] for i, p in enumerate(_prompts(6))]
    sampling = SamplingConfig(max_new_tokens=37, temperature=1.0, eos_token_id=3)
    batch = SpeculativeSampler(model, SPARSE_DRAFT, draft_tokens=4).generate(prompts, sampling, seeds=[7, 8, 9, 10, 11, 12])
    assert compactions and any(len(set(counts.tolist())) > 1 for counts in accepted_per_round)
    mask = batch.attention_mask
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=mask,
                       position_ids=(mask.cumsum(dim=1) - 1).clamp(min=0)).logits
    width = batch.prompt_ids.shape[1]
    expected = logits[:, width - 1:-1].log_softmax(dim=-1).gather(2, batch.response_ids[..., None]).squeeze(2)
    real = batch.response_mask.bool()
    torch.testing.assert_close(batch.sampler_logprobs[real], expected[real], atol=1e-9, rtol=0)
    for ids, length, ended in zip(batch.response_ids, batch.response_lengths, batch.ended):
        eos_at = (ids[:length] == 3).nonzero().flatten().tolist()
        if ended:  # ends on its first EOS, nothing after it
            assert eos_at == [length - 1]
        else:
            assert not eos_at and length == 37
    assert batch.ended.any() and not batch.ended.all()


@pytest.mark.parametrize("replaced", ["seeds", "rows"])
def test_a_draft_step_over_new_seeds_or_rows_is_captured_anew(model, monkeypatch, replaced):
    """The draft step reads the rows' seeds and the request each cache row holds, which are not its own buffers: both
    are in its graph's key (`steps.RolloutRunner`). Here they become new tensors after the first round (the seeds
    also new values), the buffers unchanged: the draft step is captured anew, and the rollout replayed from traced
    graphs (`capture_standin.py`) is the eager one with the same change, bit for bit. Keyed without them, the two
    rounds' draft steps would share one graph, replayed over the old tensors (the stand-in refuses that capture)."""
    from capture_standin import model_tensors, traced_graphs

    from sparserl.rollout.engine.step import StepRunner

    begin_round, rounds = speculative_steps.Rollout.begin_round, []

    def replacing_after_the_first_round(rollout, most):
        rounds.append(rollout)
        if len(rounds) == 2:
            state = rollout.state
            if replaced == "seeds":
                state.seeds = state.seeds.flip(0) + 1
            else:
                state.rows = state.rows.clone()
        return begin_round(rollout, most)

    monkeypatch.setattr(speculative_steps.Rollout, "begin_round", replacing_after_the_first_round)
    sampling = SamplingConfig(max_new_tokens=12, temperature=1.0, eos_token_id=None)

    def rollout(runner=None):
        rounds.clear()
        sampler = SpeculativeSampler(model, None, draft_tokens=2)  # a dense draft: one graph while the rows stay
        if runner is not None:
            sampler.runners[sampling.compile_decode] = runner
        return sampler.generate(_prompts(4), sampling, seeds=[5, 6, 7, 8])

    eager = rollout()
    with traced_graphs(monkeypatch, model_tensors(model)) as (graphs, met):
        replayed = rollout(StepRunner("graphs"))
    draft_keys = [(key, held) for run, key, held in met if run is speculative_steps.draft_step]
    first_round = draft_keys[:2]  # γ = 2 draft steps a round
    assert len(set(first_round)) == 1 and first_round[0] not in draft_keys[2:]
    assert len(graphs) == len(set(met))
    assert torch.equal(eager.response_ids, replayed.response_ids)
    torch.testing.assert_close(eager.sampler_logprobs, replayed.sampler_logprobs, atol=0, rtol=0)


def test_adaptive_draft_length_follows_the_acceptance_rate():
    choose = AdaptiveDraftLength(first=4, most=8)
    assert choose.choose() == 4  # nothing measured yet
    choose.observe(4, alpha=0.99, draft_step_seconds=0.1, verify_seconds=1.0)
    assert choose.choose() == 8  # near-certain acceptance and cheap drafts: the longest draft
    choose = AdaptiveDraftLength(first=4, most=8, smoothing=1.0)
    choose.observe(4, alpha=0.2, draft_step_seconds=0.5, verify_seconds=1.0)
    assert choose.choose() == 1


def test_adaptive_sampler_and_metrics(model):
    sampling = SamplingConfig(max_new_tokens=30, temperature=1.0)
    sampler = SpeculativeSampler(model, SPARSE_DRAFT, draft_tokens="adaptive")
    batch = sampler.generate(_prompts(4), sampling, seeds=[1, 2, 3, 4])
    metrics = sampler.take_stats().metrics(bin_size=16)
    assert 1 <= metrics["spec_gamma_mean"] <= 8
    assert 0 < metrics["spec_acceptance_rate"] < 1 and metrics["spec_tokens_per_verification"] > 1
    # Drafting and verifying are parts of the rollout, each timed once.
    assert 0 < metrics["spec_draft_s"] + metrics["spec_verify_s"] <= batch.rollout_seconds
    assert any(k.startswith("spec_acceptance_len_") for k in metrics) and "spec_alpha_mean" in metrics
    assert sampler.take_stats().metrics(bin_size=16) == {}


def test_row_bytes_hold_the_dense_cache_and_its_slack(model):
    sampler = SpeculativeSampler(model, SPARSE_DRAFT, draft_tokens=4)
    dense = RolloutEngine(model).row_bytes(24, 1000)
    assert dense < sampler.row_bytes(24, 1000) <= dense * 1.2


def test_speculative_flags():
    config = load_config(overrides={"speculative": "true", "draft_tokens": "adaptive"})
    assert config.rollout.speculative and config.rollout.draft_tokens == "adaptive"
    assert load_config(overrides={"draft_tokens": "6"}).rollout.draft_tokens == 6
    with pytest.raises(ConfigError, match="draft_tokens"):
        load_config(overrides={"speculative": "true", "draft_tokens": "0"})
    with pytest.raises(ConfigError, match="draft_tokens"):
        load_config(overrides={"draft_tokens": "many"})
    window = load_config(overrides={"speculative": "true", "speculative_draft": "window", "kv_budget": "80"})
    assert draft_from_config(window.rollout) == WindowDraft(budget=80, sink=20)
    assert isinstance(draft_from_config(load_config(overrides={"speculative": "true"}).rollout), BlockSparsity)


def test_window_draft_reports_the_share_of_real_keys_it_reads():
    """Budget 32 over caches of 40 to 440 real keys: the draft reads 32 of L at each step, so its
    attended share is about the mean of 32 / L over the steps (0.193), whatever slack the buffer has.
    (A model with near-uniform attention, whose drafts are nearly all accepted: few holes in the window.)"""
    plain = _tiny_llama(VOCAB, 1.0)
    batch = SpeculativeSampler(plain, WindowDraft(budget=32, sink=4), draft_tokens=4).generate(
        [list(range(1, 11)) * 4] * 2, SamplingConfig(max_new_tokens=400, temperature=1.0, eos_token_id=None),
        seeds=[1, 2])
    expected = sum(32 / length for length in range(40, 440)) / 400
    assert batch.speculation.attended_frac == pytest.approx(expected, rel=0.05)


@pytest.mark.parametrize("draft", [SPARSE_DRAFT, WindowDraft(budget=8, sink=2)], ids=["block", "window"])
def test_a_groups_prompt_is_prefilled_once_and_samples_as_its_own_prefill_would(model, monkeypatch, draft):
    """Rows with the same prompt (a GRPO group) share one prefill: the prefill forward holds one row per group,
    and the batch draws what it draws when every row is prefilled on its own, token for token. (Not a row
    alone: the draft's pages and sink are cache slots, which a batch's left padding moves.)"""
    prompts = [p[: 10 + 3 * i] for i, p in enumerate(_prompts(3, seed=6))]
    grouped_prompts = [p for p, size in zip(prompts, (3, 1, 2)) for _ in range(size)]
    seeds = list(range(40, 40 + len(grouped_prompts)))
    sampling = SamplingConfig(max_new_tokens=20, temperature=1.0, eos_token_id=3)
    prefill_rows, forward = [], type(model).forward

    def counting(self, input_ids=None, **kwargs):
        if input_ids.shape[1] > 1 and not prefill_rows:
            prefill_rows.append(input_ids.shape[0])
        return forward(self, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(type(model), "forward", counting)
    grouped = SpeculativeSampler(model, draft, draft_tokens=3).generate(grouped_prompts, sampling, seeds=seeds)
    assert prefill_rows == [3]
    monkeypatch.setattr(type(model), "forward", forward)
    monkeypatch.setattr(speculative, "prompt_groups", lambda ids, mask: (torch.arange(len(ids)),) * 2)
    separate = SpeculativeSampler(model, draft, draft_tokens=3).generate(grouped_prompts, sampling, seeds=seeds)
    assert torch.equal(grouped.response_lengths, separate.response_lengths)
    assert torch.equal(grouped.response_ids, separate.response_ids)
    torch.testing.assert_close(grouped.sampler_logprobs, separate.sampler_logprobs, atol=1e-9, rtol=0)
    assert grouped.speculation.acceptance_rate == separate.speculation.acceptance_rate < 1


def test_dense_equivalent_bytes_are_the_engines_on_the_same_rows(model):
    """Groups of rows sharing a prompt, the dense draft (so both samplers draw the same tokens): the KV figure a dense
    cache of these rows would hold is the same number from either sampler, counted by hand: every row, every layer,
    keys and values, the prompt width plus the longest response."""
    prompts = [p[: 8 + 2 * i] for i, p in enumerate(_prompts(3, seed=7)) for _ in range(4)]
    seeds = list(range(60, 60 + len(prompts)))
    sampling = SamplingConfig(max_new_tokens=16, temperature=1.0, eos_token_id=3)
    engine = RolloutEngine(model).generate(prompts, sampling, seeds=seeds)
    speculative_batch = SpeculativeSampler(model, None, draft_tokens=3).generate(prompts, sampling, seeds=seeds)
    assert torch.equal(engine.response_ids, speculative_batch.response_ids)
    config = model.config
    by_hand = (len(prompts) * config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim
               * next(model.parameters()).element_size()
               * (max(map(len, prompts)) + int(engine.response_lengths.max())))
    assert engine.kv.kv_dense_bytes == speculative_batch.kv.kv_dense_bytes == by_hand
