"""Wrap the lines over the line length by formatting only the statements that hold them.

``ruff format`` over a whole file would rewrite every statement in the formatter's style (120 files and
+6,400 lines on this tree at 5dedf4b, and two modules past the 600-line limit); this formats only the
statements ruff's E501 names, bottom up, with ``ruff format --range``, and leaves the rest of the file as
written. What a formatter cannot wrap (a long string or comment) is left for a hand fix, and ruff check
reports it. ``scripts/lint.sh --fix`` runs it.

Usage: python scripts/wrap_long_lines.py [PATH ...]   (default: src tests benchmarks scripts)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

DEFAULT_PATHS = ("src", "tests", "benchmarks", "scripts")


def long_lines(ruff: list[str], paths: list[str]) -> dict[str, set[int]]:
    """{file: line numbers} of ruff's E501 findings under ``paths``."""
    out = subprocess.run([*ruff, "check", "--select", "E501", "--output-format", "json", *paths],
                         capture_output=True, text=True, check=False)
    if out.returncode not in (0, 1):  # 1: findings
        raise SystemExit(f"ruff check failed (exit {out.returncode}): {out.stderr.strip()}")
    found: dict[str, set[int]] = {}
    for d in json.loads(out.stdout or "[]"):
        found.setdefault(d["filename"], set()).add(d["location"]["row"])
    return found


def main(argv: list[str]) -> int:
    paths = argv or list(DEFAULT_PATHS)
    ruff = [sys.executable, "-m", "ruff"]
    found = long_lines(ruff, paths)
    for filename, rows in sorted(found.items()):
        for row in sorted(rows, reverse=True):  # bottom up: the rows above keep their numbers
            subprocess.run([*ruff, "format", "--range", f"{row}:1-{row}:100000", filename],
                           capture_output=True, check=True)
    left = sum(len(r) for r in long_lines(ruff, paths).values())
    print(f"wrapped statements in {len(found)} files; {left} lines over the length left to wrap by hand"
          f" ({Path.cwd()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
