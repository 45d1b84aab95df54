"""Compile, for an H100 (sm_90), every Triton kernel specialization the CPU tests ran through the interpreter.

Triton's interpreter runs a kernel's Python body on the CPU and so never meets the compiler's front end: a
loop-carried variable whose type changes, a branch whose sides disagree, a scalar where a block is wanted
all pass there and fail at the first launch on a GPU. This catches them on a machine without one.

1. Record: run tests with ``HSHARE_RECORD_KERNELS=<file>`` set (`tests/conftest.py` wraps the interpreter's
   launch and writes, when the session ends, each kernel's distinct specializations: argument types,
   constexpr values and launch options: the first `PER_KERNEL`, then up to `MAX_PER_KERNEL` those that bring a
   constexpr value or launch option not kept yet, so that a path few tests take is compiled too).
2. Compile: ``python tests/hopper_compile.py <file>`` (without ``TRITON_INTERPRET``) builds each one for
   ``GPUTarget("cuda", 90, 32)`` down to a cubin (Triton bundles ptxas; no GPU, no driver) and exits 1 naming
   every kernel that does not compile. A kernel that takes a ``PDL`` constexpr is built as a decode step
   launches it on such a GPU: ``PDL=True`` with ``launch_pdl`` (`kernels.dependent_launch`).

``make test`` does both: the whole suite records, then every kernel it ran is compiled.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
from typing import Any

PER_KERNEL = 8  # distinct specializations kept per kernel: the first met,
MAX_PER_KERNEL = 32  # then, up to this many, each that brings a constexpr value or launch option not yet kept
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64", "int64": "i64",
           "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1"}


def argument_type(value: Any) -> Any:
    """The JIT signature type of a runtime argument: ``"*bf16"`` for a tensor, ``"i32"`` / ``"i64"`` for an
    int, ``"fp32"`` for a float, ``"i1"`` for a bool; None for what a signature cannot hold."""
    if hasattr(value, "data_ptr") and hasattr(value, "dtype"):
        return "*" + _DTYPES[str(value.dtype).removeprefix("torch.")]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    return None


def install_recorder(records: dict, module_prefix: str) -> None:
    """Wrap the interpreter's launch so that the specializations of each kernel defined in a module named
    ``module_prefix...`` land in `records` (``"module:name" -> {key: specialization}``)."""
    from triton.runtime.interpreter import InterpretedFunction

    launch = InterpretedFunction.run
    constexprs_of: dict = {}  # kernel -> its constexpr parameters
    covered: dict = {}  # kernel -> the (constexpr or launch option, value) pairs of its kept specializations

    def run(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        if not fn.__module__.startswith(module_prefix):
            return launch(self, *args, grid=grid, warmup=warmup, **kwargs)
        given = dict(zip(self.arg_names, args))
        given.update({k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS})
        spec = {"arguments": {}, "options": {k: kwargs[k] for k in LAUNCH_OPTIONS if k in kwargs}}
        for name, value in given.items():
            kind = argument_type(value)
            tensor = kind is not None and kind.startswith("*")
            spec["arguments"][name] = {"type": kind} if tensor else {"type": kind, "value": value}
        # distinct by constexpr values, tensor dtypes and launch options (not by the values of plain scalars)
        if fn not in constexprs_of:
            constexprs_of[fn] = {name for name, kind in inspect.get_annotations(fn).items() if "constexpr" in str(kind)}
        constexprs = constexprs_of[fn]
        key = json.dumps({name: arg if name in constexprs or "value" not in arg else arg["type"]
                          for name, arg in spec["arguments"].items()} | {"options": spec["options"]},
                         sort_keys=True, default=repr)
        name = f"{fn.__module__}:{fn.__name__}"
        kernel, seen = records.setdefault(name, {}), covered.setdefault(name, set())
        pairs = {(k, json.dumps(arg.get("value"), default=repr)) for k, arg in spec["arguments"].items()
                 if k in constexprs} | {(k, json.dumps(v)) for k, v in spec["options"].items()}
        if key not in kernel and (len(kernel) < PER_KERNEL or (len(kernel) < MAX_PER_KERNEL and not pairs <= seen)):
            kernel[key] = spec
            seen |= pairs
        return launch(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run


def compile_all(records: dict) -> list[str]:
    """Compile every recorded specialization for sm_90; the failures, one line each."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    failures = []
    for kernel, specs in sorted(records.items()):
        module, name = kernel.split(":")
        fn = getattr(importlib.import_module(module), name)
        constexpr = {p.name for p in fn.params if p.is_constexpr}
        for spec in specs.values():
            signature, constants = {}, {}
            for param in fn.params:
                if param.name not in spec["arguments"]:  # a defaulted argument left out: a constexpr takes its
                    if param.is_constexpr and param.has_default:  # default, as a launch does
                        signature[param.name], constants[param.name] = "constexpr", param.default
                    continue
                given = spec["arguments"][param.name]
                if param.name in constexpr or given["type"] is None:  # a constexpr, or None passed to a plain one
                    signature[param.name] = "constexpr"
                    constants[param.name] = given["value"]
                else:
                    signature[param.name] = given["type"]
            options = spec["options"]
            if "PDL" in constexpr:  # as a decode step on the GPU launches it (`kernels.dependent_launch`)
                signature["PDL"], constants["PDL"], options = "constexpr", True, {**options, "launch_pdl": True}
            try:
                triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants), target=target,
                               options=options)
            except Exception as error:  # noqa: BLE001 - every compiler error is reported, none raised
                first = str(error).strip().splitlines()
                failures.append(f"{kernel} {constants} {spec['options']}: {type(error).__name__}: "
                                f"{' / '.join(first[-3:])}")
    return failures


def main(path: str) -> int:
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the compiler's default of the Triton the GPUs run
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("hopper_compile: unset TRITON_INTERPRET to compile", file=sys.stderr)
        return 2
    if not os.path.exists(path):  # the kernels ran natively (a GPU machine) or no test ran one
        print(f"hopper_compile: nothing recorded at {path}; the kernels ran natively or not at all")
        return 0
    with open(path) as handle:
        records = json.load(handle)
    failures = compile_all(records)
    count = sum(len(specs) for specs in records.values())
    print(f"hopper_compile: {count - len(failures)} of {count} specializations of {len(records)} kernels "
          f"compiled for sm_90")
    for line in failures:
        print("  FAILED", line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
