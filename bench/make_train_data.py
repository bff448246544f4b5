"""Collect Python source for draft training from this machine's site-packages, excluding every file whose
text overlaps the fixture's held-out prompts. Usage: make_train_data.py OUT_DIR HELDOUT.jsonl [MAX_MB]"""

import hashlib
import json
import site
import sys
from pathlib import Path

out, heldout = Path(sys.argv[1]), Path(sys.argv[2])
max_bytes = int(float(sys.argv[3] if len(sys.argv) > 3 else 60) * 2**20)
held = [json.loads(line)["text"] for line in heldout.read_text().splitlines() if line.strip()]
held_hashes = {hashlib.sha256(t.encode()).hexdigest() for t in held}
held_heads = {t[:300] for t in held}
out.mkdir(parents=True, exist_ok=True)
total = kept = skipped = 0
for root in site.getsitepackages():
    for f in sorted(Path(root).rglob("*.py")):
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) < 500:
            continue
        if hashlib.sha256(text.encode()).hexdigest() in held_hashes or any(h in text for h in held_heads):
            skipped += 1
            continue
        (out / f"{kept:06d}.py").write_text(text)
        kept += 1
        total += len(text)
        if total > max_bytes:
            break
    if total > max_bytes:
        break
print(json.dumps({"files": kept, "bytes": total, "excluded_as_heldout": skipped}))
