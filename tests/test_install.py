"""The base install (`pip install -e .`, no extras) works: Triton is optional.

Without Triton, spruce imports, generates with the bundled demo model and its EAGLE-3 head (torch reference
paths), and refuses the triton attention backend at config time, naming the extra to install.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import spruce

SRC = Path(spruce.__file__).resolve().parent
TRITON_GATEWAY = SRC / "ops" / "triton_support.py"

WITHOUT_TRITON = textwrap.dedent("""
    import sys
    sys.modules["triton"] = None  # `import triton` now raises ImportError, as on an install without it

    from spruce import LLM, SamplingParams
    from spruce.config import EngineConfig, builtin_draft_path
    from spruce.errors import ConfigError

    out = LLM(draft_model=builtin_draft_path()).generate("def f", SamplingParams(max_tokens=4))[0]
    assert len(out.token_ids) == 4, out
    assert out.spec_stats and out.spec_stats["rounds"] >= 1, out.spec_stats
    try:
        EngineConfig(model="m", attention_backend="triton")
    except ConfigError as e:
        print("refused:", e)
    else:
        raise SystemExit("attention_backend='triton' was accepted without Triton")
""")


def test_generates_with_triton_unimportable():
    """Import, speculative generation and the triton-backend refusal, in a process where Triton cannot import."""
    run = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "pip install 'spruce[triton]'" in run.stdout, run.stdout


def _imports_triton(path: Path) -> bool:
    """Whether the module at `path` imports triton (or a submodule) at its top level."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "triton" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "triton":
            return True
    return False


def test_only_the_gateway_imports_triton():
    """Every other module takes `triton` / `tl` from spruce.ops.triton_support, which tolerates its absence."""
    offenders = [str(p.relative_to(SRC)) for p in sorted(SRC.rglob("*.py")) if p != TRITON_GATEWAY and _imports_triton(p)]
    assert offenders == []
