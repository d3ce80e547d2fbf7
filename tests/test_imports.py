"""The layers ARCHITECTURE.md draws, read off every mplab module's imports (ast, nothing run).

    notebooks -> teaching (widgets, exercises, grade) -> bench, diagnosis, fixtures -> train
    -> amp, lowbit -> hardware, data, models, plots -> numerics -> ground (_display)

A module imports only from its own floor or floors below (`FLOORS`); widgets and exercises do
not import each other; the exact layer (float formats, casts, the GradScaler, the trace, the
low-bit recipes) imports nothing that trains or loads data, so it stands alone. No module, and
no notebook, uses another module's private names; a notebook imports only what a module
exports (`__all__`), and every module says what it exports. No modules, and no packages, import
each other in a circle (lazy imports inside functions count too). The package root holds at
most 10 modules, and no module is over 600 lines.
"""

import ast
import importlib
from pathlib import Path

import pytest
from conftest import optional

import mplab

nbformat = optional("nbformat")

PACKAGE = Path(mplab.__file__).resolve().parent
NOTEBOOKS = sorted((PACKAGE.parent / "notebooks").glob("*.ipynb"))

#: The floors, lowest first: a module imports from its own floor or below, never above.
#: `mplab` itself (the package's face: `mplab.diagnose`) is on the top floor, with the teaching.
FLOORS = (
    ("mplab._display", "mplab._moved", "mplab._optional"),
    ("mplab.numerics",),
    ("mplab.hardware", "mplab.data", "mplab.models", "mplab.plots"),
    ("mplab.amp", "mplab.lowbit"),
    ("mplab.train",),
    ("mplab.bench", "mplab.diagnosis", "mplab.fixtures"),
    ("mplab.widgets", "mplab.exercises", "mplab.grade"),
)
#: The exact layer: exact arithmetic over torch, each module checked bit for bit against it.
EXACT_PACKAGES = ("mplab.numerics", "mplab.amp", "mplab.lowbit")
#: What the exact layer must not import: data, models, training, the lesson fixtures, the UI.
NOT_FOR_EXACT = ("mplab.data", "mplab.models", "mplab.train", "mplab.fixtures",
                 "mplab.diagnosis", "mplab.widgets", "mplab.exercises", "mplab.grade")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def is_module(name: str) -> bool:
    return name in MODULES


def layer(name: str) -> str:
    if within(name, "mplab.widgets"):
        return "widgets"
    if within(name, "mplab.exercises") or within(name, "mplab.grade"):
        return "exercises"
    return "library"


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


EXACT = sorted(m for m in MODULES if any(within(m, p) for p in EXACT_PACKAGES))


def imports(name: str, tree: ast.AST) -> dict[str, list[str]]:
    """mplab module imported -> the names taken from it ([] for a plain `import`)."""
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if within(a.name, "mplab"):
                    found.setdefault(a.name, [])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            if not within(source, "mplab"):
                continue
            for a in node.names:
                sub = f"{source}.{a.name}"
                if is_module(sub):  # `from mplab import casts`: the module itself
                    found.setdefault(sub, [])
                else:
                    found.setdefault(source, []).append(a.name)
    return found


TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}
IMPORTS = {name: imports(name, tree) for name, tree in TREES.items()}


def test_every_module_is_read():
    assert {"mplab.numerics.casts", "mplab.amp.capture", "mplab.numerics.failures",
            "mplab.fixtures", "mplab.numerics.formats", "mplab.widgets.lesson2",
            "mplab.exercises.lesson2", "mplab.train.torch_path"} <= set(MODULES)
    assert "mplab.ranges" not in MODULES
    assert "mplab.fixtures" in IMPORTS["mplab.exercises.lesson2"]


def floor(name: str) -> int:
    """The floor of a module: that of the longest entry of FLOORS it is within."""
    if name == "mplab":
        return len(FLOORS) - 1
    found = [(len(entry), i) for i, entries in enumerate(FLOORS) for entry in entries
             if within(name, entry)]
    assert found, f"{name} is on no floor: add its package to FLOORS (and ARCHITECTURE.md)"
    return max(found)[1]


def test_every_module_is_on_a_floor():
    for name in MODULES:
        floor(name)


def test_no_module_imports_from_a_floor_above_its_own():
    wrong = sorted((m, i) for m, found in IMPORTS.items() for i in found if floor(i) > floor(m))
    assert not wrong, f"imports reaching up a floor (ARCHITECTURE.md): {wrong}"


def test_nothing_in_the_library_imports_a_widget_or_an_exercise():
    wrong = {(m, i) for m, found in IMPORTS.items() if layer(m) == "library"
             for i in found if layer(i) != "library"}
    assert not wrong, f"library modules importing a widget or an exercise: {sorted(wrong)}"


def test_widgets_and_exercises_do_not_import_each_other():
    wrong = {(m, i) for m, found in IMPORTS.items() for i in found
             if {layer(m), layer(i)} == {"widgets", "exercises"}}
    assert not wrong, sorted(wrong)


@pytest.mark.parametrize("name", EXACT)
def test_the_exact_layer_stands_alone(name):
    wrong = [i for i in IMPORTS[name] if any(within(i, bad) for bad in NOT_FOR_EXACT)]
    assert not wrong, f"{name} imports {wrong}: the exact layer must not depend on them"


def private_uses(tree: ast.AST, aliases: dict[str, str]) -> list[str]:
    """`alias._name` where alias is an mplab module: another module's private name."""
    return [f"{aliases[n.value.id]}.{n.attr}" for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id in aliases and n.attr.startswith("_") and not n.attr.startswith("__")]


