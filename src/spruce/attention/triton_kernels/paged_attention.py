"""One attention kernel for every phase: paged committed prefix + tree-scratch block, one online softmax.

Grid: (request x query-block, query head, kv split). A program takes BLOCK_M consecutive query tokens of one
request (qo_indptr), one query head, and the split's share of the paged prefix [0, max kv_len of the tile).
PACK_GQA (grouped-query attention, few query tokens a request: tree verify, drafts): the grid's second axis is
the kv head instead, and a block's BLOCK_M rows are (query token, query head) pairs of that kv head's GROUP =
Hq / Hkv heads, token-major, head fastest (row r of a request = token r // GROUP, head kv_head * GROUP +
r % GROUP); e.g. 6 verify tokens of Llama-3.1-8B (GROUP 4) are 24 rows of one 32-row block, so each K/V tile
is read once for the kv head's 4 query heads instead of once per head. Either way, rows' keys are then
positions mapped to slots through the page table and masked per row by its token's `pos < kv_lens[t]`
(causal for prefill, the committed length for tree phases). The last split also walks the request row's
scratch block, masked per row by its token's ancestor bitmask. Online softmax in the log2 domain:
    m' = max(m, rowmax(s));  alpha = 2^(m - m');  p = 2^(s - m')
    l' = l * alpha + rowsum(p);  acc' = acc * alpha + p @ V
With one split the program writes acc / l (and, when asked, lse = m + log2(l)); with several it writes
acc / l and lse per split and `merge_splits_kernel` combines them. With `kv_start` the paged range starts at
the request's kv_start instead of 0 (the tail half of a split attention, DESIGN §13). A token with nothing to
attend to gets zeros. Every size that shapes the grid is a host int fixed per CUDA-graph bucket; per-request
lengths are read on the device.

Sliding window W (HAS_WINDOW, gpt-oss): token t also needs paged position > positions[t] - W; the paged walk
starts at the tile's lowest such position, so a tile reads about W + BLOCK_M keys whatever the context. Scratch
entries are not cut (a tree's ancestors; the runner refuses trees as deep as the window). Chunks of C (HAS_CHUNK,
Llama 4): position >= C * floor(positions[t] / C), scratch entries too (VERIFY: entry j is the request's query
token j, at its position), since a chunk boundary can cut a tree. Sinks (HAS_SINKS):
a per-head logit s in the softmax's denominator only: out = acc / (l + 2^(s log2 e - m)), applied where the
final normalisation happens (here without splits, in `merge_splits_kernel` with them).
"""

from __future__ import annotations

from spruce.ops.triton_support import tl, triton


