"""Task configs generated from a data directory (`hshare.eval.tasks`), CoQA and LongBench conversion
and metrics, and lm-eval loading the generated tasks (offline, CPU)."""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import datasets
import huggingface_hub
import pytest
import yaml
from lm_eval.api.model import LM

from hshare.eval import coqa, longbench, tasks
from hshare.eval.tasks import DATA_DIR_ENV, MARKER, prepare_tasks, resolve_data_dir

# LongBench's metrics module (loaded with its tasks) warns that fuzzywuzzy runs without Levenshtein.
pytestmark = pytest.mark.filterwarnings("ignore:Using slow pure-python SequenceMatcher:UserWarning")

FIXTURES = Path(__file__).parent / "data"
COQA_FIXTURE = FIXTURES / "coqa_synthetic.json"
TREC_FIXTURE = FIXTURES / "longbench_trec.jsonl"
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
needs_shared = pytest.mark.skipif(not (SHARED_DATA / "gsm8k" / "test.jsonl").is_file(),
                                  reason=f"the shared data directory {SHARED_DATA} is not on this machine")

# The keys of a generated override: the stock YAML included, its name, tag cleared, the dataset lines.
DATASET_KEYS = {"include", "task", "tag", "dataset_path", "dataset_name", "dataset_kwargs"}


def read_yaml(path: Path) -> dict:
    """A generated YAML, ``!function`` tags read as plain strings."""
    text = path.read_text()
    assert text.splitlines()[0] == MARKER
    return yaml.load(text, Loader=tasks._StockLoader)


def gsm8k_rows(n: int, offset: int = 0) -> str:
    """`n` made-up GSM8K rows (question ``What is i + 1?``) as jsonl text."""
    return "".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}) + "\n"
                   for i in range(offset, offset + n))


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No hub: the variables, and the constants the libraries read from them when imported."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)


@pytest.fixture
def data_dir(tmp_path) -> Path:
    """A data directory of small fixtures: gsm8k (made up), coqa (official JSON), longbench trec."""
    root = tmp_path / "data"
    (root / "gsm8k").mkdir(parents=True)
    (root / "gsm8k" / "train.jsonl").write_text(gsm8k_rows(4, offset=100))
    (root / "gsm8k" / "test.jsonl").write_text(gsm8k_rows(3))
    (root / "coqa").mkdir()
    shutil.copy(COQA_FIXTURE, root / "coqa" / "coqa-dev-v1.0.json")
    (root / "longbench").mkdir()
    shutil.copy(TREC_FIXTURE, root / "longbench" / "trec.jsonl")
    return root


