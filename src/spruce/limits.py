"""`Limits`: the one source of truth for every size in the engine (DESIGN §3).

Derived once from the engine config and the model config, then frozen. Every buffer (eager or CUDA graph),
the scheduler's admission checks, the page allocator and the KV pools read their widths from here and
nothing else computes a width.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

from spruce.attention.tree_mask import MASK_WORD_BITS
from spruce.config import EngineConfig, draft_candidates
from spruce.errors import ConfigError, InvariantError

DUMMY_PAGE = 0  # page 0 is never handed out: padding rows and padding tokens read and write it


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _token_buckets(largest: int) -> tuple[int, ...]:
    """16, 32, 48, 64, then each power of two and 1.5 times it (96, 128, 192, 256, 384, ...) below `largest`, then
    `largest` itself (none when it is 0): a batch padded up to its bucket does at most 1.5x its tokens' work above
    16 tokens."""
    if largest == 0:
        return ()
    cands, step = {16, 32, 48, 64}, 16
    while max(cands) < largest:
        step *= 2
        top = max(cands)
        cands |= {top + step * i for i in (1, 2)}
    return tuple(sorted({b for b in cands if b < largest} | {largest}))


def _size_buckets(largest: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 8 below `largest`, then `largest` itself (none when it is 0)."""
    if largest == 0:
        return ()
    cands = {b for b in [1, 2, 4, 8, *range(16, largest + 1, 8)] if b < largest}
    return tuple(sorted(cands | {largest}))


