"""Training text for draft heads: documents in, fixed-length token windows out.

A document is one plain-text / source file, or one `{"text": ...}` line of a JSONL file. Documents are
tokenized as the engine tokenizes prompts (bos where the tokenizer adds one), followed by eos, concatenated
into one token stream and cut into windows of `max_length` tokens, so no batch carries padding. The order
in which windows are visited is a pure function of (seed, step), which makes a resumed run continue exactly
where an uninterrupted one would be.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from spruce.errors import SpruceError

TEXT_SUFFIXES = ("*.py", "*.txt", "*.md", "*.jsonl")


def load_documents(paths: list[str]) -> list[str]:
    """Every file is a document (a JSONL file: every line's "text"); directories are walked for TEXT_SUFFIXES.

    Unreadable (non-UTF-8) files are skipped. SpruceError when a path is missing or nothing usable is found."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for pattern in TEXT_SUFFIXES for f in p.rglob(pattern) if f.is_file())
        elif p.is_file():
            files.append(p)
        else:
            raise SpruceError(f"training data not found: {p}")
    docs = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if f.suffix == ".jsonl":
            for n, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line).get("text")
                except (json.JSONDecodeError, AttributeError) as e:
                    raise SpruceError(f"{f}:{n}: expected a JSON object with a \"text\" field ({e})") from e
                if isinstance(value, str) and value.strip():
                    docs.append(value)
        elif text.strip():
            docs.append(text)
    if not docs:
        raise SpruceError(f"no usable text in {paths}")
    return docs


def split_heldout(docs: list[str], count: int, seed: int) -> tuple[list[str], list[str]]:
    """(train, held-out): `count` documents drawn (seeded) and kept out of training, when at least twice as
    many remain for training; otherwise nothing is held out."""
    if count <= 0 or len(docs) < 3 * count:
        return docs, []
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    held = set(order[:count])
    return [d for i, d in enumerate(docs) if i not in held], [docs[i] for i in sorted(held)]


def tokenize_documents(target_dir, tokenizer, docs: list[str]) -> list[list[int]]:
    """Token ids of each document as the engine would encode it as a prompt, plus eos at its end.

    Uses the `tokenizers` library's batch encoder on the target's tokenizer.json (parallel, fast); bos is
    prepended exactly when spruce's Tokenizer.encode would add it."""
    from tokenizers import Tokenizer as HFTokenizer

    fast = HFTokenizer.from_file(str(Path(target_dir) / "tokenizer.json"))
    bos = tokenizer.bos_token_id
    head = [bos] if bos is not None and tokenizer.encode("x")[:1] == [bos] else []
    tail = list(tokenizer.eos_token_ids[:1])
    return [head + e.ids + tail for e in fast.encode_batch(docs, add_special_tokens=False)]


class PackedWindows:
    """All documents' tokens concatenated and cut into `length`-token windows (the short tail dropped).

    batch(step, size) -> [size, length] int64: the windows of step `step` of an endless sequence of seeded
    epoch permutations (every window once per epoch)."""

    def __init__(self, token_docs: list[list[int]], max_length: int, seed: int):
        stream = torch.tensor([t for doc in token_docs for t in doc], dtype=torch.int64)
        self.length = min(max_length, len(stream))
        if self.length < 2:
            raise SpruceError(f"training data has only {len(stream)} tokens; need at least 2")
        count = len(stream) // self.length
        self.windows = stream[: count * self.length].view(count, self.length)  # [W, length]
        self.num_tokens = len(stream)
        self.seed = seed
        self._perms: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.windows.shape[0]

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(len(self), generator=g)}  # one epoch cached at a time
        return self._perms[epoch]

    def batch(self, step: int, size: int) -> torch.Tensor:
        """Windows [size, length] of step `step` (0-based)."""
        n = len(self)
        picks = []
        for g in range(step * size, (step + 1) * size):
            picks.append(int(self._perm(g // n)[g % n]))
        return self.windows[picks]
