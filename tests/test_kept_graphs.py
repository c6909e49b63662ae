"""Captured decode steps kept across the rollouts of a run (`rollout/arena.py`, `StepRunner._kept`): a later
rollout that meets a shape an earlier one met replays its graph instead of capturing again, and samples what the
eager step samples, after the weights moved in place (an optimizer step), at another temperature (a new graph), and
without overwriting what earlier rollouts returned. Replayed on the CPU by traced graphs (`capture_standin.py`),
which read and write the memory at the addresses the capture saw, as a CUDA graph does."""

from __future__ import annotations

import pytest
import torch
from capture_standin import model_tensors, traced_graphs
from conftest import make_tiny_model

from sparserl.rollout.batch import SamplingConfig
from sparserl.rollout.dispatch.scheduler import request_seed
from sparserl.rollout.engine import decode_loop, step
from sparserl.rollout.arena import StepArena
from sparserl.rollout.engine.decode_loop import row_bucket
from sparserl.rollout.engine.engine import RolloutEngine
from sparserl.rollout.sparsity.eviction import KVCompression

SPARSITY = {"dense": None, "rkv": KVCompression("rkv", budget=12, window=3, interval=3),
            "h2o": KVCompression("h2o", budget=12, window=3, interval=3, per_head=True)}
WORDS = ["^abcdefgh|a", "^xyzw|x", "^qrstuvw|r", "^mnop|n"]


@pytest.fixture()
def tiny():
    return make_tiny_model(seed=7)


def _rollout(engine, tokenizer, first_word: int, temperature: float = 1.0, compile_decode: str = "auto"):
    prompts = [tokenizer(WORDS[(first_word + r) % len(WORDS)]).input_ids for r in range(6)]
    sampling = SamplingConfig(14, temperature, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id, prompt_width=12, compile_decode=compile_decode)
    return engine.generate(prompts, sampling, seeds=[request_seed(first_word, r) for r in range(6)], max_rows=4)


def _same(eager, replayed) -> None:
    assert torch.equal(eager.response_ids, replayed.response_ids)
    torch.testing.assert_close(eager.sampler_logprobs, replayed.sampler_logprobs, atol=0, rtol=0)
    assert eager.kv.kv_peak_bytes == replayed.kv.kv_peak_bytes


@pytest.mark.parametrize("sparsity", ["dense", "rkv", "h2o"])
def test_a_later_rollout_replays_the_graphs_an_earlier_one_captured(tiny, monkeypatch, sparsity):
    """Rollouts of one engine whose step is captured. The first reserves its storages at their largest (so none
    moves), and the second, over the same prompts and seeds, captures nothing. Before the third the weights move in
    place, as an optimizer step moves them: it replays the kept graphs, captures only the shapes it meets anew, and is
    the eager rollout of the moved weights. Each rollout is the eager one token for token, and what the first returned
    is still what it sampled once the others ran (the arena's outputs are copied out). Rows join and leave
    (`max_rows` 4 of 6), so each rollout meets several shapes."""
    model, tokenizer = tiny
    eager_engine = RolloutEngine(model, SPARSITY[sparsity])
    with traced_graphs(monkeypatch, model_tensors(model)) as (graphs, met):
        engine = RolloutEngine(model, SPARSITY[sparsity])
        engine.runners["eager"] = step.StepRunner("graphs")  # what auto runs on a GPU
        first = _rollout(engine, tokenizer, 0)
        first_ids = first.response_ids.clone()
        assert first.kv.step_captures == len(graphs) > 1
        _same(_rollout(eager_engine, tokenizer, 0, compile_decode="false"), first)
        second = _rollout(engine, tokenizer, 0)
        assert second.kv.step_captures == 0
        _same(first, second)

        with torch.no_grad():
            for parameter in model.parameters():
                parameter.mul_(1.05)  # in place: the addresses a graph holds still hold the weights
        replays = len(met)
        again = _rollout(engine, tokenizer, 0)
        # The moved weights sample other tokens, so rows may leave at other steps: only shapes not met before capture.
        before, now = set(met[:replays]), set(met[replays:])
        assert again.kv.step_captures == len(now - before) < len(now)
        moved = _rollout(eager_engine, tokenizer, 0, compile_decode="false")
        _same(moved, again)
        assert not torch.equal(moved.sampler_logprobs, first.sampler_logprobs)  # the weights did move

        other = _rollout(engine, tokenizer, 1)
        _same(_rollout(eager_engine, tokenizer, 1, compile_decode="false"), other)
        assert torch.equal(first.response_ids, first_ids)


