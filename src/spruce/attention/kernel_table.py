"""Kernel tables and the rule `auto` picks a backend per phase by (DESIGN §13). Imports no torch.

A kernel table is the JSON `bench/attention_table.py` writes: `{"device": <torch.cuda.get_device_name()>,
"config": {...}, "rows": [{"phase", "bs", "context", "<backend>_ms", ...}, ...]}`, one attention layer's forward
time per phase, batch size and context, per backend. The package ships the tables it knows in
`spruce/attention/tables/`, in that same format (one format, one reader): installing a bench result is

    python -m spruce.attention.kernel_table bench/results/attention-table-<device>-<date>.json

which checks it, copies it to `tables/<device slug>.json` with a "source" field naming the bench file, and
prints the choice. A table is found by its "device" field, equal to the device's name; a device with no table of
its own takes the table of another GPU of its architecture (`ARCHITECTURES`: one SM version, the same kernels, so
the same ranking, though not the same times), e.g. an H200 the H100's. The start-up log names the table's file and
the device it runs on.

The rule, per phase: every backend measured on every row of the phase is scored by its **summed time over
those rows** (each batch size x context the table holds); the lowest sum ranks first, and the phase runs the
first-ranked backend that can run here (installed, the config's dtype, CUDA graphs, the models), else the
fallback. The choice cannot depend on the context, which changes at every replay of a captured graph; it does
not depend on the batch size either, so eager runs and every graph bucket run the same kernels. The sum is the
time of a workload spread evenly over the measured grid: it follows the cells where the backends differ by
milliseconds (long contexts), not those where they differ by microseconds.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

TABLES_DIR = Path(__file__).resolve().parent / "tables"
# GPUs of one SM architecture, by name (torch.cuda.get_device_name): the kernels a table ranks are the same on each,
# only memory size and bandwidth differ. e.g. "NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA GH200 480GB": Hopper.
ARCHITECTURES = (
    ("Hopper (sm90)", re.compile(r"\bG?H(100|200|800|20)\b")),
    ("Ampere GA100 (sm80)", re.compile(r"\bA(100|800)\b")),
    ("Blackwell (sm100)", re.compile(r"\bG?B(100|200)\b")),
)


class TableError(ValueError):
    """A kernel table that cannot be read (names the file and what is wrong)."""


@dataclass(frozen=True)
class KernelTable:
    path: Path
    device: str
    rows: tuple[dict, ...]

    def backends(self, phase: str, among: tuple[str, ...]) -> tuple[str, ...]:
        """Backends of `among` timed on every row of `phase` (none when the table has no row of it)."""
        rows = [r for r in self.rows if r["phase"] == phase]
        return tuple(n for n in among if rows and all(isinstance(r.get(f"{n}_ms"), (int, float)) for r in rows))

    def summed_ms(self, phase: str, backend: str) -> float:
        """`backend`'s time summed over the rows of `phase` (ms)."""
        return sum(r[f"{backend}_ms"] for r in self.rows if r["phase"] == phase)

    def cells(self, phase: str) -> int:
        return sum(r["phase"] == phase for r in self.rows)


@dataclass(frozen=True)
class PhaseChoice:
    """The backend one phase runs, and why (for the start-up log)."""

    backend: str
    reason: str
    fell_back: bool = False  # not the table's fastest backend (no table, or faster ones cannot run): `reason` says why


