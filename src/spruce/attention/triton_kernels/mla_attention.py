"""MLA attention in absorbed form (DeepSeek-V2/V3): multi-query attention over one shared latent per position.

Each cached position holds one latent row of Dk values (Dk = kv_lora_rank + rope dim, 576 for DeepSeek-V3):
its key is the whole row and its value the first Dv columns (the compressed kv, 512). Every query head attends
to the same keys, so a program takes a block of BLOCK_M (query token, head) pairs of one request and loads each
latent tile once for all of them. A request's query rows are flattened token-major, head fastest
(row r = i * Hq + h for its i-th token), so with Hq >= BLOCK_M a block is BLOCK_M heads of one token and with
fewer heads it spans BLOCK_M / Hq consecutive tokens.

Grid: (request x row block, kv split). The keys a row sees follow the attention contract of
`spruce.attention.metadata`: the split's share of the paged prefix [0, max kv_len of the block), slots from
the page table, masked per row by `pos < kv_lens[token]`; the last split also walks the request row's scratch
block, masked per row by its token's ancestor bitmask. Dk need not be a power of two: the key is split into
its value part (Dv columns, padded to BLOCK_DV) and the rest (Dk - Dv, padded to BLOCK_DR >= 16, all
padding when Dk == Dv), and
    s = (q[:, :Dv] @ kv[:, :Dv]^T + q[:, Dv:] @ kv[:, Dv:]^T) * scale * log2(e)
where the value tile is the key tile's first part, loaded once for both products. Online softmax in the log2
domain, as in `paged_attention`:
    m' = max(m, rowmax(s));  alpha = 2^(m - m');  p = 2^(s - m')
    l' = l * alpha + rowsum(p);  acc' = acc * alpha + p @ kv[:, :Dv]
With one split the program writes acc / l (and, when asked, lse = m + log2(l)); with several it writes acc / l
and lse per split and `merge_latent_splits_kernel` combines them. A row with nothing to attend to gets zeros.
With `kv_start` the paged range starts at the request's kv_start instead of 0 (the tail half of a split
attention, DESIGN §13).

Blocking (chosen by the backend from host ints): acc is [BLOCK_M, Dv] fp32, so BLOCK_M is 64 rows on 8 warps
when a request has that many rows (prefill, verify, decode with >= 64 heads) and 16 rows on 4 warps
otherwise; BLOCK_N = 32 positions. Few row blocks (batch-1 decode) are made up for by up to 64 kv splits.
Every size that shapes the grid is a host int fixed per CUDA-graph bucket; per-request lengths are read on
the device.
"""

from __future__ import annotations

from spruce.ops.triton_support import tl, triton