def test_a_rollout_at_another_temperature_captures_its_own_graphs(tiny, monkeypatch):
    """The temperature is a Python value a graph freezes: a rollout at another one, over shapes an earlier rollout's
    graphs hold, captures anew (its key differs) and samples as the eager step at its temperature; the first
    temperature's graphs are still replayed afterwards."""
    model, tokenizer = tiny
    eager_engine = RolloutEngine(model, SPARSITY["rkv"])
    with traced_graphs(monkeypatch, model_tensors(model)):
        engine = RolloutEngine(model, SPARSITY["rkv"])
        engine.runners["eager"] = step.StepRunner("graphs")
        hot = _rollout(engine, tokenizer, 0)
        cool = _rollout(engine, tokenizer, 0, temperature=0.5)
        assert cool.kv.step_captures == hot.kv.step_captures > 0
        _same(_rollout(eager_engine, tokenizer, 0, temperature=0.5, compile_decode="false"), cool)
        assert _rollout(engine, tokenizer, 0).kv.step_captures == 0


def test_a_rollout_after_its_storages_moved_captures_over_the_new_ones(tiny, monkeypatch):
    """A rollout with more rows than any before needs larger storages, which move: a graph over an old address is
    never replayed (its tensors moved, and the stand-in would refuse it), so a later rollout over shapes met before
    captures them anew over the new storages and samples as the eager step. Replacing the weights (not in place)
    makes every kept graph's key miss too."""
    model, tokenizer = tiny
    eager = _rollout(RolloutEngine(model, SPARSITY["rkv"]), tokenizer, 0, compile_decode="false")
    with traced_graphs(monkeypatch, model_tensors(model)):
        engine = RolloutEngine(model, SPARSITY["rkv"])
        runner = engine.runners["eager"] = step.StepRunner("graphs")
        _rollout(engine, tokenizer, 0)
        _rollout(engine, tokenizer, 0)
        moves = runner.arena.moves
        prompts = [tokenizer(WORDS[r % len(WORDS)]).input_ids for r in range(8)]
        sampling = SamplingConfig(14, 1.0, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                  prompt_width=12)
        engine.generate(prompts, sampling, seeds=[request_seed(0, r) for r in range(8)], max_rows=8)
        assert runner.arena.moves > moves
        after = _rollout(engine, tokenizer, 0)
        assert after.kv.step_captures > 0
        _same(eager, after)
        assert _rollout(engine, tokenizer, 0).kv.step_captures == 0
    for name, parameter in list(model.named_parameters()):  # the same values at new addresses
        module, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(module), attribute, torch.nn.Parameter(parameter.detach().clone()))
    with traced_graphs(monkeypatch, model_tensors(model)):
        replaced = _rollout(engine, tokenizer, 0)
        assert replaced.kv.step_captures > 0
        _same(eager, replaced)


def test_the_arena_places_a_tensor_at_its_roles_start_and_grows_only():
    """Placed tensors hold the values given (a cut of the role's own tensor included, which overlaps its new place),
    contiguous at the role's storage start; a tensor no larger keeps the storage, a larger one moves it, and one no
    larger than a reservation lands in the reserved storage."""
    arena = StepArena()
    source = torch.arange(24, dtype=torch.float32).view(2, 3, 4)
    first = arena.place("keys", source)
    assert torch.equal(first, source) and first.is_contiguous() and arena.holds(first) and arena.moves == 1
    cut = arena.place("keys", first[:, :, :2])  # overlaps: row 1 of the cut lies where row 0 of `first` was
    assert torch.equal(cut, source[:, :, :2]) and cut.data_ptr() == first.data_ptr() and arena.moves == 1
    assert arena.place("keys", cut) is cut  # already in place
    rows = arena.place("keys", torch.ones(1, 3, 2, dtype=torch.float32))
    assert rows.data_ptr() == first.data_ptr() and arena.moves == 1
    flags = arena.place("real", torch.tensor([[True, False, True]]))
    assert flags.dtype == torch.bool and flags.tolist() == [[True, False, True]] and arena.moves == 2
    grown = arena.place("keys", torch.zeros(4, 3, 4))
    assert arena.moves == 3 and not arena.holds(first) and arena.holds(grown)
    assert arena.nbytes() == grown.nbytes + 3
    assert not arena.holds(torch.zeros(3))
    small = arena.place("mass", torch.zeros(2, 3, 5), rows=6, slots=9)  # with room for [6, 3, 9] float32
    assert small.shape == (2, 3, 5) and not small.any()
    assert arena.moves == 4 and arena.nbytes() == grown.nbytes + 3 + 6 * 3 * 9 * 4
    largest = arena.place("mass", torch.ones(6, 3, 9))
    assert arena.moves == 4 and arena.holds(largest)