def module_aliases(tree: ast.AST, resolve) -> dict[str, str]:
    """Local name -> the mplab module it is bound to, for `import ... as` and `from ... import`."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if within(a.name, "mplab"):
                    out[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom):
            source = resolve(node)
            for a in node.names:
                if source and is_module(f"{source}.{a.name}"):
                    out[a.asname or a.name] = f"{source}.{a.name}"
    return out


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_uses_another_modules_private_names(name):
    taken = [f"{source}.{n}" for source, names in IMPORTS[name].items() for n in names
             if n.startswith("_") and not n.startswith("__")]
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]

    def resolve(node):
        if node.level:
            return f"{package}.{node.module}" if node.module else package
        return node.module if node.module and within(node.module, "mplab") else None

    used = private_uses(TREES[name], module_aliases(TREES[name], resolve))
    assert not taken + used, f"{name} reaches into private names: {taken + used}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_use_only_public_names_of_mplab(path):
    nb = nbformat.read(path, as_version=4)
    source = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    tree = ast.parse(source)

    def resolve(node):
        return node.module if node.module and within(node.module, "mplab") else None

    taken = [f"{node.module}.{a.name}" for node in ast.walk(tree)
             if isinstance(node, ast.ImportFrom) and resolve(node)
             for a in node.names if a.name.startswith("_")]
    used = private_uses(tree, module_aliases(tree, resolve))
    assert not taken + used, f"{path.name} reaches into private names: {taken + used}"


def package_of(name: str) -> str:
    """The package a module belongs to: `mplab.train.run` -> `mplab.train`, `mplab.data` itself."""
    return ".".join(name.split(".")[:2])


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one node (Tarjan's algorithm): each is a
    circle of imports, lazy ones (inside a function) included."""
    index, low, stack, found = {}, {}, [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while not part or part[-1] != v:
                part.append(stack.pop())
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_modules_import_each_other_in_a_circle():
    graph = {m: {i for i in found if i != m} for m, found in IMPORTS.items()}
    assert not circles(graph), "modules in an import circle (put the shared piece a floor " \
        f"lower, as ARCHITECTURE.md says): {circles(graph)}"


def test_no_packages_import_each_other_in_a_circle():
    graph: dict[str, set[str]] = {}
    for m, found in IMPORTS.items():
        graph.setdefault(package_of(m), set()).update(
            package_of(i) for i in found if package_of(i) != package_of(m))
    assert not circles(graph), f"packages in an import circle: {circles(graph)}"


def test_every_module_says_what_it_exports():
    missing = [name for name, tree in TREES.items() if not any(
        isinstance(n, ast.Assign | ast.AnnAssign) and "__all__" in
        [t.id for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
         if isinstance(t, ast.Name)] for n in tree.body)]
    assert not missing, f"modules without __all__: {missing}"


@pytest.mark.parametrize("name", sorted(n for n, p in MODULES.items()
                                        if p.name != "__main__.py"))
def test_every_exported_name_exists(name):
    module = importlib.import_module(name)
    absent = [n for n in module.__all__ if not hasattr(module, n) and not is_module(f"{name}.{n}")]
    assert not absent, f"{name}.__all__ names what it does not have: {absent}"


def exported(module: str, name: str) -> bool:
    """Whether `from module import name` takes something the module exports: a name in its
    __all__, or a public module of its package."""
    if is_module(f"{module}.{name}"):
        return not name.startswith("_")
    return name in getattr(importlib.import_module(module), "__all__", ())


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_import_only_exported_names(path):
    nb = nbformat.read(path, as_version=4)
    tree = ast.parse("\n".join(c.source for c in nb.cells if c.cell_type == "code"))
    taken = [(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
             and n.module and within(n.module, "mplab") for a in n.names]
    aliases = module_aliases(tree, lambda n: n.module if n.module and within(n.module, "mplab")
                             else None)
    used = [(aliases[n.value.id], n.attr) for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id in aliases]
    wrong = sorted({f"{m}.{n}" for m, n in taken + used if not exported(m, n)})
    assert not wrong, f"{path.name} uses names mplab does not export: {wrong}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_import_from_packages_not_from_deep_inside_them(path):
    """A lesson imports from a package (`mplab.train`), a module at the root (`mplab.models`),
    or a module its package exports (`mplab.amp.trace`): never one a package keeps to itself
    (`mplab.train.trainer_path`)."""
    nb = nbformat.read(path, as_version=4)
    tree = ast.parse("\n".join(c.source for c in nb.cells if c.cell_type == "code"))
    sources = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
               and n.module and within(n.module, "mplab")}
    sources |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
                if within(a.name, "mplab")}

    def reachable(module: str) -> bool:
        parent, _, leaf = module.rpartition(".")
        return (MODULES[module].name == "__init__.py" or parent == "mplab"
                or leaf in importlib.import_module(parent).__all__)

    deep = sorted(m for m in sources if not reachable(m))
    assert not deep, f"{path.name} imports from modules its packages do not export: {deep}"


def test_the_package_root_holds_a_handful_of_modules():
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= 10, f"{len(root)} modules at mplab's root: {root}"


def test_no_module_is_over_600_lines():
    long = {name: n for name, p in MODULES.items() if (n := len(p.read_text().splitlines())) > 600}
    assert not long, f"modules over 600 lines (one holds two ideas): {long}"
