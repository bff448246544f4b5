"""One-launch fill of the scratch-phase metadata (VERIFY, DRAFT_DECODE) on the GPU.

The torch version in `BatchBuilder.scratch_phase` is the reference (and the CPU path); this kernel writes
the same values into the same persistent buffers with one launch instead of ~20 small ones. Padding rows
(the dummy row) get out_slot 0, kv_len 0 and an empty mask, exactly as `BatchBuilder._mask_padding` does.
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
