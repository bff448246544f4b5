"""Collect Python source for draft training from this machine's site-packages, minus the held-out prompts.

Usage: make_train_data.py OUT.jsonl HELDOUT.jsonl [MAX_MB] [SEED]

Every held-out prompt is the beginning (up to 4000 characters) of some source file, so a file is excluded when
the SHA-256 of its text, or of its first len(prompt) characters for any held-out prompt length, is a held-out
prompt's hash, or when it starts like one (first 200 characters). Files are visited in a seeded random order
(so the cap samples every package, not the alphabetically first ones); very small and very large (generated)
files are skipped. Writes one {"text": ...} line per file and prints a JSON summary.
"""

import hashlib
import json
import random
import site
import sys
from pathlib import Path


def sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def main() -> None:
    out, heldout = Path(sys.argv[1]), Path(sys.argv[2])
    max_bytes = int(float(sys.argv[3] if len(sys.argv) > 3 else 60) * 2**20)
    seed = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    held = [json.loads(line)["text"] for line in heldout.read_text().splitlines() if line.strip()]
    held_hashes = {sha(t) for t in held}
    held_lengths = sorted({len(t) for t in held})
    held_heads = {t[:200] for t in held}
    files = sorted({f for root in site.getsitepackages() for f in Path(root).rglob("*.py") if f.is_file()})
    random.Random(seed).shuffle(files)
    total = kept = excluded = 0
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for path in files:
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if not 200 <= len(text) <= 400_000:
                continue
            if text[:200] in held_heads or any(sha(text[:n]) in held_hashes for n in held_lengths if n <= len(text)):
                excluded += 1
                continue
            f.write(json.dumps({"text": text}) + "\n")
            kept += 1
            total += len(text)
            if total >= max_bytes:
                break
    print(json.dumps({"files": kept, "bytes": total, "candidates": len(files), "excluded_as_heldout": excluded,
                      "site_packages": site.getsitepackages()}))


if __name__ == "__main__":
    main()
