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

from hshare.config import HShareConfig, resolve_config


@dataclass
class EvalResult:
    """One config's evaluation.

    Attributes:
        config: the `HShareConfig` fields that ran (``dense_fallback_mib`` included).
        scores: task -> metric name (lm-eval's ``metric,filter``) -> value; stderr entries dropped.
        work: summed work counters of the generations (`WorkTotals.as_dict`).
        seconds: wall time of the evaluation.
        limit: lm-eval's ``limit`` (documents per task), None = all.
        plan: what the generations' sharing plans share, the mean over the batches of `SharingPlan.summary`
            (layer copies, head copies, the share of (layer, selection head) pairs scoring the whole context);
            empty where no batch made a plan (dense).
        samples: per-document records when asked for (lm-eval's ``samples``), else None.
    """

    config: dict[str, Any]
    scores: dict[str, dict[str, float]]
    work: dict[str, int]
    seconds: float
    limit: int | float | None
    plan: dict[str, float] = field(default_factory=dict)
    samples: dict[str, list] | None = field(default=None, repr=False)

    def as_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if self.samples is None:
            data.pop("samples")
        return data


def evaluation_config(config: HShareConfig | str | None, overrides: dict[str, Any] | None = None,
                      dense_fallback: bool = False) -> HShareConfig:
    """The config an evaluation (``eval``, ``sweep``, ``fidelity``) runs: `config` (None = the
    default preset) with `overrides`; where the config leaves the dense fallback of small steps to
    the device (``dense_fallback_mib`` None), it is off unless `dense_fallback`: evaluation
    measures the algorithm. A value the config or the overrides set explicitly is kept."""
    resolved = resolve_config(config, **(overrides or {}))
    if not dense_fallback and resolved.runtime.dense_fallback_mib is None:
        resolved = resolved.replace(dense_fallback_mib=0.0)
    return resolved


def task_scores(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """lm-eval's ``results["results"]`` -> task -> metric -> value (numbers only: no stderr, no
    ``sample_len``)."""
    scores = {}
    for task, metrics in results.get("results", {}).items():
        scores[task] = {name: float(value) for name, value in metrics.items()
                        if "_stderr" not in name and name != "sample_len"
                        and isinstance(value, (int, float)) and not isinstance(value, bool)}
    return scores


@dataclass
class TaskSuite:
    """Tasks ready for lm-eval: generated configs and lm-eval's task index, built once and reused
    by every config of a sweep (indexing lm-eval's stock tasks takes tens of seconds).

    Attributes:
        tasks: lm-eval task names to run (groups expanded).
        task_manager: lm-eval's ``TaskManager`` over the stock tasks and the generated ones.
        task_dir: where the generated YAMLs and converted data live (kept while the suite is used).
    """

    tasks: list[str]
    task_manager: Any
    task_dir: Path
    notes: list[str] = dataclasses.field(default_factory=list)

    @classmethod
    def prepare(cls, tasks: list[str], data_dir: str | os.PathLike | None, task_dir: str | os.PathLike,
                ruler: Any = None) -> "TaskSuite":
        """Generate the task configs under `task_dir` (`hshare.eval.tasks.prepare_tasks`); offline
        (``HF_HUB_OFFLINE``, ``HF_DATASETS_OFFLINE``) when a data directory is used. `ruler`: the
        `hshare.eval.ruler.RulerOptions` of RULER tasks (their lengths and the evaluated model's tokenizer);
        their sentence splitter's data is put on nltk's path, and their notes (haystack, splitter) kept."""
        from lm_eval.tasks import TaskManager

        from hshare.eval.ruler import use_nltk_data
        from hshare.eval.tasks import prepare_tasks, resolve_data_dir

        setup = prepare_tasks(list(tasks), resolve_data_dir(data_dir), Path(task_dir), ruler)
        if setup.offline:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        if setup.nltk_data is not None:
            use_nltk_data(Path(setup.nltk_data))
        return cls(setup.tasks, TaskManager(include_path=setup.include_path), Path(task_dir), list(setup.notes))


def evaluate(model, tokenizer, config: HShareConfig | str, tasks: "list[str] | TaskSuite",
             data_dir: str | os.PathLike | None = None, limit: int | float | None = None, batch_size: int = 8,
             num_fewshot: int | None = None, gen_kwargs: dict[str, Any] | str | None = None,
             dense_fallback: bool = False, log_samples: bool = False,
             overrides: dict[str, Any] | None = None, ruler_lengths: list[int] | None = None) -> EvalResult:
    """Evaluate `model` patched with `config` on lm-eval `tasks`; the model is unpatched afterwards.

    Args:
        model, tokenizer: a loaded transformers causal LM (Llama / Mistral) and its tokenizer.
        config: an `HShareConfig`, preset name or YAML path.
        tasks: lm-eval task names (``gsm8k``, ``coqa``, ``longbench_multi_news``, ``longbench``...),
            or a `TaskSuite` prepared once for several evaluations (then `data_dir` is not used).
        data_dir: local task data (see `hshare.eval.tasks`); None = `HSHARE_DATA_DIR` or the hub.
        limit: documents per task (None = all).
        batch_size: generation batch size.
        gen_kwargs: lm-eval generation overrides (``{"max_gen_toks": 128}`` or its string form).
        dense_fallback: keep the config's dense fallback of small steps (off: measure the algorithm).
        overrides: `HShareConfig` fields replacing the config's.
        ruler_lengths: token lengths of RULER tasks (``ruler`` or its stock task names; None = lm-eval's
            default lengths), sized with `tokenizer` and capped by the model's context.
    """
    if not isinstance(tasks, TaskSuite):
        from hshare.eval.ruler import RulerOptions

        ruler = RulerOptions(lengths=ruler_lengths, model_args={"pretrained": model, "tokenizer": tokenizer})
        with tempfile.TemporaryDirectory(prefix="hshare-tasks-") as scratch:
            suite = TaskSuite.prepare(list(tasks), data_dir, scratch, ruler)
            return evaluate(model, tokenizer, config, suite, limit=limit, batch_size=batch_size,
                            num_fewshot=num_fewshot, gen_kwargs=gen_kwargs, dense_fallback=dense_fallback,
                            log_samples=log_samples, overrides=overrides)
    import lm_eval

    from hshare.eval.lm_eval_model import HShareLM

    lm = HShareLM(pretrained=model, tokenizer=tokenizer, hshare=config, dense_fallback=dense_fallback,
                  batch_size=batch_size, **{f"hshare_{k}": v for k, v in (overrides or {}).items()})
    start = time.perf_counter()
    try:
        results = lm_eval.simple_evaluate(model=lm, tasks=tasks.tasks, limit=limit, num_fewshot=num_fewshot,
                                          gen_kwargs=gen_kwargs, task_manager=tasks.task_manager,
                                          log_samples=log_samples, bootstrap_iters=0)
    finally:
        lm.unpatch()
    return EvalResult(
        config=lm.hshare_config.to_dict(),
        scores=task_scores(results),
        work=lm.work.as_dict(),
        seconds=time.perf_counter() - start,
        limit=limit,
        plan=lm.work.plan_mean(),
        samples=results.get("samples") if log_samples else None,
    )
