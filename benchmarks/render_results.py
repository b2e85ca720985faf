"""Markdown tables of microbenchmark JSON files (written by the bench_*.py scripts), for the
tables of docs/benchmarks.md.

python benchmarks/render_results.py benchmarks/results/<date>_<machine>_tree-verify.json
"""

import json
import sys

from common import _fmt

PRECISION = {"_ms": 3, "_us": 1, "_speedup": 1, "_frac_copy_bw": 3, "_GBps": 1, "rows_visited": 2}


def cell(column, value):
    if isinstance(value, float):
        for suffix, digits in PRECISION.items():
            if column.endswith(suffix):
                return f"{value:.{digits}f}"
    return _fmt(value)


def render(path):
    with open(path) as f:
        data = json.load(f)
    if "meta" not in data or "rows" not in data:  # e2e*.json: written by `specdec bench`
        print(f"skipped {path}: not a microbenchmark result", file=sys.stderr)
        return
    meta, rows = data["meta"], data["rows"]
    machine = meta["machine"]
    where = machine.get("gpu") or f"{machine['cpu']}, {machine['torch_threads']} thread(s)"
    print(f"### {meta['op']} on {meta['device']} ({where})\n")
    print(
        f"{meta['date']}, commit {meta['git_commit'][:10]}, torch {machine['torch']}, "
        f"copy bandwidth {meta['copy_GBps']:.1f} GB/s, load average "
        f"{', '.join(f'{x:.1f}' for x in machine.get('load_average_1_5_15min') or [])}; "
        f"raw: `{path}`\n"
    )
    columns = meta["columns"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(cell(c, row.get(c)) for c in columns) + " |")
    notes = sorted({f"{k}: {v}" for row in rows for k, v in row.items() if k.endswith("_note")})
    for note in notes:
        print(f"\n- {note}")
    print()


if __name__ == "__main__":
    for p in sys.argv[1:]:
        render(p)
