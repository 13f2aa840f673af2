#!/usr/bin/env bash
# The linter (ruff) and the type checker (mypy), configured in pyproject.toml ([tool.ruff], [tool.mypy]);
# .ci/run runs this before the tests. Both come with the test extra (pip install -e ".[test]", pinned).
#   ruff: src/ with the full rule set; tests/, benchmarks/ and scripts/ with a few rules fewer
#   mypy: src/fastrecord (every module; the public entry points strictest) and
#         tests/typecheck_api.py (a type checker sees the entry points' parameters)
# Usage: bash scripts/lint.sh          (exit 1 when either finds something; both always run)
#        bash scripts/lint.sh --fix    (first ruff's safe fixes, and the statements holding lines over 120
#                                       characters formatted (scripts/wrap_long_lines.py); then the report)
#        PYTHON=/path/to/python bash scripts/lint.sh   (default: .venv/bin/python, else python3)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
if [ "${1:-}" = "--fix" ]; then
  "$PY" -m ruff check --fix --quiet src tests benchmarks scripts >/dev/null || true  # what is left: below
  "$PY" scripts/wrap_long_lines.py src tests benchmarks scripts
fi
status=0
echo "ruff check src tests benchmarks scripts"
"$PY" -m ruff check --output-format concise src tests benchmarks scripts || status=1
echo "mypy (pyproject.toml: src/fastrecord, tests/typecheck_api.py)"
"$PY" -m mypy || status=1
exit $status
