"""test_tokenizer.py's fixture-model tests, run again on the bundled demo model's tokenizer (pycode-6m: the
same byte-level BPE layout and tokenizer_config as pycode-19m) so that a fresh clone covers them: encode /
decode equal transformers', special tokens, bos/eos flags with and without a post-processor, chat templates
(inline, from a file, errors) and incremental detokenization (the library's stream against the Python windows).

The tests are imported unchanged; in this module `pycode19m` is the bundled model and `heldout_prompts` are
prompts of real Python from the standard library.
"""

from __future__ import annotations

from bundled_fixtures import heldout_prompts, pycode19m  # noqa: F401  (the bundled model stands in)
from test_tokenizer import (  # noqa: F401  (collected again here, with the fixtures above)
    test_add_bos_token_without_post_processor,
    test_bos_eos_flags_match_transformers,
    test_chat_template_file_and_errors,
    test_chat_template_matches_transformers,
    test_encode_decode_match_transformers,
    test_incremental_detokenizer_equals_full_decode,
    test_special_tokens,
    test_the_library_stream_adds_what_the_python_windows_add,
    sentencepiece_style,
    toks,
)
