"""The table of an A/B of two code versions, each timed by `python3 -m hshare.bench.grid` in processes of its own
(`benchmarks/device.sh ab`): decode tok/s of every (shape, rows, prompt, path) by process, and the new code's median
over the base's.

    python3 benchmarks/ab_table.py OUT    # reads OUT/ab_base_*/bench_grid.json and OUT/ab_new_*/bench_grid.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def decode_rates(out: Path, side: str) -> dict[str, list[float]]:
    """Decode tok/s of each row of `side`'s grids under `out`, in process order (a process's rounds in order)."""
    rates: dict[str, list[float]] = {}
    for grid in sorted(out.glob(f"ab_{side}_*/bench_grid.json"), key=lambda p: int(p.parent.name.rsplit("_", 1)[1])):
        for row in json.loads(grid.read_text())["generate"]:
            if row.get("decode_tok_s"):
                key = f"{row['shape']} B{row['batch']} x {row['prompt']} `{row['path']}`"
                rates.setdefault(key, []).extend(row.get("decode_tok_s_runs") or [row["decode_tok_s"]])
    return rates


def table(out: Path) -> str:
    base, new = decode_rates(out, "base"), decode_rates(out, "new")
    lines = ["| row | base tok/s | new tok/s | new / base (medians) |", "|---|---|---|---|"]
    for key in sorted(base.keys() | new.keys()):
        b, n = base.get(key, []), new.get(key, [])
        ratio = f"{statistics.median(n) / statistics.median(b):.3f}" if b and n else "-"
        lines.append(f"| {key} | {' / '.join(f'{v:.1f}' for v in b) or '-'} | "
                     f"{' / '.join(f'{v:.1f}' for v in n) or '-'} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the folder holding ab_base_K/ and ab_new_K/")
    print(table(parser.parse_args().out))


if __name__ == "__main__":
    main()
