"""Runs hshare presets on a saved model and saves what they did (`tests/test_tensor_parallel.py`).

Under ``torchrun --nproc-per-node N tests/tp_worker.py SPEC OUT`` the model is loaded with
``tp_plan="auto"`` (transformers' tensor parallelism: NCCL on GPUs, gloo on CPU) and each rank writes
``OUT/rank<r>.pt``; the test runs `run_cases` in its own process for the one-process reference.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import traceback

import torch


def run_case(model, case: dict, batch: dict, new_tokens: int) -> dict:
    """One preset on one batch: tokens, logits, the plan, the counters and the cache's head counts."""
    import hshare
    from hshare import compat

    with hshare.patched(model, case["preset"], **case["overrides"]):
        cache = hshare.new_cache(model)
        ids, mask = batch["ids"].to(model.device), batch["mask"].to(model.device)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                             **{compat.CACHE_KWARG: cache})
    plan = cache.planner.sharing
    return {
        "tokens": out.sequences.cpu(),
        "logits": torch.stack(out.logits, 1).float().cpu(),
        "layer_source": None if plan is None else plan.layer_source.cpu(),
        "head_source": None if plan is None else plan.head_source.cpu(),
        "stats": dataclasses.asdict(cache.stats),
        "heads": (cache.q_heads, cache.kv_heads, cache.sel_heads),
        "prefix_levels": None if cache.prefix is None else [level.width for level in cache.prefix.levels],
        "static_decode": getattr(cache.static_decode, "reason", None),
    }


def run_cases(model, spec: dict) -> dict:
    """`run_case` for every case of `spec`; a failing case records its error instead."""
    results = {}
    for case in spec["cases"]:
        try:
            results[case["name"]] = run_case(model, case, spec["batches"][case["batch"]], spec["new_tokens"])
        except Exception as error:  # noqa: BLE001 - reported by the test, with the traceback
            results[case["name"]] = {"error": f"{type(error).__name__}: {error}\n{traceback.format_exc()}"}
    return results


def main(spec_path: str, out_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    spec = torch.load(spec_path)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], tp_plan="auto",
                                                 dtype=getattr(torch, spec["dtype"])).eval()
    results = run_cases(model, spec)
    rank = torch.distributed.get_rank()
    torch.save({"world": torch.distributed.get_world_size(), "cases": results}, os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
