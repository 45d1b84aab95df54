"""The ``hshare`` command: ``demo``, ``eval``, ``sweep``, ``fidelity``, ``plan``, ``calibrate``, ``presets``,
``bench attention|prefix|generate|grid|plot``."""

from __future__ import annotations

import argparse
import sys
from fractions import Fraction


def _demo(args: argparse.Namespace) -> int:
    from hshare.demo import DEMO_PRESETS, run_demo

    presets = tuple(args.presets.split(",")) if args.presets else DEMO_PRESETS
    if "dense" not in presets:
        presets = ("dense", *presets)
    run_demo(args.data_dir, args.questions, args.new_tokens, presets, args.threads)
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from hshare.calibrate import calibrate_to_file, default_calibration_path
    from hshare.channels import model_name
    from hshare.default_model import load_model

    model, tokenizer = load_model(args.model, args.gguf_file, "float32", args.device)
    name = model_name(model.config)
    out = args.out or default_calibration_path(name)
    with tqdm(total=args.blocks, desc="calibrating", unit="block") as bar:
        calibration = calibrate_to_file(model, tokenizer, args.text, out, blocks=args.blocks,
                                        block_tokens=args.block_tokens, name=name,
                                        progress=lambda done, total: bar.update(1))
    print(f"wrote {out}: {calibration.model}, {calibration.signature}, {calibration.tokens} tokens "
          f"(hshare.patch finds it for this model with heavy_channels='auto')")
    return 0


def _ratio(value: float) -> str:
    """A sharing ratio or budget as the fraction it was written as (0.25 -> '1/4')."""
    return str(Fraction(value).limit_denominator(64))


def _presets(args: argparse.Namespace) -> int:
    from hshare.config import HShareConfig, preset_names

    names = preset_names()
    width = max(map(len, names)) + 2
    for name in names:
        c = HShareConfig.from_preset(name)
        b, s = c.budget, c.sharing
        scores = c.policy.describe() if b.heavy else "no scoring"
        refine = f" refining {c.candidate_count} candidates" if c.candidate_count else ""
        refine += " by exact logits" if c.candidate_count and s.refine_by == "keys" else ""
        refine += " at selection steps" if c.candidate_count and not s.refine_steps else ""
        refine += (" with successors" if c.candidate_count else ", heavy with successors") if s.successors else ""
        sharing = f"sharing {s.layer:g}-{s.head:g}-{s.query:g}"
        if c.planner.scorings is not None:
            sharing = (f"auto planner: at most {_ratio(c.planner.scorings)} of the (layer, head) pairs selecting "
                       f"(bounds layer {_ratio(s.layer)}, head {_ratio(s.head)}), query {_ratio(s.query)}")
        detail = f"N_c {b.total} = {b.sink}+{b.local}+{b.heavy}, {sharing}{refine}, {scores}" if c.sparse else "exact dense"
        print(f"{name:<{width}}{detail}")
    return 0


def _rounds_arg(text: str) -> int:  # torch is imported only where the option is given
    from hshare.bench.generate import rounds_arg

    return rounds_arg(text)


