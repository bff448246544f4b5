"""Compile Triton kernel launches for a GPU that is not there (test-only tool).

Triton's interpreter, which runs the kernels in CI, accepts programs that a GPU's compiler refuses (a tl.dot over
fewer than 16 values) or that do not fit on the chip (shared memory). `record_launches` swaps kernels for spies
that note each launch (tensor dtypes, scalars, constexprs, warps, stages) instead of running it; `compile_for`
then compiles every distinct launch for a CUDA architecture in a subprocess without the interpreter (Triton
compiles for a target without its device) and returns each one's shared memory or compile error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

H200_SHARED_BYTES = 232448  # the most shared memory one program may take on an H100 / H200 (sm_90)

_POINTER = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.float8_e4m3fn: "*fp8e4nv",
            torch.int32: "*i32", torch.int64: "*i64"}
_LAUNCH_OPTIONS = ("num_warps", "num_stages")


def _describe(value):
    """A tensor by its pointer type; anything else by its value (a constexpr, or a scalar typed by the kernel)."""
    return _POINTER[value.dtype] if isinstance(value, torch.Tensor) else ["value", value]


@contextmanager
def record_launches(module, names: tuple[str, ...]):
    """Within the block, `module.<name>[grid](*args, **kwargs)` records (name, args, kwargs) into the yielded list
    and runs nothing."""
    launches = []
    saved = {name: getattr(module, name) for name in names}

    class Spy:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                options = {k: kwargs.pop(k) for k in _LAUNCH_OPTIONS if k in kwargs}
                launches.append({"kernel": f"{getattr(saved[self.name], 'fn', saved[self.name]).__module__}.{self.name}",
                                 "args": [_describe(a) for a in args],
                                 "kwargs": {k: _describe(v) for k, v in kwargs.items()}, "options": options})
            return launch

    for name in names:
        setattr(module, name, Spy(name))
    try:
        yield launches
    finally:
        for name, kernel in saved.items():
            setattr(module, name, kernel)


_COMPILE = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

arch = int(sys.argv[1])
out = []
for launch in json.loads(sys.stdin.read()):
    module, name = launch["kernel"].rsplit(".", 1)
    kernel = getattr(importlib.import_module(module), name)
    given = dict(zip(kernel.arg_names, launch["args"]))
    given.update(launch["kwargs"])
    signature, constants = {}, {}
    for i, (arg, param) in enumerate(zip(kernel.arg_names, kernel.params)):
        value = given.get(arg, ["value", param.default])
        if not isinstance(value, list):
            signature[arg] = value  # a tensor's pointer type
        elif param.is_constexpr or value[1] is None:
            signature[arg], constants[(i,)] = "constexpr", value[1]
        elif isinstance(value[1], bool):
            signature[arg] = "i1"
        elif isinstance(value[1], int):
            signature[arg] = "i32" if -2**31 <= value[1] < 2**31 else "i64"
        else:
            signature[arg] = "fp32"
    try:
        compiled = triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", arch, 32),
                                  options=launch["options"])
        out.append({"shared": compiled.metadata.shared})
    except Exception as e:  # the compiler's refusal is the result
        out.append({"error": f"{type(e).__name__}: {str(e)[-400:]}"})
print(json.dumps(out))
"""


def compile_for(launches: list[dict], arch: int = 90) -> list[tuple[dict, dict]]:
    """(launch, {"shared": bytes} or {"error": message}) for each distinct launch, compiled for sm_<arch>."""
    distinct = list({json.dumps(x, sort_keys=True): x for x in launches}.values())
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run([sys.executable, "-c", _COMPILE, str(arch)], input=json.dumps(distinct), env=env,
                         capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        raise RuntimeError(run.stderr[-3000:])
    return list(zip(distinct, json.loads(run.stdout.strip().splitlines()[-1])))
