"""One-launch fills of the uniform phases' metadata on the GPU: the scratch phases (VERIFY, DRAFT_DECODE) and the
paged ones (DECODE, DRAFT_EXTEND).

The torch versions in `BatchBuilder.scratch_phase`, `BatchBuilder.decode` and `BatchBuilder.draft_extend` are the
references (and the CPU path); these kernels write the same values into the same persistent buffers with one launch
instead of ~12-20 small ones. Padding rows (the dummy row) get out_slot 0, kv_len 0 and an empty mask, exactly as
`BatchBuilder._mask_padding` does.

Why DECODE too: its torch fill copies contiguous int64 views (`req_rows[:P] = rows`, the positions, the token ids),
which a CUDA graph captures as memcpy nodes: lowered as a copy kernel in one graph and on the copy engine
(`Memcpy DtoD`) in another, where the same step spanned more of the stream for the same kernels. A kernel writes
them on the compute engine whatever the graph's lowering.
"""

from __future__ import annotations

from spruce.ops.triton_support import HAS_TRITON, missing_triton_error, tl, triton


@triton.jit(do_not_specialize=["batch", "n_per", "scratch_offset"])  # vary per call: compile once
def _scratch_metadata_kernel(
    rows_ptr, committed_ptr, ids_ptr, depths_ptr, masks_ptr,
    out_ids, out_pos, out_slots, out_rows, out_kv, out_mask, out_req_rows, out_indptr,
    batch, n_per, scratch_start, scratch_offset, scratch_width, dummy_row,
    IN_WORDS: tl.constexpr, OUT_WORDS: tl.constexpr, BLOCK: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    total = batch * n_per
    valid = t < total
    b = t // n_per
    i = t % n_per
    row = tl.load(rows_ptr + b, mask=valid, other=0)
    committed = tl.load(committed_ptr + b, mask=valid, other=0)
    pad = row == dummy_row
    tl.store(out_ids + t, tl.load(ids_ptr + t, mask=valid, other=0), mask=valid)
    tl.store(out_pos + t, committed + tl.load(depths_ptr + t, mask=valid, other=0), mask=valid)
    slot = scratch_start + row * scratch_width + scratch_offset + i
    tl.store(out_slots + t, tl.where(pad, 0, slot), mask=valid)
    tl.store(out_rows + t, row, mask=valid)
    tl.store(out_kv + t, tl.where(pad, 0, committed).to(tl.int32), mask=valid)
    for w in tl.static_range(OUT_WORDS):
        if w < IN_WORDS:
            word = tl.load(masks_ptr + t * IN_WORDS + w, mask=valid, other=0)
        else:
            word = tl.zeros([BLOCK], dtype=tl.int64)
        tl.store(out_mask + t * OUT_WORDS + w, tl.where(pad, 0, word), mask=valid)
    tl.store(out_req_rows + t, tl.load(rows_ptr + t, mask=t < batch, other=0), mask=t < batch)
    tl.store(out_indptr + t, (t * n_per).to(tl.int32), mask=t <= batch)


@triton.jit
def _uniform_metadata_kernel(
    rows_ptr, starts_ptr, ids_ptr, counts_ptr, table_ptr,
    out_ids, out_pos, out_slots, out_rows, out_kv, out_mask, out_req_rows, out_indptr,
    batch, stride, table_stride, page_size, dummy_row,
    HAS_COUNTS: tl.constexpr, MASK_WORDS: tl.constexpr, BLOCK: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    total = batch * stride
    valid = t < total
    b = t // stride
    i = t % stride
    row = tl.load(rows_ptr + b, mask=valid, other=0)
    pos = tl.load(starts_ptr + b, mask=valid, other=0) + i
    drop = row == dummy_row  # padding rows write the dummy page and attend to nothing
    if HAS_COUNTS:
        drop = drop | (i >= tl.load(counts_ptr + b, mask=valid, other=0))  # past the request's tokens
    page = tl.load(table_ptr + row * table_stride + pos // page_size, mask=valid & (drop == 0), other=0)
    tl.store(out_ids + t, tl.load(ids_ptr + t, mask=valid, other=0), mask=valid)
    tl.store(out_pos + t, pos, mask=valid)
    tl.store(out_slots + t, tl.where(drop, 0, page.to(tl.int64) * page_size + pos % page_size), mask=valid)
    tl.store(out_rows + t, row, mask=valid)
    tl.store(out_kv + t, tl.where(drop, 0, pos + 1).to(tl.int32), mask=valid)
    for w in tl.static_range(MASK_WORDS):
        tl.store(out_mask + t * MASK_WORDS + w, tl.zeros([BLOCK], dtype=tl.int64), mask=valid)
    tl.store(out_req_rows + t, tl.load(rows_ptr + t, mask=t < batch, other=0), mask=t < batch)
    tl.store(out_indptr + t, (t * stride).to(tl.int32), mask=t <= batch)


def fill_uniform_metadata(builder, rows, starts, input_ids, counts=None) -> None:
    """Write the builder's buffers for a paged uniform phase (DECODE, DRAFT_EXTEND): P = rows.shape[0] requests of
    `stride` = input_ids.shape[1] tokens each, token i of request b at position starts[b] + i; with `counts` [P],
    only a request's first counts[b] tokens write the cache and attend (the rest get out_slot 0 and kv_len 0, as
    padding rows do). rows, starts, counts [P] and input_ids [P, stride] on the device."""
    if not HAS_TRITON:
        raise missing_triton_error("the one-launch uniform-phase metadata fill (BatchBuilder.fused, on for CUDA)")
    p, stride = input_ids.shape
    block = 128
    table = builder.page_table.table
    _uniform_metadata_kernel[(triton.cdiv(max(p * stride, p + 1), block),)](
        rows.contiguous(), starts.contiguous(), input_ids.contiguous(),
        counts.contiguous() if counts is not None else rows, table,
        builder.input_ids, builder.positions, builder.out_slots, builder.token_rows, builder.kv_lens,
        builder.tree_mask, builder.req_rows, builder.qo_indptr,
        p, stride, table.stride(0), builder.limits.page_size, builder.limits.dummy_row,
        HAS_COUNTS=counts is not None, MASK_WORDS=builder.tree_mask.shape[1], BLOCK=block,
    )


def fill_scratch_metadata(builder, rows, committed, input_ids, depths, masks, scratch_offset: int,
                          scratch_start: int, scratch_width: int) -> None:
    """Write the builder's buffers for P = rows.shape[0] requests of n = input_ids.shape[1] tokens each."""
    if not HAS_TRITON:
        raise missing_triton_error("the one-launch scratch-metadata fill (BatchBuilder.fused, on for CUDA)")
    p, n = input_ids.shape
    total = p * n
    block = 256
    grid = (triton.cdiv(max(total, p + 1), block),)
    _scratch_metadata_kernel[grid](
        rows, committed, input_ids.contiguous(), depths.contiguous(), masks.contiguous(),
        builder.input_ids, builder.positions, builder.out_slots, builder.token_rows, builder.kv_lens,
        builder.tree_mask, builder.req_rows, builder.qo_indptr,
        p, n, scratch_start, scratch_offset, scratch_width, builder.limits.dummy_row,
        IN_WORDS=masks.shape[-1], OUT_WORDS=builder.tree_mask.shape[1], BLOCK=block,
    )
