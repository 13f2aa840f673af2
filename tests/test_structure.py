"""The package's shape, read from its source (the last checks build the CLI parser): the rules the README's "How it is
built" section states, checked so that they stay true."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

from scripts.import_cycles import cycles, module_names

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "fastrecord"
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    return module_names(PACKAGE)


def test_no_import_circles():
    assert cycles(PACKAGE) == []


def test_no_module_imports_another_modules_private_names():
    """``from fastrecord.x import _name`` across modules: a name another module needs is public."""
    found = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith("fastrecord")
                and node.module != name
            ):
                found += [f"{name}: from {node.module} import {a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert found == []


def test_modules_stay_small_or_say_why():
    """No module over 600 lines unless docs/design.md names it with its size and the reason."""
    design = (ROOT / "docs" / "design.md").read_text()
    over = {}
    for name, path in _modules().items():
        n = len(path.read_text().splitlines())
        if n > MAX_LINES:
            over[name] = n
    unexplained = {
        name: n
        for name, n in over.items()
        if not re.search(rf"`{re.escape(str(_modules()[name].relative_to(ROOT / 'src')))}`[^\n]*\b{n}\b", design)
    }
    assert unexplained == {}


def test_no_benchmark_inside_the_package():
    """Benchmarks and profilers live in benchmarks/ (not installed); `fastrecord bench` only loads them."""
    loader = PACKAGE / "commands" / "bench.py"
    assert len(loader.read_text().splitlines()) < 120
    names = [n for n in _modules() if re.search(r"bench|profil", n.rpartition(".")[2])]
    assert names == ["fastrecord.commands.bench"]
    assert (ROOT / "benchmarks" / "bench.py").is_file()


def test_every_recording_option_is_a_record_flag():
    from fastrecord.commands import record
    from fastrecord.commands.cli import build_parser
    from fastrecord.options import CLI_EXCLUDED, RecordOptions

    parser, _ = build_parser(only="record")
    sub = next(a for a in parser._actions if a.dest == "command").choices["record"]
    dests = {a.dest for a in sub._actions}
    wanted = {f.name for f in dataclasses.fields(RecordOptions)} - set(CLI_EXCLUDED)
    assert wanted - dests == set(), record.__name__
    assert set(CLI_EXCLUDED) <= {"save_video_trigger", "source_type", "source_desc"}


def test_readme_module_table_matches_the_tree():
    """Every module and package of src/fastrecord is named in the README's module table, and every name
    there exists."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## How it is built", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^\| `([\w/.]+)`", section, re.MULTILINE))
    tree = {
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py") and p.parent == PACKAGE
    }
    tree |= {f"{p.name}/" for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert tree - named == set(), "modules missing from the README's table"
    assert {n for n in named if not (PACKAGE / n).exists()} == set(), "names in the README's table that do not exist"


MAX_FUNCTION_LINES = 80
LONG_BECAUSE = "Long because:"  # a docstring line starting so names why a function must stay over 80 lines
def long_functions(max_lines: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """{module.Class.function: its lines (decorators and docstring included)} of every function of the
    package over ``max_lines`` whose docstring has no line starting with `LONG_BECAUSE`."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([child.lineno] + [d.lineno for d in child.decorator_list])
                n = (child.end_lineno or child.lineno) - start + 1
                doc = ast.get_docstring(child) or ""
                if n > max_lines and not any(line.strip().startswith(LONG_BECAUSE) for line in doc.splitlines()):
                    found[prefix + child.name] = n
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    for name, path in _modules().items():
        visit(ast.parse(path.read_text(), str(path)), f"{name}.")
    return found


def test_functions_stay_short_or_say_why():
    """No function over 80 lines unless its docstring has a line starting "Long because:" with the reason."""
    assert long_functions() == {}
