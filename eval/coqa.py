"""CoQA for lm-eval without ``transformers.data.metrics``: metrics, prompt glue, data conversion.

lm-eval's stock ``coqa`` task imports ``transformers.data.metrics.squad_metrics`` (removed in
transformers 5), so it fails at load. `task_config` describes our replacement: the same name, data
layout, prompt, generation settings and metrics (``em``, ``f1``), with the functions of this module.

Metrics follow the SQuAD / CoQA official evaluation: answers are normalised (lowercase, punctuation
and the articles a/an/the removed, whitespace collapsed); exact match compares normalised strings,
F1 the bags of normalised tokens. With several gold answers the official CoQA script scores a turn
as the mean, over each gold answer left out in turn, of the best score against the others
(`turn_scores`); with one gold answer, the score against it.

Document layout (one row per story, as lm-eval reads ``EleutherAI/coqa``): ``id``, ``source``,
``story``, ``questions{input_text[], turn_id[]}``, ``answers{span_start[], span_end[],
span_text[], input_text[], turn_id[]}``, ``additional_answers{"0","1","2": the same five lists}``.
`convert_official_coqa` writes it from the official CoQA JSON. A document asks for the answer to
the story's *last* question, after all earlier questions and their answers.
"""

from __future__ import annotations

import json
import os
import re
import string
from collections import Counter
from collections.abc import Callable, Iterable

ANSWER_FIELDS = ("span_start", "span_end", "span_text", "input_text", "turn_id")
QUESTION_FIELDS = ("input_text", "turn_id")
ADDITIONAL_KEYS = ("0", "1", "2")
# The train split has no additional answers: one empty answer per key keeps the row layout uniform.
PLACEHOLDER_ANSWER = {"span_start": -1, "span_end": -1, "span_text": "", "input_text": "", "turn_id": -1}
HUB_DATASET = "EleutherAI/coqa"
# The task's functions, referenced from its YAML (``doc_to_text: !function <module>.doc_to_text``).
GLUE_FUNCTIONS = ("doc_to_text", "doc_to_target", "process_results")

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


# ----------------------------------------------------------------------------------------- metrics

def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lowercase, drop punctuation, drop a/an/the, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(gold: str, prediction: str) -> float:
    """1.0 when the normalised strings are equal, else 0.0."""
    return float(normalize_answer(gold) == normalize_answer(prediction))


def token_f1(gold: str, prediction: str) -> float:
    """F1 of the normalised token bags; when either side has no tokens, 1.0 only if both are empty."""
    gold_tokens = normalize_answer(gold).split()
    pred_tokens = normalize_answer(prediction).split()
    if not gold_tokens or not pred_tokens:
        return float(gold_tokens == pred_tokens)
    common = sum((Counter(gold_tokens) & Counter(pred_tokens)).values())
    if common == 0:
        return 0.0
    precision = common / len(pred_tokens)
    recall = common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def best_score(golds: Iterable[str], prediction: str, metric: Callable[[str, str], float]) -> float:
    """The best `metric` of `prediction` against any of `golds`."""
    return max(metric(gold, prediction) for gold in golds)


def turn_scores(golds: list[str], prediction: str) -> dict[str, float]:
    """CoQA official turn score: ``{"em", "f1"}``.

    One gold answer: the score against it. Several: for each gold left out in turn, the best score
    against the remaining ones, averaged (so a prediction equal to one of three distinct golds gets
    EM 2/3).
    """
    if not golds:
        raise ValueError("turn_scores needs at least one gold answer")
    if len(golds) == 1:
        pools = [golds]
    else:
        pools = [golds[:i] + golds[i + 1:] for i in range(len(golds))]
    return {
        "em": sum(best_score(pool, prediction, exact_match) for pool in pools) / len(pools),
        "f1": sum(best_score(pool, prediction, token_f1) for pool in pools) / len(pools),
    }


# ---------------------------------------------------------------------------------- lm-eval glue

def doc_to_text(doc: dict) -> str:
    """The story, then ``Q: ...`` / ``A: ...`` turns, ending on the last question and ``A:``."""
    questions = doc["questions"]["input_text"]
    answers = doc["answers"]["input_text"]
    parts = [doc["story"], "\n\n"]
    for turn, question in enumerate(questions):
        parts.append(f"Q: {question}\n\n")
        parts.append(f"A: {answers[turn]}\n\n" if turn < len(questions) - 1 else "A:")
    return "".join(parts)


def doc_to_target(doc: dict) -> list[str]:
    """The gold answers of the last turn: the answer, then additional answers that differ from
    those before them (case-insensitively); empty placeholders are skipped."""
    turn = len(doc["questions"]["input_text"]) - 1
    golds = [doc["answers"]["input_text"][turn]]
    for extra in (doc.get("additional_answers") or {}).values():
        texts = (extra or {}).get("input_text") or []
        if turn < len(texts) and texts[turn] and texts[turn].lower() not in (g.lower() for g in golds):
            golds.append(texts[turn])
    return golds


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """``{"em", "f1"}`` of the generation's first line against the last turn's gold answers."""
    prediction = results[0].strip().split("\n")[0]
    return turn_scores(doc_to_target(doc), prediction)


