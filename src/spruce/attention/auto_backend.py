"""`auto` on CUDA: a composite backend that delegates each phase to one registered backend (DESIGN §13).

The choice per phase comes from the packaged kernel table of this device (`attention/kernel_table.py`: the
backend with the lowest summed time over the table's batch sizes and contexts), and falls back to
`registry.AUTO_FALLBACK` (triton) where there is no table, the faster backend is not installed or cannot run the
config (dtype, CUDA graphs), or cannot serve the target or the draft (MLA, head dim). The choice is fixed once the
models are known (`check_model`) and logged once, in one line, when the backend is allocated.

The composite is one backend like any other: `plan` (host, outside graphs) and `forward` / `forward_latent`
(inside graphs) go to the phase's backend, which keeps its own persistent buffers sized from `Limits`. A phase
always runs the same backend (eager or replayed, every bucket), so each phase's graph captures one backend's
kernels and graphs equal eager as they do on that backend alone. Backends share the KV pools: every backend
reads and writes the same slots (the attention contract of `attention/metadata.py`).
"""

from __future__ import annotations

import logging

from spruce.attention import kernel_table, registry
from spruce.attention.backend import AttentionBackend, create_backend
from spruce.attention.kernel_table import PhaseChoice
from spruce.attention.metadata import ForwardBatch, Phase
from spruce.errors import InvariantError

logger = logging.getLogger("spruce")


class PerPhaseAttention(AttentionBackend):
    """Each phase delegated to one registered backend (`choices`); phases whose backend cannot serve a model
    (`check_model`) go to `fallback`. Sub-backends are built and allocated in `allocate`."""

    name = registry.AUTO

    def __init__(self, page_size: int, choices: dict[Phase, PhaseChoice], fallback: str = registry.AUTO_FALLBACK,
                 source: str = "", limits=None, device=None):
        missing = [p.value for p in Phase if p not in choices]
        if missing:
            raise InvariantError(f"per-phase attention needs a backend for every phase; missing {missing}")
        self.choices = dict(choices)
        self.fallback = fallback
        self.source = source  # where the choice came from (the start-up log says it)
        self._backends: dict[str, AttentionBackend] = {}
        self._by_phase: dict[Phase, AttentionBackend] = {}
        super().__init__(page_size, limits, device)

    @property
    def info(self) -> registry.BackendInfo:
        """The fallback's record: the one the config was checked against (`registry.resolve`)."""
        return registry.get_info(self.fallback)

    def check_model(self, *, head_dim: int | None = None, mla: bool = False, window: bool = False,
                    chunk: bool = False, what: str = "the model") -> None:
        """Send every phase whose backend cannot serve this model to the fallback (which must serve it)."""
        if self._by_phase:
            raise InvariantError("per-phase attention: check_model after allocate (the choice is fixed by then)")
        for phase, choice in self.choices.items():
            why = registry.model_refusal(choice.backend, head_dim=head_dim, mla=mla, window=window, chunk=chunk,
                                         what=what)
            if why is None and mla and choice.backend != self.fallback:
                why = f"was timed on MHA/GQA only: the kernel table has no MLA (latent) rows for {what}"
            if why is not None:
                self.choices[phase] = PhaseChoice(self.fallback, f"{choice.backend} (measured faster) {why}",
                                                  fell_back=True)
        registry.check_model(self.fallback, head_dim=head_dim, mla=mla, window=window, chunk=chunk, what=what)

    def allocate(self, limits, device) -> None:
        super().allocate(limits, device)
        for name in dict.fromkeys(c.backend for c in self.choices.values()):
            self._backends[name] = create_backend(name, self.page_size, limits, device)
        self._by_phase = {phase: self._backends[c.backend] for phase, c in self.choices.items()}
        logger.info("%s", self.log_line())

    def backend_for(self, phase: Phase) -> AttentionBackend:
        """The allocated backend that runs `phase`."""
        backend = self._by_phase.get(phase)
        if backend is None:
            raise InvariantError(f"{phase.value}: per-phase attention used before allocate")
        return backend

    def describe(self) -> str:
        return f"{self.name} (" + ", ".join(f"{p.value}={c.backend}" for p, c in self.choices.items()) + ")"

    def log_line(self) -> str:
        """The one start-up line: the backend per phase, where the choice came from, and every fallback's reason."""
        fell_back: dict[tuple[str, str], list[str]] = {}
        for phase, choice in self.choices.items():
            if choice.fell_back:
                fell_back.setdefault((choice.backend, choice.reason), []).append(phase.value)
        line = f"attention: {self.describe()}, from {self.source or 'the given choices'}"
        for (backend, reason), phases in fell_back.items():
            line += f"; {', '.join(phases)} -> {backend}: {reason}"
        return line

    # --- plan and forward: the phase's backend -------------------------------------------------------------------
    @property
    def captures_prefill(self) -> bool:
        return self.backend_for(Phase.EXTEND).captures_prefill

    def plan(self, batch: ForwardBatch, page_table) -> None:
        self.backend_for(batch.phase).plan(batch, page_table)

    def forward(self, q, k, v, k_cache, v_cache, scratch_start, batch: ForwardBatch, page_table, scale, **extra):
        """`extra`: window / sinks, passed only for models check_model was told need them."""
        return self.backend_for(batch.phase).forward(q, k, v, k_cache, v_cache, scratch_start, batch, page_table,
                                                     scale, **extra)

    def forward_latent(self, q, latent, cache, value_dim, scratch_start, batch: ForwardBatch, page_table, scale):
        return self.backend_for(batch.phase).forward_latent(q, latent, cache, value_dim, scratch_start, batch,
                                                            page_table, scale)


def auto_attention(page_size: int, device: str, device_name: str, dtype: str, cuda_graph: bool) -> PerPhaseAttention:
    """`auto` for this device and config: each phase's backend from the packaged kernel table of `device_name`
    among the registered backends that can run here (`registry.config_refusal`), else the fallback."""
    table = kernel_table.find_table(device_name)
    refusals = {n: registry.config_refusal(n, device, dtype, cuda_graph) for n in registry.backend_names()}
    known = ", ".join(repr(d) for d in kernel_table.known_devices()) or "none"
    choices = kernel_table.select(table, tuple(p.value for p in Phase), refusals, registry.AUTO_FALLBACK,
                                  no_table=f"no kernel table for {device_name!r} (tables: {known})")
    source = (f"the kernel table {table.path.name}" if table is not None else "no kernel table") + f" on {device_name}"
    return PerPhaseAttention(page_size, {Phase(p): c for p, c in choices.items()}, source=source)