def _bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from hshare import bench

    if args.what == "plot":
        if not args.results:
            raise SystemExit("hshare bench plot RESULTS.json: the results file is missing")
        print(f"wrote {bench.plot(Path(args.results))}")
        return 0
    if args.what == "generate":
        paths = tuple(args.paths.split(",")) if args.paths else bench.generate.PATHS
        try:
            bench.generate.check_paths(paths)
        except ValueError as error:
            raise SystemExit(f"hshare bench generate --paths: {error}") from None
        bench.main_generate(Path(args.out), args.shape, args.batch, args.prompt, args.new_tokens, paths, args.shared,
                            args.layers, args.smoke,
                            {} if args.dense_fallback_mib is None else {"dense_fallback_mib": args.dense_fallback_mib},
                            tp=args.tp, device_map=args.device_map, repeats=args.repeats, timing=args.timing,
                            rounds=args.rounds)
        return 0
    run = bench.main_attention if args.what == "attention" else bench.main_prefix
    run(Path(args.out), args.smoke)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["eval"]:  # lm-eval's own arguments: not parsed here
        from hshare.eval.lm_eval_cli import main_eval

        return main_eval(argv[1:])
    if argv[:2] == ["bench", "grid"]:  # its own arguments (python -m hshare.bench.grid --help)
        from hshare.bench.grid import main as main_grid

        return main_grid(argv[2:])
    parser = argparse.ArgumentParser(prog="hshare", description="HShare sparse decoding for transformers")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="GSM8K on the embedded SmolLM2-135M-Instruct: dense vs presets")
    demo.add_argument("--data-dir", help="directory with gsm8k/test.jsonl (default: 8 built-in questions)")
    demo.add_argument("--questions", type=int, default=6, help="batch size (default 6)")
    demo.add_argument("--new-tokens", type=int, default=40, help="tokens to generate (default 40)")
    demo.add_argument("--presets", help="comma-separated presets, each with optional +FIELD=VALUE options and "
                      "+prefix (default: dense, streaming, ds, the sharing presets, and hshare-auto with and without "
                      "group_lookahead)")
    demo.add_argument("--threads", type=int, help="torch CPU threads")
    demo.set_defaults(run=_demo)

    cal = commands.add_parser("calibrate", help="heavy-channel calibration of a model on a text file")
    cal.add_argument("text", help="a plain-text corpus (e.g. War and Peace)")
    cal.add_argument("out", nargs="?", help="output JSON (default: configs/channels/<model>.json when writable, "
                                            "else $HSHARE_CACHE/channels/<model>.json)")
    cal.add_argument("--model", help="a model directory or hub id (default: the embedded SmolLM2)")
    cal.add_argument("--gguf-file", help="a GGUF file inside --model")
    cal.add_argument("--device", help="cuda or cpu (default: CUDA when present)")
    cal.add_argument("--blocks", type=int, default=16)
    cal.add_argument("--block-tokens", type=int, default=512)
    cal.set_defaults(run=_calibrate)

    presets = commands.add_parser("presets", help="list the bundled presets")
    presets.set_defaults(run=_presets)

    bench = commands.add_parser("bench", help="decode speed: attention, prefix, generate, grid (run it on a GPU)")
    bench.add_argument("what", choices=("attention", "prefix", "generate", "grid", "plot"),
                       help="grid: `hshare bench grid --help` (its own arguments)")
    bench.add_argument("results", nargs="?", help="for plot: a results JSON written by a bench")
    bench.add_argument("--out", default="bench-results", help="directory for the JSON and PNG (default bench-results)")
    bench.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the bench runs)")
    bench.add_argument("--shape", default="llama2-7b",
                       help="generate: llama2-7b, llama3-8b, llama3.1-8b, mistral-7b, llama3-70b, tiny (random weights)")
    bench.add_argument("--batch", type=int, default=16, help="generate: rows")
    bench.add_argument("--prompt", type=int, default=4096, help="generate: prompt tokens")
    bench.add_argument("--new-tokens", type=int, default=256, help="generate: new tokens")
    bench.add_argument("--paths", default="", help="generate: comma-separated paths (unpatched, static, presets)")
    bench.add_argument("--shared", action="store_true", help="generate: every row is one prompt (prefix held once)")
    bench.add_argument("--layers", type=int, default=None, help="generate: cut the model to this many layers")
    bench.add_argument("--repeats", type=int, default=1,
                       help="generate: timed pairs (1-token, N-token generate) per path; the row gives the median")
    bench.add_argument("--rounds", type=_rounds_arg, default=1,
                       help="generate: the paths measured in turn this many times, every other round reversed (A B, "
                            "B A, ...); a row's rate is the median over its rounds (an A/B in one process)")
    bench.add_argument("--timing", choices=("pairs", "steps"), default="pairs",
                       help="generate: pairs (t(N) - t(1), after a warm-up call) or steps (the tokens of one N-token "
                            "generate timed as they come, the first quarter of the steps left out: a third of the "
                            "prefills)")
    bench.add_argument("--dense-fallback-mib", type=float, default=None,
                       help="generate: HShareConfig.runtime.dense_fallback_mib for patched paths (0: sparse at any size)")
    bench.add_argument("--tp", type=int, default=1,
                       help="generate: tensor-parallel ranks, one a GPU; run under torchrun: `torchrun --standalone "
                            "--nproc-per-node N -m hshare.cli bench generate --tp N ...` (rank 0 prints and writes)")
    bench.add_argument("--device-map", default=None,
                       help="generate: dispatch the model over the visible GPUs with accelerate: auto, balanced, "
                            "sequential, or splitN (the layers in N contiguous parts, one a GPU); sparse presets "
                            "are refused there (the row records why)")
    bench.set_defaults(run=_bench)

    commands.add_parser("eval", help="lm-eval with the 'hshare' model and local task data (hshare eval --help)",
                        add_help=False)
    from hshare.eval.fidelity import add_fidelity_parser
    from hshare.eval.plan import add_plan_parser
    from hshare.eval.sweep import add_sweep_parser

    add_sweep_parser(commands)
    add_fidelity_parser(commands)
    add_plan_parser(commands)

    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
