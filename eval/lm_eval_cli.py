"""``hshare eval``: lm-eval's own command line, with the ``hshare`` model registered and local tasks.

    hshare eval --model hshare --model_args pretrained=<dir or hub id>,hshare=ds@512 \\
        --tasks gsm8k,coqa,longbench_multi_news --data-dir data/ --limit 20

Every lm-eval ``run`` argument is accepted as lm-eval documents it. Added here:

* ``--data-dir DIR`` (or ``$HSHARE_DATA_DIR``): task configs are generated from local files
  (`hshare.eval.tasks`) and passed to lm-eval as ``--include_path``; the hub is not contacted;
* ``--model`` defaults to ``hshare``; ``pretrained`` defaults to the embedded SmolLM2;
* after lm-eval's table, the work counters of the generations (label scorings, KV rows read).
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

    with tempfile.TemporaryDirectory(prefix="hshare-tasks-") as task_dir:
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
        finally:
            sys.argv = saved
    lm = lm_eval_model.HShareLM.last
    if lm is not None:
        print(f"hshare work counters ({lm.hshare_config.name}): {lm.work.as_dict()}")
    return 0
