"""Counts Triton's kernel compilations in this process, and names each one made while serving.

A Triton kernel is compiled for every new specialisation of its arguments (a constexpr, an integer's divisibility
by 16 or value 1, a pointer's alignment). Each compilation stalls the step that launched it for 0.1-1 s on a GPU,
so a server must compile everything while it starts: a kernel first met by some rare path (a draft extend at a
new batch size, say) stalls serving instead. `install()` hooks Triton's post-compile hook (chaining any hook
already set) once per process; `serving()` marks the start of serving, after which every compilation is logged
as a warning with the kernel's specialisation. `compiles()` gives the counts since the process started, split
into before and while serving (the engine reports them in `Engine.stats()`, /metrics as
spruce_triton_compiles_total).
"""

from __future__ import annotations

import logging
import threading

from spruce.ops.triton_support import HAS_TRITON, interpreter_on

log = logging.getLogger(__name__)

_lock = threading.Lock()
_counts = {"startup": 0, "serving": 0}
_state = {"installed": False, "serving": False}


def install() -> bool:
    """Hook Triton's compilations (once per process); False where there is nothing to hook (no Triton, the CPU
    interpreter, or a Triton without the hook)."""
    with _lock:
        if _state["installed"]:
            return True
        if not HAS_TRITON or interpreter_on():
            return False
        try:
            from triton import knobs
        except ImportError:
            return False
        runtime = getattr(knobs, "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
            return False
        previous = runtime.jit_post_compile_hook

        def on_compile(*args, **kwargs):
            _record(_describe(kwargs))
            return previous(*args, **kwargs) if previous is not None else None

        runtime.jit_post_compile_hook = on_compile
        _state["installed"] = True
        return True


def _describe(hook_kwargs: dict) -> str:
    """A compilation as the log names it: the kernel, its constexprs and its specialised arguments (Triton's own
    repr of the arguments is empty on some versions)."""
    fn = hook_kwargs.get("fn")
    name = getattr(fn, "name", None) or str(hook_kwargs.get("repr", "?")).split("[", 1)[0]
    compiled = hook_kwargs.get("compile") or {}
    constants = compiled.get("constants") or {}
    signature = compiled.get("signature") or {}
    specialised = (compiled.get("configs") or [None])[0]
    return (f"{name} constexprs {dict(constants)} signature {dict(signature)} specialisations {specialised}"
            [:2000])


def _record(kernel: str) -> None:
    with _lock:
        phase = "serving" if _state["serving"] else "startup"
        _counts[phase] += 1
        count = _counts["serving"]
    if phase == "serving":
        log.warning("Triton compiled a kernel while serving (%d so far), stalling the step that launched it: %s",
                    count, kernel)


def serving() -> None:
    """From now on every compilation is one made while serving (logged)."""
    with _lock:
        _state["serving"] = True


def compiles() -> dict[str, int]:
    """Compilations since the process started, {"startup": n, "serving": m}; {} when they are not counted (see
    `install`)."""
    with _lock:
        return dict(_counts) if _state["installed"] else {}
