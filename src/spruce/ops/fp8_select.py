"""Which kernel runs an FP8 linear at decode-sized M, chosen by measurement on the device.

For every (M bucket, N, K, layout) of a model's FP8 linears, `choose` (called at load by
models/quantization.tune_linears) times each candidate that fits
(`CANDIDATES`: the split-K GEMV in several tile shapes, on the CUDA cores or the tensor cores; the tiled Triton
GEMM; torch's row-wise scaled matmul for per-channel weights and its 1x128 / 128x128 block-scaled matmul for
block weights, both with activations quantized per token in one fused launch), checks its output against the
float32 emulation, and keeps the fastest correct one. M buckets: 1, 2, 4, 8, 16 (a batch of M tokens runs its
bucket's choice: M = 3 the choice of 4); larger M runs the rule of ops/fp8.py. At load only the weight-only
candidates are chosen: a decode step and the verify of its drafts then share one numerics (speculation stays
token for token equal to plain decoding); the W8A8 ones are measured by the bench for comparison.

Timing: each candidate runs in a CUDA graph over enough copies of the weight to overflow the L2 cache (what a
decode step sees: every weight read from HBM), the mean of three replays. Determinism: a packaged table
(`tables/fp8_gemm-<device>.json`, the `choices` that `python -m spruce.bench.fp8 --write-table` measured) is used
where it names the key; otherwise the measurement decides, a later candidate replacing the earlier only when at
least `MARGIN` faster. Each choice is logged once per process (logger "spruce"), with its time and the runner-up.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from spruce.ops import fp8

logger = logging.getLogger("spruce")
BUCKETS = fp8.GEMV_BUCKETS
MARGIN = 0.03  # a later candidate must be this much faster to replace an earlier one
L2_FLUSH_BYTES = 256 << 20  # weight copies per timing: at least this many bytes (H200's L2: 50 MB)
MAX_COPIES = 8
TABLES_DIR = Path(__file__).resolve().parent / "tables"
_CHOICES: dict[tuple, "Candidate"] = {}  # (device name, bucket, N, K, layout, static input) -> choice, per process
_TIMES: dict[tuple, dict[str, float | str]] = {}  # the same keys -> every candidate's ms (or why it was dropped)


bucket = fp8.gemv_bucket


def layout_name(group_k: int | None, k: int) -> str:
    """"channel" (one scale per row: per-channel, per-tensor) or "group<g>" (per row and g-wide K group)."""
    return "channel" if group_k is None or group_k >= k else f"group{group_k}"


@dataclass(frozen=True)
class Candidate:
    """One kernel configuration. kind: "gemv" (ops/fp8_gemm.fp8_gemv with these tiles), "tiled"
    (ops/fp8_gemm.fp8_gemm), "scaled_mm" (torch's row-wise, per-channel weights) or "scaled_mm_block" (torch's
    1x128 x 128x128 block-scaled matmul, weights whose scales are constant over 128-row blocks)."""

    name: str
    kind: str
    block_n: int = 0
    block_k: int = 0
    use_dot: bool = False
    num_warps: int = 4
    quantizes_x: bool = False  # W8A8: the activations are quantized per token (else the weight is only widened)
    channel_tiles: bool = False  # a GEMV whose K steps may cross 128 (per-channel weights only)
    prefetch: bool = False  # a GEMV that loads its next weight tile before summing the current one

    def fits(self, m_bucket: int, n: int, k: int, group_k: int | None, static_input: bool) -> str | None:
        """None if it runs this key, else why not."""
        one_group = group_k is None or group_k >= k
        if self.quantizes_x and static_input:
            return "static activation scales run weight-only"
        if self.kind == "gemv":
            if not self.use_dot and m_bucket > 4:
                return "CUDA-core GEMV runs M <= 4"
            if one_group != self.channel_tiles:
                return "tiles of the other layout"
            if not one_group and (group_k % self.block_k):
                return f"K step {self.block_k} crosses the scale group {group_k}"
        if self.kind == "scaled_mm" and not one_group:
            return "row-wise scales only"
        if self.kind == "scaled_mm_block" and (one_group or group_k != 128 or k % 128 or n % 128):
            return "128x128 blocks only"
        if self.kind.startswith("scaled_mm") and (n % 16 or k % 16):
            return "N and K must be multiples of 16"
        return None

    def run(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group_k: int | None,
            bias: torch.Tensor | None, block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] -> [M, N] in x's dtype (block_scale: `block_scales_t` of the weight, scaled_mm_block only)."""
        from spruce.ops.fp8_gemm import fp8_gemm, fp8_gemv

        if self.kind == "gemv":
            return fp8_gemv(x, weight, scale, group_k, bias, block_n=self.block_n, block_k=self.block_k,
                            use_dot=self.use_dot, num_warps=self.num_warps, prefetch=self.prefetch)
        if self.kind == "tiled":
            return fp8_gemm(x, weight, scale, group_k, bias)
        if self.kind == "scaled_mm":
            return scaled_mm_rowwise(x, weight, scale, bias)
        return scaled_mm_block(x, weight, block_scale, bias)