@pytest.fixture
def datasets_cache(tmp_path, monkeypatch):
    """Keep the arrow files of `datasets` in the test's temporary folder."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))


def lm_eval_tasks(setup: tasks.TaskSetup, stock_folders: tuple[str, ...] = ()) -> tuple[object, dict]:
    """lm-eval's TaskManager over the stock `stock_folders` then the generated folder (the order of
    its default tasks and an include_path; the whole stock index takes ~30 s to build), and the
    loaded tasks of `setup`."""
    import lm_eval
    from lm_eval.tasks import TaskManager, get_task_dict

    stock = [str(Path(lm_eval.__file__).parent / "tasks" / folder) for folder in stock_folders]
    manager = TaskManager(include_path=[*stock, setup.include_path], include_defaults=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # get_task_dict: TaskManager.load in newer lm-eval
        loaded = get_task_dict(setup.tasks, manager)
    return manager, loaded


# ------------------------------------------------------------------------------ data directory

def test_resolve_data_dir_flag_then_env_then_hub(tmp_path, monkeypatch):
    flag_dir, env_dir = tmp_path / "flag", tmp_path / "env"
    flag_dir.mkdir()
    env_dir.mkdir()
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    assert resolve_data_dir(None) is None
    assert resolve_data_dir(str(flag_dir)) == flag_dir.resolve()
    monkeypatch.setenv(DATA_DIR_ENV, str(env_dir))
    assert resolve_data_dir(None) == env_dir.resolve()
    assert resolve_data_dir(str(flag_dir)) == flag_dir.resolve()


def test_resolve_data_dir_missing_names_path_and_origin(tmp_path, monkeypatch):
    missing = tmp_path / "nope"
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    with pytest.raises(FileNotFoundError, match=r"nope.*--data-dir"):
        resolve_data_dir(str(missing))
    monkeypatch.setenv(DATA_DIR_ENV, str(missing))
    with pytest.raises(FileNotFoundError, match=rf"nope.*\${DATA_DIR_ENV}"):
        resolve_data_dir(None)


# ------------------------------------------------------------------------------ generated configs

@pytest.mark.parametrize("name", tasks.GSM8K_TASKS)
def test_gsm8k_override_includes_stock_yaml_and_sets_only_dataset_lines(data_dir, tmp_path, name):
    setup = prepare_tasks([name], data_dir, tmp_path / "out")
    assert setup == tasks.TaskSetup(include_path=str((tmp_path / "out").resolve()), tasks=[name], offline=True)
    config = read_yaml(Path(setup.include_path) / f"{name}.yaml")
    assert set(config) == DATASET_KEYS
    include = Path(config["include"])
    assert include.is_absolute() and include.is_file() and include.parts[-3:-1] == ("tasks", "gsm8k")
    assert yaml.load(include.read_text(), Loader=tasks._StockLoader)["task"] == name  # the stock task itself
    assert config["task"] == name and config["tag"] is None
    assert (config["dataset_path"], config["dataset_name"]) == ("json", None)
    files = config["dataset_kwargs"]["data_files"]
    assert files == {"train": str(data_dir / "gsm8k" / "train.jsonl"), "test": str(data_dir / "gsm8k" / "test.jsonl")}
    assert all(Path(p).is_absolute() for p in files.values())


def test_relative_data_dir_gives_absolute_paths(data_dir, tmp_path, monkeypatch):
    (data_dir / "coqa" / "coqa-dev-v1.0.json").unlink()
    coqa.convert_official_coqa(COQA_FIXTURE, data_dir / "coqa" / "validation.jsonl")  # read in place
    monkeypatch.chdir(data_dir.parent)
    setup = prepare_tasks(["gsm8k", "longbench_trec", "coqa"], Path("data"), Path("out"))
    assert Path(setup.include_path).is_absolute()
    for name in setup.tasks:
        files = read_yaml(Path(setup.include_path) / f"{name}.yaml")["dataset_kwargs"]["data_files"]
        assert all(Path(p).is_absolute() and Path(p).is_file() for p in files.values())


def test_hub_without_data_dir_only_coqa_is_generated(tmp_path):
    setup = prepare_tasks(["gsm8k", "longbench", "longbench_trec"], None, tmp_path / "out")
    assert setup == tasks.TaskSetup(include_path=None, tasks=["gsm8k", "longbench", "longbench_trec"], offline=False)
    assert not list((tmp_path / "out").glob("*.yaml"))

    setup = prepare_tasks(["coqa", "gsm8k"], None, tmp_path / "out")
    assert setup.include_path is not None and setup.tasks == ["coqa", "gsm8k"] and not setup.offline
    assert sorted(p.name for p in (tmp_path / "out").glob("*.yaml")) == ["coqa.yaml"]
    config = read_yaml(tmp_path / "out" / "coqa.yaml")
    assert config["dataset_path"] == "EleutherAI/coqa" and "dataset_kwargs" not in config
    assert (config["training_split"], config["validation_split"]) == ("train", "validation")


def test_coqa_yaml_matches_stock_settings_with_our_functions(data_dir, tmp_path):
    setup = prepare_tasks(["coqa"], data_dir, tmp_path / "out")
    out = Path(setup.include_path)
    text = (out / "coqa.yaml").read_text()
    for name in coqa.GLUE_FUNCTIONS:
        assert re.search(rf"^{name}: !function '?{tasks.GLUE_MODULE}\.{name}'?$", text, re.MULTILINE)
    glue = (out / f"{tasks.GLUE_MODULE}.py").read_text()
    assert "from hshare.eval.coqa import doc_to_text, doc_to_target, process_results" in glue
    config = read_yaml(out / "coqa.yaml")
    assert config["task"] == "coqa" and config["output_type"] == "generate_until"
    assert config["generation_kwargs"] == {"until": ["\nQ:"]}
    assert [m["metric"] for m in config["metric_list"]] == ["em", "f1"]
    converted = out / "data" / "coqa" / "validation.jsonl"
    assert config["dataset_kwargs"]["data_files"] == {"validation": str(converted)}
    assert "training_split" not in config  # no train file in the data directory
    assert len(converted.read_text().splitlines()) == 3


def test_coqa_reads_converted_rows_and_optional_train(data_dir, tmp_path):
    (data_dir / "coqa" / "coqa-dev-v1.0.json").unlink()
    coqa.convert_official_coqa(COQA_FIXTURE, data_dir / "coqa" / "validation.jsonl")
    shutil.copy(COQA_FIXTURE, data_dir / "coqa" / "coqa-train-v1.0.json")
    setup = prepare_tasks(["coqa"], data_dir, tmp_path / "out")
    config = read_yaml(Path(setup.include_path) / "coqa.yaml")
    assert config["dataset_kwargs"]["data_files"] == {
        "validation": str(data_dir / "coqa" / "validation.jsonl"),  # used as it is
        "train": str(Path(setup.include_path) / "data" / "coqa" / "train.jsonl"),  # converted
    }
    assert config["training_split"] == "train"


def test_longbench_groups_expand_to_files_present(data_dir, tmp_path):
    shutil.copy(TREC_FIXTURE, data_dir / "longbench" / "2wikimqa.jsonl")  # any rows will do here
    names = ["longbench", "longbench_multi_news", "longbench_fewshot", "hellaswag", " ", "longbench_trec_e"]
    with pytest.raises(FileNotFoundError, match="multi_news.jsonl"):  # asked for by name, missing
        prepare_tasks(names, data_dir, tmp_path / "out")
    setup = prepare_tasks([n for n in names if n != "longbench_multi_news"], data_dir, tmp_path / "out")
    assert setup.tasks == ["longbench_2wikimqa", "longbench_trec", "hellaswag", "longbench_trec_e"]
    assert sorted(p.name for p in Path(setup.include_path).glob("*.yaml")) == [
        "longbench_2wikimqa.yaml", "longbench_trec.yaml"]
    config = read_yaml(Path(setup.include_path) / "longbench_2wikimqa.yaml")
    assert set(config) == DATASET_KEYS and Path(config["include"]).name == "2wikimqa.yaml"
    assert config["dataset_kwargs"]["data_files"] == {
        "test": str(Path(setup.include_path) / "data" / "longbench" / "2wikimqa.jsonl")}


def test_missing_files_name_the_expected_path(data_dir, tmp_path):
    (data_dir / "gsm8k" / "train.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match=r"'gsm8k'.*gsm8k/train\.jsonl"):
        prepare_tasks(["gsm8k"], data_dir, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match=r"longbench/qasper\.jsonl"):
        prepare_tasks(["longbench_qasper"], data_dir, tmp_path / "out")
    (data_dir / "coqa" / "coqa-dev-v1.0.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"coqa/coqa-dev-v1\.0\.json.*coqa/validation\.jsonl"):
        prepare_tasks(["coqa"], data_dir, tmp_path / "out")
    (data_dir / "longbench" / "trec.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match=r"'longbench_code'.*lcc\.jsonl"):
        prepare_tasks(["longbench_code"], data_dir, tmp_path / "out")


def test_stale_generated_yamls_are_removed_others_kept(data_dir, tmp_path):
    out = tmp_path / "out"
    prepare_tasks(["gsm8k"], data_dir, out)
    (out / "mine.yaml").write_text("task: mine\n")
    setup = prepare_tasks(["coqa"], None, out)
    assert sorted(p.name for p in out.glob("*.yaml")) == ["coqa.yaml", "mine.yaml"]
    assert setup.tasks == ["coqa"]


def test_unknown_stock_task_is_reported():
    with pytest.raises(LookupError, match=r"no stock task 'gsm8k_nope'.*gsm8k_cot"):
        tasks.stock_task_yaml("gsm8k", "gsm8k_nope")


# ------------------------------------------------------------------------------ converters

def test_convert_official_coqa(tmp_path):
    out = tmp_path / "coqa.jsonl"
    assert coqa.convert_official_coqa(COQA_FIXTURE, out) == 3
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    first = rows[0]
    assert set(first) == {"id", "source", "story", "questions", "answers", "additional_answers"}
    assert first["id"] == "synthetic-1" and first["source"] == "mctest"
    assert first["questions"] == {"input_text": ["What was the cat's name?", "Where did he live?",
                                                 "What did he like to do?"], "turn_id": [1, 2, 3]}
    assert first["answers"]["input_text"] == ["Tom", "on a farm", "sit in the sun"]
    assert first["answers"]["span_text"][1] == "lived on a farm"
    start, end = first["answers"]["span_start"][1], first["answers"]["span_end"][1]
    assert first["story"][start:end] == "lived on a farm"
    assert first["additional_answers"]["2"]["input_text"] == ["Tom.", "farm", "in the sun"]
    assert set(first["additional_answers"]["0"]) == set(coqa.ANSWER_FIELDS)
    # the third story has no additional answers (like the train split): one placeholder per key
    assert rows[2]["additional_answers"] == {key: {f: [v] for f, v in coqa.PLACEHOLDER_ANSWER.items()}
                                             for key in ("0", "1", "2")}


def test_convert_official_coqa_rejects_bad_layouts(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"story": "x"}]))
    with pytest.raises(ValueError, match="official CoQA layout"):
        coqa.convert_official_coqa(bad, tmp_path / "out.jsonl")
    content = json.loads(COQA_FIXTURE.read_text())
    content["data"][1]["answers"].pop()
    bad.write_text(json.dumps(content))
    with pytest.raises(ValueError, match="'synthetic-2': 2 questions but 1 answers"):
        coqa.convert_official_coqa(bad, tmp_path / "out.jsonl")


def test_convert_longbench(tmp_path):
    out = tmp_path / "trec.jsonl"
    assert longbench.convert_longbench(TREC_FIXTURE, out) == 3
    source = [json.loads(line) for line in TREC_FIXTURE.read_text().splitlines()]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for before, after in zip(source, rows):
        assert after == {**before, "question": before["input"]}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(TREC_FIXTURE.read_text().splitlines()[0] + "\n" + json.dumps({"input": "q"}) + "\n")
    with pytest.raises(ValueError, match=r"line 2: .*missing field\(s\) \['context', 'answers'\]"):
        longbench.convert_longbench(bad, tmp_path / "x.jsonl")


def test_longbench_names():
    assert len(longbench.ENGLISH_TASKS) == 16 == len(set(longbench.ENGLISH_TASKS))
    assert longbench.dataset_of("longbench_repobench-p") == "repobench-p"
    assert longbench.dataset_of("longbench_vcsum") is None  # Chinese: not ours
    assert longbench.dataset_of("longbench_trec_e") is None
    for dataset in longbench.ENGLISH_TASKS:  # every name is a stock lm-eval task
        assert tasks.stock_task_yaml("longbench", longbench.task_name(dataset)).is_file()


# ------------------------------------------------------------------------------ CoQA metrics

def test_normalize_answer():
    assert coqa.normalize_answer("  The Cat, sat -- on A mat!  ") == "cat sat on mat"
    assert coqa.normalize_answer("Theatre and another") == "theatre and another"  # whole words only


def test_exact_match_and_f1_hand_worked():
    assert coqa.exact_match("The cat sat.", "cat  SAT") == 1.0
    assert coqa.exact_match("The cat sat", "cat sat on") == 0.0
    # "cat sat" vs "cat sat on": 2 common tokens, precision 2/3, recall 2/2 -> F1 = 2*2 / (2+3)
    assert coqa.token_f1("The cat sat", "cat sat on") == pytest.approx(2 * 2 / (2 + 3))
    # a token counts as often as both sides have it: gold [b, b], pred [b]: precision 1/1, recall 1/2
    assert coqa.token_f1("b b", "b") == pytest.approx(2 * (1 / 1) * (1 / 2) / (1 + 1 / 2))
    assert coqa.token_f1("dog", "cat") == 0.0
    assert coqa.token_f1("the", "a") == 1.0  # both empty after normalisation
    assert coqa.token_f1("the", "cat") == 0.0


def test_turn_scores_leave_one_out():
    # one gold: its own score
    assert coqa.turn_scores(["cat sat"], "the cat sat on") == {"em": 0.0, "f1": pytest.approx(0.8)}
    # golds g1 "sit in sun", g2 "to sit in sun", g3 "in sun"; prediction "sit in sun":
    # F1 1, 6/7 (p 3/3, r 3/4), 4/5 (p 2/3, r 2/2); EM 1, 0, 0.
    # leave g1 out: EM 0, F1 6/7; leave g2: EM 1, F1 1; leave g3: EM 1, F1 1.
    scores = coqa.turn_scores(["sit in the sun", "to sit in the sun", "in the sun"], "sit in the sun")
    assert scores["em"] == pytest.approx(2 / 3)
    assert scores["f1"] == pytest.approx((6 / 7 + 1 + 1) / 3)
    with pytest.raises(ValueError):
        coqa.turn_scores([], "x")


def test_coqa_glue_on_converted_story(tmp_path):
    coqa.convert_official_coqa(COQA_FIXTURE, tmp_path / "coqa.jsonl")
    first, second, third = (json.loads(line) for line in (tmp_path / "coqa.jsonl").read_text().splitlines())
    assert coqa.doc_to_text(first) == (
        "Once upon a time, a small cat named Tom lived on a farm. Tom liked to sit in the sun.\n\n"
        "Q: What was the cat's name?\n\nA: Tom\n\n"
        "Q: Where did he live?\n\nA: on a farm\n\n"
        "Q: What did he like to do?\n\nA:")
    # "Sit in the sun" repeats the answer (case aside): dropped
    assert coqa.doc_to_target(first) == ["sit in the sun", "to sit in the sun", "in the sun"]
    assert coqa.doc_to_target(second) == ["at noon", "noon", "At noon.", "noon on Saturdays"]
    assert coqa.doc_to_target(third) == ["two"]  # placeholders skipped
    # only the first line of the generation counts
    assert coqa.process_results(first, [" sit in the sun\n\nQ: next"]) == coqa.turn_scores(
        ["sit in the sun", "to sit in the sun", "in the sun"], "sit in the sun")
    assert coqa.process_results(third, ["Two.\nmore"]) == {"em": 1.0, "f1": 1.0}


def test_coqa_single_turn_story_without_additional_answers():
    story = json.loads(COQA_FIXTURE.read_text())["data"][2]
    story = {**story, "questions": story["questions"][:1], "answers": story["answers"][:1]}  # no additional answers
    row = coqa.convert_story(story)
    assert row["additional_answers"]["0"]["input_text"] == [""]  # the placeholder holds turn 1
    assert coqa.doc_to_target(row) == ["apple and pear trees"]
    assert coqa.doc_to_text(row).endswith("behind her house.\n\nQ: What did Maria plant?\n\nA:")


# ------------------------------------------------------------------------------ lm-eval loads them

def test_lm_eval_runs_local_tasks_over_stock_ones(data_dir, tmp_path, datasets_cache):
    setup = prepare_tasks(["gsm8k", "longbench_trec"], data_dir, tmp_path / "out")
    manager, loaded = lm_eval_tasks(setup, stock_folders=("gsm8k", "longbench"))
    for name in setup.tasks:  # the generated file wins over the stock one of the same name
        assert manager.task_index[name].yaml_path == Path(setup.include_path) / f"{name}.yaml"
    # the stock tags keep all their members (a generated tag would have replaced them)
    assert {"gsm8k", "gsm8k_cot_zeroshot"} <= manager.task_index["math_word_problems"].tags
    assert len(manager.task_index["longbench_tasks"].tags) == 21
    gsm8k = loaded["gsm8k"]
    docs = list(gsm8k.eval_docs)
    assert [d["question"] for d in docs] == ["What is 0 + 1?", "What is 1 + 1?", "What is 2 + 1?"]
    assert gsm8k.doc_to_text(docs[1]) == "Question: What is 1 + 1?\nAnswer:"
    assert gsm8k.config.num_fewshot == 5  # stock few-shot settings, examples from the local train file
    assert [d["question"] for d in gsm8k.fewshot_docs()][:2] == ["What is 100 + 1?", "What is 101 + 1?"]
    assert gsm8k.config.generation_kwargs["until"][0] == "Question:"

    trec = loaded["longbench_trec"]
    docs = list(trec.eval_docs)
    assert len(docs) == 3
    context = json.loads(TREC_FIXTURE.read_text().splitlines()[0])["context"]
    assert trec.doc_to_text(docs[0]) == ("Please determine the type of the question below. Here are some examples "
                                         f"of questions.\n\n{context}\nWhat does CPU stand for?")
    # the stock metric reads answers and all_classes
    assert trec.process_results(docs[2], ["Number of something"])["classification_score"] == 1.0
    assert trec.process_results(docs[2], ["Human being"])["classification_score"] == 0.0


def test_lm_eval_loads_our_coqa(data_dir, tmp_path, datasets_cache):
    shutil.copy(COQA_FIXTURE, data_dir / "coqa" / "coqa-train-v1.0.json")
    setup = prepare_tasks(["coqa"], data_dir, tmp_path / "out")
    _, loaded = lm_eval_tasks(setup)
    task = loaded["coqa"]
    docs = list(task.eval_docs)
    assert [d["id"] for d in docs] == ["synthetic-1", "synthetic-2", "synthetic-3"]
    assert task.doc_to_text(docs[0]).endswith("Q: What did he like to do?\n\nA:")
    assert task.doc_to_target(docs[0]) == ["sit in the sun", "to sit in the sun", "in the sun"]
    assert task.config.generation_kwargs["until"] == ["\nQ:"]
    assert task.process_results(docs[2], ["two"]) == {"em": 1.0, "f1": 1.0}
    assert len(list(task.fewshot_docs())) == 3  # train split present


class ScriptedLM(LM):
    """A model for lm-eval's evaluate: answers each prompt by the first key it contains."""

    def __init__(self, answers: dict[str, str]):
        super().__init__()
        self.answers = answers

    def generate_until(self, requests):
        return [next(v for k, v in self.answers.items() if k in r.args[0]) for r in requests]

    def loglikelihood(self, requests):
        raise NotImplementedError

    def loglikelihood_rolling(self, requests):
        raise NotImplementedError