def task_config(functions: dict[str, object], data_files: dict[str, str] | None = None) -> dict:
    """Our ``coqa`` task as an lm-eval config dict (prompt and generation settings of the stock task).

    Args:
        functions: each of `GLUE_FUNCTIONS` -> its value in the YAML (a ``!function`` reference to
            a module re-exporting this module's function).
        data_files: split -> absolute jsonl path (``validation`` required, ``train`` optional: few-shot
            examples); None reads ``EleutherAI/coqa`` from the hub (train and validation).
    """
    if set(functions) != set(GLUE_FUNCTIONS):
        raise ValueError(f"coqa task_config needs references for {list(GLUE_FUNCTIONS)}, got {sorted(functions)}")
    if data_files is None:
        dataset = {"dataset_path": HUB_DATASET}
        splits = {"training_split": "train", "validation_split": "validation"}
    else:
        if "validation" not in data_files:
            raise ValueError(f"coqa data_files need a 'validation' split, got {sorted(data_files)}")
        dataset = {"dataset_path": "json", "dataset_name": None, "dataset_kwargs": {"data_files": dict(data_files)}}
        splits = {"validation_split": "validation"}
        if "train" in data_files:
            splits = {"training_split": "train", **splits}
    return {
        "task": "coqa",
        **dataset,
        "output_type": "generate_until",
        **splits,
        **{name: functions[name] for name in GLUE_FUNCTIONS},
        "should_decontaminate": True,
        "doc_to_decontamination_query": "{{story}} {{questions.input_text|join('\n')}}",
        "generation_kwargs": {"until": ["\nQ:"]},
        "metric_list": [{"metric": metric, "aggregation": "mean", "higher_is_better": True} for metric in ("em", "f1")],
        "metadata": {"version": 3.0},
    }


# ------------------------------------------------------------------------------------- conversion

def _columns(records: list[dict], fields: tuple[str, ...], where: str) -> dict[str, list]:
    """List of records -> dict of lists (the layout of a ``datasets`` Sequence of structs)."""
    try:
        return {name: [record[name] for record in records] for name in fields}
    except KeyError as err:
        raise ValueError(f"{where}: a record lacks {err}; expected fields {list(fields)}") from None


def convert_story(story: dict) -> dict:
    """One story of the official CoQA JSON -> one lm-eval row (see the module docstring)."""
    where = f"story {story.get('id', '?')!r}"
    missing = [name for name in ("id", "source", "story", "questions", "answers") if name not in story]
    if missing:
        raise ValueError(f"{where}: missing {missing}; an official CoQA story has id, source, story, "
                         "questions, answers (and additional_answers in dev)")
    if len(story["questions"]) != len(story["answers"]):
        raise ValueError(f"{where}: {len(story['questions'])} questions but {len(story['answers'])} answers")
    extra = story.get("additional_answers") or {}
    return {
        "id": story["id"],
        "source": story["source"],
        "story": story["story"],
        "questions": _columns(story["questions"], QUESTION_FIELDS, f"{where}, questions"),
        "answers": _columns(story["answers"], ANSWER_FIELDS, f"{where}, answers"),
        "additional_answers": {
            key: _columns(extra.get(key) or [PLACEHOLDER_ANSWER], ANSWER_FIELDS, f"{where}, additional_answers[{key}]")
            for key in ADDITIONAL_KEYS
        },
    }


def convert_official_coqa(path_in: str | os.PathLike, path_out: str | os.PathLike) -> int:
    """Official CoQA JSON (``coqa-dev-v1.0.json`` / ``coqa-train-v1.0.json``) -> lm-eval jsonl rows.

    Stories without additional answers (the train split) get one `PLACEHOLDER_ANSWER` per key.
    Returns the number of stories written.

    Raises:
        ValueError: the file is not ``{"data": [story, ...]}`` or a story lacks a field (named).
    """
    with open(path_in, encoding="utf-8") as src:
        try:
            content = json.load(src)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path_in}: not JSON ({err}); expected the official CoQA layout") from err
    if not isinstance(content, dict) or not isinstance(content.get("data"), list):
        raise ValueError(f"{path_in}: expected the official CoQA layout {{\"version\", \"data\": [story, ...]}}")
    with open(path_out, "w", encoding="utf-8") as dst:
        for story in content["data"]:
            try:
                row = convert_story(story)
            except ValueError as err:
                raise ValueError(f"{path_in}: {err}") from err
            dst.write(json.dumps(row, ensure_ascii=False) + "\n")
    return len(content["data"])