def _gemv(tag: str, bn: int, bk: int, dot: bool, warps: int, prefetch: bool = False) -> Candidate:
    return Candidate(f"gemv-{'dot' if dot else 'fma'}-{bn}x{bk}-w{warps}{tag}{'-p' if prefetch else ''}", "gemv",
                     bn, bk, dot, warps, channel_tiles=tag == "-c", prefetch=prefetch)


# per-channel tiles end in "-c" (K steps up to 1024); block tiles step 128 (one scale group). Warps per tile keep
# them under ~180 registers on sm90 (compiled offline: e.g. fma 16x512 on 4 warps 56 at M = 1, 96 at M = 4; 32x512
# on 4 warps would take 204), so that several programs share an SM and their loads overlap. The CUDA-core loop is
# not software-pipelined by Triton (its loads feed no dot): "-p" tiles load step i + 1 before summing step i,
# twice the bytes in flight per program for one more tile of registers (fma 16x512 on 4 warps: 16 more at M = 1).
CANDIDATES = (
    _gemv("-c", 16, 512, False, 4), _gemv("-c", 16, 1024, False, 4), _gemv("-c", 32, 256, False, 8),
    _gemv("-c", 32, 512, False, 8), _gemv("-c", 32, 256, True, 8), _gemv("-c", 64, 256, True, 8),
    _gemv("", 32, 128, False, 4), _gemv("", 64, 128, False, 8), _gemv("", 128, 128, False, 16),
    _gemv("", 32, 128, True, 8), _gemv("", 64, 128, True, 8),
    _gemv("-c", 16, 512, False, 4, True), _gemv("-c", 32, 256, False, 8, True), _gemv("-c", 16, 256, False, 4, True),
    _gemv("", 32, 128, False, 4, True), _gemv("", 64, 128, False, 8, True),
    Candidate("tiled", "tiled"),
    Candidate("scaled_mm-rowwise", "scaled_mm", quantizes_x=True),
    Candidate("scaled_mm-block", "scaled_mm_block", quantizes_x=True),
)
BY_NAME = {c.name: c for c in CANDIDATES}


def scaled_mm_rowwise(x, weight, scale, bias):
    """torch's row-wise scaled matmul: x quantized per token (one fused launch), weight [N, K] per-row scales."""
    from spruce.ops.fp8_gemm import quantize_activations

    xq, x_scale = quantize_activations(x)
    out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale.float().reshape(1, -1),
                           out_dtype=x.dtype)
    return out if bias is None else out + bias


