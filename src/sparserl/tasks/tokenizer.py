"""A character-level tokenizer saved in the standard Hugging Face format.

The built-in task speaks single characters, so every printable ASCII character is one token.
The tokenizer is a plain `tokenizers` WordLevel model behind `PreTrainedTokenizerFast`, which
means a saved model directory loads with `AutoTokenizer.from_pretrained` and nothing of ours.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"
# The task's end-of-response marker doubles as EOS, so generation stops on it with no extra token.
EOS_TOKEN = "$"
BOS_TOKEN = "^"

CHARACTERS = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"]


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Return a fresh tokenizer: `<pad>`=0, `<unk>`=1, then the printable ASCII characters."""
    vocab = {PAD_TOKEN: 0, UNK_TOKEN: 1}
    for char in CHARACTERS:
        vocab[char] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        eos_token=EOS_TOKEN,
        bos_token=BOS_TOKEN,
        padding_side="left",
    )
