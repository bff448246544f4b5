"""No history in the product: README.md, docs/ and src/ state what spruce is and why, not when or in which
session it got there (history lives in `git log`). Flagged: "session N", ISO dates (2026-11-22), and words that
look like commit hashes (7-12 lowercase hex characters with at least one digit and one letter a-f, e.g.
"4e5d77e"); hex constants written as 0x... are not words of that kind, and `ALLOWED_WORDS` lists the rest.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SESSION = re.compile(r"\bsessions? \d+", re.IGNORECASE)
ISO_DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
HASH_LIKE = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,12}\b")
ALLOWED_WORDS: frozenset[str] = frozenset()  # legitimate hex-looking words, each with a reason beside it


def product_files(repo: Path = REPO) -> list[Path]:
    """README.md, every Markdown file under docs/, every Python module under src/."""
    files = [repo / "README.md", *sorted((repo / "docs").rglob("*.md")), *sorted((repo / "src").rglob("*.py"))]
    return [f for f in files if f.is_file()]


def history_marks(text: str) -> list[tuple[int, str]]:
    """(line number, the flagged text) for every history mark in `text`.

    >>> history_marks("ok\\nmeasured in session 12 at 4e5d77e on 2026-11-22; 0x9e3779b9 and deadbeef are fine")
    [(2, 'session 12'), (2, '2026-11-22'), (2, '4e5d77e')]
    """
    marks = []
    for number, line in enumerate(text.splitlines(), 1):
        found = [m.group() for pattern in (SESSION, ISO_DATE) for m in pattern.finditer(line)]
        found += [w for w in HASH_LIKE.findall(line) if w not in ALLOWED_WORDS]
        marks += [(number, f) for f in found]
    return marks


def test_no_history_in_readme_docs_or_src():
    files = product_files()
    assert any(f.name == "README.md" for f in files) and any(f.suffix == ".py" for f in files)
    hits = [f"{path.relative_to(REPO)}:{line}: {mark}" for path in files
            for line, mark in history_marks(path.read_text(encoding="utf-8"))]
    assert not hits, f"{len(hits)} history marks (sessions, dates, commit hashes):\n" + "\n".join(hits[:60])


def test_the_patterns_catch_each_kind_and_spare_constants():
    assert history_marks("Session 7's fix") == [(1, "Session 7")]
    assert history_marks("sessions 8-18 (DESIGN §16)") == [(1, "sessions 8")]
    assert history_marks("`serving-...-205800.json`, commit 0351fb1") == [(1, "0351fb1")]
    assert history_marks("at c474dd2f0e, on 2026-11-28") == [(1, "2026-11-28"), (1, "c474dd2f0e")]
    assert history_marks("seed 0x9E3779B9, mask 0xffffffff, decade 1234567, fifteen, accepted, 20261122") == []
    assert history_marks("a sha256 " + "ab12" * 16) == []  # a digest is too long to be a short hash
