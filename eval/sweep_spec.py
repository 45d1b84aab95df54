"""A sweep's list of configs, read from YAML (``configs/sweeps/*.yaml``).

A sweep file names the tasks (optional: the command line may give them) and the configs::

    tasks: [longbench_multi_news]
    configs:
      - dense                                  # a preset name or a YAML path
      - ds@512
      - {name: ds-dense01, preset: ds@512, set: {dense_layers: [0, 1]}}
    vary:                                      # each value of each field alone, on one base
      base: ds@512
      layer_sharing: ["3/4", "1/2", "1/4"]
      query_sharing: ["1/2", "1/4"]

``vary`` entries are named ``<base>+<field>=<value>``; a list of ``vary`` blocks is allowed.
Every config is validated when the file is read, before anything runs.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from hshare.config import ConfigError, HShareConfig, resolve_config


@dataclass(frozen=True)
class SweepEntry:
    """One config of a sweep.

    Attributes:
        name: the row name in tables and plots (unique in the sweep).
        preset: a preset name or YAML path.
        overrides: `HShareConfig` fields replacing the preset's.
    """

    name: str
    preset: str
    overrides: dict[str, Any] = field(default_factory=dict, hash=False)

    def config(self) -> HShareConfig:
        return resolve_config(self.preset, **self.overrides).replace(name=self.name)

    @property
    def file_stem(self) -> str:
        """`name` as a file name (``/`` and other characters outside ``[A-Za-z0-9._@+=-]`` -> ``_``)."""
        return re.sub(r"[^A-Za-z0-9._@+=-]", "_", self.name)


@dataclass
class SweepSpec:
    """Tasks and configs of a sweep file."""

    entries: list[SweepEntry]
    tasks: list[str] = field(default_factory=list)
    source: str = ""


def _entry(item: Any, where: str) -> SweepEntry:
    if isinstance(item, str):
        return SweepEntry(item, item)
    if isinstance(item, dict) and "preset" in item:
        unknown = set(item) - {"name", "preset", "set"}
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}; accepted: name, preset, set")
        overrides = dict(item.get("set") or {})
        if isinstance(overrides.get("dense_layers"), list):
            overrides["dense_layers"] = tuple(overrides["dense_layers"])
        return SweepEntry(str(item.get("name") or item["preset"]), str(item["preset"]), overrides)
    raise ConfigError(f"{where} = {item!r}; accepted: a preset name / YAML path, or a mapping with preset, name, set")


def _varied(block: Any, where: str) -> list[SweepEntry]:
    if not isinstance(block, dict) or "base" not in block:
        raise ConfigError(f"{where}: accepted: a mapping with 'base' (a preset) and fields mapped to lists of values")
    base = str(block["base"])
    entries = []
    for name, values in block.items():
        if name == "base":
            continue
        if not isinstance(values, list):
            raise ConfigError(f"{where}.{name} = {values!r}; accepted: a list of values")
        for value in values:
            entries.append(SweepEntry(f"{base}+{name}={value}", base, {name: tuple(value) if isinstance(value, list)
                                                                         else value}))
    return entries


def load_sweep(path_or_name: str | os.PathLike) -> SweepSpec:
    """Read a sweep file (a path, or the name of a bundled one in ``configs/sweeps``) and validate it."""
    path = Path(path_or_name)
    if not path.is_file():
        bundled = sweep_dir() / f"{path_or_name}.yaml"
        if not bundled.is_file():
            raise ConfigError(f"sweep {str(path_or_name)!r} not found; accepted: a YAML path or one of "
                              f"{', '.join(sweep_names())}")
        path = bundled
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: accepted: a mapping with 'configs' and/or 'vary' (and optional 'tasks')")
    unknown = set(data) - {"tasks", "configs", "vary"}
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {sorted(unknown)}; accepted: tasks, configs, vary")
    entries = [_entry(item, f"{path}: configs[{i}]") for i, item in enumerate(data.get("configs") or [])]
    blocks = data.get("vary") or []
    for i, block in enumerate(blocks if isinstance(blocks, list) else [blocks]):
        entries.extend(_varied(block, f"{path}: vary[{i}]"))
    if not entries:
        raise ConfigError(f"{path} names no configs; accepted: a 'configs' list or 'vary' blocks")
    names = [e.name for e in entries]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(f"{path}: config name(s) {repeated} appear more than once; accepted: unique names")
    stems = [e.file_stem for e in entries]
    if len(set(stems)) != len(stems):
        raise ConfigError(f"{path}: two config names map to one file name; rename one of {names}")
    for entry in entries:
        entry.config()  # raises ConfigError naming the field
    tasks = data.get("tasks") or []
    tasks = tasks.split(",") if isinstance(tasks, str) else [str(t) for t in tasks]
    return SweepSpec(entries, tasks, str(path))


def sweep_dir() -> Path:
    return Path(str(resources.files("hshare.configs"))) / "sweeps"


def sweep_names() -> list[str]:
    return sorted(p.stem for p in sweep_dir().glob("*.yaml"))
