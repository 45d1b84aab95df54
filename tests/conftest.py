"""Tiny random Llama / Mistral models built from configs (nothing is downloaded)."""

from __future__ import annotations

import os
import shutil

# Triton kernels run on the CPU through the interpreter; it must be chosen before triton is
# imported (transformers may import it). A machine with a GPU driver runs them natively.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

if os.environ.get("TRITON_INTERPRET") == "1":  # a custom `tl.reduce` combine by halves, not element by element
    import interpreter_reduce  # noqa: E402

    interpreter_reduce.install()

VOCAB = 160


def tiny_llama(kv_heads: int = 2, layers: int = 4, heads: int = 4, dtype=torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=1024,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config).to(dtype).eval()


def tiny_mistral(sliding_window: int | None = 24, dtype=torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    config = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                           sliding_window=sliding_window, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return MistralForCausalLM(config).to(dtype).eval()


def randomize_zeroed_weights(model):
    """Random projection biases (the initializer zeroes them) and a nonzero pad-token embedding: once
    generated, a zero embedding gives all-zero (Qwen3, Phi-3) queries, every label score tied, and a
    top-k that breaks ties by column (a padded row would differ from itself alone)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                torch.nn.init.normal_(module.bias, std=0.2)
        model.get_input_embeddings().weight[0].normal_(std=0.02)
    return model


def letter_tokenizer(padding_side: str = "right"):
    """An offline tokenizer of single letters and spaces (ids 3-29; pad / bos / eos 0-2) for pipelines."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{chr(97 + i): 3 + i for i in range(26)}, " ": 29}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   padding_side=padding_side)


WIDE = dict(sink=2, local=4, heavy=400)  # N_c above every context of these tests: a sparse config attends to all


def cache_kwarg(cache) -> dict:
    """`cache` as a keyword argument under the installed transformers' name (`hshare.compat.CACHE_KWARG`: ``cache``
    from 5.24, ``past_key_values`` before), so that no call passes a deprecated name; hshare takes either spelling
    (both tested in test_transformers_contract)."""
    from hshare import compat

    return {compat.CACHE_KWARG: cache}


def generate_with_logits(model, ids, mask, new_tokens=10, **kwargs):
    """Greedy `generate` of exactly `new_tokens` tokens: ``(sequences, logits [B, new_tokens, vocab])``."""
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True, **kwargs)
    return out.sequences, torch.stack(out.logits, 1)


def assert_generates_as_dense(model, ids, mask, preset: str, new_tokens: int = 10, **options):
    """Patched with `preset` and `options` (a budget covering the context, e.g. `WIDE`), `model` generates the
    unpatched model's tokens and, up to summation order, its logits."""
    import hshare

    ref_tokens, ref_logits = generate_with_logits(model, ids, mask, new_tokens)
    with hshare.patched(model, preset, **options):
        tokens, logits = generate_with_logits(model, ids, mask, new_tokens)
    # exact attention, summed in another order where transformers repeats K/V per query head (before 5.23)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)


def left_padded(lengths: list[int], generator: torch.Generator | None = None):
    """Random prompts of the given lengths, left-padded: (input_ids, attention_mask)."""
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = torch.randint(3, VOCAB, (length,), generator=generator)
        mask[row, width - length:] = 1
    return ids, mask


def left_pad(prompts):
    """Left-pad 1-D token tensors into one batch: (input_ids, attention_mask)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = prompt
        mask[row, width - len(prompt):] = 1
    return ids, mask


def assert_rows_equal_alone(model, ids, mask, lengths, new_tokens: int) -> None:
    """Greedy on the left-padded batch gives each row the tokens it gets alone (unpadded)."""
    batch = greedy(model, ids, mask, new_tokens=new_tokens)
    width = ids.shape[1]
    for row, length in enumerate(lengths):
        alone = greedy(model, ids[row:row + 1, width - length:], mask[row:row + 1, width - length:],
                       new_tokens=new_tokens)
        assert torch.equal(alone[0, length:], batch[row, width:]), f"row {row} differs"


def greedy(model, ids, mask, new_tokens: int = 12, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, pad_token_id=0, **kwargs)


@pytest.fixture(params=["gqa", "mha"])
def llama(request):
    return tiny_llama(kv_heads=2 if request.param == "gqa" else 4)


# ``HSHARE_RECORD_KERNELS=<file>``: record the Triton kernel specializations the interpreter runs, for
# `hopper_compile.py` (here) to compile for sm_90 after the run (``make test`` does both).
_KERNEL_RECORDS: dict | None = None
if os.environ.get("HSHARE_RECORD_KERNELS") and os.environ.get("TRITON_INTERPRET") == "1":
    from hopper_compile import install_recorder  # noqa: E402

    _KERNEL_RECORDS = {}
    install_recorder(_KERNEL_RECORDS, "hshare.")


def pytest_sessionfinish(session, exitstatus):
    if _KERNEL_RECORDS is not None:
        import json

        with open(os.environ["HSHARE_RECORD_KERNELS"], "w") as handle:
            json.dump(_KERNEL_RECORDS, handle, default=repr)
