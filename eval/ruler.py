"""RULER (lm-eval's ``ruler`` tasks) through ``hshare eval``, its documents built on this machine.

lm-eval 0.4.x builds RULER's documents in code (each task's ``custom_dataset``), sized to token
budgets (``max_seq_lengths``) with a tokenizer named in the task metadata. For every RULER task asked
for, `prepare_ruler` writes a task config that includes the stock YAML, keeps its name, and changes
only:

* ``metadata``: ``max_seq_lengths`` (the lengths asked for, none longer than the model's context),
  ``tokenizer`` (the evaluated model's tokenizer, saved into the task folder: lm-eval's own
  ``get_tokenizer`` loads it from there), and, for the record in lm-eval's results,
  ``ruler_tokenizer_of`` (the model it came from), ``ruler_haystack`` and ``ruler_sentence_splitter``;
* ``metric_list``: one metric per length (lm-eval's own ``aggregate_metrics``), so that any length
  is reported, not only the stock six;
* ``custom_dataset``: lm-eval's own builder, through `documents_once`, which builds a task's documents
  once per process for the same metadata (lm-eval would rebuild them for every evaluated config:
  10-60 s a task); for essay tasks (`ESSAY_TASKS`) with a local haystack, the builder called with its
  essay haystack (the hub dataset ``baber/paul_graham_essays``) replaced by the words of a local text
  (`local_haystack_dataset`).

Tasks:

* `SYNTHETIC_TASKS` (what ``--tasks ruler`` runs here): built from code, with no download;
  the essay tasks among them read their haystack from ``--ruler-haystack PATH``, else from
  ``<data dir>/text/war_and_peace.txt``; without either they read lm-eval's stock haystack from the
  hub, which an offline run refuses;
* `QA_TASKS`: lm-eval downloads their documents (SQuAD v2, HotpotQA) at run time; an offline run
  (a data directory, or ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` set) refuses them by name.

Lengths: `parse_lengths` (``4096`` or ``4k``), at least `MIN_LENGTH`, capped by the evaluated model's
context (``max_length`` in its model_args, else ``max_position_embeddings`` of its config); lengths
above the cap are dropped with a note. lm-eval builds 500 documents per task and length; ``--limit N``
keeps the first N, which are those of the first length.

Sentence splitting (essay tasks): lm-eval splits the haystack into sentences with nltk's
``sent_tokenize`` (the ``punkt_tab`` English model) to place the needles, and checks for that model
when ``prepare_niah`` is imported, calling nltk's downloader if it is missing. The downloader is never
called here: if ``punkt_tab`` is installed it is used; otherwise `punkt_data` writes a Punkt model with
empty parameters (nltk's Punkt algorithm without learned abbreviations, so "St. Petersburg" splits
after "St.") into the task folder, which the caller puts first on nltk's data path (`use_nltk_data`)
before lm-eval loads any RULER task. Which one ran is written to ``ruler_sentence_splitter``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import yaml

if TYPE_CHECKING:
    import datasets

STOCK_FOLDER = "ruler"
GROUP = "ruler"
# The stock group's members that build their documents in code, no download needed.
SYNTHETIC_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
                   "niah_multikey_3", "niah_multiquery", "niah_multivalue", "ruler_vt", "ruler_cwe", "ruler_fwe")
# The synthetic tasks whose haystack is lm-eval's essay text (niah_utils.get_haystack("essay")).
ESSAY_TASKS = ("niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multiquery", "niah_multivalue")
# Tasks whose documents lm-eval downloads at run time.
QA_TASKS = ("ruler_qa_squad", "ruler_qa_hotpot")
TASKS = SYNTHETIC_TASKS + QA_TASKS
HAYSTACK_IN_DATA_DIR = Path("text") / "war_and_peace.txt"
STOCK_HAYSTACK = "baber/paul_graham_essays (HuggingFace hub dataset, lm-eval's stock essay haystack)"
# lm-eval's variable-tracking builder sizes an in-context example to 500 tokens and, below about
# this length, retries forever to fit the rest.
MIN_LENGTH = 1024
GLUE_MODULE = "hshare_ruler_glue"
STOCK_MODULE = "lm_eval.tasks.ruler"  # the package of the stock task YAMLs and their builders
HAYSTACK_KEY = "ruler_haystack"
TOKENIZER_SOURCE_KEY = "ruler_tokenizer_of"
SPLITTER_KEY = "ruler_sentence_splitter"
PUNKT_LANGUAGE = "english"  # the model sent_tokenize loads by default
CONTEXT_ATTRIBUTES = ("max_position_embeddings", "n_positions", "n_ctx")  # config fields holding the context
HUB_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
TRUE_VALUES = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's reading of those variables

log = logging.getLogger(__name__)


class RulerError(ValueError):
    """A RULER request that cannot run as given; the message names what is wrong and what is accepted."""


@dataclass
class RulerOptions:
    """How `prepare_ruler` builds the RULER tasks.

    Attributes:
        lengths: token budgets of the documents (`parse_lengths`); None = lm-eval's default
            (``DEFAULT_SEQ_LENGTHS`` of its ``ruler/common_utils``).
        haystack: text file for the essay tasks; None = ``<data dir>/text/war_and_peace.txt`` when a
            data directory is given, else lm-eval's stock haystack from the hub.
        model_args: the evaluated model as lm-eval ``model_args`` of the ``hshare`` model:
            ``pretrained`` (a directory or hub id, or a loaded model; absent = the embedded default
            model), ``gguf_file``, ``tokenizer`` (a name or a loaded tokenizer), ``revision``,
            ``trust_remote_code``, ``max_length``. Its tokenizer sizes the documents and its context
            caps `lengths`.
    """

    lengths: list[int] | None = None
    haystack: str | os.PathLike | None = None
    model_args: dict[str, Any] = field(default_factory=dict)


@dataclass
class RulerSetup:
    """What `prepare_ruler` produced.

    Attributes:
        configs: task name -> the task config to write as YAML (stock name kept).
        nltk_data: folder to put first on nltk's data path before lm-eval loads a RULER task
            (`use_nltk_data`); None when nltk's ``punkt_tab`` is installed.
        notes: lines for the person running the evaluation (haystack, sentence splitter, lengths).
    """

    configs: dict[str, dict]
    nltk_data: Path | None
    notes: list[str]


def parse_lengths(text: str) -> list[int]:
    """``"4k,8192"`` -> ``[4096, 8192]``: comma-separated token counts, ``k`` = 1024; sorted, no repeats.

    Raises:
        RulerError: an item is not a positive count, or one is below `MIN_LENGTH`.
    """
    lengths = set()
    for item in (part.strip() for part in text.split(",")):
        match = re.fullmatch(r"(\d+)([kK]?)", item)
        if match is None or int(match.group(1)) == 0:
            raise RulerError(f"--ruler-lengths: {item!r} is not a length; accepted: positive token counts such as "
                             "4096 or 4k (= 4096), separated by commas (4k,8k)")
        lengths.add(int(match.group(1)) * (1024 if match.group(2) else 1))
    short = sorted(length for length in lengths if length < MIN_LENGTH)
    if short:
        raise RulerError(f"--ruler-lengths: {short} below {MIN_LENGTH} tokens; lm-eval's ruler_vt cannot build "
                         f"documents that short (its in-context example alone takes up to 500 tokens)")
    return sorted(lengths)


def hub_offline_by_environment() -> bool:
    """``HF_HUB_OFFLINE`` or ``HF_DATASETS_OFFLINE`` is set to a true value."""
    return any(os.environ.get(name, "").strip().upper() in TRUE_VALUES for name in HUB_OFFLINE_VARIABLES)


def prepare_ruler(tasks: list[str], options: RulerOptions, data_dir: Path | None, out_dir: Path,
                  offline: bool) -> RulerSetup:
    """Task configs for the RULER `tasks`, and the files they read, written under `out_dir`.

    Written: ``ruler_tokenizer/`` (the evaluated model's tokenizer), `GLUE_MODULE`.py (the functions
    the configs name with ``!function``), and ``nltk_data/`` when ``punkt_tab`` is not installed.

    Args:
        tasks: names from `TASKS`.
        options: lengths, haystack and evaluated model (`RulerOptions`).
        data_dir: the data directory (its ``text/war_and_peace.txt`` is the default haystack), or None.
        out_dir: the folder of the generated task configs (lm-eval's ``include_path``).
        offline: the run must not download: QA tasks and the hub haystack are refused.

    Raises:
        RulerError: a QA task offline, an essay task offline without a local haystack, no length
            within the model's context.
        FileNotFoundError: the haystack file is missing.
    """
    unknown = [name for name in tasks if name not in TASKS]
    if unknown:
        raise RulerError(f"{unknown} are not RULER tasks; accepted: {list(TASKS)} or the group {GROUP!r}")
    refused = [name for name in tasks if name in QA_TASKS and offline]
    if refused:
        raise RulerError(f"{refused} refused: lm-eval downloads their documents (SQuAD v2, HotpotQA) at run time and "
                         "this run is offline (a data directory, or HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set). "
                         f"Offline RULER tasks: {list(SYNTHETIC_TASKS)} (--tasks {GROUP} runs them all)")
    essay_tasks = [name for name in tasks if name in ESSAY_TASKS]
    haystack = resolve_haystack(options.haystack, data_dir) if essay_tasks else None
    if essay_tasks and haystack is None and offline:
        raise RulerError(f"{essay_tasks} need a haystack text offline (lm-eval's stock one is a hub dataset): "
                         f"give --ruler-haystack PATH, or a data directory holding {HAYSTACK_IN_DATA_DIR}")
    tokenizer, context, model_name = evaluated_tokenizer_and_context(options.model_args)
    lengths, dropped = lengths_within_context(options.lengths, context)
    notes = [f"RULER lengths {lengths} (tokens; the model's context is {context})"]
    if dropped:
        notes.append(f"RULER lengths {dropped} dropped: longer than the context of {model_name} ({context} tokens)")

    from hshare.eval.tasks import FunctionRef, stock_task_yaml

    out_dir = Path(out_dir).resolve()
    tokenizer_dir = out_dir / "ruler_tokenizer"
    tokenizer.save_pretrained(tokenizer_dir)
    nltk_data, splitter = punkt_data(out_dir)  # lm-eval checks for it whenever a NIAH task loads
    haystack_record = str(haystack) if haystack is not None else STOCK_HAYSTACK
    if essay_tasks:
        notes.append(f"RULER essay haystack ({', '.join(essay_tasks)}): {haystack_record}")
        notes.append(f"RULER sentence splitter (essay haystacks): {splitter}")
    write_glue_module(out_dir, {name: LOCAL_HAYSTACK if name in essay_tasks and haystack is not None
                                else stock_builder(stock_task_yaml(STOCK_FOLDER, name)) for name in tasks})

    configs = {}
    for name in tasks:
        stock_yaml = stock_task_yaml(STOCK_FOLDER, name)
        metadata = {**stock_metadata(stock_yaml), "max_seq_lengths": lengths, "tokenizer": str(tokenizer_dir),
                    TOKENIZER_SOURCE_KEY: model_name, SPLITTER_KEY: splitter}
        config = {"include": str(stock_yaml), "task": name, "tag": None,
                  "custom_dataset": FunctionRef(f"{GLUE_MODULE}.{name}")}
        if name in essay_tasks:
            metadata[HAYSTACK_KEY] = haystack_record
        config["metric_list"] = metric_list(lengths)
        config["metadata"] = metadata
        configs[name] = config
    for line in notes:
        log.info("%s", line)
    return RulerSetup(configs=configs, nltk_data=nltk_data, notes=notes)


def resolve_haystack(flag: str | os.PathLike | None, data_dir: Path | None) -> Path | None:
    """The essay haystack file: `flag`, else ``<data_dir>/text/war_and_peace.txt``, else None (the hub).

    Raises:
        FileNotFoundError: the chosen file does not exist (the message says where it came from).
    """
    if flag is not None and str(flag) != "":
        path = Path(flag).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"--ruler-haystack {str(flag)!r} is not a file; give a text file (any language "
                                    "the model reads; e.g. a data directory's text/war_and_peace.txt)")
        return path
    if data_dir is None:
        return None
    path = Path(data_dir) / HAYSTACK_IN_DATA_DIR
    if not path.is_file():
        raise FileNotFoundError(f"RULER essay tasks: expected {path} in the data directory, or give "
                                "--ruler-haystack PATH (any text file)")
    return path.resolve()


def evaluated_tokenizer_and_context(model_args: dict[str, Any]) -> tuple[Any, int, str]:
    """(tokenizer, context in tokens, a name for messages) of the model `model_args` describe
    (`RulerOptions.model_args`); loads the tokenizer and the config, not the weights, except that the
    embedded default model is converted once (`hshare.eval.lm_eval_model.default_model_dir`).

    Raises:
        RulerError: the config names no context (give ``max_length`` in model_args).
    """
    from transformers import AutoConfig, AutoTokenizer, PreTrainedModel

    pretrained = model_args.get("pretrained")
    load_kwargs = {key: model_args[key] for key in ("revision", "trust_remote_code") if key in model_args}
    gguf = {"gguf_file": model_args["gguf_file"]} if model_args.get("gguf_file") else {}
    if pretrained is None:
        from hshare.default_model import MODEL_NAME
        from hshare.eval.lm_eval_model import default_model_dir

        pretrained, name, gguf = str(default_model_dir()), f"the embedded {MODEL_NAME}", {}
    else:
        name = (pretrained.config.name_or_path or type(pretrained).__name__) \
            if isinstance(pretrained, PreTrainedModel) else str(pretrained)
    tokenizer = model_args.get("tokenizer")
    if tokenizer is None or isinstance(tokenizer, str):
        source = tokenizer or pretrained
        if isinstance(source, PreTrainedModel):
            raise RulerError("model_args: a loaded model as pretrained needs its tokenizer as tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(source, **(gguf if source == pretrained else {}), **load_kwargs)
    if model_args.get("max_length"):
        return tokenizer, int(model_args["max_length"]), name
    config = pretrained.config if isinstance(pretrained, PreTrainedModel) else \
        AutoConfig.from_pretrained(pretrained, **gguf, **load_kwargs)
    text_config = getattr(config, "text_config", None) or config
    for attribute in CONTEXT_ATTRIBUTES:
        if getattr(text_config, attribute, None):
            return tokenizer, int(getattr(text_config, attribute)), name
    raise RulerError(f"the config of {name} names no context length ({', '.join(CONTEXT_ATTRIBUTES)}); "
                     "give it with --model_args max_length=N")


def lengths_within_context(lengths: list[int] | None, context: int) -> tuple[list[int], list[int]]:
    """(kept, dropped): `lengths` (None = lm-eval's ``DEFAULT_SEQ_LENGTHS``) split at `context`.

    Raises:
        RulerError: none is kept (the message names the context and the accepted lengths).
    """
    if lengths is None:
        from lm_eval.tasks.ruler.common_utils import DEFAULT_SEQ_LENGTHS

        lengths = sorted(DEFAULT_SEQ_LENGTHS)
    if context < MIN_LENGTH:
        raise RulerError(f"the model's context ({context} tokens) is shorter than the shortest RULER length "
                         f"hshare builds ({MIN_LENGTH} tokens)")
    kept = [length for length in lengths if length <= context]
    dropped = [length for length in lengths if length > context]
    if not kept:
        raise RulerError(f"RULER lengths {lengths} are all longer than the model's context ({context} tokens); "
                         f"accepted: --ruler-lengths from {MIN_LENGTH} to {context} tokens")
    return kept, dropped


def punkt_data(out_dir: Path) -> tuple[Path | None, str]:
    """(folder for nltk's data path or None, description of the sentence splitter).

    If nltk finds its ``punkt_tab`` English model, (None, its location). Otherwise a Punkt model with
    empty parameters is written in ``punkt_tab`` layout under ``out_dir/nltk_data`` (nltk's own
    `save_punkt_params`; nltk accepts files only under its data path, so the folder is on it while
    writing) and that folder is returned.
    """
    import nltk
    from nltk.tokenize.punkt import PunktParameters, save_punkt_params

    model = f"tokenizers/punkt_tab/{PUNKT_LANGUAGE}/"
    try:
        found = nltk.data.find(model)
        return None, f"nltk punkt_tab model '{PUNKT_LANGUAGE}' ({found})"
    except LookupError:
        pass
    root = (Path(out_dir) / "nltk_data").resolve()
    (root / model).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with nltk_data_path(root):
        save_punkt_params(PunktParameters(), dir=str(root / model))
    return root, ("nltk Punkt with empty parameters, no learned abbreviations (nltk's punkt_tab model is not "
                  "installed; its downloader is never called)")


@contextlib.contextmanager
def nltk_data_path(folder: Path) -> Iterator[None]:
    """`folder` first on nltk's data path inside the block."""
    import nltk

    nltk.data.path.insert(0, str(folder))
    try:
        yield
    finally:
        nltk.data.path.remove(str(folder))


def use_nltk_data(folder: Path) -> None:
    """Put `folder` first on nltk's data path for the rest of the process (and ``NLTK_DATA`` for its
    children); the caller does this before lm-eval loads a RULER task."""
    import nltk

    if str(folder) not in nltk.data.path:
        nltk.data.path.insert(0, str(folder))
    os.environ["NLTK_DATA"] = os.pathsep.join([str(folder), *filter(None, [os.environ.get("NLTK_DATA")])])


def metric_list(lengths: list[int]) -> list[dict]:
    """One metric per length, aggregated by lm-eval's own ``aggregate_metrics`` (which ignores the -1
    its ``process_results`` gives the lengths a document does not have). The lengths in lm-eval's
    ``DEFAULT_SEQ_LENGTHS`` are always listed: ``process_results`` reports them for every document."""
    from lm_eval.tasks.ruler.common_utils import DEFAULT_SEQ_LENGTHS

    from hshare.eval.tasks import FunctionRef

    return [{"metric": str(length), "aggregation": FunctionRef(f"{GLUE_MODULE}.aggregate_metrics"),
             "higher_is_better": True} for length in sorted(set(lengths) | set(DEFAULT_SEQ_LENGTHS))]


def write_glue_module(out_dir: Path, builders: dict[str, str]) -> None:
    """`GLUE_MODULE`.py in `out_dir` (lm-eval resolves ``!function`` next to the YAML): lm-eval's
    ``aggregate_metrics`` and, per task, its documents built once (`documents_once`) by `builders`
    (task -> the dotted path of lm-eval's builder, or `LOCAL_HAYSTACK`)."""
    lines = "".join(f'{name} = partial(documents_once, "{name}", "{builder}")\n' for name, builder in builders.items())
    (Path(out_dir) / f"{GLUE_MODULE}.py").write_text(
        '"""Generated by hshare.eval.ruler; regenerated on each run. lm-eval resolves !function next to the YAML."""\n'
        "from functools import partial\n\n"
        "from lm_eval.tasks.ruler.common_utils import aggregate_metrics  # noqa: F401\n\n"
        "from hshare.eval.ruler import documents_once\n\n" + lines, encoding="utf-8")


LOCAL_HAYSTACK = "local_haystack"  # a builder name: `local_haystack_dataset`
_DOCUMENTS: dict[tuple[str, str, str], Any] = {}  # (task, builder, metadata) -> lm-eval's {"test": Dataset}


def stock_builder(stock_yaml: Path) -> str:
    """The dotted path of the ``custom_dataset`` function a stock RULER task YAML names
    (``!function niah_utils.niah_single_1`` -> ``lm_eval.tasks.ruler.niah_utils.niah_single_1``)."""
    match = re.search(r"^custom_dataset:\s*!function\s+([\w.]+)\s*$", Path(stock_yaml).read_text(), re.MULTILINE)
    if match is None:
        raise RulerError(f"{stock_yaml} names no custom_dataset function; this lm-eval's RULER layout is not "
                         "the 0.4.x one hshare builds documents with")
    return f"{STOCK_MODULE}.{match.group(1)}"


def documents_once(task: str, builder: str, **metadata: Any) -> Any:
    """lm-eval's documents of `task` for `metadata`, built by `builder` (a dotted function path, or
    `LOCAL_HAYSTACK`) at the first call in this process and reused after it: every config evaluated in
    one process reads the same documents. Returns lm-eval's ``{"test": datasets.Dataset}``."""
    import json

    key = (task, builder, json.dumps(metadata, sort_keys=True, default=str))
    if key not in _DOCUMENTS:
        if builder == LOCAL_HAYSTACK:
            _DOCUMENTS[key] = local_haystack_dataset(task, **metadata)
        else:
            module, _, name = builder.rpartition(".")
            _DOCUMENTS[key] = getattr(importlib.import_module(module), name)(**metadata)
    return _DOCUMENTS[key]


def local_haystack_dataset(task: str, **metadata: Any) -> dict:
    """lm-eval's own builder of essay task `task` (``lm_eval.tasks.ruler.niah_utils.<task>``, called
    with `metadata`), its essay haystack replaced by the words of the file ``metadata["ruler_haystack"]``.

    Returns:
        lm-eval's ``{"test": datasets.Dataset}``: 500 documents per length, each with ``input``,
        ``outputs`` (the needle values), ``length``, ``max_length``, ``gen_prefix``.

    Raises:
        RulerError: `task` is not an essay task, no haystack in `metadata`, or this lm-eval's
            ``niah_utils`` lacks ``get_haystack`` or the task's builder.
    """
    if task not in ESSAY_TASKS:
        raise RulerError(f"{task!r} has no essay haystack; essay tasks: {list(ESSAY_TASKS)}")
    if not metadata.get(HAYSTACK_KEY):
        raise RulerError(f"task {task!r}: no {HAYSTACK_KEY} in the task metadata (a text file path)")
    niah_utils = importlib.import_module("lm_eval.tasks.ruler.niah_utils")
    stock_haystack, build = getattr(niah_utils, "get_haystack", None), getattr(niah_utils, task, None)
    if not callable(stock_haystack) or not callable(build):
        import lm_eval

        raise RulerError(f"lm-eval {getattr(lm_eval, '__version__', '?')}: lm_eval.tasks.ruler.niah_utils has no "
                         f"get_haystack or {task}; the local haystack needs lm-eval 0.4.x's RULER layout")
    words = haystack_words(str(metadata[HAYSTACK_KEY]))

    def get_haystack(type_haystack: str):
        return list(words) if type_haystack == "essay" else stock_haystack(type_haystack)

    niah_utils.get_haystack = get_haystack
    try:
        dataset = build(**metadata)
    finally:
        niah_utils.get_haystack = stock_haystack
    warn_short_documents(task, dataset["test"], metadata[HAYSTACK_KEY], len(words))
    return dataset


@functools.lru_cache(maxsize=4)
def haystack_words(path: str) -> tuple[str, ...]:
    """The words of text file `path` (split at whitespace), the form of lm-eval's essay haystack.

    Raises:
        RulerError: the file holds no word.
    """
    words = tuple(Path(path).read_text(encoding="utf-8").split())
    if not words:
        raise RulerError(f"RULER haystack {path} holds no text; give a text file with --ruler-haystack")
    return words


def warn_short_documents(task: str, documents: datasets.Dataset, haystack: str, haystack_words_count: int) -> None:
    """Log a warning for each length whose longest document is under half of it (lm-eval grows essay
    haystacks 500 words at a time and stops at the end of the text)."""
    longest: dict[int, int] = {}
    for budget, length in zip(documents["max_length"], documents["length"]):
        longest[budget] = max(longest.get(budget, 0), length)
    for budget, length in sorted(longest.items()):
        if length < budget // 2:
            log.warning("%s: documents of length %d reach only %d tokens (haystack %s, %d words; lm-eval adds "
                        "haystack text 500 words at a time)", task, budget, length, haystack, haystack_words_count)


def stock_metadata(path: Path) -> dict:
    """The ``metadata`` a stock task YAML ends up with, its ``include`` chain followed (the generated
    config replaces the whole mapping, so the stock entries, ``version`` among them, are carried over)."""
    from hshare.eval.tasks import _StockLoader

    config = yaml.load(Path(path).read_text(encoding="utf-8"), Loader=_StockLoader)
    if "metadata" in config or "include" not in config:
        return dict(config.get("metadata") or {})
    return stock_metadata(Path(path).parent / config["include"])
