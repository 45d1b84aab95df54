"""``hshare eval``: lm-eval's own command line, with the ``hshare`` model registered and local tasks.

    hshare eval --model hshare --model_args pretrained=<dir or hub id>,hshare=ds@512 \\
        --tasks gsm8k,coqa,longbench_multi_news --data-dir data/ --limit 20

Every lm-eval ``run`` argument is accepted as lm-eval documents it. Added here:

* ``--data-dir DIR`` (or ``$HSHARE_DATA_DIR``): task configs are generated from local files
  (`hshare.eval.tasks`) and passed to lm-eval as ``--include_path``; the hub is not contacted;
* ``--model`` defaults to ``hshare``; ``pretrained`` defaults to the embedded SmolLM2;
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


def split_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Our options (``--data-dir``, ``--tasks``, ``--include_path``, ``--model``) and the rest, which
    goes to lm-eval unchanged."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--data-dir", "--data_dir", dest="data_dir")
    parser.add_argument("--tasks", "-t")
    parser.add_argument("--include_path")
    parser.add_argument("--model", "-m", default="hshare")
    return parser.parse_known_args(argv)


def lm_eval_argv(argv: list[str], task_dir: Path) -> tuple[list[str], bool]:
    """The argument list for lm-eval's ``run`` and whether the run is offline.

    Args:
        argv: ``hshare eval``'s arguments.
        task_dir: where generated task YAMLs are written.
    """
    from hshare.eval.tasks import prepare_tasks, resolve_data_dir

    ours, rest = split_args(argv)
    if ours.tasks is None:
        raise SystemExit("hshare eval: --tasks is required (e.g. --tasks gsm8k,coqa,longbench_multi_news)")
    setup = prepare_tasks(ours.tasks.split(","), resolve_data_dir(ours.data_dir), task_dir)
    include = [p for p in (ours.include_path, setup.include_path) if p]
    out = ["run", "--model", ours.model, "--tasks", ",".join(setup.tasks), *rest]
    if include:
        out += ["--include_path", os.pathsep.join(include) if len(include) > 1 else include[0]]
    return out, setup.offline


def main_eval(argv: list[str]) -> int:
    """Run lm-eval with `argv` (see the module docstring); returns the exit code."""
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        argv = ["run", "--help"]
    import hshare.eval.lm_eval_model as lm_eval_model  # registers the "hshare" model
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    lm_eval_model.HShareLM.last = None
    with tempfile.TemporaryDirectory(prefix="hshare-tasks-") as task_dir:  # one per process (rank)
        if argv[:2] != ["run", "--help"]:
            argv, offline = lm_eval_argv(argv, Path(task_dir))
            if offline:
                os.environ.setdefault("HF_HUB_OFFLINE", "1")
                os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
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
    """Print the work counters of `lm`'s generations: summed over the data-parallel ranks, by rank
    0 (every rank must call this: the sum is a collective)."""
    work = lm.work_over_ranks()
    if lm.rank != 0:
        return
    ranks = f", summed over {lm.world_size} data-parallel ranks" if lm.world_size > 1 else ""
    print(f"hshare work counters ({lm.hshare_config.name}{ranks}): {work.as_dict()}")
