"""`--chat-template true`: every prompt reaches the model as transformers' own chat-template
tokenization of one user turn would give it, with no BOS doubled, and the task's scores unchanged."""

from __future__ import annotations

import json

import pytest
from tokenizers.processors import TemplateProcessing

from sparserl.config.schema import load_config
from sparserl.errors import ConfigError
from sparserl.tasks.chat import ChatPrompts
from sparserl.tasks.math_jsonl import MathJsonlTask
from sparserl.tasks.registry import task_from_config
from sparserl.tasks.tokenizer import BOS_TOKEN, build_char_tokenizer

TEMPLATE = "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}|{% endfor %}" \
           "{% if add_generation_prompt %}<assistant>{% endif %}"


@pytest.fixture
def problems(tmp_path):
    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {a} + {a}?", "label": str(2 * a)}) + "\n"
                            for a in range(1, 21)))
    return path


def chat_tokenizer(adds_bos: bool):
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    if adds_bos:  # as Gemma's and Llama-3's tokenizers do on every call
        bos = tokenizer.convert_tokens_to_ids(BOS_TOKEN)
        tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single=f"{BOS_TOKEN} $A",
                                                                        special_tokens=[(BOS_TOKEN, bos)])
    return tokenizer


@pytest.mark.parametrize("adds_bos", [False, True])
def test_prompt_ids_are_the_chat_templates_own(problems, adds_bos):
    tokenizer = chat_tokenizer(adds_bos)
    assert (tokenizer("x").input_ids[0] == tokenizer.bos_token_id) == adds_bos
    plain = MathJsonlTask(problems, template="Q: {prompt}")
    chat = ChatPrompts(plain, tokenizer)
    for bare, wrapped in zip(plain.examples(6, seed=3, split="train"), chat.examples(6, seed=3, split="train")):
        expected = tokenizer.apply_chat_template([{"role": "user", "content": bare.prompt}], tokenize=True,
                                                 add_generation_prompt=True, return_dict=False)
        assert tokenizer(wrapped.prompt).input_ids == expected
        assert expected.count(tokenizer.bos_token_id) == 1
        assert wrapped.label == bare.label


def test_rewards_and_name_are_the_tasks(problems):
    chat = ChatPrompts(MathJsonlTask(problems), chat_tokenizer(False))
    assert chat.name == "math_jsonl"
    assert chat.reward(["so \\boxed{4}", "\\boxed{5}"], label=["4", "4"], extra=[{}, {}]) == [1.0, 0.0]


def test_the_config_flag_wraps_the_task_and_a_tokenizer_without_a_template_is_refused(problems):
    config = load_config(None, {"task": "math_jsonl", "data_path": str(problems), "chat_template": True})
    assert isinstance(task_from_config(config.task, chat_tokenizer(False)), ChatPrompts)
    with pytest.raises(ConfigError, match="chat template"):
        task_from_config(config.task, build_char_tokenizer())
    config.task.chat_template = False
    assert isinstance(task_from_config(config.task, build_char_tokenizer()), MathJsonlTask)