@triton.jit
def store_latent_kernel(latent_ptr, cache, slots, latent_stride, cache_stride, KEY_DIM: tl.constexpr,
                        BLOCK: tl.constexpr):
    """cache[slots[t], :] = latent[t, :] (already in the cache dtype), one program per token."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < KEY_DIM
    x = tl.load(latent_ptr + t * latent_stride + offs, mask=mask)
    tl.store(cache + slot * cache_stride + offs, x, mask=mask)


def store_latent(latent, cache, slots) -> None:
    """latent [T, Dk] -> cache[slots] ([slots_total, Dk]), rounded to the cache dtype as the reference does."""
    t, key_dim = latent.shape
    if t == 0:
        return
    latent = latent.to(cache.dtype)  # no copy when the model runs in the cache dtype
    latent = latent if latent.stride(1) == 1 else latent.contiguous()
    store_latent_kernel[(t,)](latent, cache, slots, latent.stride(0), cache.stride(0), KEY_DIM=key_dim,
                              BLOCK=triton.next_power_of_2(key_dim))


@triton.jit
def _load_latents(cache, slot, n_valid, cache_stride, offs_dv, offs_dr, VALUE_DIM: tl.constexpr,
                  ROPE_DIM: tl.constexpr):
    """The latent rows of `slot` ([BLOCK_N]): value part [BLOCK_N, BLOCK_DV] and rest [BLOCK_N, BLOCK_DR]."""
    row = cache + slot[:, None] * cache_stride
    kv = tl.load(row + offs_dv[None, :], mask=n_valid[:, None] & (offs_dv < VALUE_DIM)[None, :], other=0.0)
    kr = tl.load(row + VALUE_DIM + offs_dr[None, :], mask=n_valid[:, None] & (offs_dr < ROPE_DIM)[None, :],
                 other=0.0)
    return kv, kr


@triton.jit
def _latent_step(q_v, q_r, kv, kr, allowed, m_i, l_i, acc, sm_scale_log2, DOT_PRECISION: tl.constexpr):
    """One online-softmax step of a row block over one key tile (value = the key's first part `kv`)."""
    kv, kr = kv.to(q_v.dtype), kr.to(q_r.dtype)  # an FP8 cache's tiles widened to the query's dtype
    s = tl.dot(q_v, tl.trans(kv), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
    s = tl.dot(q_r, tl.trans(kr), acc=s, input_precision=DOT_PRECISION) * sm_scale_log2
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing yet stay at zero
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_DV]
    return m_new, l_i, acc


# num_m_blocks, num_tokens and num_splits vary per call: one compiled kernel for all their values (a new value of a
# specialised int compiles a kernel in the middle of serving)
@triton.jit(do_not_specialize=["num_m_blocks", "num_tokens", "num_splits"])
def mla_attention_kernel(
    q_ptr, o_ptr, cache, page_table, req_rows, qo_indptr, kv_lens, tree_mask, part_o, part_lse, kv_start, lse_ptr,
    num_m_blocks, num_tokens, num_splits, q_stride, cache_stride, table_stride, mask_stride, scratch_start,
    sm_scale_log2, NUM_HEADS: tl.constexpr, KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_DR: tl.constexpr, PAGE_SIZE: tl.constexpr, SCRATCH_WIDTH: tl.constexpr, SPLIT_KV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_KV_START: tl.constexpr = False, RETURN_LSE: tl.constexpr = False,
):
    ROPE_DIM: tl.constexpr = KEY_DIM - VALUE_DIM
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // num_m_blocks
    r0 = (pid % num_m_blocks) * BLOCK_M  # first row of the block within the request
    q_start = tl.load(qo_indptr + b)
    q_end = tl.load(qo_indptr + b + 1)
    if q_start + r0 // NUM_HEADS < q_end:
        row = tl.load(req_rows + b).to(tl.int64)
        r = r0 + tl.arange(0, BLOCK_M)
        tok = q_start + r // NUM_HEADS  # [BLOCK_M] query token of each row
        head = r % NUM_HEADS  # [BLOCK_M]
        m_valid = tok < q_end
        tok = tl.where(m_valid, tok, q_start).to(tl.int64)  # rows past the request's end read its first token
        offs_dv = tl.arange(0, BLOCK_DV)
        offs_dr = tl.arange(0, BLOCK_DR)
        q_row = q_ptr + tok[:, None] * q_stride + head[:, None] * KEY_DIM
        q_v = tl.load(q_row + offs_dv[None, :], mask=m_valid[:, None] & (offs_dv < VALUE_DIM)[None, :],
                      other=0.0)  # [BLOCK_M, BLOCK_DV]
        q_r = tl.load(q_row + VALUE_DIM + offs_dr[None, :], mask=m_valid[:, None] & (offs_dr < ROPE_DIM)[None, :],
                      other=0.0)  # [BLOCK_M, BLOCK_DR]
        tok_kv = tl.load(kv_lens + tok, mask=m_valid, other=0)  # [BLOCK_M]
        kv_max = tl.max(tok_kv, axis=0)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

        # paged prefix: this split's share of [kv_lo, kv_max), in whole BLOCK_N chunks; kv_lo = 0, or the
        # request's kv_start when another kernel attends to [0, kv_start) (FlashInfer's half: DESIGN §13)
        kv_lo = 0
        if HAS_KV_START:
            kv_lo = tl.load(kv_start + b)
        chunk = tl.cdiv(tl.cdiv(tl.maximum(kv_max - kv_lo, 0), num_splits), BLOCK_N) * BLOCK_N
        lo = kv_lo + split * chunk
        hi = tl.minimum(lo + chunk, kv_max)
        for start in range(lo, hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
            n_valid = pos < hi
            page = tl.load(page_table + row * table_stride + pos // PAGE_SIZE, mask=n_valid, other=0).to(tl.int64)
            slot = page * PAGE_SIZE + pos % PAGE_SIZE
            kv, kr = _load_latents(cache, slot, n_valid, cache_stride, offs_dv, offs_dr, VALUE_DIM, ROPE_DIM)
            allowed = (pos[None, :] < tok_kv[:, None]) & n_valid[None, :]
            m_i, l_i, acc = _latent_step(q_v, q_r, kv, kr, allowed, m_i, l_i, acc, sm_scale_log2, DOT_PRECISION)

        # tree scratch of this row (last split only): entry j allowed where bit j of the token's mask is set
        if SCRATCH_WIDTH > 0:
            if split == num_splits - 1:
                for start in range(0, SCRATCH_WIDTH, BLOCK_N):
                    j = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
                    n_valid = j < SCRATCH_WIDTH
                    slot = scratch_start + row * SCRATCH_WIDTH + j
                    kv, kr = _load_latents(cache, slot, n_valid, cache_stride, offs_dv, offs_dr, VALUE_DIM, ROPE_DIM)
                    word = tl.load(tree_mask + tok[:, None] * mask_stride + j[None, :] // 64,
                                   mask=m_valid[:, None] & n_valid[None, :], other=0)  # [BLOCK_M, BLOCK_N]
                    bit = (word >> (j[None, :] % 64).to(tl.int64)) & 1
                    allowed = (bit != 0) & n_valid[None, :]
                    m_i, l_i, acc = _latent_step(q_v, q_r, kv, kr, allowed, m_i, l_i, acc, sm_scale_log2,
                                                 DOT_PRECISION)

        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]  # [BLOCK_M, BLOCK_DV]
        o_row = tok * NUM_HEADS + head  # [BLOCK_M] row of the [T, Hq] output
        o_off = o_row[:, None] * VALUE_DIM + offs_dv[None, :]
        o_mask = m_valid[:, None] & (offs_dv < VALUE_DIM)[None, :]
        if not SPLIT_KV:
            tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=o_mask)
            if RETURN_LSE:  # log2-sum-exp of the scaled scores: FlashInfer's convention (merge_state)
                lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
                tl.store(lse_ptr + o_row, lse, mask=m_valid)
        else:
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
            tl.store(part_o + split * num_tokens * NUM_HEADS * VALUE_DIM + o_off, out, mask=o_mask)
            tl.store(part_lse + split * num_tokens * NUM_HEADS + o_row, lse, mask=m_valid)


@triton.jit(do_not_specialize=["num_tokens", "num_splits"])
def merge_latent_splits_kernel(part_o, part_lse, o_ptr, num_tokens, num_splits, NUM_HEADS: tl.constexpr,
                               VALUE_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, MAX_SPLITS: tl.constexpr):
    """out = sum_s 2^(lse_s - m) * out_s / sum_s 2^(lse_s - m), m = max_s lse_s, over the num_splits (<= MAX_SPLITS)
    splits (splits that saw nothing: -inf).

    One program per (token, head); the splits' rows are summed one at a time."""
    t = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, MAX_SPLITS)
    lse = tl.load(part_lse + (offs_s * num_tokens + t) * NUM_HEADS + head, mask=offs_s < num_splits,
                  other=float("-inf"))  # [S]
    m = tl.max(lse, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w_sum = tl.sum(tl.exp2(lse - m_safe), axis=0)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_valid = offs_dv < VALUE_DIM
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for s in range(num_splits):
        row = (s * num_tokens + t) * NUM_HEADS + head
        w = tl.exp2(tl.load(part_lse + row) - m_safe)
        acc += w * tl.load(part_o + row * VALUE_DIM + offs_dv, mask=dv_valid, other=0.0)
    out = acc / tl.where(w_sum == 0.0, 1.0, w_sum)
    tl.store(o_ptr + (t * NUM_HEADS + head) * VALUE_DIM + offs_dv, out.to(o_ptr.dtype.element_ty), mask=dv_valid)
