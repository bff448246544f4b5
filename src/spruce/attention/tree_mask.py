"""The tree mask's layout, importable without torch (`spruce.limits` sizes the mask from it).

`ForwardBatch.tree_mask` [T, words] int64: bit j % MASK_WORD_BITS of word j // MASK_WORD_BITS is set where the
token may attend to scratch entry j of its request row."""

MASK_WORD_BITS = 64  # tree_mask words are int64
