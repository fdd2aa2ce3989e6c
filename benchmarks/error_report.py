"""The worst value of every accuracy check a test run made: each ``rel_rms`` the tests computed with
``FLASHGDN_ERROR_LOG=DIR`` set (``tests/helpers.py`` appends one JSON line per call to ``DIR/errors-*.jsonl``),
grouped by the call's site (file and line) and the ``name`` its caller was checking, with the test that gave the
worst value and the site's source line (which says what it compares against: the float64 oracle, the run without
context parallelism, the other build of an A/B).

    FLASHGDN_ERROR_LOG=/tmp/errs python3 -m pytest -m gpu tests/test_gpu_hopper_forward.py
    python3 benchmarks/error_report.py /tmp/errs [--out report.json]

prints a markdown table, worst first within each file.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from typing import Dict, List, Tuple


def read_records(folder: str) -> List[dict]:
    """Every record of the folder's ``errors-*.jsonl`` files (a line cut short by a killed worker is skipped)."""
    records = []
    for path in sorted(glob.glob(os.path.join(folder, "errors-*.jsonl"))):
        with open(path) as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return records


def worst_by_site(records: List[dict]) -> List[dict]:
    """One row per (file, line, name): how many values, the largest (NaN counts as the largest), its test, the
    source line; rows by file, then worst first."""
    groups: Dict[Tuple[str, int, object], List[dict]] = {}
    for r in records:
        groups.setdefault((r["file"], r["line"], r.get("name")), []).append(r)

    def badness(r):
        v = r["value"]
        return float("inf") if v != v else v

    rows = []
    for (file, line, name), rs in groups.items():
        worst = max(rs, key=badness)
        rows.append(dict(file=file, line=line, name=name, checks=len(rs), tests=len({r["test"] for r in rs}),
                         worst=worst["value"], worst_test=worst["test"], source=worst["source"]))
    rows.sort(key=lambda r: (r["file"], -badness(dict(value=r["worst"])), r["line"], str(r["name"])))
    return rows


def markdown(rows: List[dict]) -> str:
    out = ["| site | name | checks | worst | its test | source |", "|---|---|---|---|---|---|"]
    for r in rows:
        test = r["worst_test"].split("::", 1)[-1]
        source = r["source"].replace("|", "\\|")
        name = "" if r["name"] is None else r["name"]
        out.append(f"| {r['file']}:{r['line']} | {name} | {r['checks']} | {r['worst']:.2e} | `{test}` | "
                   f"`{source}` |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", help="the FLASHGDN_ERROR_LOG folder of a test run")
    p.add_argument("--out", help="also write the rows as JSON here")
    a = p.parse_args(argv)
    records = read_records(a.folder)
    if not records:
        print(f"no records under {a.folder} (was FLASHGDN_ERROR_LOG set for the run?)", file=sys.stderr)
        return 1
    rows = worst_by_site(records)
    print(f"{len(records)} values from {len({r['test'] for r in records})} tests at {len(rows)} checks\n")
    print(markdown(rows))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