@triton.jit
def _first_visible(pos, window, chunk, HAS_WINDOW: tl.constexpr, HAS_CHUNK: tl.constexpr):
    """The first key position a token at `pos` (int32, a scalar or a block) sees: max(0, pos - window + 1 with a
    window, pos // chunk * chunk with chunks)."""
    first = pos * 0  # zeros of pos's shape
    if HAS_WINDOW:
        first = tl.maximum(first, pos - window + 1)
    if HAS_CHUNK:
        first = tl.maximum(first, pos // chunk * chunk)
    return first


@triton.jit
def _online_softmax_step(q, k, v, allowed, m_i, l_i, acc, sm_scale_log2, DOT_PRECISION: tl.constexpr):
    k, v = k.to(q.dtype), v.to(q.dtype)  # an FP8 cache's tiles widened to the query's dtype (no-op otherwise)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale_log2  # [BLOCK_M, BLOCK_N]
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing yet stay at zero
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# num_q_blocks, num_tokens and num_splits vary per call: one compiled kernel for all their values (a new value of a
# specialised int compiles a kernel in the middle of serving, ~0.1 s)
@triton.jit(do_not_specialize=["num_q_blocks", "num_tokens", "num_splits"])
def paged_attention_kernel(
    q_ptr, o_ptr, k_cache, v_cache, page_table, req_rows, qo_indptr, kv_lens, tree_mask, part_o, part_lse,
    kv_start, lse_ptr, num_q_blocks, num_tokens, num_splits, q_stride, table_stride, scratch_start, sm_scale_log2,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, SCRATCH_WIDTH: tl.constexpr, MASK_WORDS: tl.constexpr,
    SPLIT_KV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_KV_START: tl.constexpr = False, RETURN_LSE: tl.constexpr = False, positions=None, window=0,
    sinks=None, HAS_WINDOW: tl.constexpr = False, HAS_SINKS: tl.constexpr = False, chunk=0,
    HAS_CHUNK: tl.constexpr = False, PACK_GQA: tl.constexpr = False,
):
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    pid = tl.program_id(0)
    split = tl.program_id(2)
    b = pid // num_q_blocks
    req_start = tl.load(qo_indptr + b)
    q_end = tl.load(qo_indptr + b + 1)
    r0 = (pid % num_q_blocks) * BLOCK_M  # the block's first row within the request
    r = r0 + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    if PACK_GQA:
        kv_head = tl.program_id(1)
        q_start = req_start + r0 // GROUP
        offs_m = req_start + r // GROUP  # [BLOCK_M] each row's query token
        head = kv_head * GROUP + r % GROUP  # [BLOCK_M] and query head
    else:
        kv_head = tl.program_id(1) // GROUP
        q_start = req_start + r0
        offs_m = req_start + r
        head = tl.program_id(1) + tl.zeros([BLOCK_M], dtype=tl.int32)
    if q_start < q_end:
        row = tl.load(req_rows + b).to(tl.int64)
        m_valid = offs_m < q_end
        offs_d = tl.arange(0, BLOCK_D)
        d_valid = offs_d < HEAD_DIM
        q = tl.load(q_ptr + offs_m[:, None].to(tl.int64) * q_stride + head[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=m_valid[:, None] & d_valid[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
        tok_kv = tl.load(kv_lens + offs_m, mask=m_valid, other=0)  # [BLOCK_M]
        kv_max = tl.max(tok_kv, axis=0)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        kv_stride = NUM_KV_HEADS * HEAD_DIM

        # paged prefix: this split's share of [kv_lo, kv_max), in whole BLOCK_N chunks; kv_lo = 0, or the
        # request's kv_start when another kernel attends to [0, kv_start) (FlashInfer's half: DESIGN §13)
        kv_lo = 0
        if HAS_KV_START:
            kv_lo = tl.load(kv_start + b)
        first = tl.zeros([BLOCK_M], dtype=tl.int32)  # [BLOCK_M] first position each token sees (window, chunk)
        if HAS_WINDOW or HAS_CHUNK:
            tok_pos = tl.load(positions + offs_m, mask=m_valid, other=0).to(tl.int32)
            first = _first_visible(tok_pos, window, chunk, HAS_WINDOW, HAS_CHUNK)
            kv_lo = tl.maximum(kv_lo, tl.min(tl.where(m_valid, first, 2147483647), axis=0))  # the tile's lowest
        span = tl.cdiv(tl.cdiv(tl.maximum(kv_max - kv_lo, 0), num_splits), BLOCK_N) * BLOCK_N  # keys per split
        lo = kv_lo + split * span
        hi = tl.minimum(lo + span, kv_max)
        for start in range(lo, hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
            n_valid = pos < hi
            page = tl.load(page_table + row * table_stride + pos // PAGE_SIZE, mask=n_valid, other=0).to(tl.int64)
            slot = page * PAGE_SIZE + pos % PAGE_SIZE
            kv_off = slot[:, None] * kv_stride + kv_head * HEAD_DIM + offs_d[None, :]
            kv_mask = n_valid[:, None] & d_valid[None, :]
            k = tl.load(k_cache + kv_off, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
            v = tl.load(v_cache + kv_off, mask=kv_mask, other=0.0)
            allowed = (pos[None, :] < tok_kv[:, None]) & n_valid[None, :]
            if HAS_WINDOW or HAS_CHUNK:
                allowed = allowed & (pos[None, :] >= first[:, None])
            m_i, l_i, acc = _online_softmax_step(q, k, v, allowed, m_i, l_i, acc, sm_scale_log2, DOT_PRECISION)

        # tree scratch of this row (last split only): entry j allowed where bit j of the token's mask is set
        if SCRATCH_WIDTH > 0:
            if split == num_splits - 1:
                for start in range(0, SCRATCH_WIDTH, BLOCK_N):
                    j = start + tl.arange(0, BLOCK_N)
                    n_valid = j < SCRATCH_WIDTH
                    slot = scratch_start + row * SCRATCH_WIDTH + j
                    kv_off = slot[:, None] * kv_stride + kv_head * HEAD_DIM + offs_d[None, :]
                    kv_mask = n_valid[:, None] & d_valid[None, :]
                    k = tl.load(k_cache + kv_off, mask=kv_mask, other=0.0)
                    v = tl.load(v_cache + kv_off, mask=kv_mask, other=0.0)
                    word = tl.load(tree_mask + offs_m[:, None] * MASK_WORDS + j[None, :] // 64,
                                   mask=m_valid[:, None] & n_valid[None, :], other=0)
                    bit = (word >> (j[None, :] % 64).to(tl.int64)) & 1
                    allowed = (bit != 0) & n_valid[None, :]
                    if HAS_CHUNK:  # VERIFY: scratch entry j is the request's query token j, at its position
                        j_pos = tl.load(positions + req_start + j, mask=n_valid & (req_start + j < q_end), other=-1)
                        allowed = allowed & (j_pos.to(tl.int32)[None, :] >= first[:, None])
                    m_i, l_i, acc = _online_softmax_step(q, k, v, allowed, m_i, l_i, acc, sm_scale_log2,
                                                         DOT_PRECISION)

        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        if HAS_SINKS and not SPLIT_KV:  # acc / (l + 2^(s - m)) = out / (1 + 2^(s - lse)), lse = m + log2(l)
            sink = tl.load(sinks + head).to(tl.float32) * 1.4426950408889634  # [BLOCK_M]
            lse_t = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
            out = out / (1.0 + tl.exp2(sink - lse_t))[:, None]
        o_off = (offs_m[:, None] * NUM_HEADS + head[:, None]) * HEAD_DIM + offs_d[None, :]
        o_mask = m_valid[:, None] & d_valid[None, :]
        if not SPLIT_KV:
            tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=o_mask)
            if RETURN_LSE:  # log2-sum-exp of the scaled scores: FlashInfer's convention (merge_state)
                lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
                tl.store(lse_ptr + offs_m * NUM_HEADS + head, lse, mask=m_valid)  # [T, Hq]
        else:
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
            tl.store(part_o + split * num_tokens * NUM_HEADS * HEAD_DIM + o_off, out, mask=o_mask)
            tl.store(part_lse + (split * num_tokens + offs_m) * NUM_HEADS + head, lse, mask=m_valid)


@triton.jit(do_not_specialize=["num_tokens", "num_splits"])
def merge_splits_kernel(part_o, part_lse, o_ptr, num_tokens, num_splits, NUM_HEADS: tl.constexpr,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MAX_SPLITS: tl.constexpr, sinks=None,
                        HAS_SINKS: tl.constexpr = False):
    """out = sum_s 2^(lse_s - lse) * out_s with lse = log2 sum_s 2^lse_s over the num_splits (<= MAX_SPLITS) splits
    (splits that saw nothing: -inf); with sinks, then times 1 / (1 + 2^(s log2 e - lse))."""
    t = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, MAX_SPLITS)
    s_valid = offs_s < num_splits
    lse = tl.load(part_lse + (offs_s * num_tokens + t) * NUM_HEADS + head, mask=s_valid,
                  other=float("-inf"))  # [S]
    m = tl.max(lse, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe)  # [S]
    w_sum = tl.sum(w, axis=0)
    w = w / tl.where(w_sum == 0.0, 1.0, w_sum)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    parts = tl.load(part_o + ((offs_s[:, None] * num_tokens + t) * NUM_HEADS + head) * HEAD_DIM + offs_d[None, :],
                    mask=s_valid[:, None] & d_valid[None, :], other=0.0)  # [S, BLOCK_D]
    out = tl.sum(parts * w[:, None], axis=0)
    if HAS_SINKS:
        total = tl.where(w_sum == 0.0, float("-inf"), m_safe + tl.log2(tl.where(w_sum == 0.0, 1.0, w_sum)))
        out = out / (1.0 + tl.exp2(tl.load(sinks + head).to(tl.float32) * 1.4426950408889634 - total))
    tl.store(o_ptr + (t * NUM_HEADS + head) * HEAD_DIM + offs_d, out.to(o_ptr.dtype.element_ty), mask=d_valid)


@triton.jit
def _load_kv_tile(k_cache, v_cache, page_table, row, table_stride, pos, n_valid, kv_head, offs_d, d_valid,
                  NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """The K and V tiles [BLOCK_N, BLOCK_D] of paged positions `pos` (zeros where not n_valid: no memory read)."""
    page = tl.load(page_table + row * table_stride + pos // PAGE_SIZE, mask=n_valid, other=0).to(tl.int64)
    slot = page * PAGE_SIZE + pos % PAGE_SIZE
    kv_off = slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + offs_d[None, :]
    kv_mask = n_valid[:, None] & d_valid[None, :]
    return tl.load(k_cache + kv_off, mask=kv_mask, other=0.0), tl.load(v_cache + kv_off, mask=kv_mask, other=0.0)


# num_tokens and num_splits vary per call: one compiled kernel for all their values
@triton.jit(do_not_specialize=["num_tokens", "num_splits"])
def grouped_decode_kernel(
    q_ptr, o_ptr, k_cache, v_cache, page_table, req_rows, qo_indptr, kv_lens, part_o, part_lse, num_tokens,
    num_splits, q_stride, table_stride, sm_scale_log2, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
    SPLIT_KV: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, PREFETCH: tl.constexpr = True,
    FP16_DOT: tl.constexpr = False, positions=None, window=0, sinks=None, HAS_WINDOW: tl.constexpr = False,
    HAS_SINKS: tl.constexpr = False, chunk=0, HAS_CHUNK: tl.constexpr = False,
):
    """Decode (one query token per request, no scratch): program (request, kv head, split) takes the kv head's
    GROUP = NUM_HEADS / NUM_KV_HEADS query heads as the rows of one tile (padded to BLOCK_H >= 16), so each K/V
    tile is read, and an FP8 cache's tile widened, once for the whole group. The same outputs (and split partials,
    for `merge_splits_kernel`) as `paged_attention_kernel` on such a batch, windows, chunks and sinks included: the
    token at position p sees [first, kv_len) with first = max(p - window + 1, p // chunk * chunk, 0), split
    across the programs of its splits (nothing before `first` is read: its pages may be freed).

    PREFETCH: the loads of tile i + 1 are issued before tile i's softmax step in the loop body (two tiles in
    registers); without it the loop loads its own tile and Triton's pipeliner (num_stages) overlaps the loads.
    FP16_DOT (FP8 cache, 16-bit query): q is cast to float16 once and the tiles widen to float16, which e4m3
    does exactly in one conversion per pair (to bfloat16 it takes three); the scores and acc stay float32."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    t = tl.load(qo_indptr + b)
    if t < tl.load(qo_indptr + b + 1):
        row = tl.load(req_rows + b).to(tl.int64)
        offs_h = tl.arange(0, BLOCK_H)
        h_valid = offs_h < NUM_HEADS // NUM_KV_HEADS  # the kv head's query heads: GROUP rows of BLOCK_H
        head = kv_head * (NUM_HEADS // NUM_KV_HEADS) + offs_h  # [BLOCK_H]
        offs_d = tl.arange(0, BLOCK_D)
        d_valid = offs_d < HEAD_DIM
        q = tl.load(q_ptr + t.to(tl.int64) * q_stride + head[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=h_valid[:, None] & d_valid[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
        kv_len = tl.load(kv_lens + t)
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        first = 0  # the first position the token sees (window, chunk)
        if HAS_WINDOW or HAS_CHUNK:
            first = _first_visible(tl.load(positions + t).to(tl.int32), window, chunk, HAS_WINDOW, HAS_CHUNK)
        span = tl.cdiv(tl.cdiv(tl.maximum(kv_len - first, 0), num_splits), BLOCK_N) * BLOCK_N  # keys per split
        lo = first + split * span
        hi = tl.minimum(lo + span, kv_len)
        if FP16_DOT:  # the tiles follow q's dtype in _online_softmax_step; float16's range is +-65504
            q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
        if PREFETCH:  # the loads of tile i + 1 are issued before tile i's softmax step (two tiles in flight)
            pos = lo + tl.arange(0, BLOCK_N)  # [BLOCK_N]
            n_valid = pos < hi
            k, v = _load_kv_tile(k_cache, v_cache, page_table, row, table_stride, pos, n_valid, kv_head, offs_d,
                                 d_valid, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE)
            for start in range(lo, hi, BLOCK_N):
                pos_next = start + BLOCK_N + tl.arange(0, BLOCK_N)
                valid_next = pos_next < hi
                k_next, v_next = _load_kv_tile(k_cache, v_cache, page_table, row, table_stride, pos_next, valid_next,
                                               kv_head, offs_d, d_valid, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE)
                allowed = h_valid[:, None] & n_valid[None, :]
                m_i, l_i, acc = _online_softmax_step(q, k, v, allowed, m_i, l_i, acc, sm_scale_log2, DOT_PRECISION)
                k, v, n_valid = k_next, v_next, valid_next
        else:
            for start in range(lo, hi, BLOCK_N):
                pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
                n_valid = pos < hi
                k, v = _load_kv_tile(k_cache, v_cache, page_table, row, table_stride, pos, n_valid, kv_head, offs_d,
                                     d_valid, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE)
                allowed = h_valid[:, None] & n_valid[None, :]
                m_i, l_i, acc = _online_softmax_step(q, k, v, allowed, m_i, l_i, acc, sm_scale_log2, DOT_PRECISION)
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        if HAS_SINKS and not SPLIT_KV:  # acc / (l + 2^(s - m)) = out / (1 + 2^(s - lse)), lse = m + log2(l)
            sink = tl.load(sinks + head, mask=h_valid, other=0.0).to(tl.float32) * 1.4426950408889634  # [BLOCK_H]
            lse_h = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
            out = out / (1.0 + tl.exp2(sink - lse_h))[:, None]
        o_off = (t * NUM_HEADS + head[:, None]) * HEAD_DIM + offs_d[None, :]
        o_mask = h_valid[:, None] & d_valid[None, :]
        if not SPLIT_KV:
            tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=o_mask)
        else:
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
            tl.store(part_o + split * num_tokens * NUM_HEADS * HEAD_DIM + o_off, out, mask=o_mask)
            tl.store(part_lse + (split * num_tokens + t) * NUM_HEADS + head, lse, mask=h_valid)