@dataclass(frozen=True)
class Limits:
    """Every width and count the engine allocates by. Fields are plain ints; properties derive from them, each
    computed once (the engine reads several per decode step: graph_buckets rebuilt its tuple at every lookup)."""

    max_running_requests: int  # R: request rows in the page table (plus one dummy row)
    page_size: int
    context_length: int  # max prompt + output tokens per request
    num_pages: int  # paged KV pages, dummy page 0 included
    chunked_prefill_size: int  # max prompt tokens in one prefill forward
    # speculative settings (0 when speculation is off)
    num_steps: int = 0  # S
    eagle_topk: int = 0  # K
    num_draft_tokens: int = 0  # N (tree size, root included)
    narrower_widths: tuple[int, ...] = ()  # adaptive speculation: verify widths N' < N its rounds may run, ascending
    # positions at and past the committed length the draft's KV holds: a draft LM (STANDALONE) caches its next root
    # (1); an EAGLE head, whose slot p pairs the target's feature at p with the token at p+1, none (0)
    draft_ahead: int = 0
    graph_max_bs: int = 0  # largest CUDA-graph bucket (0: no graphs)
    prefill_graph_max_tokens: int = 0  # largest token bucket of the prefill CUDA graphs (0: prefills run eagerly)
    overlap: bool = False  # overlap scheduling: one step may be in flight while the next is planned
    reverted_fixes: frozenset = frozenset()  # fix toggles reverted for A/B debugging (spruce.runtime.fixes)

    def __post_init__(self):
        if self.num_pages < 2:
            raise ConfigError(f"KV cache has {self.num_pages} pages; need >= 2 (one is the reserved dummy page)")
        widths = self.narrower_widths
        if list(widths) != sorted(set(widths)) or any(not 2 <= w < self.num_draft_tokens for w in widths):
            raise InvariantError(f"narrower_widths {widths} must ascend within [2, num_draft_tokens "
                                 f"{self.num_draft_tokens})")

    # --- speculation -------------------------------------------------------------------------------------
    @cached_property
    def speculative(self) -> bool:
        return self.num_draft_tokens > 0

    @cached_property
    def step_advance(self) -> int:
        """Positions past the committed length one decode step may write (and commit): S+1 with
        speculation (root + S accepted), 1 without."""
        return self.num_steps + 1 if self.speculative else 1

    @cached_property
    def steps_ahead(self) -> int:
        """Decode steps whose writes the host reserves pages for past a request's known committed length:
        the step being planned, plus (overlap) the step still in flight, whose commits the host learns late."""
        if self.overlap and "overlap_page_lookahead" not in self.reverted_fixes:
            return 2
        return 1

    @cached_property
    def lookahead(self) -> int:
        """Positions past the host-known committed length that pages must cover before a decode step."""
        per_step = 1 if "spec_page_lookahead" in self.reverted_fixes else self.step_advance
        return per_step * self.steps_ahead + self.draft_ahead

    @cached_property
    def num_candidates(self) -> int:
        """M: draft candidates one round produces, K at step 0 and K*K at each later step (`draft_candidates`)."""
        return draft_candidates(self.num_steps, self.eagle_topk)

    @cached_property
    def tree_widths(self) -> tuple[int, ...]:
        """The verify widths a round may run, ascending: the narrower ones, then N (none without speculation)."""
        return (*self.narrower_widths, self.num_draft_tokens) if self.speculative else ()

    @cached_property
    def step_result_width(self) -> int:
        """Columns of a decode step's result row: the accept length, then S+1 tokens (plain: 0, then 1), then per
        narrower width N' the drafts a round at N' would have accepted (`EagleWorker._extend_phase`). The widest
        row; a plain step's is `plain_result_width` even beside a draft."""
        return 1 + self.step_advance + len(self.narrower_widths)

    @cached_property
    def plain_result_width(self) -> int:
        """Columns of a plain step's result row (also beside a draft): the accept length 0, then the token."""
        return 2

    @cached_property
    def target_scratch_width(self) -> int:
        """Tree tokens per request row in the target's scratch: N."""
        return self.num_draft_tokens

    @cached_property
    def draft_scratch_width(self) -> int:
        """Draft-step tokens per request row in the draft's scratch: K*S."""
        if "draft_scratch_width" in self.reverted_fixes:
            return self.num_draft_tokens
        return self.eagle_topk * self.num_steps

    @cached_property
    def mask_words(self) -> int:
        """64-bit words of ancestor bitmask per query token (covers both scratch widths)."""
        width = max(self.target_scratch_width, self.draft_scratch_width, 1)
        return ceil_div(width, MASK_WORD_BITS)

    @cached_property
    def draft_extend_stride(self) -> int:
        """Uniform per-request token stride of DRAFT_EXTEND after verify: at most S+1 committed tokens (a draft LM:
        the root, the accepted drafts and the bonus, S+2)."""
        if "draft_extend_stride" in self.reverted_fixes:
            return self.num_draft_tokens
        return self.num_steps + 1 + self.draft_ahead

    # --- paged cache -------------------------------------------------------------------------------------
    @cached_property
    def num_rows(self) -> int:
        """Page-table rows: one per running request plus the dummy row (index R) used by padding."""
        return self.max_running_requests + 1

    @cached_property
    def dummy_row(self) -> int:
        return self.max_running_requests

    @cached_property
    def num_page_slots(self) -> int:
        return self.num_pages * self.page_size

    @cached_property
    def max_pages_per_request(self) -> int:
        return ceil_div(self.context_length + self.lookahead, self.page_size)

    def pages_for(self, num_tokens: int) -> int:
        """Pages a request needs to hold `num_tokens` positions."""
        return ceil_div(num_tokens, self.page_size)

    def pool_slots(self, scratch_width: int) -> int:
        """Slots of a KV pool: the paged region followed by `num_rows` scratch blocks of `scratch_width`."""
        return self.num_page_slots + self.num_rows * scratch_width

    # --- forward sizes -----------------------------------------------------------------------------------
    @cached_property
    def max_tokens_per_forward(self) -> int:
        """Most query tokens any phase can put in one forward (sizes every per-token buffer)."""
        r = self.max_running_requests
        widths = [self.chunked_prefill_size, r]
        if self.speculative:
            widths += [r * self.num_draft_tokens, r * self.eagle_topk, r * self.draft_extend_stride,
                       self.chunked_prefill_size + r * self.draft_ahead]  # a draft LM's prefill: + each new token
        return max(widths)

    @cached_property
    def graph_buckets(self) -> tuple[int, ...]:
        """Batch-size buckets captured as CUDA graphs; always includes the largest (graph_max_bs)."""
        return _size_buckets(self.graph_max_bs)

    @cached_property
    def kv_capacity(self) -> int:
        """The most positions any request can hold (its pages' slots): the bound every batch's max_kv_len is
        checked against, the max_kv_len CUDA graphs are captured with, and per running request what the paged KV
        pool is sized for at most (`derive`)."""
        return self.max_pages_per_request * self.page_size

    @cached_property
    def rope_positions(self) -> int:
        """Rows of every rope table (models/rope.py): positions [0, kv_capacity). Every token of a forward lies below
        its batch's max_kv_len, which BatchBuilder checks against kv_capacity before the launch: the context, then
        the lookahead past it that a round's draft and tree tokens reach (S+1 per step ahead). E.g. context 2048,
        S=5 under overlap, page 16: ceil((2048 + 2*6) / 16) * 16 = 2064 rows."""
        return self.kv_capacity

    @cached_property
    def prefill_graph_tokens(self) -> tuple[int, ...]:
        """Token buckets captured as prefill CUDA graphs (the target over a batch of prompt chunks, padded up to
        the bucket); always includes the largest (prefill_graph_max_tokens)."""
        return _token_buckets(self.prefill_graph_max_tokens)

    def prefill_bucket_for(self, num_tokens: int) -> int | None:
        """Smallest prefill graph bucket holding `num_tokens` prompt tokens, or None (run eagerly)."""
        for b in self.prefill_graph_tokens:
            if b >= num_tokens:
                return b
        return None

    def prefill_graph_rows(self, num_tokens: int) -> int:
        """Requests a padded prefill batch of `num_tokens` tokens holds: every request has at least one token, so
        min(tokens, R) real ones, then one padding request that owns the padding tokens (the dummy row)."""
        return min(num_tokens, self.max_running_requests) + 1

    @cached_property
    def cost_buckets(self) -> tuple[int, ...]:
        """Batch-size buckets adaptive speculation keeps one cost and one choice per: the graph buckets, then
        the same grid up to max_running_requests for batches that run eagerly."""
        graphs = self.graph_buckets
        return graphs + tuple(b for b in _size_buckets(self.max_running_requests) if b > self.graph_max_bs)

    def cost_bucket_for(self, batch_size: int) -> int:
        """Smallest cost bucket holding `batch_size` requests (1 <= batch_size <= max_running_requests)."""
        for b in self.cost_buckets:
            if b >= batch_size:
                return b
        raise InvariantError(f"batch size {batch_size} > max_running_requests {self.max_running_requests}")

    def bucket_for(self, batch_size: int) -> int | None:
        """Smallest graph bucket holding `batch_size` requests, or None (run eagerly)."""
        for b in self.graph_buckets:
            if b >= batch_size:
                return b
        if "graph_bucket_holds_batch" in self.reverted_fixes and self.graph_buckets:
            return self.graph_buckets[-1]
        return None

    @staticmethod
    def derive(config: EngineConfig, max_position_embeddings: int, kv_bytes_per_token: int,
               kv_budget_bytes: int | None, reverted_fixes: frozenset = frozenset()) -> "Limits":
        """Derive limits from the config and the model. kv_budget_bytes: memory for the paged KV (None: config)."""
        ctx = config.context_length or max_position_embeddings
        if config.context_length and config.context_length > max_position_embeddings:
            raise ConfigError(
                f"context_length={config.context_length} exceeds the model's max_position_embeddings="
                f"{max_position_embeddings}"
            )
        spec = config.speculative
        s, k, n = (spec.num_steps, spec.eagle_topk, spec.num_draft_tokens) if spec else (0, 0, 0)
        narrower = spec.tree_widths[:-1] if spec else ()
        ps = config.page_size
        r = config.max_running_requests
        graph_max_bs = prefill_graph_max_tokens = 0
        if config.use_cuda_graph:
            graph_max_bs = min(config.cuda_graph_max_bs or r, r)
            prefill_graph_max_tokens = min(config.cuda_graph_max_prefill_tokens, config.chunked_prefill_size)
        sized = Limits(  # every width but the pool's, which is sized by what its running requests can hold
            max_running_requests=r, page_size=ps, context_length=ctx, num_pages=2,
            chunked_prefill_size=config.chunked_prefill_size, num_steps=s, eagle_topk=k, num_draft_tokens=n,
            narrower_widths=narrower, draft_ahead=1 if spec is not None and spec.algorithm == "STANDALONE" else 0,
            graph_max_bs=graph_max_bs, prefill_graph_max_tokens=prefill_graph_max_tokens,
            overlap=not config.disable_overlap_schedule,
            reverted_fixes=frozenset(reverted_fixes),
        )
        needed = r * sized.kv_capacity  # every running request at its longest
        if config.max_total_tokens is not None:
            total_tokens = config.max_total_tokens
        elif kv_budget_bytes is not None:
            total_tokens = min(max(kv_budget_bytes // max(kv_bytes_per_token, 1), ps), needed)
        else:
            total_tokens = min(needed, 1 << 16)
        return dataclasses.replace(sized, num_pages=ceil_div(total_tokens, ps) + 1)  # + the dummy page
