"""Running lm-eval on a patched model: one config, given tasks, from Python.

`evaluate` is what ``hshare sweep`` runs per config, and what a user calls with a model already in
memory::

    from hshare.eval.harness import evaluate
    result = evaluate(model, tokenizer, "ds@512", ["gsm8k"], data_dir="data", limit=50)
    result.scores["gsm8k"], result.work

Task configs come from `hshare.eval.tasks.prepare_tasks` (local files when a data directory is
given, the hub otherwise).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hshare.config import HShareConfig


@dataclass
class EvalResult:
    """One config's evaluation.

    Attributes:
        config: the `HShareConfig` fields that ran (``dense_fallback_mib`` included).
        scores: task -> metric name (lm-eval's ``metric,filter``) -> value; stderr entries dropped.
        work: summed work counters of the generations (`WorkTotals.as_dict`).
        seconds: wall time of the evaluation.
        limit: lm-eval's ``limit`` (documents per task), None = all.
        samples: per-document records when asked for (lm-eval's ``samples``), else None.
    """

    config: dict[str, Any]
    scores: dict[str, dict[str, float]]
    work: dict[str, int]
    seconds: float
    limit: int | float | None
    samples: dict[str, list] | None = field(default=None, repr=False)

    def as_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if self.samples is None:
            data.pop("samples")
        return data


def task_scores(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """lm-eval's ``results["results"]`` -> task -> metric -> value (numbers only: no stderr, no
    ``sample_len``)."""
    scores = {}
    for task, metrics in results.get("results", {}).items():
        scores[task] = {name: float(value) for name, value in metrics.items()
                        if "_stderr" not in name and name != "sample_len"
                        and isinstance(value, (int, float)) and not isinstance(value, bool)}
    return scores


def evaluate(model, tokenizer, config: HShareConfig | str, tasks: list[str], data_dir: str | os.PathLike | None = None,
             limit: int | float | None = None, batch_size: int = 8, num_fewshot: int | None = None,
             gen_kwargs: dict[str, Any] | None = None, dense_fallback: bool = False, log_samples: bool = False,
             overrides: dict[str, Any] | None = None, task_dir: str | os.PathLike | None = None) -> EvalResult:
    """Evaluate `model` patched with `config` on lm-eval `tasks`; the model is unpatched afterwards.

    Args:
        model, tokenizer: a loaded transformers causal LM (Llama / Mistral) and its tokenizer.
        config: an `HShareConfig`, preset name or YAML path.
        tasks: lm-eval task names (``gsm8k``, ``coqa``, ``longbench_multi_news``, ``longbench``...).
        data_dir: local task data (see `hshare.eval.tasks`); None = `HSHARE_DATA_DIR` or the hub.
        limit: documents per task (None = all).
        batch_size: generation batch size.
        dense_fallback: keep the config's dense fallback of small steps (off: measure the algorithm).
        task_dir: where generated task YAMLs go (default: a temporary directory).
    """
    import lm_eval
    from lm_eval.tasks import TaskManager

    from hshare.eval.lm_eval_model import HShareLM
    from hshare.eval.tasks import prepare_tasks, resolve_data_dir

    with tempfile.TemporaryDirectory(prefix="hshare-tasks-") as scratch:
        setup = prepare_tasks(list(tasks), resolve_data_dir(data_dir), Path(task_dir or scratch))
        if setup.offline:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        task_manager = TaskManager(include_path=setup.include_path)
        lm = HShareLM(pretrained=model, tokenizer=tokenizer, hshare=config, dense_fallback=dense_fallback,
                      batch_size=batch_size, **{f"hshare_{k}": v for k, v in (overrides or {}).items()})
        start = time.perf_counter()
        try:
            results = lm_eval.simple_evaluate(model=lm, tasks=setup.tasks, limit=limit, num_fewshot=num_fewshot,
                                              gen_kwargs=gen_kwargs, task_manager=task_manager,
                                              log_samples=log_samples, bootstrap_iters=0)
        finally:
            lm.unpatch()
        seconds = time.perf_counter() - start
    return EvalResult(
        config={k: v for k, v in dataclasses.asdict(lm.hshare_config).items()},
        scores=task_scores(results),
        work=lm.work.as_dict(),
        seconds=seconds,
        limit=limit,
        samples=results.get("samples") if log_samples else None,
    )
