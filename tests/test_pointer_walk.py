"""The built-in pointer-walk task and the character tokenizer, checked by parsing the text ourselves."""

from __future__ import annotations

import re
import string

import pytest
from transformers import AutoTokenizer

from sparserl.tasks.pointer_walk import PointerWalkTask, extract_answer
from sparserl.tasks.tokenizer import build_char_tokenizer

# Step counters written out by hand: the ten digits, then ASCII punctuation in order without
# the four format characters ^ | # $.
MY_COUNTERS = "0123456789" + "!\"%&'()*+,-./:;<=>?@[\\]_`{}~"
assert len(MY_COUNTERS) == 38

PROMPT_RE = re.compile(r"^\^((?:[a-z][A-Z])+)\|([a-z])$")


def parse_prompt(prompt: str) -> tuple[dict[str, str], str]:
    """links {key: next key (lower case)} and the start letter, from the prompt text alone."""
    match = PROMPT_RE.match(prompt)
    assert match, f"prompt does not have the documented shape: {prompt!r}"
    pairs = re.findall(r"([a-z])([A-Z])", match.group(1))
    keys = [k for k, _ in pairs]
    assert len(set(keys)) == len(keys), f"a key appears twice: {prompt!r}"
    return {k: v.lower() for k, v in pairs}, match.group(2)


def my_walk(links: dict[str, str], start: str, hops: int) -> tuple[str, str]:
    """(demonstration, label) by walking the links `hops` times."""
    out, node = [], start
    for k in range(hops):
        nxt = links[node]
        out.append(MY_COUNTERS[k] + node + nxt.upper())
        node = nxt
    return "".join(out) + "#" + node.upper() + "$", node.upper()


@pytest.mark.parametrize("letters, hops", [(2, 1), (3, 4), (6, 8), (12, 32), (26, 38), (26, 3)])
def test_prompt_demonstration_and_label(letters, hops):
    task = PointerWalkTask(letters=letters, hops=hops)
    for example in task.examples(40, seed=7):
        links, start = parse_prompt(example.prompt)
        assert len(links) == letters
        # Values are exactly the keys: a permutation of the letters.
        assert sorted(links.values()) == sorted(links)
        assert start in links
        # ONE cycle through all letters: from any key, `letters` steps come back and visit all.
        node, seen = start, []
        for _ in range(letters):
            seen.append(node)
            node = links[node]
        assert node == start and len(set(seen)) == letters
        demo, label = my_walk(links, start, hops)
        assert example.demonstration == demo
        assert example.label == label
        # Sizes the task advertises: "^" + 2 per link + "|" + start; 3 per hop + "#X$".
        assert len(example.prompt) == 2 * letters + 3 == task.prompt_chars
        assert len(example.demonstration) == 3 * hops + 3 == task.max_response_chars
        assert task.default_max_new_tokens >= task.max_response_chars


def test_docstring_example_walks_correctly():
    # ^sRtHrEhSlTeL|h: s->r, t->h, r->e, h->s, l->t, e->l; from h, 8 hops:
    # h->s->r->e->l->t->h->s->r, so the answer is R.
    links, start = parse_prompt("^sRtHrEhSlTeL|h")
    demo, label = my_walk(links, start, 8)
    assert demo == "0hS1sR2rE3eL4lT5tH6hS7sR#R$"
    assert label == "R"
    assert PointerWalkTask(letters=6, hops=8).reward([demo], label=[label]) == [1.0]


def test_start_letters_and_link_orders_vary():
    examples = PointerWalkTask(letters=5, hops=4).examples(200, seed=0)
    starts = {parse_prompt(e.prompt)[1] for e in examples}
    assert len(starts) > 10  # starts spread over the alphabet
    labels = {e.label for e in examples}
    assert len(labels) > 10


# ----------------------------------------------------------------------------- seeds and splits
def test_same_seed_same_examples_and_seeds_splits_differ():
    task = PointerWalkTask(letters=8, hops=10)
    a = task.examples(30, seed=3)
    assert a == task.examples(30, seed=3)
    assert a == PointerWalkTask(letters=8, hops=10).examples(30, seed=3)
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
@pytest.mark.parametrize("completion, reward", [
    ("0hS1sR2rE3eL4lT5tH6hS7sR#R$", 1.0),  # the demonstration
    ("0hS1sR2rE3eL4lT5tH6hS7sR#R", 1.0),  # `$` stripped as a special token on decode
    ("#R", 1.0),
    ("#R$ ", 1.0),
    ("0hS1sR#E#R$", 1.0),  # the letter after the LAST `#` counts
    ("0hS1sR2rE3eL4lT5tH6hS7sR#T$", 0.0),  # wrong letter
    ("0hS1sR2rE3eL4lT5tH6hS7sRR$", 0.0),  # missing `#`
    ("0hS1sR2rE3eL4lT5tH6hS7sR#r$", 0.0),  # lower case is a different letter
    ("#R$$", 0.0),  # answer followed by more than `$`
    ("#R$0hS", 0.0),  # text after the answer
    ("#R#", 0.0),
    ("", 0.0),
    ("#", 0.0),
])
def test_reward_hand_cases(completion, reward):
    task = PointerWalkTask(letters=6, hops=8)
    assert task.reward([completion], label=["R"]) == [reward]


def test_reward_lines_up_with_labels():
    task = PointerWalkTask(letters=4, hops=3)
    examples = task.examples(6, seed=1)
    demos = [e.demonstration for e in examples]
    labels = [e.label for e in examples]
    assert task.reward(demos, label=labels) == [1.0] * 6
    shifted = labels[1:] + labels[:1]
    expected = [float(a == b) for a, b in zip(labels, shifted)]
    assert task.reward(demos, label=shifted) == expected
    assert extract_answer("xx#Q$") == "Q" and extract_answer("xx") is None


@pytest.mark.parametrize("letters, hops", [(1, 4), (0, 4), (27, 4), (3, 0), (3, 39), (3, -1)])
def test_invalid_letters_or_hops(letters, hops):
    with pytest.raises(ValueError):
        PointerWalkTask(letters=letters, hops=hops)


def test_longest_valid_settings():
    task = PointerWalkTask(letters=26, hops=38)
    (example,) = task.examples(1, seed=0)
    links, _ = parse_prompt(example.prompt)
    assert sorted(links) == list(string.ascii_lowercase)


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
    for letters, hops in ((3, 4), (12, 32), (26, 38)):
        for e in PointerWalkTask(letters=letters, hops=hops).examples(20, seed=5):
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
