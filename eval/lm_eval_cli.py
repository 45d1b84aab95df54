"""``hshare eval``: lm-eval's own command line, with the ``hshare`` model registered and local tasks.

    hshare eval --model hshare --model_args pretrained=<dir or hub id>,hshare=ds@512 \\
        --tasks gsm8k,coqa,longbench_multi_news --data-dir data/ --limit 20

Every lm-eval ``run`` argument is accepted as lm-eval documents it. Added here:

* ``--data-dir DIR`` (or ``$HSHARE_DATA_DIR``): task configs are generated from local files
  (`hshare.eval.tasks`) and passed to lm-eval as ``--include_path``; the hub is not contacted;
* RULER (`hshare.eval.ruler`): ``--tasks ruler`` (its 11 tasks built in code) or stock task names
  (``niah_single_1,ruler_vt``); the documents are sized with the evaluated model's tokenizer;
  ``--ruler-lengths 4k,8k`` (token counts, ``k`` = 1024; default lm-eval's 4096; lengths above the
  model's context are dropped with a note); ``--ruler-haystack PATH``: the essay tasks' haystack
  (default ``<data dir>/text/war_and_peace.txt``; lm-eval's hub essays when online without either).
  The QA tasks (``ruler_qa_squad``, ``ruler_qa_hotpot``) download their documents: refused offline.
  lm-eval's ``--metadata`` must not set ``max_seq_lengths`` or ``tokenizer`` (the flags above do);
  ``--limit N`` keeps the first N documents of each task, all of the first length;
* ``--model`` defaults to ``hshare``; ``pretrained`` defaults to the embedded SmolLM2; ``--device``
  defaults to ``cuda:0`` where CUDA is available, else ``cpu``;
* after lm-eval's table, the work counters of the generations (label scorings, KV rows read).

Several GPUs (see `hshare.eval.lm_eval_model`):

* data parallel, one model copy per GPU, the documents split over them (lm-eval's own way)::

      accelerate launch -m hshare eval --model_args pretrained=<dir or hub id>,hshare=ds@512 --tasks gsm8k

  (``python -m hshare`` is the ``hshare`` command); the work counters printed are summed over the
  ranks, by rank 0, which alone writes lm-eval's outputs;
* one model split over GPUs: ``--model_args ...,parallelize=True`` runs ``hshare=dense``; a sparse
  config is refused once the model is loaded, before any request, with a message naming what to
  change (exit status 1).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hshare.eval.ruler import RulerOptions
    from hshare.eval.tasks import TaskSetup


def split_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Our options (``--data-dir``, ``--tasks``, ``--include_path``, ``--model``, ``--ruler-lengths``,
    ``--ruler-haystack``) and the rest, which goes to lm-eval unchanged."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--data-dir", "--data_dir", dest="data_dir")
    parser.add_argument("--tasks", "-t")
    parser.add_argument("--include_path")
    parser.add_argument("--model", "-m", default="hshare")
    parser.add_argument("--ruler-lengths", "--ruler_lengths", dest="ruler_lengths")
    parser.add_argument("--ruler-haystack", "--ruler_haystack", dest="ruler_haystack")
    return parser.parse_known_args(argv)


def lm_eval_options(rest: list[str]) -> argparse.Namespace:
    """lm-eval's ``--model_args`` and ``--metadata`` in `rest` as dicts, parsed as lm-eval parses them
    (``key=val,key2=val2``, ``key=val key2=val2`` or JSON); `rest` itself is left as it is."""
    from lm_eval._cli.utils import MergeDictAction

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model_args", "-a", nargs="+", action=MergeDictAction, default={})
    parser.add_argument("--metadata", nargs="+", action=MergeDictAction, default={})
    return parser.parse_known_args(rest)[0]


def ruler_options(ours: argparse.Namespace, rest: list[str]) -> RulerOptions | None:
    """`hshare.eval.ruler.RulerOptions` from ``--ruler-lengths``, ``--ruler-haystack`` and lm-eval's
    ``--model_args``; None when ``--tasks`` names no RULER task.

    Raises:
        hshare.eval.ruler.RulerError: a ``--ruler-*`` flag without a RULER task, lm-eval's
            ``--metadata`` setting ``max_seq_lengths`` or ``tokenizer`` (the message names the flag to
            use instead), or a malformed length.
    """
    from hshare.eval.ruler import GROUP, TASKS, RulerError, RulerOptions, parse_lengths

    if not {name.strip() for name in ours.tasks.split(",")} & {GROUP, *TASKS}:
        given = [flag for flag, value in (("--ruler-lengths", ours.ruler_lengths),
                                          ("--ruler-haystack", ours.ruler_haystack)) if value is not None]
        if given:
            raise RulerError(f"{' and '.join(given)} apply to RULER tasks, and --tasks names none "
                             f"(RULER: {GROUP} or any of {list(TASKS)})")
        return None
    lm_eval_args = lm_eval_options(rest)
    taken = {"max_seq_lengths": "--ruler-lengths", "tokenizer": "--model_args tokenizer=NAME"}
    clash = sorted(set(lm_eval_args.metadata) & set(taken))
    if clash:
        raise RulerError(f"--metadata {clash}: hshare eval sets these for RULER itself; use "
                         f"{', '.join(taken[key] for key in clash)} instead")
    return RulerOptions(lengths=None if ours.ruler_lengths is None else parse_lengths(ours.ruler_lengths),
                        haystack=ours.ruler_haystack, model_args=dict(lm_eval_args.model_args))


def lm_eval_argv(argv: list[str], task_dir: Path) -> tuple[list[str], TaskSetup]:
    """The argument list for lm-eval's ``run``, and the `hshare.eval.tasks.TaskSetup` (its ``offline``:
    the run is offline; its ``nltk_data`` and ``notes``: RULER's).

    Args:
        argv: ``hshare eval``'s arguments.
        task_dir: where generated task YAMLs are written.
    """
    from hshare.eval.tasks import prepare_tasks, resolve_data_dir

    ours, rest = split_args(argv)
    if ours.tasks is None:
        raise SystemExit("hshare eval: --tasks is required (e.g. --tasks gsm8k,coqa,longbench_multi_news)")
    setup = prepare_tasks(ours.tasks.split(","), resolve_data_dir(ours.data_dir), task_dir,
                          ruler_options(ours, rest))
    include = [p for p in (ours.include_path, setup.include_path) if p]
    out = ["run", "--model", ours.model, "--tasks", ",".join(setup.tasks), *rest]
    if include:
        out += ["--include_path", os.pathsep.join(include) if len(include) > 1 else include[0]]
    if not any(arg == "--device" or arg.startswith("--device=") for arg in rest):
        out += ["--device", default_device()]
    return out, setup


def default_device() -> str:
    """lm-eval's default device is ``cuda:0``; on a machine without CUDA the run could not start, so ``hshare
    eval`` names the device it can run on when ``--device`` is not given."""
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"


def main_eval(argv: list[str]) -> int:
    """Run lm-eval with `argv` (see the module docstring); returns the exit code."""
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        argv = ["run", "--help"]
    import hshare.eval.lm_eval_model as lm_eval_model  # registers the "hshare" model
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    from hshare.eval.ruler import RulerError, use_nltk_data

    lm_eval_model.HShareLM.last = None
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="hshare-tasks-") as task_dir:  # one per process (rank)
        if argv[:2] != ["run", "--help"]:
            try:
                argv, setup = lm_eval_argv(argv, Path(task_dir))
            except RulerError as error:
                raise SystemExit(f"hshare eval: {error}") from None
            if setup.offline:
                os.environ.setdefault("HF_HUB_OFFLINE", "1")
                os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
            if setup.nltk_data is not None:
                use_nltk_data(Path(setup.nltk_data))
            notes = setup.notes
            for line in notes:
                print(f"hshare eval: {line}", file=sys.stderr)
        setup_logging()
        saved, sys.argv = sys.argv, ["lm-eval", *argv]
        try:
            cli = HarnessCLI()
            cli.execute(cli.parse_args())
        except lm_eval_model.SplitPlacementError as error:
            raise SystemExit(f"hshare eval: {error}") from None
        finally:
            sys.argv = saved
    lm = lm_eval_model.HShareLM.last
    if notes and (lm is None or lm.rank == 0):
        print("\n".join(notes))
    if lm is not None:
        print_work(lm)
        if lm.world_size > 1:
            _leave_process_group()
    return 0


def _leave_process_group() -> None:
    """End the data-parallel process group together (a rank exiting while another still holds it can
    abort the other at exit)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def print_work(lm) -> None:
    """Print the work counters of `lm`'s generations and what their sharing plans shared: over the
    data-parallel ranks, by rank 0 (every rank must call this: the sum is a collective)."""
    work = lm.work_over_ranks()
    if lm.rank != 0:
        return
    ranks = f", summed over {lm.world_size} data-parallel ranks" if lm.world_size > 1 else ""
    print(f"hshare work counters ({lm.hshare_config.name}{ranks}): {work.as_dict()}")
    if work.planned:
        print(f"hshare sharing plans ({lm.hshare_config.name}, the mean of {work.planned} batches' "
              f"SharingPlan.summary): {work.plan_mean()}")
