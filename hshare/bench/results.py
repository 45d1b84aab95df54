"""What every benchmark writes: its results as JSON with the environment they were measured in,
and a PNG plot next to it where matplotlib is installed (``hshare bench plot results.json`` draws
it later, from the benchmark that wrote the JSON)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import torch


def environment() -> dict:
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__,
            "date": time.strftime("%Y-%m-%d")}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            pass
    else:
        info["device"] = "cpu"
    return info


def write(results: dict, out: Path, name: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(results, indent=1))
    try:
        plot(path)
    except ImportError:
        print(f"(matplotlib not installed: run `hshare bench plot {path}` where it is)")
    return path


def plot(path: Path) -> Path:
    """The PNG of a results JSON (same name), drawn by the benchmark that wrote it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hshare.bench import attention, generate, prefix

    path = Path(path)
    results = json.loads(path.read_text())
    if "attention" in results:
        fig = attention.figure(results)
    elif "prefix" in results:  # tested before "generate": a prefix JSON holds `generate_speed` rows there too
        fig = prefix.figure(results)
    else:
        fig = generate.figure(results, path.stem)
    fig.tight_layout()
    png = path.with_suffix(".png")
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def speedup_panels(results: dict, title: str, draw: Callable[[object, str], None]):
    """Speed-up against the fastest dense backend: eager (what ``generate`` runs) and CUDA-graph
    replay (GPU time alone) side by side; ``draw(ax, suffix)`` draws one panel's bars, suffix ``""``
    (eager) or ``"_graph"`` as in the rows' ``speedup_graph``."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(15, 5), sharey=True)
    for ax, (suffix, mode) in zip(axes, (("", "eager"), ("_graph", "CUDA graph"))):
        draw(ax, suffix)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title(f"{title}\n{mode} - {results['env'].get('device')}", fontsize=10)
    axes[0].set_ylabel("speed-up (x)")
    return fig
