"""Engine configuration: what the user asks for, validated once, frozen.

Everything derived from it (buffer widths, page counts, graph buckets) lives in `spruce.limits.Limits`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from spruce.attention import registry as attention_registry
from spruce.errors import ConfigError

# NEXTN: the checkpoint's own MTP layers (alias MTP); STANDALONE: a separate causal LM with the target's vocabulary
SPECULATIVE_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM")  # NGRAM: drafts copied from the context
ALGORITHM_ALIASES = {"MTP": "NEXTN"}
DTYPES = ("float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")
QUANTIZATIONS = ("fp8",)  # `quantization`: weights quantized at load (an FP8 checkpoint loads as FP8 without it)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # "auto": the model dtype; "fp8" is "fp8_e4m3" (vLLM's names)
FP8_KV_BACKENDS = ("torch", "triton")  # attention backends that read an FP8 KV cache
MAX_DRAFT_TOKENS = 128  # speculative_num_draft_tokens upper bound (two 64-bit ancestor mask words)
MAX_NUM_STEPS = MAX_DRAFT_TOKENS - 1  # speculative_num_steps upper bound: the deepest tree of MAX_DRAFT_TOKENS nodes
# SGLang's defaults when only a draft path is given: (steps, topk, draft tokens); NEXTN's are its DeepSeek ones.
DEFAULT_SPECULATIVE = (5, 4, 8)
DEFAULT_NEXTN = (3, 1, 4)
DEFAULT_NGRAM = (5, 1, 6)  # a chain of 5 (vLLM's documented num_speculative_tokens); topk > 1 makes a trie
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's prompt_lookup_min and _max when neither is given (one given: the other equals it)


def builtin_model_path() -> Path:
    """The bundled demo model (pycode-6m: a real 6.6M-parameter Llama trained on Python source)."""
    return Path(__file__).parent / "assets" / "models" / "pycode-6m"


def builtin_draft_path() -> Path:
    """The EAGLE-3 head trained for the bundled demo model (may be absent in old checkouts)."""
    return Path(__file__).parent / "assets" / "models" / "pycode-6m-eagle3"


DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's --dtype names
BIG_GPU_BYTES = 70 << 30  # vLLM's larger batch defaults start at this much GPU memory (an A100 excepted)
# vLLM's max_num_seqs defaults (vllm/engine/arg_utils.py, EngineArgs.get_batch_defaults): by the GPU's memory
MAX_RUNNING_REQUESTS_BIG_GPU, MAX_RUNNING_REQUESTS_GPU, MAX_RUNNING_REQUESTS_CPU = 1024, 256, 16
MAX_DEFAULT_GRAPH_BS = 512  # vLLM's largest default CUDA-graph capture size (min(2 * max_num_seqs, 512))


def resolve_device(device: str | None) -> str:
    """The device to run on: as given, else cuda when torch sees a GPU, else cpu."""
    if device is not None:
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str, device: str, model: str | Path) -> str:
    """A dtype of DTYPES from vLLM's names: `half` = float16, `float` = float32; `auto` on cpu float32, on cuda the
    checkpoint's torch_dtype (config.json), bfloat16 where that is float32 or absent (vLLM runs a float32
    checkpoint in half precision too)."""
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype != "auto":
        return dtype
    if device == "cpu":
        return "float32"
    import json

    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    text = cfg.get("torch_dtype") or cfg.get("dtype") or (cfg.get("text_config") or {}).get("torch_dtype")
    return text if text in ("bfloat16", "float16") else "bfloat16"


def resolve_max_running_requests(max_running_requests: int | None, device: str) -> int:
    """Requests decoded together: as given, else vLLM's max_num_seqs default on cuda (1024 on a GPU of 70 GiB or
    more that is not an A100, else 256), 16 on cpu."""
    if max_running_requests is not None:
        return max_running_requests
    if device == "cpu":
        return MAX_RUNNING_REQUESTS_CPU
    import torch

    _check_device_available(device)  # a device this torch cannot see: the config's one-line error, not torch's
    props = torch.cuda.get_device_properties(torch.device(device))
    big = props.total_memory >= BIG_GPU_BYTES and "a100" not in props.name.lower()
    return MAX_RUNNING_REQUESTS_BIG_GPU if big else MAX_RUNNING_REQUESTS_GPU


def default_graph_max_bs(max_running_requests: int) -> int:
    """The largest CUDA-graph batch when running requests are left to their default: at most vLLM's largest default
    capture size (512); batches above it run eagerly."""
    return min(max_running_requests, MAX_DEFAULT_GRAPH_BS)


def check_delay_factor(delay_factor) -> None:
    """`scheduler_delay_factor` must be a finite number >= 0 (EngineConfig and PrefillBatching both ask here)."""
    if isinstance(delay_factor, bool) or not isinstance(delay_factor, (int, float)) or not (
            math.isfinite(delay_factor) and delay_factor >= 0):
        raise ConfigError(f"scheduler_delay_factor must be a finite number >= 0, got {delay_factor!r}")


def draft_candidates(num_steps: int, eagle_topk: int) -> int:
    """M: the draft candidates one EAGLE round produces, K at step 0 and K*K at each later step (the one formula:
    `SpeculativeConfig` checks N against it, `Limits.num_candidates` sizes the round's buffers by it)."""
    return eagle_topk + (num_steps - 1) * eagle_topk * eagle_topk


# --- synthetic acceptance (a benchmark setting: speculative/synthetic.py draws by these rates) -----------------
RATE_TOLERANCE = 1e-9  # rates may rise by rounding noise at most this much (1/3, 1/3 + 1e-17, ...)


def rates_for_length(length: float, num_steps: int) -> tuple[float, ...]:
    """The minimum-variance unconditional rates of mean acceptance length `length` over `num_steps` depths.

    e.g. rates_for_length(3.5, 5) == (1.0, 1.0, 0.5, 0.0, 0.0); rates_for_length(6.0, 5) == (1.0,) * 5."""
    check_length(length, num_steps)
    drafts = float(length) - 1.0  # expected accepted drafts per round
    full = min(int(drafts), num_steps)
    rates = [1.0] * full + [drafts - full] + [0.0] * num_steps
    return tuple(rates[:num_steps])


def check_length(length, num_steps: int) -> None:
    """A mean acceptance length: a finite number in [1, num_steps + 1] (1: nothing accepted; S+1: everything)."""
    if isinstance(length, bool) or not isinstance(length, (int, float)) or not (
            math.isfinite(length) and 1.0 <= length <= num_steps + 1):
        raise ConfigError(f"speculative_synthetic_acceptance_length must be a number in [1, {num_steps + 1}] "
                          f"(1 + speculative_num_steps={num_steps}: tokens a round commits, bonus included), "
                          f"got {length!r}")


def check_rates(rates, num_steps: int) -> tuple[float, ...]:
    """Unconditional per-depth rates: `num_steps` numbers in [0, 1], non-increasing. Returns them as floats."""
    if not isinstance(rates, (list, tuple)) or len(rates) != num_steps or any(
            isinstance(r, bool) or not isinstance(r, (int, float)) or not (math.isfinite(r) and 0.0 <= r <= 1.0)
            for r in rates):
        raise ConfigError(f"speculative_synthetic_acceptance_rates must be {num_steps} numbers in [0, 1] (one per "
                          f"draft depth, speculative_num_steps={num_steps}), got {rates!r}")
    rising = [d + 2 for d in range(num_steps - 1) if rates[d + 1] > rates[d] + RATE_TOLERANCE]
    if rising:
        raise ConfigError(f"speculative_synthetic_acceptance_rates={list(rates)} must be non-increasing (entry d is "
                          f"the probability that a round accepts depths 1..d), but depth {rising[0]} exceeds the "
                          f"one before it")
    return tuple(float(r) for r in rates)


def mean_acceptance_length(rates: tuple[float, ...]) -> float:
    """The mean acceptance length (tokens a round commits, bonus included) the rates give a chain: 1 + sum."""
    return 1.0 + sum(rates)


def describe_synthetic(rates: tuple[float, ...] | None) -> str:
    """One line naming the setting, for logs, Engine.info and results: 'off' when it is off."""
    if rates is None:
        return "off"
    return (f"synthetic acceptance rates={','.join(f'{r:g}' for r in rates)} "
            f"(mean length {mean_acceptance_length(rates):g}): "
            f"drafts accepted at these rates, not verified; outputs are not the target's")


def resolve_rates(num_steps: int, rates=None, length=None) -> tuple[float, ...] | None:
    """The engine's unconditional rates from at most one of `rates` or `length` (None when neither is given)."""
    if rates is not None and length is not None:
        raise ConfigError("give speculative_synthetic_acceptance_rates or speculative_synthetic_acceptance_length, "
                          "not both (a length resolves to rates)")
    if length is not None:
        return rates_for_length(length, num_steps)
    if rates is not None:
        return check_rates(tuple(rates) if isinstance(rates, list) else rates, num_steps)
    return None


@dataclass(frozen=True)
class SpeculativeConfig:
    """EAGLE tree drafting settings. S = num_steps, K = eagle_topk, N = num_draft_tokens (root included)."""

    algorithm: str
    draft_model: str | None  # None: NGRAM, which loads no draft
    num_steps: int
    eagle_topk: int
    num_draft_tokens: int
    adaptive: bool = False  # per decode step: this (S, K, N) round or a plain step (speculative/adaptive.py)
    adaptive_widths: tuple[int, ...] = ()  # narrower verify trees (N' < N) adaptive rounds may run instead of N
    # a benchmark setting, never on by default: drafts accepted at these unconditional per-depth rates instead of
    # verified (speculative/synthetic.py); the mean length a user asked for, if that is how they were given
    synthetic_acceptance_rates: tuple[float, ...] | None = None
    synthetic_acceptance_length: float | None = None
    # NGRAM (speculative/ngram.py): the n-gram lengths matched at the end of the context, vLLM's names
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    def __post_init__(self):
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"speculative_adaptive must be True or False, got {self.adaptive!r}")
        self._check_widths()
        if self.algorithm not in SPECULATIVE_ALGORITHMS:
            raise ConfigError(
                f"speculative_algorithm={self.algorithm!r} is not supported; expected one of {SPECULATIVE_ALGORITHMS}"
            )
        s, k, n = self.num_steps, self.eagle_topk, self.num_draft_tokens
        for name, v in (("speculative_num_steps", s), ("speculative_eagle_topk", k),
                        ("speculative_num_draft_tokens", n)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"{name} must be an integer, got {v!r}")
        if not 1 <= s <= MAX_NUM_STEPS:
            raise ConfigError(f"speculative_num_steps={s} is outside [1, {MAX_NUM_STEPS}] (a verify tree of at most "
                              f"{MAX_DRAFT_TOKENS} nodes is at most {MAX_NUM_STEPS} deep)")
        if k < 1:
            raise ConfigError(f"speculative_eagle_topk must be >= 1, got {k}")
        if n < 2:
            raise ConfigError(f"speculative_num_draft_tokens must be >= 2 (root + at least one draft), got {n}")
        if n > MAX_DRAFT_TOKENS:
            raise ConfigError(
                f"speculative_num_draft_tokens={n} exceeds the supported maximum {MAX_DRAFT_TOKENS}"
            )
        if n - 1 > self.num_candidates:
            raise ConfigError(
                f"speculative_num_draft_tokens={n} needs {n - 1} draft candidates, but topk={k} and steps={s} "
                f"produce only K + (S-1)*K*K = {self.num_candidates}; lower num_draft_tokens or raise steps/topk"
            )
        self._check_synthetic()
        self._check_ngram()

    @property
    def loads_draft(self) -> bool:
        """Whether a draft model is loaded (NGRAM drafts from the request's own tokens)."""
        return self.algorithm != "NGRAM"

    def _check_ngram(self) -> None:
        lookup = (("prompt_lookup_min", self.prompt_lookup_min), ("prompt_lookup_max", self.prompt_lookup_max))
        if self.algorithm != "NGRAM":
            given = [name for name, v in lookup if v is not None]
            if given:
                raise ConfigError(f"{'/'.join(given)} apply to speculative_algorithm='NGRAM' only, got "
                                  f"{self.algorithm!r}")
            return
        for name, v in lookup:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be an integer >= 1 (an n-gram length), got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"prompt_lookup_min={self.prompt_lookup_min} must be <= prompt_lookup_max="
                              f"{self.prompt_lookup_max}")
        if self.draft_model is not None:
            raise ConfigError(f"speculative_algorithm='NGRAM' drafts from the request's own tokens and loads no draft "
                              f"model, got draft_model={self.draft_model!r}")
        if self.adaptive:
            raise ConfigError("speculative_adaptive is not supported with speculative_algorithm='NGRAM'")
        s, k, n = self.num_steps, self.eagle_topk, self.num_draft_tokens
        if n - 1 > k * s:
            raise ConfigError(f"speculative_num_draft_tokens={n} needs {n - 1} draft nodes, but NGRAM's topk={k} "
                              f"continuations of steps={s} tokens make at most K*S = {k * s}; lower num_draft_tokens "
                              f"or raise steps/topk")

    @property
    def num_candidates(self) -> int:
        """Draft candidates one round produces (`draft_candidates`)."""
        return draft_candidates(self.num_steps, self.eagle_topk)

    @property
    def tree_widths(self) -> tuple[int, ...]:
        """The verify widths a round may run, ascending: the narrower adaptive ones, then N."""
        return (*sorted(self.adaptive_widths), self.num_draft_tokens)

    def _check_synthetic(self) -> None:
        if self.synthetic_acceptance_rates is not None:
            check_rates(self.synthetic_acceptance_rates, self.num_steps)
        if self.synthetic_acceptance_length is not None:
            if self.synthetic_acceptance_rates != rates_for_length(self.synthetic_acceptance_length, self.num_steps):
                raise ConfigError(f"synthetic_acceptance_length={self.synthetic_acceptance_length} names the rates "
                                  f"it resolves to, got rates {self.synthetic_acceptance_rates}")

    def _check_widths(self) -> None:
        widths = self.adaptive_widths
        if not isinstance(widths, tuple) or not all(isinstance(w, int) and not isinstance(w, bool) for w in widths):
            raise ConfigError(f"speculative_adaptive_widths must be a tuple of integers, got {widths!r}")
        if widths and not self.adaptive:
            raise ConfigError(f"speculative_adaptive_widths={list(widths)} needs speculative_adaptive (the policy "
                              f"chooses the width per batch size)")
        bad = [w for w in widths if not 2 <= w < self.num_draft_tokens]
        if bad or len(set(widths)) != len(widths):
            raise ConfigError(f"speculative_adaptive_widths={list(widths)}: each must be distinct and in "
                              f"[2, speculative_num_draft_tokens={self.num_draft_tokens}) (the tree N is always one)")


