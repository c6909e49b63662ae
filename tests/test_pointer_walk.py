"""The built-in pointer-walk task and the character tokenizer, checked by parsing the text ourselves."""

from __future__ import annotations

import random
import re
import string

import pytest
from transformers import AutoTokenizer

from sparserl.tasks.base import reward_columns
from sparserl.tasks.pointer_walk import PointerWalkTask, extract_answer, needed_source
from sparserl.tasks.tokenizer import build_char_tokenizer

# Step counters written out by hand: the ten digits, then ASCII punctuation in order without
# the four format characters ^ | # $.
MY_COUNTERS = "0123456789" + "!\"%&'()*+,-./:;<=>?@[\\]_`{}~"
assert len(MY_COUNTERS) == 38

PROMPT_RE = re.compile(r"^\^((?:[a-z][A-Z])+)\|([a-z])(.)$")


def parse_prompt(prompt: str) -> tuple[dict[str, str], str, int]:
    """links {key: next key (lower case)}, the start letter and the hop count, from the prompt text alone."""
    match = PROMPT_RE.match(prompt)
    assert match, f"prompt does not have the documented shape: {prompt!r}"
    pairs = re.findall(r"([a-z])([A-Z])", match.group(1))
    keys = [k for k, _ in pairs]
    assert len(set(keys)) == len(keys), f"a key appears twice: {prompt!r}"
    return {k: v.lower() for k, v in pairs}, match.group(2), MY_COUNTERS.index(match.group(3)) + 1


def my_walk(links: dict[str, str], start: str, hops: int) -> tuple[str, str]:
    """(demonstration, label) by walking the links `hops` times."""
    out, node = [], start
    for k in range(hops):
        nxt = links[node]
        out.append(MY_COUNTERS[k] + node + nxt.upper())
        node = nxt
    return "".join(out) + "#" + node.upper() + "$", node.upper()


