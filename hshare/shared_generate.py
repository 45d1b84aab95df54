"""``generate`` with a shared prompt prefix held once (Hydragen inside transformers' generate).

1. Detect the prefix levels on the rows' unpadded prompts, after ``num_return_sequences``
   duplication (`hshare.prefix.detect_shared_prefix`).
2. Prefill each level once (batch = its groups) into the cache's `PrefixStore`.
3. Call transformers' ``generate`` on the batch laid out ``[level 1 | level 2 | gap | own]``: the
   cache already holds the level columns, so generate prefills only the own parts.
4. Return the sequences with the caller's original prompt in front of the new tokens.

Falls back to the ordinary path (returns None) where sharing does not apply: the generate features
that keep the prefix per row (`hshare.generate_features`: beams, assisted decoding, ``inputs_embeds``,
a streamer, ``output_hidden_states``), a sliding window shorter than the sequence, as laid out or as the
caller padded it (no key may leave a row's window), no prefix worth sharing under the config's rule.

Sparse configs share under the same rule as dense ones: the prefix stays exact and the HShare
budget applies to each row's own tokens (faster than a sparse prefix in every measured shape:
``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import torch

from hshare import compat
from hshare.cache import HShareCache
from hshare.generate_features import generation_setting, unshared_reason
from hshare.patches import sliding_window
from hshare.prefix import build_layout, detect_shared_prefix, unpadded_prompts
from hshare.prefix_store import PrefixLevel, PrefixStore


def _prompt_mask(model, input_ids: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """The caller's attention mask, or the one transformers' generate would infer from padding."""
    mask = kwargs.get("attention_mask")
    if mask is not None:
        return mask
    pad, eos = generation_setting(model, kwargs, "pad_token_id"), generation_setting(model, kwargs, "eos_token_id")
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    if pad is not None and pad not in eos and bool((input_ids == pad).any()):
        return (input_ids != pad).long()
    return torch.ones_like(input_ids)


def generate_with_shared_prefix(model, generate, cache: HShareCache, args: tuple, kwargs: dict):
    """Run `generate` with the rows' shared prefix held once in `cache`; None = not applicable."""
    config = cache.config
    input_ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    if (not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.is_floating_point()
            or len(args) > 1 or unshared_reason(model, kwargs) is not None):
        return None
    repeats = generation_setting(model, kwargs, "num_return_sequences") or 1
    prompt_mask = _prompt_mask(model, input_ids, kwargs)
    ids = input_ids.repeat_interleave(repeats, dim=0)
    prompts = unpadded_prompts(ids, prompt_mask.repeat_interleave(repeats, dim=0))
    if min(len(p) for p in prompts) < 2:
        return None
    forced = config.prefix.mode == "on"
    graphs = cache.static_decode is not None and not cache.static_decode.reason  # steps will replay as graphs
    shared = detect_shared_prefix(prompts, 1 if forced else config.prefix.min_tokens,
                                  1 if forced else config.prefix.min_batch, config.prefix.levels,
                                  0 if forced else config.prefix.min_saved(input_ids.device, graphs))
    if shared.empty:
        return None
    pad = generation_setting(model, kwargs, "pad_token_id")
    layout = build_layout(prompts, shared, 0 if pad is None else int(pad))
    extra = layout.input_ids.shape[1] - ids.shape[1]  # the layout may be longer than the padded batch
    window = sliding_window(model.config)  # a config's window that no layer applies does not count
    if window is not None:
        # a window counts columns: neither the layout's nor the caller's (whose padding and gaps may stretch a
        # row) may reach past it, else keys leave a row's window where they would not in the other
        new_tokens = generation_setting(model, kwargs, "max_new_tokens")
        total = max(layout.input_ids.shape[1], ids.shape[1]) + (
            new_tokens if new_tokens is not None else (generation_setting(model, kwargs, "max_length") or 0))
        if total > window:
            return None

    _prefill_levels(model, cache, layout)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("inputs", "input_ids")}
    kwargs.update(attention_mask=layout.attention_mask, num_return_sequences=1)
    compat.with_cache(kwargs, cache)
    for length, new in (("max_length", "max_new_tokens"), ("min_length", "min_new_tokens")):
        if generation_setting(model, kwargs, new) is None and (generation_setting(model, kwargs, length) or 0) > 0:
            kwargs[length] = generation_setting(model, kwargs, length) + extra
    output = generate(layout.input_ids, **kwargs)
    width = layout.input_ids.shape[1]
    if isinstance(output, torch.Tensor):
        return torch.cat((ids, output[:, width:]), dim=1)
    output.sequences = torch.cat((ids, output.sequences[:, width:]), dim=1)
    return output


@torch.no_grad()
def _prefill_levels(model, cache: HShareCache, layout) -> None:
    """Prefill every prefix level once (batch = its groups) into a new `PrefixStore` of `cache`."""
    levels = [
        PrefixLevel(row_group, valid, tokens.shape[0], tokens.shape[1], cache.num_layers)
        for tokens, valid, row_group in zip(layout.level_tokens, layout.level_valid, layout.row_groups)
    ]
    store = PrefixStore(levels)
    cache.set_prefix(store)
    for index, (tokens, valid) in enumerate(zip(layout.level_tokens, layout.level_valid)):
        start = store.start(index)
        groups, width = tokens.shape
        positions = (start + torch.arange(width, device=tokens.device)).expand(groups, width)
        mask = None
        if valid is not None or (start and groups > 1):
            own = torch.ones_like(tokens) if valid is None else valid.long()
            mask = torch.cat((torch.ones((groups, start), dtype=torch.long, device=tokens.device), own), dim=1)
        cache.begin_prefix_fill(index)
        model(input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
              **{compat.CACHE_KWARG: cache})
    cache.end_prefix_fill()