@dataclass(frozen=True)
class EngineConfig:
    """What the user asked for. Frozen: nothing mutates it after construction."""

    model: str
    tokenizer: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    attention_backend: str | None = None  # a registered backend or "auto"; None: "auto" on cuda, "torch" on cpu
    page_size: int = 16
    max_running_requests: int = 16
    context_length: int | None = None  # None: the model's max_position_embeddings
    max_total_tokens: int | None = None  # paged KV capacity in tokens; None: derived from memory
    mem_fraction_static: float = 0.85
    chunked_prefill_size: int = 2048
    cuda_graph: bool | None = None  # None: on for cuda
    cuda_graph_max_bs: int | None = None
    cuda_graph_max_prefill_tokens: int = 256  # prefills of at most this many tokens replay CUDA graphs; 0: eager
    speculative: SpeculativeConfig | None = None
    seed: int = 0
    show_progress: bool = False
    load_format: str = "auto"  # "dummy": random weights from config.json alone (benchmarks at real shapes)
    quantization: str | None = None  # "fp8": quantize a bf16 checkpoint's weights at load (models/quantization.py)
    kv_cache_dtype: str = "auto"  # "fp8_e4m3" (or "fp8"): the target's KV cache in FP8 (ops/fp8.py)
    disable_overlap_schedule: bool = False  # True: resolve each step before planning the next (no overlap)
    disable_radix_cache: bool = False  # True: no prefix cache (every prompt is computed in full)
    mixed_steps: bool = True  # plain decoding: prompt chunks run inside decode steps (runtime/mixed_step.py); False:
    # prefill and decode steps alternate (speculative decoding always alternates)
    tp_size: int = 1  # tensor-parallel ranks (processes); 1: one process, torch.distributed untouched
    scheduler_delay_factor: float = 0.0  # prefill batching (runtime/prefill_batching.py); 0: admit at once

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r} is not supported; expected one of {DTYPES}")
        if not (self.device == "cpu" or re.fullmatch(r"cuda(:\d+)?", self.device)):
            raise ConfigError(f"device={self.device!r} is not supported; expected 'cpu' or 'cuda[:N]'")
        _check_device_available(self.device)
        if self.cuda_graph and not self.device.startswith("cuda"):
            raise ConfigError(f"cuda_graph=True needs device='cuda', got device={self.device!r}")
        # names, capabilities and their messages come from the backend registry (DESIGN §13)
        attention_registry.check_config(self.attention_backend, self.device, self.dtype, self.cuda_graph)
        for name in ("page_size", "max_running_requests", "chunked_prefill_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
        for name in ("context_length", "max_total_tokens", "cuda_graph_max_bs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"{name} must be an integer >= 1 or None, got {v!r}")
        v = self.cuda_graph_max_prefill_tokens
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"cuda_graph_max_prefill_tokens must be an integer >= 0 (0: prefills run eagerly), "
                              f"got {v!r}")
        _check_tp_size(self.tp_size, self.device)
        check_delay_factor(self.scheduler_delay_factor)
        d = self.scheduler_delay_factor
        if self.tp_size > 1 and d > 0:  # every rank must schedule alike (DESIGN §18); the delay reads a clock
            raise ConfigError(f"scheduler_delay_factor={d} cannot run with tp_size={self.tp_size}: its admission "
                              f"waits on measured times, which differ between ranks (use 0)")
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"load_format={self.load_format!r} is not supported; expected one of {LOAD_FORMATS}")
        self._check_fp8_options()
        if not (0.0 < self.mem_fraction_static < 1.0):
            raise ConfigError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")

    def _check_fp8_options(self) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization={self.quantization!r} is not supported; expected None or one of "
                              f"{QUANTIZATIONS} (FP8 checkpoints load as FP8 without it)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; expected one of "
                              f"{KV_CACHE_DTYPES}")
        if self.kv_cache_dtype == "auto":
            return
        backend = self.resolved_attention_backend  # auto: triton on CUDA (the runner skips the composite), torch
        if backend not in FP8_KV_BACKENDS:
            raise ConfigError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported by attention_backend="
                              f"{backend!r}; backends with an FP8 KV cache: {FP8_KV_BACKENDS}")

    @property
    def fp8_kv_cache(self) -> bool:
        """Whether the target's KV cache is float8_e4m3fn."""
        return self.kv_cache_dtype in ("fp8", "fp8_e4m3")

    @property
    def resolved_attention_backend(self) -> str:
        """The registered backend that runs: None and 'auto' resolve per device (attention/registry.py)."""
        return attention_registry.resolve(self.attention_backend, self.device)

    @property
    def use_cuda_graph(self) -> bool:
        if self.cuda_graph is not None:
            return self.cuda_graph
        info = attention_registry.get_info(self.resolved_attention_backend)
        return self.device.startswith("cuda") and info.cuda_graphs


