"""`tests/hopper_compile.py`: the interpreter's launches are recorded with their types and constexprs, and a
kernel that runs in the interpreter but does not compile for sm_90 is reported (a subprocess compiles it)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
from hopper_compile import argument_type, install_recorder

TOOL = Path(__file__).resolve().parent / "hopper_compile.py"

KERNELS = textwrap.dedent('''
    import triton
    import triton.language as tl

    @triton.jit
    def fine(x_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) + 1, mask=offsets < n)

    @triton.jit
    def loop_retyped(x_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)  # [BLOCK]
        for start in range(0, n, 16):
            offsets = start + tl.arange(0, 16)  # [16]: runs in the interpreter, not in the compiler
            tl.store(x_ptr + offsets, 0.0, mask=offsets < n)
''')


def test_argument_types():
    assert argument_type(torch.zeros(1, dtype=torch.bfloat16)) == "*bf16"
    assert argument_type(torch.zeros(1, dtype=torch.bool)) == "*i1"
    assert argument_type(7) == "i32" and argument_type(2**40) == "i64" and argument_type(True) == "i1"
    assert argument_type(0.5) == "fp32" and argument_type(None) is None


def test_a_kernel_that_only_the_interpreter_runs_is_reported(tmp_path, monkeypatch):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the recorder wraps the interpreter (TRITON_INTERPRET=1)")
    from triton.runtime.interpreter import InterpretedFunction

    (tmp_path / "toy_kernels.py").write_text(KERNELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(InterpretedFunction, "run", InterpretedFunction.run)  # restored after the test
    import toy_kernels

    records: dict = {}
    install_recorder(records, "toy_kernels")
    n = int(torch.randint(5, 30, ()))
    for kernel in (toy_kernels.fine, toy_kernels.loop_retyped):
        x = torch.zeros(32)
        kernel[(1,)](x, n, BLOCK=32, num_warps=2)
        assert bool((x[:n] == (1.0 if kernel is toy_kernels.fine else 0.0)).all())  # both run interpreted
    spec = next(iter(records["toy_kernels:fine"].values()))
    assert spec["arguments"] == {"x_ptr": {"type": "*fp32"}, "n": {"type": "i32", "value": n},
                                 "BLOCK": {"type": "i32", "value": 32}}
    assert spec["options"] == {"num_warps": 2}
    path = tmp_path / "records.json"
    path.write_text(json.dumps(records))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(TOOL), str(path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 of 2 specializations of 2 kernels compiled for sm_90" in done.stdout
    failed = [line for line in done.stdout.splitlines() if "FAILED" in line]
    assert len(failed) == 1 and "toy_kernels:loop_retyped" in failed[0] and "Loop-carried" in failed[0]
