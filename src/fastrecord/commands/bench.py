"""`fastrecord bench`: the benchmark of ``benchmarks/`` in the source checkout (beside ``src/``; it is not part
of the installed package), found from fastrecord's own path and run with the flags given.

    fastrecord bench --help                                 # its phases and flags
    fastrecord bench --config configs/bench_cpu.yaml --json bench.json
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import fastrecord

BENCHMARKS = Path(fastrecord.__file__).resolve().parents[2] / "benchmarks"  # src/fastrecord/../../benchmarks


def load_benchmarks(module: str = "bench") -> ModuleType:
    """``benchmarks.<module>`` of the checkout fastrecord runs from, imported by its path.

    Raises ValueError naming the fix where fastrecord is installed without its checkout."""
    if not (BENCHMARKS / "__init__.py").is_file():
        raise ValueError(f"the benchmark is not installed with fastrecord (no {BENCHMARKS}); clone fastrecord's "
                         f"repository and run `fastrecord bench` from the checkout (`pip install -e .` there, or "
                         f"PYTHONPATH=src)")
    package = sys.modules.get("benchmarks")
    if package is None:
        spec = importlib.util.spec_from_file_location("benchmarks", BENCHMARKS / "__init__.py",
                                                      submodule_search_locations=[str(BENCHMARKS)])
        assert spec is not None and spec.loader is not None  # a .py file that exists: the source loader's spec
        package = importlib.util.module_from_spec(spec)
        sys.modules["benchmarks"] = package
        spec.loader.exec_module(package)
    elif Path(package.__path__[0]).resolve() != BENCHMARKS.resolve():  # the checkout may reach it by a link
        raise ValueError(f"another 'benchmarks' package is imported ({package.__path__[0]}), not {BENCHMARKS}; "
                         f"run `fastrecord bench` in a fresh process")
    return importlib.import_module(f"benchmarks.{module}")


def configure_parser(p: argparse.ArgumentParser) -> None:
    """The benchmark's flags (`benchmarks.config`, no torch: ``--help`` stays fast) and its description."""
    try:
        config = load_benchmarks("config")
    except ValueError as e:  # nothing to run: say so at once, --help included
        p.exit(2, f"fastrecord bench: error: {e}\n")
    p.description = sys.modules["benchmarks"].__doc__
    config.configure_parser(p)


def main_from_args(args: argparse.Namespace) -> int:
    """Run the benchmark (`benchmarks.bench`) with the parsed flags; the table goes to stdout."""
    return load_benchmarks("bench").main_from_args(args)
