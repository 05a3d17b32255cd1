"""machinery/'s shape, read from its source: rooms of at most 450 lines, at most 18 files, each opening with a
one-line statement of its job; machinery/__init__.py's map lists every module once, in an order where each imports
(at its top) only modules listed below it; no module imports remix, and no import circle. The walk is checked on
planted packages too, so a walk that found nothing would fail."""

import ast
import re
from pathlib import Path

import pytest

from tests.common import ROOT

MACHINERY = ROOT / "machinery"
MAX_FILES, MAX_LINES = 18, 450
# Imports inside functions that point up the map, each with why it is there and not at the top (where it would close
# a circle): (importer, imported)
LATE_UPWARD = {
    ("console", "dist"): "a rank is asked for only when a line is said: console is imported before torch is",
    ("console", "runfolder"): "a signal's line names the folder this process locked, looked up when one lands",
    ("console", "checkpoints"): "a signal's line names the run's last checkpoint, looked up when one lands",
    ("dist", "flags"): "torchrun's environment numbers are checked as flags are (flags.env_number), at init",
}


def imports(path: Path, package: str) -> list[tuple[str, bool, int]]:
    """(module imported, whether it runs when the file is imported (outside any function), line) for every import of
    a module of package, or of remix, in a file."""
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            names = []
            if isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                parts = child.module.split(".")
                if parts[0] == package:
                    names = [alias.name for alias in child.names] if len(parts) == 1 else [parts[1]]
                elif parts[0] == "remix":
                    names = ["remix"]
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    parts = alias.name.split(".")
                    if parts[0] == package and len(parts) > 1:
                        names.append(parts[1])
                    elif parts[0] == "remix":
                        names.append("remix")
            found.extend((name, not in_function, child.lineno) for name in names)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text()), False)
    return found


def graph(folder: Path) -> dict[str, dict[str, list[tuple[str, int]]]]:
    """module -> {"top": [(imported, line)], "late": [(imported, line)]} over a package's folder."""
    package = folder.name
    modules = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    edges = {}
    for module in sorted(modules):
        edges[module] = {"top": [], "late": []}
        for name, at_top, line in imports(folder / f"{module}.py", package):
            if name in modules or name == "remix":
                edges[module]["top" if at_top else "late"].append((name, line))
    return edges


def circle(edges: dict[str, list[str]]) -> list[str] | None:
    """A cycle of the directed graph (module -> modules it imports), as a path that returns to its start, or None."""
    state, path = {}, []

    def visit(node):
        state[node] = "open"
        path.append(node)
        for nxt in edges.get(node, []):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def map_order(init: Path) -> list[str]:
    """The modules machinery/__init__.py's map lists, in its order: its indented lines `    name   what it holds`."""
    doc = ast.get_docstring(ast.parse(init.read_text()), clean=False)
    return [m.group(1) for m in re.finditer(r"^ {4}([a-z_]+) {2,}\S", doc, flags=re.M)]


def problems(folder: Path, late_upward: dict) -> list[str]:
    """Everything wrong with a package's shape, one line each (none: it is as this file's docstring says)."""
    found, edges = [], graph(folder)
    for module, kinds in edges.items():
        found += [f"{module} imports remix (line {line})" for kind in kinds.values()
                  for name, line in kind if name == "remix"]
    top = {m: [n for n, _ in kinds["top"] if n != "remix"] for m, kinds in edges.items()}
    loop = circle(top)
    if loop:
        found.append("an import circle at the modules' tops: " + " -> ".join(loop))
    order = map_order(folder / "__init__.py")
    if sorted(order) != sorted(edges):
        found.append(f"__init__.py's map lists {sorted(order)}, the folder holds {sorted(edges)}")
        return found
    below = {m: set(order[i + 1:]) for i, m in enumerate(order)}
    for module in order:
        found += [f"{module} imports {name} at its top (line {line}), which the map lists above it"
                  for name, line in edges[module]["top"] if name != "remix" and name not in below[module]]
        upward = {(module, name) for name, _ in edges[module]["late"] if name != "remix" and name not in below[module]}
        found += [f"{module} imports {name} inside a function, which the map lists above it: move it down, or name it "
                  f"with its reason in LATE_UPWARD" for _, name in sorted(upward - set(late_upward))]
    found += [f"LATE_UPWARD names {a} -> {b}, which no longer imports it inside a function"
              for a, b in sorted(set(late_upward)) if a in edges and b not in {n for n, _ in edges[a]["late"]}]
    return found