def test_lm_eval_evaluates_coqa_and_trec_end_to_end(data_dir, tmp_path, datasets_cache):
    import lm_eval
    from lm_eval.tasks import TaskManager

    setup = prepare_tasks(["coqa", "longbench_fewshot"], data_dir, tmp_path / "out")
    model = ScriptedLM({"like to do?": " sit in the sun\nQ: and then?", "CPU": "Abbreviation\n", "": "Human being"})
    results = lm_eval.simple_evaluate(model=model, tasks=setup.tasks, bootstrap_iters=0,
                                      task_manager=TaskManager(include_path=setup.include_path, include_defaults=False))
    scores = results["results"]
    # coqa: story 1 scores EM 2/3, F1 20/21 (test_turn_scores_leave_one_out); stories 2 and 3 score 0
    assert scores["coqa"]["em,none"] == pytest.approx((2 / 3) / 3)
    assert scores["coqa"]["f1,none"] == pytest.approx((20 / 21) / 3)
    # trec: rows 1 and 2 right ("Abbreviation", "Human being"), row 3 wrong
    assert scores["longbench_trec"]["classification_score,none"] == pytest.approx(2 / 3)


@needs_shared
def test_lm_eval_loads_shared_data(tmp_path, datasets_cache):
    setup = prepare_tasks(["gsm8k", "gsm8k_cot", "longbench"], SHARED_DATA, tmp_path / "out")
    assert setup.tasks[:2] == ["gsm8k", "gsm8k_cot"] and "longbench_multi_news" in setup.tasks
    _, loaded = lm_eval_tasks(setup)
    first = json.loads((SHARED_DATA / "gsm8k" / "test.jsonl").open().readline())
    gsm8k = list(loaded["gsm8k"].eval_docs)
    assert len(gsm8k) == 1319 and len(list(loaded["gsm8k"].fewshot_docs())) == 7473
    assert loaded["gsm8k"].doc_to_text(gsm8k[0]) == f"Question: {first['question']}\nAnswer:"
    assert loaded["gsm8k_cot"].doc_to_text(gsm8k[0]) == f"Q: {first['question']}\nA:"
    assert loaded["gsm8k_cot"].config.num_fewshot == 8

    news = loaded["longbench_multi_news"]
    docs = list(news.eval_docs)
    first = json.loads((SHARED_DATA / "longbench" / "multi_news.jsonl").open().readline())
    assert len(docs) == 200 and docs[0]["_id"] == first["_id"]
    assert news.doc_to_text(docs[0]) == (
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n"
        f"{first['context']}\n\nNow, write a one-page summary of all the news.\n\nSummary:")
    assert news.config.generation_kwargs["max_gen_toks"] == 512