@pytest.mark.parametrize("letters, min_letters", [(3, None), (6, 3), (12, None), (26, None), (26, 26)])
def test_prompt_demonstration_and_label(letters, min_letters):
    task = PointerWalkTask(letters=letters, min_letters=min_letters)
    low = min_letters or max(3, letters - 10)
    seen_n, seen_hops = set(), set()
    for example in task.examples(300, seed=7):
        links, start, hops = parse_prompt(example.prompt)
        n = len(links)
        assert low <= n <= letters
        # Values are exactly the keys: a permutation of the letters.
        assert sorted(links.values()) == sorted(links)
        assert start in links
        # ONE cycle through all letters: from any key, n steps come back and visit all.
        node, seen = start, []
        for _ in range(n):
            seen.append(node)
            node = links[node]
        assert node == start and len(set(seen)) == n
        # Never a full lap: every hop needs a link only the prompt holds.
        assert -(-n // 3) <= hops <= n - 1
        demo, label = my_walk(links, start, hops)
        assert example.demonstration == demo
        assert example.label == label
        assert len(example.prompt) == 2 * n + 4  # ^, n links of 2, |, start, last counter
        assert len(example.demonstration) == 3 * hops + 3 <= task.max_response_chars
        seen_n.add(n)
        seen_hops.add(hops)
    assert task.default_max_new_tokens >= task.max_response_chars
    assert seen_n == set(range(low, letters + 1))  # every cycle length occurs
    assert len(seen_hops) >= min(letters - 2, 10)


def test_docstring_example_walks_correctly():
    # ^sRtHrEhSlTeL|h4: s->r, t->h, r->e, h->s, l->t, e->l; from h, 5 hops (counters 0..4):
    # h->s->r->e->l->t, so the answer is T.
    links, start, hops = parse_prompt("^sRtHrEhSlTeL|h4")
    demo, label = my_walk(links, start, hops)
    assert hops == 5 and demo == "0hS1sR2rE3eL4lT#T$" and label == "T"
    assert PointerWalkTask(letters=6).reward([demo], label=[label], demonstration=[demo]) == [1.0]


def test_start_letters_and_link_orders_vary():
    examples = PointerWalkTask(letters=5).examples(200, seed=0)
    starts = {parse_prompt(e.prompt)[1] for e in examples}
    assert len(starts) > 10  # starts spread over the alphabet
    labels = {e.label for e in examples}
    assert len(labels) > 10


# ----------------------------------------------------------------------------- shortcuts
# The first version of this task (a fixed 12-cycle, 32 hops) was solved by a model that looped back
# with a period of 8 hops, since 32 = 8 (mod 12). These scripted policies are every fixed-period,
# fixed-offset, fixed-length and constant policy we could think of. None may beat chance (a random
# letter of the cycle other than the start) by more than 5 points.

def loop_answer(links: dict[str, str], start: str, hops: int, walked: int, period: int) -> str:
    """Follow the links for `walked` hops, then copy the letter written `period` hops back."""
    letters, node = [], start
    for j in range(hops):
        node = links[node] if j < walked else letters[j - period]
        letters.append(node)
    return letters[-1].upper()


def walk_answer(links: dict[str, str], start: str, hops: int) -> str:
    node = start
    for _ in range(hops):
        node = links[node]
    return node.upper()


def constant_policies(prompt: str) -> dict[str, str]:
    links, start, _ = parse_prompt(prompt)
    values = re.findall(r"[A-Z]", prompt)
    letters = re.findall(r"[A-Za-z]", prompt.split("|")[0])
    counts = {c: letters.count(c) + letters.count(c.lower()) for c in map(str.upper, links)}
    answers = {"start": start.upper(), "predecessor of start": next(k for k, v in links.items() if v == start).upper(),
               "most frequent letter": max(sorted(counts), key=counts.get),
               "first value": values[0], "last value": values[-1]}
    answers.update({f"always {c}": c for c in string.ascii_uppercase})
    answers.update({f"value in slot {j}": values[j % len(values)] for j in range(26)})
    answers.update({f"walk {k} hops whatever the prompt says": walk_answer(links, start, k) for k in range(1, 26)})
    return answers


def _shortcut_scores(prompts: list[str], labels: list[str], hops_of) -> tuple[float, dict[str, float]]:
    parsed = [(parse_prompt(p), label) for p, label in zip(prompts, labels)]
    chance = sum(1 / (len(links) - 1) for (links, _, _), _ in parsed) / len(parsed)
    hits: dict[str, list[bool]] = {}
    for prompt, label in zip(prompts, labels):
        for name, answer in constant_policies(prompt).items():
            hits.setdefault(name, []).append(answer == label)
    for walked in range(1, 26):
        for period in range(1, walked + 1):
            # Scored only where the loop is taken: on prompts of at most `walked` hops it IS the walk.
            rows = [((links, start, hops_of(links, hops)), label) for (links, start, hops), label in parsed
                    if hops_of(links, hops) > walked]
            if len(rows) >= 100:
                hits[f"walk {walked}, then loop with period {period}"] = [
                    loop_answer(links, start, hops, walked, period) == label for (links, start, hops), label in rows]
    return chance, {name: sum(h) / len(h) for name, h in hits.items()}


def test_no_shortcut_policy_beats_chance():
    examples = PointerWalkTask().examples(1000, seed=0, split="test")
    chance, scores = _shortcut_scores([e.prompt for e in examples], [e.label for e in examples],
                                      hops_of=lambda links, hops: hops)
    assert len(scores) > 250
    worst = max(scores, key=scores.get)
    assert scores[worst] <= chance + 0.05, f"{worst}: {scores[worst]:.3f} vs chance {chance:.3f}"


def test_the_shortcut_check_fails_on_the_first_task_design():
    """The same check on the old design (fixed 12-cycle, 32 hops, hop count not in the prompt): the
    period-8 loop that the shipped model had learnt scores 100%, so the check has teeth."""
    rng = random.Random(0)
    prompts, labels = [], []
    for _ in range(1000):
        nodes = rng.sample(string.ascii_lowercase, 12)
        successor = {a: nodes[(i + 1) % 12] for i, a in enumerate(nodes)}
        links = [k + successor[k].upper() for k in nodes]
        rng.shuffle(links)
        start = rng.choice(nodes)
        prompts.append("^" + "".join(links) + "|" + start + MY_COUNTERS[0])  # the counter slot unused
        labels.append(walk_answer(successor, start, 32))
    chance, scores = _shortcut_scores(prompts, labels, hops_of=lambda links, hops: 32)
    assert scores["walk 8, then loop with period 8"] == 1.0
    assert max(scores.values()) > chance + 0.05


# ----------------------------------------------------------------------------- seeds and splits
def test_same_seed_same_examples_and_seeds_splits_differ():
    task = PointerWalkTask(letters=8)
    a = task.examples(30, seed=3)
    assert a == task.examples(30, seed=3)
    assert a == PointerWalkTask(letters=8).examples(30, seed=3)
    assert a[:10] == task.examples(10, seed=3)  # a prefix of a longer draw
    assert [e.prompt for e in a] != [e.prompt for e in task.examples(30, seed=4)]
    assert [e.prompt for e in a] != [e.prompt for e in task.examples(30, seed=3, split="test")]


def test_train_and_test_do_not_overlap():
    task = PointerWalkTask()
    train = {e.prompt for e in task.examples(500, seed=0, split="train")}
    test = {e.prompt for e in task.examples(500, seed=0, split="test")}
    assert len(train) == 500 and len(test) == 500
    assert not train & test


# ----------------------------------------------------------------------------- reward
DEMO = "0hS1sR2rE3eL4lT#T$"  # the docstring example


@pytest.mark.parametrize("completion, reward", [
    (DEMO, 1.0),
    (DEMO[:-1], 1.0),  # `$` stripped as a special token on decode
    ("0hS1sR2rE3eL4lT#T$ ", 0.0),
    ("0hS1sR2rE3eL4lT#R$", 0.0),  # wrong letter
    ("0hS1sR2rE3eL4lTT$", 0.0),  # missing `#`
    ("0hS1sR2rE3eL4lT#t$", 0.0),  # lower case is a different letter
    ("0hS1sR2rE3eL44lT#T$", 0.0),  # right walk and answer, but a doubled counter: not the walk
    ("0hS1sR2rE3eL4lT5tH#T$", 0.0),  # walked past the stated hop count
    ("#T$", 0.0),  # the answer without the walk
    ("0hS1sR2rE3eL4lT#T$$", 0.0),
    ("0hS1sR2rE3eL4lT#T$0hS", 0.0),
    ("", 0.0),
])
def test_reward_is_the_exact_walk(completion, reward):
    task = PointerWalkTask(letters=6)
    assert task.reward([completion], label=["T"], demonstration=[DEMO]) == [reward]


def test_reward_lines_up_with_its_columns():
    task = PointerWalkTask(letters=4)
    examples = task.examples(6, seed=1)
    demos = [e.demonstration for e in examples]
    assert task.reward(demos, **reward_columns(examples)) == [1.0] * 6
    grouped = reward_columns(examples, repeat=2)
    assert grouped["demonstration"] == [d for d in demos for _ in range(2)]
    assert task.reward([d for d in demos for _ in range(2)], **grouped) == [1.0] * 12
    shifted = demos[1:] + demos[:1]
    assert task.reward(demos, demonstration=shifted) == [float(a == b) for a, b in zip(demos, shifted)]
    assert extract_answer("xx#Q$") == "Q" and extract_answer("xx") is None


@pytest.mark.parametrize("completion, error_hop", [
    ("0hS1sR2rE#E$", None),  # the demonstration
    ("0hS1sR2rE#E", None),  # `$` stripped on decode
    ("0hS1sT2tH#H$", 2),  # wrong value at hop 2
    ("0hS1sR2rE3eL#L$", 4),  # walked past the stated hop count
    ("0hS1sR#R$", 3),  # stopped early
    ("0hS1sR2rE#L$", 4),  # right walk, wrong answer
    ("0hS1sR2rX#E$", 3),
    ("9hS1sR2rE#E$", 1),  # a wrong counter is a deviation too, though the answer is right
    ("", 1),
])
def test_walk_metrics_hand_cases(completion, error_hop):
    demo = "0hS1sR2rE#E$"
    task = PointerWalkTask(letters=6)
    metrics = task.walk_metrics([completion], [demo])
    assert metrics["walk_exact"] == float(error_hop is None)
    assert metrics.get("first_error_hop") == error_hop
    assert metrics["answer_accuracy"] == float(completion.rstrip("$").endswith("#E"))


def test_walk_metrics_average_over_wrong_responses_only():
    demo = "0hS1sR2rE#E$"
    metrics = PointerWalkTask(letters=6).walk_metrics([demo, "0hS1sT2tH#H$", "0hS1sR2rE3eL#L$", demo],
                                                      [demo] * 4)
    assert metrics == {"walk_exact": 0.5, "first_error_hop": 3.0, "answer_accuracy": 0.5}  # hops 2 and 4


def test_needed_source_by_hand():
    # ^sRtHrEhSlTeL|h4 with response 0hS1sR2rE3eL4lT#T$: the value of hop 1 (S, response index 2)
    # copies the character after `h` in the prompt (index 8: "^sRtHrEhS" -> S at 8); the key of hop 2
    # (s, index 4) is the previous value (index 2); the end marker reads the prompt's last counter.
    prompt = "^sRtHrEhSlTeL|h4"
    assert needed_source(prompt, DEMO, 2) == ("value", "prompt", 8) and prompt[8] == "S"
    assert needed_source(prompt, DEMO, 5) == ("value", "prompt", prompt.index("s") + 1)
    assert needed_source(prompt, DEMO, 1) == ("key", "prompt", len(prompt) - 2)  # the start letter
    assert needed_source(prompt, DEMO, 4) == ("key", "response", 2)
    assert needed_source(prompt, DEMO, 0) == ("counter", None, None)
    assert needed_source(prompt, DEMO, 3) == ("counter", "response", 0)
    assert needed_source(prompt, DEMO, 15) == ("end marker", "prompt", len(prompt) - 1)
    assert needed_source(prompt, DEMO, 16) == ("answer", "response", 14)


@pytest.mark.parametrize("letters, min_letters", [(2, None), (0, None), (27, None), (10, 2), (10, 11)])
def test_invalid_letter_ranges(letters, min_letters):
    with pytest.raises(ValueError):
        PointerWalkTask(letters=letters, min_letters=min_letters)


def test_longest_valid_settings():
    task = PointerWalkTask(letters=26, min_letters=26)
    (example,) = task.examples(1, seed=0)
    links, _, hops = parse_prompt(example.prompt)
    assert sorted(links) == list(string.ascii_lowercase) and hops <= 25


# ----------------------------------------------------------------------------- tokenizer
def test_char_tokenizer_specials():
    tok = build_char_tokenizer()
    assert tok.pad_token == "<pad>" and tok.pad_token_id == 0
    assert tok.convert_ids_to_tokens(0) == "<pad>"
    assert tok.eos_token == "$"
    assert tok.eos_token_id == tok("$").input_ids[0]
    assert tok.padding_side == "left"


def _all_text() -> list[str]:
    texts = []
    for letters in (3, 12, 26):
        for e in PointerWalkTask(letters=letters).examples(20, seed=5):
            texts += [e.prompt, e.demonstration, e.prompt + e.demonstration]
    return texts


def test_char_tokenizer_round_trips_demonstrations():
    tok = build_char_tokenizer()
    unk = tok.unk_token_id
    alphabet = string.ascii_letters + MY_COUNTERS + "^|#$ "
    ids = tok(alphabet).input_ids
    assert len(ids) == len(alphabet) and len(set(ids)) == len(set(alphabet))  # one id per character
    assert unk not in ids and 0 not in ids
    for text in _all_text():
        ids = tok(text).input_ids
        assert len(ids) == len(text)  # one token per character, nothing added
        assert unk not in ids
        assert tok.decode(ids) == text
    # Left padding in a batch puts pad (id 0) on the left.
    batch = tok(["^aB|a", "^aBbA|b"], padding=True).input_ids
    assert batch[0][:2] == [0, 0] and 0 not in batch[1]


def test_char_tokenizer_save_and_autoload(tmp_path):
    tok = build_char_tokenizer()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.pad_token_id == 0 and loaded.eos_token == "$"
    assert loaded.eos_token_id == tok.eos_token_id
    assert len(loaded) == len(tok)
    for text in _all_text():
        assert loaded(text).input_ids == tok(text).input_ids
        assert loaded.decode(loaded(text).input_ids) == text