def test_the_row_ladder_is_four_sizes_a_doubling():
    assert [row_bucket(rows, 64) for rows in (1, 2, 3, 4, 5, 7, 8, 9, 11, 13, 17, 29, 33, 41, 49, 57, 64)] == \
        [1, 2, 3, 4, 5, 7, 8, 10, 12, 14, 20, 32, 40, 48, 56, 64, 64]
    assert row_bucket(50, 50) == 50 and row_bucket(45, 50) == 48 and row_bucket(49, 50) == 50


@pytest.mark.parametrize("sparsity", ["dense", "rkv"])
def test_a_captured_rollout_holds_its_rows_at_ladder_sizes(tiny, monkeypatch, sparsity):
    """Once no request waits, a captured rollout keeps ended rows as padding up to the next size of the ladder, so its
    steps meet ladder sizes only; its decisions are the eager rollout's (the same rows leave at the same steps), and
    so are its tokens, its KV peak (padding is not counted) and each row's held tokens (counted when it left)."""
    model, tokenizer = tiny
    # EOS made likelier (e^1 times), so that rows end all along the rollout and leave in small groups.
    def likelier_eos(module, inputs, logits):
        bumped = logits.clone()
        bumped[..., tokenizer.eos_token_id] += 1.0
        return bumped

    model.get_output_embeddings().register_forward_hook(likelier_eos)
    prompts = [tokenizer(WORDS[r % len(WORDS)]).input_ids for r in range(26)]
    sampling = SamplingConfig(20, 1.0, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                              prompt_width=12)
    seeds = [request_seed(3, r) for r in range(26)]
    met_rows = {"eager": [], "graphs": []}  # each step's (batch rows, of them not padding)
    real_run = decode_loop.run_decode_step

    def recorded(runner, model, cache, provider, rows, *args, **kwargs):
        met_rows[runner.mode].append((len(rows.tokens), len(rows.tokens) - cache.layers[0].padding_rows))
        return real_run(runner, model, cache, provider, rows, *args, **kwargs)

    monkeypatch.setattr(decode_loop, "run_decode_step", recorded)
    eager = RolloutEngine(model, SPARSITY[sparsity], check_every=2).generate(prompts, sampling, seeds=seeds)
    with traced_graphs(monkeypatch, model_tensors(model)):
        engine = RolloutEngine(model, SPARSITY[sparsity], check_every=2)
        engine.runners["eager"] = step.StepRunner("graphs")
        replayed = engine.generate(prompts, sampling, seeds=seeds)
    ladder = {1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 26}
    held = {mode: [rows for rows, _ in met] for mode, met in met_rows.items()}
    assert set(held["graphs"]) <= ladder and not set(held["eager"]) <= ladder  # the eager rows left freely
    assert [counted for _, counted in met_rows["graphs"]] == held["eager"]  # the same rows left at the same steps
    _same(eager, replayed)
    assert torch.equal(eager.kv.kept_tokens, replayed.kv.kept_tokens)


def test_samplers_sharing_runners_replay_only_their_own_graphs(tiny, monkeypatch):
    """A run's evaluations share one set of runners (`GRPOTrainer.eval_runners`) over samplers that differ: dense, R-KV,
    an fp8 cache. They place their tensors in the same arena, so a graph's key must tell them apart (which tensors, of
    which shapes and dtypes): each sampler's rollouts are its eager ones, and once the storages hold the largest
    of them (a second round recaptures what was captured before a storage grew), a round captures nothing."""
    model, tokenizer = tiny
    samplers = {"dense": (None, "auto"), "rkv": (SPARSITY["rkv"], "auto"), "fp8": (None, "fp8")}
    eager = {name: _rollout(RolloutEngine(model, comp, kv_dtype=dtype), tokenizer, 0, compile_decode="false")
             for name, (comp, dtype) in samplers.items()}
    with traced_graphs(monkeypatch, model_tensors(model)):
        runners = {"eager": step.StepRunner("graphs")}
        for round_ in range(3):
            for name, (comp, dtype) in samplers.items():
                replayed = _rollout(RolloutEngine(model, comp, kv_dtype=dtype, runners=runners), tokenizer, 0)
                _same(eager[name], replayed)
                assert round_ < 2 or replayed.kv.step_captures == 0