def scaled_mm_block(x, weight, block_scale, bias):
    """torch's block-scaled matmul (DeepSeek-V3's recipe): x quantized per token and 128-wide K group (scales
    column-major, rows padded to a multiple of 4), weight [N, K] with one scale per 128x128 block."""
    import torch.nn.functional as F

    from spruce.ops.fp8_gemm import quantize_activations

    m = x.shape[0]
    xq, x_scale = quantize_activations(x, 128, rows=-(-m // 4) * 4, scale_major="col")
    out = F.scaled_mm(xq, weight.t(), x_scale, F.ScalingType.BlockWise1x128, block_scale,
                      F.ScalingType.BlockWise128x128, output_dtype=x.dtype)[:m]
    return out if bias is None else out + bias


def block_scales_t(scale: torch.Tensor, group_k: int | None) -> torch.Tensor | None:
    """spruce's per-row block scales [N, G] -> the [G4, N / 128] (K blocks padded to a multiple of 4, transposed
    view) torch's block-scaled matmul reads, or None when they are not constant over 128-row blocks (weights
    quantized per row and group at load) or not 128-wide groups."""
    n, g = scale.shape
    if group_k != 128 or n % 128:
        return None
    blocks = scale[::128]  # [N / 128, G]
    if not torch.equal(blocks.repeat_interleave(128, dim=0), scale):
        return None
    return torch.nn.functional.pad(blocks.float(), (0, -g % 4)).t()


def graph_time_ms(fn, copies: int, cuda: bool = True, reps: int | None = None) -> float:
    """Mean ms of one call of fn(i) (i over the weight copies), `reps` passes over the copies (default: 16 calls
    in all) captured in a CUDA graph, over three replays (CPU: wall clock of one pass, for the benches' smoke runs)."""
    for i in range(copies):
        fn(i)
    if not cuda:
        start = time.perf_counter()
        for i in range(copies):
            fn(i)
        return (time.perf_counter() - start) * 1e3 / copies
    torch.cuda.synchronize()
    reps = reps or max(1, 16 // copies)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for i in range(copies):
                fn(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (3 * reps * copies)


def _tolerance(c: Candidate) -> float:
    """Relative error allowed against the float32 emulation: bf16 output rounding; W8A8 adds e4m3 activations."""
    return 0.06 if c.quantizes_x else 0.01


def measure(weight: torch.Tensor, scale: torch.Tensor, group_k: int | None, bias: torch.Tensor | None,
            m: int, static_input: bool = False, only: tuple[str, ...] | None = None,
            dtype: torch.dtype = torch.bfloat16, weight_only: bool = False) -> dict[str, float | str]:
    """Every fitting candidate (or those named in `only`; weight_only: not the W8A8 ones) on x [m, K] (`dtype`):
    name -> mean ms, or a string saying why it was dropped (does not fit, fails, or is wrong against the
    emulation)."""
    n, k = weight.shape
    g = torch.Generator(device=weight.device).manual_seed(0)
    x = torch.randn(m, k, device=weight.device, generator=g).to(dtype)
    want = fp8.emulated_linear(x.float(), weight, scale, group_k, bias).float()
    copies = max(1, min(MAX_COPIES, -(-L2_FLUSH_BYTES // max(weight.numel(), 1)))) if weight.is_cuda else 1
    try:
        weights = [weight] + [weight.clone() for _ in range(copies - 1)]
    except torch.OutOfMemoryError:
        weights = [weight]
    block = block_scales_t(scale, group_k)
    times: dict[str, float | str] = {}
    for c in CANDIDATES:
        if only is not None and c.name not in only:
            continue
        why = c.fits(bucket(m), n, k, group_k, static_input)
        if why is None and weight_only and c.quantizes_x:
            why = "W8A8: decode and verify batches keep the weight-only numerics (spec == plain)"
        if why is None and c.kind == "scaled_mm_block" and block is None:
            why = "scales not constant over 128x128 blocks"
        if why is not None:
            times[c.name] = f"skipped: {why}"
            continue
        try:
            got = c.run(x, weight, scale, group_k, bias, block).float()
            err = ((got - want).norm() / want.norm().clamp(min=1e-12)).item()
            if not err < _tolerance(c):
                times[c.name] = f"wrong: relative error {err:.3g} >= {_tolerance(c)}"
                continue
            times[c.name] = graph_time_ms(lambda i: c.run(x, weights[i], scale, group_k, bias, block), len(weights),
                                     weight.is_cuda)
        except Exception as e:  # a kernel this torch / Triton / GPU cannot run is dropped, with its reason
            times[c.name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    return times


def pick(times: dict[str, float | str]) -> str | None:
    """The fastest timed candidate, in CANDIDATES order; a later one wins only when MARGIN faster."""
    best = None
    for c in CANDIDATES:
        t = times.get(c.name)
        if isinstance(t, float) and (best is None or t < times[best] * (1 - MARGIN)):
            best = c.name
    return best


def slug(device_name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


def table_path(device_name: str) -> Path:
    return TABLES_DIR / f"fp8_gemm-{slug(device_name)}.json"


def load_table(device_name: str) -> dict[tuple, str]:
    """The packaged choices measured on this device: (bucket, N, K, layout, static input, activation dtype) ->
    candidate name."""
    path = table_path(device_name)
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return {(r["m"], r["n"], r["k"], r["layout"], bool(r.get("static_input", False)),
             getattr(torch, r.get("dtype", "bfloat16"))): r["kernel"]
            for r in data["choices"] if r["kernel"] in BY_NAME}


def table_rows(device_name: str) -> list[dict]:
    """This process's choices on `device_name`, in the table's format (what --write-table writes)."""
    return [{"m": key[1], "n": key[2], "k": key[3], "layout": key[4], "static_input": key[5],
             "dtype": str(key[6]).removeprefix("torch."), "kernel": c.name}
            for key, c in sorted(_CHOICES.items(), key=lambda kv: str(kv[0])) if key[0] == device_name]


def choose(weight: torch.Tensor, scale: torch.Tensor, group_k: int | None, bias: torch.Tensor | None,
           static_input: bool, dtype: torch.dtype = torch.bfloat16) -> dict[int, Candidate]:
    """bucket -> the kernel of each M bucket for this weight's (N, K, layout), from the packaged table or measured
    with `dtype` activations (once per process and key); a bucket with no correct candidate keeps the ops/fp8.py
    rule (absent here)."""
    name = torch.cuda.get_device_name(weight.device)
    n, k = weight.shape
    layout = layout_name(group_k, k)
    table = load_table(name)
    out = {}
    for b in BUCKETS:
        key = (name, b, n, k, layout, static_input, dtype)
        if key not in _CHOICES:
            listed = table.get(key[1:])
            times = measure(weight, scale, group_k, bias, b, static_input, only=(listed,) if listed else None,
                            dtype=dtype, weight_only=True)
            best = pick(times)
            _TIMES[key] = times
            if best is None:
                logger.warning("fp8 linear N=%d K=%d %s M<=%d: no candidate ran correctly (%s); the default rule "
                               "runs", n, k, layout, b, times)
                continue
            _CHOICES[key] = BY_NAME[best]
            ranked = sorted((t, c) for c, t in times.items() if isinstance(t, float))
            runner = next((f"{c} {t * 1e3:.1f} us" for t, c in ranked if c != best), "none")
            logger.info("fp8 linear N=%d K=%d %s M<=%d: %s %.1f us (%s; next: %s)", n, k, layout, b, best,
                        times[best] * 1e3, "packaged table" if listed else "measured", runner)
        out[b] = _CHOICES[key]
    return out
