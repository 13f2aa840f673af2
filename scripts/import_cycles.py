"""Import circles between the modules of a package, read from the source (no import is run).

Every ``import`` and ``from ... import`` counts, at module level or inside a function, since a function's
import closes a circle at run time just the same. ``from pkg import name`` is an edge to ``pkg.name``
where that is a module of the package, else to ``pkg``. A package's ``__init__`` importing its own
submodules is not a circle (the package is the set of its modules).

    python scripts/import_cycles.py            # src/fastrecord; exit 1 and one line per circle if any
    python scripts/import_cycles.py path/to/pkg
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def module_names(root: Path) -> dict[str, Path]:
    """``{dotted module name: file}`` for every .py file under the package directory ``root``."""
    out: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that module ``name`` (file ``path``) imports anywhere in its body."""
    is_pkg = path.name == "__init__.py"
    here = name if is_pkg else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # `import a.b.c` of a name that is not a module: its package
                t = t.rpartition(".")[0]
            if t and t != name and not (is_pkg and t.startswith(name + ".")):
                found.add(t)
    return found


def cycles(root: Path) -> list[list[str]]:
    """Each strongly connected group of two or more modules, as a circle of names (sorted groups)."""
    modules = module_names(root)
    graph = {n: imports_of(n, p, modules) for n, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_circle(g, graph) for g in sorted(groups)]


def _circle(group: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One circle through the group's first module (breadth-first), to name in a report."""
    start = group[0]
    members = set(group)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:  # back at the start: walk the path to v backwards
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [*reversed(path), start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return group


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path(__file__).resolve().parents[1] / "src" / "fastrecord"
    found = cycles(root)
    for group in found:
        print(" -> ".join(group))
    print(f"{len(found)} import circle(s) in {root}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
