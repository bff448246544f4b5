"""test_tensor_parallel.py's fixture-model tests, run again on the bundled demo model (pycode-6m: 4 query and 2 KV
heads, so tp 2 divides them) so that a fresh clone without ../shared covers tensor parallelism too: tp 2 == tp 1
for plain decoding and EAGLE-3 trees, a failing worker and diverging ranks are caught, a tp size that does not
divide the heads is refused.

The tests are imported unchanged; in this module `pycode19m` is the bundled model.
"""

from __future__ import annotations

from bundled_fixtures import pycode19m  # noqa: F401  (the bundled model stands in)
from test_tensor_parallel import (  # noqa: F401  (collected again here, with the fixture above)
    test_diverging_ranks_are_caught,
    test_llama_eagle3_tree_tp2_equals_tp1,
    test_llama_plain_tp2_equals_tp1,
    test_tp_size_must_divide_the_heads,
    test_worker_failure_raises_naming_the_worker,
)