def load_table(path: str | Path) -> KernelTable:
    """Read and check a kernel table (TableError naming the file and the fault)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TableError(f"kernel table {path}: cannot read it ({e})") from e
    if not isinstance(data, dict) or not isinstance(data.get("device"), str) or not isinstance(data.get("rows"), list):
        raise TableError(f"kernel table {path}: expected an object with 'device' (a string) and 'rows' (a list)")
    for i, row in enumerate(data["rows"]):
        if not (isinstance(row, dict) and isinstance(row.get("phase"), str) and isinstance(row.get("bs"), int)
                and isinstance(row.get("context"), int)):
            raise TableError(f"kernel table {path}: row {i} needs 'phase' (a string), 'bs' and 'context' (integers), "
                             f"got {row!r}")
    return KernelTable(path, data["device"], tuple(data["rows"]))


def architecture(device_name: str) -> str | None:
    """The SM architecture `ARCHITECTURES` names for a GPU name, or None (unknown: no other GPU's table applies)."""
    return next((arch for arch, pattern in ARCHITECTURES if pattern.search(device_name)), None)


def find_table(device_name: str, tables_dir: Path | None = None) -> KernelTable | None:
    """The packaged table measured on `device_name` (its "device" field), else one measured on a GPU of the same
    architecture (the first by file name), else None."""
    tables = [load_table(path) for path in sorted((tables_dir or TABLES_DIR).glob("*.json"))]
    exact = next((t for t in tables if t.device == device_name), None)
    arch = architecture(device_name)
    return exact or next((t for t in tables if arch is not None and architecture(t.device) == arch), None)


def known_devices(tables_dir: Path | None = None) -> tuple[str, ...]:
    """The devices the packaged tables were measured on."""
    return tuple(load_table(p).device for p in sorted((tables_dir or TABLES_DIR).glob("*.json")))


def rank(table: KernelTable, phase: str, among: tuple[str, ...]) -> list[tuple[str, float]]:
    """The rule: (backend, summed ms) of every backend of `among` timed on all of `phase`'s rows, fastest first
    (ties keep `among`'s order)."""
    return sorted(((n, table.summed_ms(phase, n)) for n in table.backends(phase, among)), key=lambda x: x[1])


def select(table: KernelTable | None, phases: tuple[str, ...], refusals: dict[str, str | None], fallback: str,
           no_table: str = "no kernel table for this device") -> dict[str, PhaseChoice]:
    """Per phase, the first backend `rank` gives whose refusal is None (`refusals`: every candidate backend's
    reason it cannot run here, None if it can), else `fallback`; each with the reason the log gives (a choice
    that is not the table's fastest says which faster backends cannot run, and why)."""
    choices = {}
    for phase in phases:
        if table is None:
            choices[phase] = PhaseChoice(fallback, no_table, fell_back=True)
            continue
        ranked = rank(table, phase, tuple(refusals))
        faster = []  # the refusals of backends ranked before the one that runs
        for name, ms in ranked:
            if refusals[name] is not None:
                faster.append(f"{name} (measured faster) {refusals[name]}")
                continue
            others = ", ".join(f"{n} {t:.3g}" for n, t in ranked if n != name)
            measured = (f"{ms:.3g} ms summed over the table's {table.cells(phase)} {phase} cells"
                        + (f", vs {others}" if others else ""))
            choices[phase] = (PhaseChoice(name, "; ".join(faster), fell_back=True) if faster
                              else PhaseChoice(name, measured))
            break
        else:
            choices[phase] = PhaseChoice(fallback, "; ".join(faster) if faster else
                                         f"the kernel table times no candidate backend on every {phase} row",
                                         fell_back=True)
    return choices


def slug(device_name: str) -> str:
    """A file name for a device: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


def install(bench_json: str | Path, tables_dir: Path | None = None) -> Path:
    """Copy a bench result into the package's tables (named after its device), recording its source file."""
    table = load_table(bench_json)
    data = json.loads(Path(bench_json).read_text())
    data["source"] = Path(bench_json).name
    out = (tables_dir or TABLES_DIR) / f"{slug(table.device)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m spruce.attention.kernel_table BENCH_JSON (a bench/attention_table.py "
                         "result, copied into spruce/attention/tables/)")
    from spruce.attention import registry

    out = install(args[0])
    table = load_table(out)
    phases = tuple(dict.fromkeys(r["phase"] for r in table.rows))
    print(f"installed {out} ({table.device})")
    for phase, choice in select(table, phases, {n: None for n in registry.backend_names()},
                                registry.AUTO_FALLBACK).items():
        print(f"  {phase}: {choice.backend} ({choice.reason})")


if __name__ == "__main__":
    main()