def test_machinery_imports_point_down_the_map_never_at_remix_and_close_no_circle():
    assert problems(MACHINERY, LATE_UPWARD) == []


def test_machinery_has_at_most_18_files_each_at_most_450_lines_opening_with_its_job_in_one_line():
    files = sorted(MACHINERY.glob("*.py"))
    assert 0 < len(files) <= MAX_FILES, [f.name for f in files]
    assert not [p for p in MACHINERY.iterdir() if p.is_dir() and p.name != "__pycache__"], "machinery/ has a subfolder"
    for path in files:
        lines = path.read_text().splitlines()
        assert len(lines) <= MAX_LINES, f"{path.name} is {len(lines)} lines: split it, or move a part to its room"
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        assert doc, f"{path.name} opens with no docstring"
        first, *rest = doc.split("\n")
        assert first.endswith(".") and len('"""' + first) <= 120 and (not rest or not rest[0].strip()), \
            f"{path.name}'s docstring does not open with one line saying its job: {first!r}"


def plant(folder: Path, files: dict[str, str]) -> Path:
    """A package of the given files (name -> source), with __init__.py's map listing them in the dict's order."""
    package = folder / "planted"
    package.mkdir()
    lines = "\n".join(f"    {name:<12} what it holds" for name in files)
    (package / "__init__.py").write_text(f'"""A planted package.\n\n{lines}\n"""\n')
    for name, source in files.items():
        (package / f"{name}.py").write_text(f'"""{name}."""\n{source}')
    return package


@pytest.mark.parametrize("files, late, wrong", [
    ({"top": "from planted import low\n", "low": ""}, {}, None),  # as the map says: nothing wrong
    ({"top": "", "low": "import remix\n"}, {}, "low imports remix"),
    ({"top": "", "low": "def f():\n    from remix import train\n"}, {}, "low imports remix"),
    ({"top": "from planted import low\n", "low": "from planted import top\n"}, {}, "an import circle"),
    ({"top": "", "low": "from planted import top\n"}, {}, "low imports top at its top"),
    ({"top": "", "low": "import planted.top\n"}, {}, "low imports top at its top"),
    ({"top": "", "low": "def f():\n    from planted.top import g\n"}, {}, "low imports top inside a function"),
    ({"top": "", "low": "def f():\n    from planted import top\n"}, {("low", "top"): "why"}, None),
    ({"top": "", "low": ""}, {("low", "top"): "why"}, "no longer imports it"),
])
def test_the_walk_finds_each_planted_fault(tmp_path, files, late, wrong):
    found = problems(plant(tmp_path, files), late)
    assert (found == []) if wrong is None else any(wrong in line for line in found), found


def test_the_walk_finds_a_module_the_map_leaves_out(tmp_path):
    package = plant(tmp_path, {"top": "", "low": ""})
    (package / "extra.py").write_text('"""extra."""\n')
    assert any("map lists" in line for line in problems(package, {}))


def test_console_imports_no_torch_so_a_signal_while_torch_imports_is_one_line():
    """remix.py and eval.py import console before torch (console.one_line_interrupts): it must not import torch itself
    (it holds what messages, progress and signals held, which asked dist for the rank at their tops)."""
    import subprocess
    import sys

    check = "import sys; import machinery.console; print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
