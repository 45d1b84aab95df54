"""Heavy-channel calibration of any model: the statistic, the file, and `patch` finding it by name."""

from __future__ import annotations

import json
import sys

import pytest
import torch

import hshare
from hshare import channels
from hshare.calibrate import calibrate, default_calibration_path
from hshare.channels import calibration_file_name, find_calibration, model_name, resolve_calibration

from conftest import tiny_llama
from eval_support import byte_tokenizer


def test_statistic_is_the_mean_over_all_blocks_of_abs_q_times_k():
    model = tiny_llama(kv_heads=2, layers=2)
    tokenizer = byte_tokenizer()
    model.resize_token_embeddings(259)
    text = "".join(chr(97 + (i * 7) % 26) for i in range(300))
    result = calibrate(model, tokenizer, text, blocks=3, block_tokens=64, name="tiny")
    assert result.tokens == 192 and result.statistic.shape == (2, 4, 16)

    # brute force: q and k post-RoPE of layer 1 for each block, through an eager forward hook
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    total = torch.zeros(4, 16, dtype=torch.float64)

    def grab(module, query, key, value, attention_mask, **kwargs):
        if module.layer_idx == 1:
            k = key.repeat_interleave(2, dim=1)
            total.add_((query.abs() * k.abs()).sum(2)[0].double())
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    from transformers import AttentionInterface
    AttentionInterface.register("grab_test", grab)
    model.set_attn_implementation("grab_test")
    with torch.no_grad():
        for b in range(3):
            model(ids[b * 64:(b + 1) * 64][None], use_cache=False)
    assert torch.allclose(result.statistic[1].double(), total / 192, rtol=1e-5, atol=1e-7)


def test_patch_finds_a_calibration_by_model_name(tmp_path, monkeypatch):
    monkeypatch.setenv("HSHARE_CACHE", str(tmp_path))
    model = tiny_llama(kv_heads=2, layers=2)
    model.config._name_or_path = "/models/My-Tiny.Llama"
    assert model_name(model.config) == "My-Tiny.Llama"
    assert find_calibration(model.config) is None
    tokenizer = byte_tokenizer()
    model.resize_token_embeddings(259)
    result = calibrate(model, tokenizer, "abcdefgh" * 40, blocks=2, block_tokens=64, name=model_name(model.config))
    folder = tmp_path / "channels"
    folder.mkdir()
    other = folder / "another-model.json"  # same shape, another name: used only if nothing is named after it
    result.save(other)
    assert find_calibration(model.config) == other
    mine = folder / calibration_file_name("My-Tiny.Llama")
    assert mine.name == "my-tiny.llama.json"
    result.save(mine)
    assert find_calibration(model.config) == mine
    assert json.loads(mine.read_text())["model"] == "My-Tiny.Llama"
    hshare.patch(model, "ds", heavy_channels="auto")
    patched = hshare.api.patch_state(model).policy_state
    assert patched is not None and torch.equal(patched.statistic, resolve_calibration("auto", model.config).statistic)
    hshare.unpatch(model)


def test_default_path_is_writable(tmp_path, monkeypatch):
    monkeypatch.setenv("HSHARE_CACHE", str(tmp_path))
    path = default_calibration_path("Some/Model")
    assert path.name == "some-model.json" and path.parent.is_dir()


@pytest.mark.parametrize("chunk_elements", [1, 300, 1 << 24])  # a token a chunk, ragged chunks, one chunk
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (6, 2), (3, 1)])
def test_channel_statistic_brute_force(monkeypatch, chunk_elements, q_heads, kv_heads):
    monkeypatch.setattr(sys.modules["hshare.kernels.channel_statistic"], "STATISTIC_CHUNK_ELEMENTS", chunk_elements)
    batch, tokens, dim = 3, 23, 8
    query = torch.randn(batch, q_heads, tokens, dim, dtype=torch.bfloat16)
    keys = torch.randn(batch, kv_heads, tokens, dim, dtype=torch.bfloat16)
    valid = torch.rand(batch, tokens) > 0.3
    valid[0] = False  # a row with no valid token (all padding) sums to zero
    got = channels.channel_statistic(query, keys, valid)
    expected = torch.zeros(batch, q_heads, dim, dtype=torch.float64)
    group = q_heads // kv_heads
    for b in range(batch):
        for h in range(q_heads):
            for t in range(tokens):
                if valid[b, t]:
                    expected[b, h] += (query[b, h, t].double() * keys[b, h // group, t].double()).abs()
    assert got.dtype == torch.float32 and got.shape == (batch, q_heads, dim)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