def _check_device_available(device: str) -> None:
    """Refuse a CUDA device that this torch cannot see (else torch fails later with a bare AssertionError)."""
    if device == "cpu":
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if int(device.partition(":")[2] or 0) >= count:
        available = ", ".join(repr(d) for d in ["cpu"] + [f"cuda:{i}" for i in range(count)])
        raise ConfigError(f"device={device!r} is not available: torch {torch.__version__} sees {count} CUDA "
                          f"device(s); available: {available}")


def _check_tp_size(tp_size, device: str) -> None:
    """tp_size: an integer >= 1; on CUDA, rank r runs on cuda:r, so the device names no index and that many
    GPUs are visible."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ConfigError(f"tp_size must be an integer >= 1, got {tp_size!r}")
    if tp_size == 1 or device == "cpu":
        return
    if device != "cuda":
        raise ConfigError(f"tp_size={tp_size} runs rank r on cuda:r, so device must be 'cuda' (no index), got "
                          f"{device!r}; choose the GPUs with CUDA_VISIBLE_DEVICES")
    import torch

    count = torch.cuda.device_count()
    if count < tp_size:
        raise ConfigError(f"tp_size={tp_size} needs {tp_size} GPUs, but torch sees {count}")


def make_speculative_config(
    algorithm: str | None,
    draft_model: str | None,
    num_steps: int | None = None,
    eagle_topk: int | None = None,
    num_draft_tokens: int | None = None,
    model: str | None = None,
    adaptive: bool = False,
    adaptive_widths: tuple[int, ...] | list[int] | None = None,
    synthetic_acceptance_length: float | None = None,
    synthetic_acceptance_rates: tuple[float, ...] | list[float] | None = None,
    prompt_lookup_min: int | None = None,
    prompt_lookup_max: int | None = None,
) -> SpeculativeConfig | None:
    """Build the speculative settings from user flags, filling SGLang's defaults where only a draft is given.

    NEXTN (alias MTP) without a draft path takes the MTP layers of the target `model` itself. `adaptive`:
    choose per decode step between these rounds and plain steps; `adaptive_widths`: narrower verify trees (N' < N)
    it may also run. `synthetic_acceptance_length` or `synthetic_acceptance_rates` (at most one; a benchmark
    setting): accept drafts at those rates instead of verifying them (speculative/synthetic.py).
    NGRAM loads no draft: `prompt_lookup_min` / `_max` default as vLLM's (5 and 5; one given, the other equals it)."""
    if algorithm is None and draft_model is None and (prompt_lookup_min, prompt_lookup_max) != (None, None):
        raise ConfigError(f"prompt_lookup_min={prompt_lookup_min!r} / prompt_lookup_max={prompt_lookup_max!r} need "
                          f"speculative_algorithm='NGRAM'")
    if algorithm is None and draft_model is None:
        synthetic_given = (synthetic_acceptance_length, synthetic_acceptance_rates)
        if (any(v is not None for v in (num_steps, eagle_topk, num_draft_tokens, *synthetic_given))
                or adaptive or adaptive_widths):
            given = [n for n, v in (("speculative_num_steps", num_steps), ("speculative_eagle_topk", eagle_topk),
                                    ("speculative_num_draft_tokens", num_draft_tokens),
                                    ("speculative_adaptive", adaptive or None),
                                    ("speculative_adaptive_widths", adaptive_widths or None),
                                    ("speculative_synthetic_acceptance_length", synthetic_acceptance_length),
                                    ("speculative_synthetic_acceptance_rates", synthetic_acceptance_rates))
                     if v is not None]
            raise ConfigError(f"{'/'.join(given)} need a draft model (draft_model=PATH) or "
                              f"speculative_algorithm='NEXTN' (the target's own MTP layers)")
        return None
    if algorithm is not None and not isinstance(algorithm, str):
        raise ConfigError(f"speculative_algorithm must be a string, got {algorithm!r}")
    if algorithm is not None:
        algorithm = ALGORITHM_ALIASES.get(algorithm.upper(), algorithm.upper())
    if draft_model is None and algorithm != "NGRAM":
        if algorithm != "NEXTN" or model is None:
            raise ConfigError(f"speculative_algorithm={algorithm!r} needs a draft model (draft_model=PATH); only "
                              f"'NEXTN' (alias 'MTP') drafts with the target's own layers")
        draft_model = model
    if algorithm is None:
        algorithm = _guess_algorithm(draft_model)
    s_def, k_def, n_def = {"NEXTN": DEFAULT_NEXTN, "NGRAM": DEFAULT_NGRAM}.get(algorithm, DEFAULT_SPECULATIVE)
    s = s_def if num_steps is None else num_steps
    k = k_def if eagle_topk is None else eagle_topk
    if num_draft_tokens is None and algorithm == "NGRAM":  # the whole trie of K continuations
        n = min(1 + k * s, MAX_DRAFT_TOKENS) if isinstance(k, int) and isinstance(s, int) else n_def
    elif num_draft_tokens is None:
        n = s + 1 if k == 1 else min(n_def, 1 + draft_candidates(s, k))
    else:
        n = num_draft_tokens
    widths = tuple(adaptive_widths) if isinstance(adaptive_widths, (list, tuple)) else adaptive_widths
    rates = resolve_rates(s, synthetic_acceptance_rates, synthetic_acceptance_length)
    if algorithm == "NGRAM" and prompt_lookup_min is None and prompt_lookup_max is None:
        prompt_lookup_min = prompt_lookup_max = DEFAULT_PROMPT_LOOKUP
    elif algorithm == "NGRAM":
        prompt_lookup_min = prompt_lookup_max if prompt_lookup_min is None else prompt_lookup_min
        prompt_lookup_max = prompt_lookup_min if prompt_lookup_max is None else prompt_lookup_max
    return SpeculativeConfig(algorithm, None if draft_model is None else str(draft_model), s, k, n, adaptive,
                             () if widths is None else widths, synthetic_acceptance_rates=rates,
                             synthetic_acceptance_length=synthetic_acceptance_length,
                             prompt_lookup_min=prompt_lookup_min, prompt_lookup_max=prompt_lookup_max)


def _guess_algorithm(draft_model: str) -> str:
    import json

    cfg = Path(draft_model) / "config.json"
    try:
        archs = json.loads(cfg.read_text()).get("architectures") or []
    except (OSError, ValueError):
        return "EAGLE3"
    return "EAGLE3" if any("Eagle3" in a for a in archs) else "EAGLE"


