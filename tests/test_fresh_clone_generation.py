"""test_generation.py's fixture-model tests, run again on the bundled demo model (pycode-6m) so that a fresh
clone without ../shared covers the same behaviours: greedy equals transformers token for token at every page
size, requests joining mid-flight, queueing and preemption when out of pages, stop conditions, abort, seeded
sampling across batches, text prompts and the chat template, refused requests and engine settings.

The tests are imported unchanged; in this module `pycode19m` is the bundled model and `heldout_prompts` are
prompts of real Python from the standard library.
"""

from __future__ import annotations

from bundled_fixtures import heldout_prompts, pycode19m  # noqa: F401  (the bundled model stands in)
from test_generation import (  # noqa: F401  (collected again here, with the fixtures above)
    hf_reference,
    test_abort_frees_everything_at_once,
    test_bad_engine_settings,
    test_bad_request_is_refused_and_engine_stays_usable,
    test_greedy_equals_transformers,
    test_out_of_pages_queues_and_preempts,
    test_requests_joining_mid_flight,
    test_seeded_sampling_is_reproducible_across_batches,
    test_stop_conditions,
    test_text_prompt_and_chat_template,
)
