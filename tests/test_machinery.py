"""machinery/'s shape, read from its source: at most 13 files of at most 450 lines and 4,272 in all (4,000 and 3,872
before --overlap, which may add 400 in one module), each opening with a one-line statement of its job; the product
(every .py outside the tests, the toy and the benchmarks) at most 5,630 lines (5,200, and 430 more for --overlap);
machinery/__init__.py's map lists every module once, in an order where each imports only modules listed below it,
counting every import, those inside functions too; no module imports remix; no import circle; at most 38 connected
pairs of modules (35 before --overlap); the bottom module (what prints and ends a program) imports none of them. The walk is
checked on planted packages too, so a walk that found nothing would fail."""

import ast
import re
from pathlib import Path

import pytest

from tests.common import ROOT

MACHINERY = ROOT / "machinery"
MAX_FILES, MAX_LINES, MAX_TOTAL, MAX_PRODUCT, MAX_PAIRS = 13, 450, 4272, 5630, 38
BOTTOM = "console"  # fail, say, progress, signals: the rank and a stopped run's line reach it as values


def imports(path: Path, package: str) -> list[tuple[str, int]]:
    """(module imported, line) for every import of a module of package, or of remix, anywhere in a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] == package:
                names = [alias.name for alias in node.names] if len(parts) == 1 else [parts[1]]
            elif parts[0] == "remix":
                names = ["remix"]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                names += [parts[1]] if parts[0] == package and len(parts) > 1 else ["remix"] if parts[0] == "remix" \
                    else []
        found += [(name, node.lineno) for name in names]
    return found


def graph(folder: Path) -> dict[str, list[tuple[str, int]]]:
    """module -> [(imported module of the package or remix, line)] over a package's folder."""
    modules = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    return {module: [(name, line) for name, line in imports(folder / f"{module}.py", folder.name)
                     if (name in modules or name == "remix") and name != module] for module in sorted(modules)}


def circle(edges: dict[str, list[str]]) -> list[str] | None:
    """A cycle of the directed graph (module -> modules it imports), as a path that returns to its start, or None."""
    state, path = {}, []

    def visit(node):
        state[node] = "open"
        path.append(node)
        for nxt in edges.get(node, []):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = "done"
        path.pop()
        return None

    return next((found for node in sorted(edges) if node not in state and (found := visit(node))), None)


def map_order(init: Path) -> list[str]:
    """The modules machinery/__init__.py's map lists, in its order: its indented lines `    name   what it holds`."""
    doc = ast.get_docstring(ast.parse(init.read_text()), clean=False)
    return [m.group(1) for m in re.finditer(r"^ {4}([a-z_]+) {2,}\S", doc, flags=re.M)]


def pairs(edges: dict[str, list[tuple[str, int]]]) -> set[frozenset]:
    return {frozenset((module, name)) for module, found in edges.items() for name, _ in found if name != "remix"}


def problems(folder: Path, bottom: str | None = None, max_pairs: int = MAX_PAIRS) -> list[str]:
    """Everything wrong with a package's shape, one line each (none: it is as this file's docstring says)."""
    edges = graph(folder)
    found = [f"{module} imports remix (line {line})" for module, imported in edges.items()
             for name, line in imported if name == "remix"]
    loop = circle({m: [n for n, _ in imported if n != "remix"] for m, imported in edges.items()})
    if loop:
        found.append("an import circle: " + " -> ".join(loop))
    order = map_order(folder / "__init__.py")
    if sorted(order) != sorted(edges):
        return found + [f"__init__.py's map lists {sorted(order)}, the folder holds {sorted(edges)}"]
    for i, module in enumerate(order):
        found += [f"{module} imports {name} (line {line}), which the map lists above it"
                  for name, line in edges[module] if name != "remix" and name not in order[i + 1:]]
    if bottom is not None and edges.get(bottom):
        found.append(f"{bottom} imports {edges[bottom][0][0]} (line {edges[bottom][0][1]}): it must import none")
    if len(pairs(edges)) > max_pairs:
        found.append(f"{len(pairs(edges))} pairs of modules import one another, more than {max_pairs}")
    return found


