"""Per-rank setup hooks for tensor-parallel tests (`create_engine(config, rank_setup=partial(hook, ...), make_strategy=make_strategy)`):
module-level functions, so spawned workers can import them."""

from __future__ import annotations

from oracle_draft import OracleDraft


def install_oracle(engine, rank: int, fraction: float, references: list[tuple[list[int], list[int]]]) -> None:
    """The same oracle draft on every rank (its choices depend only on the request and position)."""
    oracle = OracleDraft(engine.runner.draft, engine, fraction)
    engine.runner.draft = oracle
    for prompt, output in references:
        oracle.add_reference(prompt, output)


def fail_at_step(engine, rank: int, victim: int, step: int) -> None:
    """Rank `victim` raises at its `step`-th engine step (a worker that fails mid-generation)."""
    if rank != victim:
        return
    run, calls = engine.step, [0]

    def failing_step(*args, **kwargs):
        calls[0] += 1
        if calls[0] == step:
            raise RuntimeError(f"injected failure on rank {rank} at step {step}")
        return run(*args, **kwargs)

    engine.step = failing_step


def skew_logits(engine, rank: int, victim: int, token: int) -> None:
    """Rank `victim` favours `token` after the logits are gathered: its greedy tokens differ from the others'."""
    if rank != victim:
        return
    target = engine.runner.target
    compute = target.compute_logits

    def compute_logits(hidden):
        logits = compute(hidden)  # every rank still runs the same collectives
        logits[:, token] += 1e4
        return logits

    target.compute_logits = compute_logits
