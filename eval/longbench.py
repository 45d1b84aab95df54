"""The 16 English LongBench v1 tasks: names, groups, and the conversion of THUDM's jsonl files.

A LongBench v1 file (``<name>.jsonl`` as THUDM publishes it, one object a line) carries ``input``,
``context``, ``answers``, ``length``, ``dataset``, ``language``, ``all_classes`` and ``_id``.
lm-eval's ``longbench_<name>`` tasks read ``{{context}}``, ``{{question}}``, ``answers`` and (trec)
``all_classes``: `convert_longbench` copies every row and adds ``question`` = ``input``.

lm-eval's task names are ``longbench_`` + THUDM's file name, spelling kept (``longbench_2wikimqa``,
``longbench_repobench-p``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TASK_PREFIX = "longbench_"

# LongBench's categories (lm-eval's group of each is "longbench_<category>"), English tasks only.
CATEGORIES: dict[str, tuple[str, ...]] = {
    "single": ("narrativeqa", "qasper", "multifieldqa_en"),
    "multi": ("hotpotqa", "2wikimqa", "musique"),
    "summarization": ("gov_report", "qmsum", "multi_news"),
    "fewshot": ("trec", "triviaqa", "samsum"),
    "synthetic": ("passage_count", "passage_retrieval_en"),
    "code": ("lcc", "repobench-p"),
}
ENGLISH_TASKS: tuple[str, ...] = tuple(name for names in CATEGORIES.values() for name in names)

# lm-eval group name -> the English dataset names it covers.
GROUPS: dict[str, tuple[str, ...]] = {
    "longbench": ENGLISH_TASKS,
    **{f"{TASK_PREFIX}{category}": names for category, names in CATEGORIES.items()},
}

REQUIRED_FIELDS = ("input", "context", "answers")


def task_name(dataset: str) -> str:
    """lm-eval's task name of a LongBench dataset: ``2wikimqa`` -> ``longbench_2wikimqa``."""
    return TASK_PREFIX + dataset


def dataset_of(task: str) -> str | None:
    """The English LongBench dataset of an lm-eval task name, None when `task` is not one of them."""
    if task.startswith(TASK_PREFIX) and task[len(TASK_PREFIX):] in ENGLISH_TASKS:
        return task[len(TASK_PREFIX):]
    return None


def data_file(data_dir: Path, dataset: str) -> Path:
    """Where a data directory holds a dataset: ``<data_dir>/longbench/<dataset>.jsonl``."""
    return Path(data_dir) / "longbench" / f"{dataset}.jsonl"


def convert_row(row: dict) -> dict:
    """One THUDM LongBench row -> the row lm-eval reads (all fields kept, ``question`` = ``input``)."""
    missing = [name for name in REQUIRED_FIELDS if name not in row]
    if missing:
        raise ValueError(f"missing field(s) {missing}; a LongBench v1 row has {list(REQUIRED_FIELDS)} "
                         "(and length, dataset, language, all_classes, _id)")
    return {**row, "question": row["input"]}


def convert_longbench(path_in: str | os.PathLike, path_out: str | os.PathLike) -> int:
    """Convert a THUDM LongBench v1 jsonl file for lm-eval's ``longbench_*`` tasks; returns the row count.

    Raises:
        ValueError: a line that is not a JSON object with ``input``, ``context`` and ``answers``
            (the message names the file and line).
    """
    count = 0
    with open(path_in, encoding="utf-8") as src, open(path_out, "w", encoding="utf-8") as dst:
        for number, line in enumerate(src, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError(f"expected a JSON object, got {type(row).__name__}")
                dst.write(json.dumps(convert_row(row), ensure_ascii=False) + "\n")
            except ValueError as err:  # json.JSONDecodeError is a ValueError
                raise ValueError(f"{path_in}, line {number}: not a LongBench v1 row: {err}") from err
            count += 1
    return count