def test_machinery_imports_point_down_the_map_never_at_remix_close_no_circle_and_join_few_pairs():
    assert problems(MACHINERY, BOTTOM) == []


def test_machinery_is_small_each_file_opening_with_its_job_in_one_line():
    files = sorted(MACHINERY.glob("*.py"))
    assert 0 < len(files) <= MAX_FILES, [f.name for f in files]
    assert not [p for p in MACHINERY.iterdir() if p.is_dir() and p.name != "__pycache__"], "machinery/ has a subfolder"
    sizes = {path.name: len(path.read_text().splitlines()) for path in files}
    assert max(sizes.values()) <= MAX_LINES and sum(sizes.values()) <= MAX_TOTAL, sizes
    for path in files:
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        assert doc, f"{path.name} opens with no docstring"
        first, *rest = doc.split("\n")
        assert first.endswith(".") and len('"""' + first) <= 120 and (not rest or not rest[0].strip()), \
            f"{path.name}'s docstring does not open with one line saying its job: {first!r}"


def test_the_product_stays_within_its_bound():
    """Every .py file outside tests/, benchmarks/, toy/, test_remix.py and conftest.py."""
    product = [p for p in ROOT.rglob("*.py") if not {"tests", "benchmarks", "toy", ".venv", ".git"} & set(
        p.relative_to(ROOT).parts) and p.name not in ("test_remix.py", "conftest.py")]
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in product}
    assert {"remix.py", "eval.py"} <= set(sizes) and sum(sizes.values()) <= MAX_PRODUCT, sizes


def plant(folder: Path, files: dict[str, str]) -> Path:
    """A package of the given files (name -> source), with __init__.py's map listing them in the dict's order."""
    package = folder / "planted"
    package.mkdir()
    lines = "\n".join(f"    {name:<12} what it holds" for name in files)
    (package / "__init__.py").write_text(f'"""A planted package.\n\n{lines}\n"""\n')
    for name, source in files.items():
        (package / f"{name}.py").write_text(f'"""{name}."""\n{source}')
    return package


@pytest.mark.parametrize("files, wrong", [
    ({"top": "from planted import low\n", "low": ""}, None),  # as the map says: nothing wrong
    ({"top": "", "low": "import remix\n"}, "low imports remix"),
    ({"top": "", "low": "def f():\n    from remix import train\n"}, "low imports remix"),
    ({"top": "from planted import low\n", "low": "from planted import top\n"}, "an import circle"),
    ({"top": "", "low": "def f():\n    from planted import top\n"}, "low imports top (line 3), which the map"),
    ({"top": "", "low": "from planted import top\n"}, "low imports top"),
    ({"top": "", "low": "import planted.top\n"}, "low imports top"),
    ({"top": "", "low": "def f():\n    from planted.top import g\n"}, "low imports top"),
    ({"top": "def f():\n    from planted import low\n", "low": ""}, None),  # inside a function, pointing down
    ({"top": "", "mid": "from planted import low\n", "low": ""}, "low imports"),  # the bottom must import nothing...
    ({"top": "from planted import mid, low\n", "mid": "from planted import low\n", "low": "", "x": ""}, "2 pairs"),
])
def test_the_walk_finds_each_planted_fault(tmp_path, files, wrong):
    if wrong == "low imports":  # ...so plant one that does
        files = {**files, "low": "from planted import x\n", "x": ""}
        found = problems(plant(tmp_path, files), bottom="low")
    else:
        found = problems(plant(tmp_path, files), bottom=None, max_pairs=1 if wrong == "2 pairs" else MAX_PAIRS)
        wrong = "3 pairs of modules" if wrong == "2 pairs" else wrong
    assert (found == []) if wrong is None else any(wrong in line for line in found), found


def test_the_walk_finds_a_module_the_map_leaves_out(tmp_path):
    package = plant(tmp_path, {"top": "", "low": ""})
    (package / "extra.py").write_text('"""extra."""\n')
    assert any("map lists" in line for line in problems(package))


def test_console_imports_no_torch_so_a_signal_while_torch_imports_is_one_line():
    """remix.py and eval.py import console before torch (console.one_line_interrupts): it must not import torch."""
    import subprocess
    import sys

    check = "import sys; import machinery.console; print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
