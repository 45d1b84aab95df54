"""An offline tokenizer for the lm-eval tests: bytes as tokens (no download, no training data).

Ids 0-2 are pad / bos / eos, byte b is id b + 3: 259 ids, so tiny models get ``vocab_size=259``.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

BYTE_VOCAB = 259


def byte_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    byte_chars = sorted(alphabet, key=lambda c: ord(c))
    vocab.update({c: i + 3 for i, c in enumerate(byte_chars)})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tokenizer.padding_side = "left"
    return tokenizer
