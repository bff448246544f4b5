"""Training data for draft heads: plain-text / source files and JSONL ({"text": ...}), tokenized into chunks."""

from __future__ import annotations

import json
from pathlib import Path

from spruce.errors import SpruceError


def load_documents(paths: list[str]) -> list[str]:
    """Every file is a document (JSONL: every line's "text"); directories are walked for *.py/*.txt/*.jsonl."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for ext in ("*.py", "*.txt", "*.md", "*.jsonl") for f in p.rglob(ext))
        elif p.exists():
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
            for line in text.splitlines():
                if line.strip():
                    value = json.loads(line).get("text")
                    if isinstance(value, str) and value:
                        docs.append(value)
        elif text.strip():
            docs.append(text)
    if not docs:
        raise SpruceError(f"no usable text in {paths}")
    return docs


def token_chunks(tokenizer, docs: list[str], max_length: int, min_length: int = 16) -> list[list[int]]:
    """Each document tokenized and cut into chunks of at most max_length tokens (short tails dropped)."""
    chunks = []
    for doc in docs:
        ids = tokenizer.encode(doc)
        for i in range(0, len(ids), max_length):
            piece = ids[i:i + max_length]
            if len(piece) >= min_length:
                chunks.append(piece)
    return chunks
