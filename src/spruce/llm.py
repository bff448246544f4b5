"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from spruce.config import (
    EngineConfig, builtin_model_path, default_graph_max_bs, make_speculative_config, resolve_device, resolve_dtype,
    resolve_max_running_requests,
)
from spruce.errors import InvalidRequestError
from spruce.runtime.engine import Engine
from spruce.runtime.output import RequestOutput
from spruce.sampling_params import SamplingParams
from spruce.speculative.registry import make_strategy


class LLM:
    """Load a Hugging Face Llama-family model (optionally with an EAGLE / EAGLE-3 draft) and generate.

    `model=None` loads the bundled demo model. By default it runs on CUDA when there is a GPU, in the checkpoint's
    dtype (`dtype="auto"`; float32 on the CPU), with vLLM's default number of running requests for that GPU
    (`spruce.config.resolve_max_running_requests`). Speculation is on when `draft_model` is given; S/K/N default
    to SGLang's (5, 4, 8) when omitted. `speculative_adaptive=True` chooses per decode step between such a
    round and a plain step, by expected tokens per second (speculative/adaptive.py), and with
    `speculative_adaptive_widths` also between verify trees of those widths and N.
    `speculative_synthetic_acceptance_length=L` (or per-depth `speculative_synthetic_acceptance_rates`), a benchmark
    setting: drafts are accepted at those rates instead of verified, so outputs are NOT the target's
    (speculative/synthetic.py).
    `speculative_algorithm="NGRAM"` drafts by prompt lookup, no draft model (speculative/ngram.py): the longest n-gram
    of `speculative_prompt_lookup_min`..`_max` tokens (vLLM's defaults: 5..5) that ends the context and occurred
    earlier proposes the `speculative_num_steps` tokens after it (default 5); `speculative_eagle_topk=K` > 1 merges
    the K best occurrences' continuations into a tree.
    `quantization="fp8"` quantizes a bf16 checkpoint's linear weights to FP8 at load (per output channel); FP8
    checkpoints load as FP8 without it (models/quantization.py). `kv_cache_dtype="fp8_e4m3"` keeps the target's
    KV cache in FP8 with the checkpoint's per-layer k_scale / v_scale, else 1.0 (torch and triton backends; auto
    runs triton on CUDA).
    `tp_size=N` runs the model tensor-parallel over N processes (this one and N-1 spawned workers; rank r on cuda:r,
    or gloo on the CPU): call `shutdown()` (or use the LLM as a context manager) to stop them, else they stop at
    interpreter exit.
    Spawning re-imports the main module, so a script that builds one needs the usual
    `if __name__ == "__main__":` guard.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        tokenizer: str | None = None,
        device: str | None = None,
        dtype: str = "auto",
        attention_backend: str | None = None,
        page_size: int = 16,
        max_running_requests: int | None = None,
        context_length: int | None = None,
        max_total_tokens: int | None = None,
        mem_fraction_static: float = 0.85,
        chunked_prefill_size: int = 2048,
        cuda_graph: bool | None = None,
        cuda_graph_max_bs: int | None = None,
        cuda_graph_max_prefill_tokens: int = 256,
        draft_model: str | Path | None = None,
        speculative_algorithm: str | None = None,
        speculative_num_steps: int | None = None,
        speculative_eagle_topk: int | None = None,
        speculative_num_draft_tokens: int | None = None,
        speculative_adaptive: bool = False,
        speculative_adaptive_widths: tuple[int, ...] | list[int] = (),
        speculative_synthetic_acceptance_length: float | None = None,
        speculative_synthetic_acceptance_rates: Sequence[float] | None = None,
        speculative_prompt_lookup_min: int | None = None,
        speculative_prompt_lookup_max: int | None = None,
        seed: int = 0,
        show_progress: bool = False,
        load_format: str = "auto",
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        disable_overlap_schedule: bool = False,
        disable_radix_cache: bool = False,
        mixed_steps: bool = True,
        tp_size: int = 1,
        scheduler_delay_factor: float = 0.0,
    ):
        model = str(model if model is not None else builtin_model_path())
        device = resolve_device(device)  # None: cuda when there is a GPU
        dtype = resolve_dtype(dtype, device, model)  # auto: the checkpoint's on cuda, float32 on cpu
        if max_running_requests is None:  # vLLM's default, by the GPU's memory; CUDA graphs up to 512 of them
            max_running_requests = resolve_max_running_requests(None, device)
            if cuda_graph_max_bs is None and device != "cpu":
                cuda_graph_max_bs = default_graph_max_bs(max_running_requests)
        spec = make_speculative_config(
            speculative_algorithm, None if draft_model is None else str(draft_model),
            speculative_num_steps, speculative_eagle_topk, speculative_num_draft_tokens, model=model,
            adaptive=speculative_adaptive, adaptive_widths=speculative_adaptive_widths,
            synthetic_acceptance_length=speculative_synthetic_acceptance_length,
            synthetic_acceptance_rates=speculative_synthetic_acceptance_rates,
            prompt_lookup_min=speculative_prompt_lookup_min, prompt_lookup_max=speculative_prompt_lookup_max,
        )
        self.config = EngineConfig(
            model=model, tokenizer=tokenizer, device=device,
            dtype=dtype, attention_backend=attention_backend, page_size=page_size,
            max_running_requests=max_running_requests, context_length=context_length,
            max_total_tokens=max_total_tokens, mem_fraction_static=mem_fraction_static,
            chunked_prefill_size=chunked_prefill_size, cuda_graph=cuda_graph, cuda_graph_max_bs=cuda_graph_max_bs,
            cuda_graph_max_prefill_tokens=cuda_graph_max_prefill_tokens,
            speculative=spec, seed=seed, show_progress=show_progress, load_format=load_format,
            quantization=quantization, kv_cache_dtype=kv_cache_dtype,
            disable_overlap_schedule=disable_overlap_schedule, disable_radix_cache=disable_radix_cache,
            mixed_steps=mixed_steps,
            tp_size=tp_size, scheduler_delay_factor=scheduler_delay_factor,
        )
        if tp_size == 1:
            self.engine = Engine(self.config, make_strategy=make_strategy)
        else:
            from spruce.runtime.launch import create_engine

            self.engine = create_engine(self.config, make_strategy=make_strategy)

    @classmethod
    def from_engine(cls, engine: Engine) -> "LLM":
        """An LLM around an engine built elsewhere (e.g. spruce.runtime.launch.create_engine)."""
        llm = cls.__new__(cls)
        llm.config, llm.engine = engine.config, engine
        return llm

    def shutdown(self) -> None:
        """Stop a tensor-parallel engine's workers (nothing to do for one process); idempotent."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def default_sampling_params(self) -> SamplingParams:
        """What `generate` samples with when given no sampling params: the model's generation_config.json settings
        (temperature, top_p, top_k, min_p, repetition_penalty) over SamplingParams' defaults, as vLLM's
        LLM.get_default_sampling_params."""
        from spruce.sampling_defaults import model_sampling_defaults

        return SamplingParams(**model_sampling_defaults(self.config.model))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, or token ids); returns finished outputs in prompt order. No
        `sampling_params`: `default_sampling_params()` (the model's generation_config.json settings).

        Every prompt is validated before any work starts: one bad prompt raises and nothing is queued.
        """
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.default_sampling_params()] * len(prompt_list)
        elif isinstance(sampling_params, (list, tuple)):
            params = list(sampling_params)
            if len(params) != len(prompt_list):
                raise InvalidRequestError(
                    f"got {len(params)} sampling params for {len(prompt_list)} prompts; expected one or one per prompt",
                    field="sampling_params")
        else:
            raise InvalidRequestError(
                f"sampling_params must be a SamplingParams or a list of them, got {type(sampling_params).__name__} "
                f"(e.g. SamplingParams(max_tokens=4), not a dict)", field="sampling_params")
        bad = next((p for p in params if not isinstance(p, SamplingParams)), None)
        if bad is not None:
            raise InvalidRequestError(f"sampling_params entries must be SamplingParams, got {type(bad).__name__}",
                                      field="sampling_params")
        engine = self.engine
        for sp in params:
            sp.check_vocab(engine.vocab_size)
        ids: list[str] = []
        results: dict[str, RequestOutput] = {}
        try:
            for p, sp in zip(prompt_list, params):
                ids.append(engine.add_request(p, sp))
            wanted = set(ids)
            while len(results) < len(ids):
                for out in engine.step(finished_only=True):
                    if out.finished and out.request_id in wanted:
                        results[out.request_id] = out
        finally:  # on any exit (an error, KeyboardInterrupt): nothing this call queued stays in the engine
            for rid in ids:
                if rid not in results:
                    engine.abort(rid)
            engine.drain()  # the step in flight completes; finished and aborted requests release their pages
        return [results[rid] for rid in ids]


def _as_prompt_list(prompts) -> list:
    """One prompt (text or a list of token ids) or a list of them, as a list of prompts (each checked by the
    engine's add_request)."""
    if isinstance(prompts, (bytes, bytearray)):
        raise InvalidRequestError("prompts must be text or token ids, got bytes (decode them to str first)",
                                  field="prompt")
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise InvalidRequestError(f"prompts must be a string, a list of token ids, or a list of strings or of "
                                  f"token-id lists, got {type(prompts).__name__}", field="prompt")
    prompts = list(prompts)
    if not prompts:
        return []
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [prompts]  # one tokenized prompt
    return prompts
