"""Code structure: no import cycle inside a package, no over-long function, no function
of the library, the client or the service taking more than a handful of parameters, no
method recognised by name outside its own unit.

The import graph counts every import, including those inside functions (a lazy import
only postpones the cycle) and those under ``TYPE_CHECKING`` (a typing-only import still
ties the two modules: neither can be read, moved or typed without the other). Each
check prints every offender, not only the first.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
# The shared API contract package joins the check wherever the checkout has it.
PACKAGES = ("maec_core", "app", "worker", "maec_client",
            *(["maec_contract"] if (ROOT / "maec_contract" / "__init__.py").is_file() else []))
LENGTH_CHECKED = ("maec_core", "app", "worker")
MAX_FUNCTION_LINES = 80
# Beyond this a signature re-lists what belongs in one object (a run context, an output
# spec, the work of a loop): callers then pass that object whole.
PARAMS_CHECKED = ("maec_core", "maec_client", "app", "worker")
MAX_PARAMETERS = 8


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (the graph may be deeper than Python's recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component: list[str] = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in edges[node]:
                        components.append(sorted(component))
    return components


def describe_cycle(graph: grimp.ImportGraph, component: list[str]) -> str:
    """The imports that hold one cycle together, each with its line."""
    members = set(component)
    lines = [f"cycle through {len(component)} modules: {', '.join(component)}"]
    for importer in component:
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & members):
            for detail in graph.get_import_details(importer=importer, imported=imported):
                lines.append(f"    {importer} -> {imported} (l.{detail['line_number']}: "
                             f"{detail['line_contents']})")
    return "\n".join(lines)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_inside_package(package: str) -> None:
    graph = grimp.build_graph(package, exclude_type_checking_imports=False, cache_dir=None)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    cycles = strongly_connected(edges)
    report = "\n".join(describe_cycle(graph, c) for c in cycles)
    assert not cycles, f"{len(cycles)} import cycle(s) inside {package}:\n{report}"


def test_cycle_finder_finds_cycles_and_only_cycles() -> None:
    # The finder itself, on a hand-made graph: a 3-cycle, a self-import, a chain, a diamond.
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"},
             "f": {"g", "h"}, "g": {"i"}, "h": {"i"}, "i": set()}
    assert sorted(strongly_connected(edges)) == [["a", "b", "c"], ["e"]]


FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef


def functions(path: Path) -> Iterator[tuple[str, FunctionNode]]:
    """(qualified name, node) of every function and method in ``path``, nested ones too."""
    tree = ast.parse(path.read_text(), filename=str(path))

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, FunctionNode]]:
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}."
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                yield name[:-1], child
            yield from walk(child, name)

    yield from walk(tree, "")


def functions_over(limit: int, path: Path) -> Iterator[tuple[int, str, int]]:
    """(def line, qualified name, lines from def to last line) of each too-long function."""
    for name, fn in functions(path):
        # lineno is the ``def`` line (decorators sit above it).
        length = (fn.end_lineno or fn.lineno) - fn.lineno + 1
        if length > limit:
            yield fn.lineno, name, length


def test_function_length_counter(tmp_path: Path) -> None:
    # The counter itself: decorators are not counted, nested functions and methods are.
    body = [f"x{i} = {i}" for i in range(79)]
    source = "\n".join([
        "@staticmethod",
        "def short():",
        *(" " * 4 + line for line in body),
        "class C:",
        "    def long(self):",
        "        def inner():",
        *(" " * 12 + line for line in body),
        "            return 1",
        "        return inner",
    ])
    path = tmp_path / "m.py"
    path.write_text(source + "\n")
    found = [(name, length) for _, name, length in functions_over(MAX_FUNCTION_LINES, path)]
    assert sorted(found) == [("C.long", 83), ("C.long.inner", 81)]


def test_no_function_longer_than_limit() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{line} {name} ({length} lines)"
        for package in LENGTH_CHECKED
        for path in sorted((ROOT / package).rglob("*.py"))
        for line, name, length in functions_over(MAX_FUNCTION_LINES, path)
    ]
    assert not offenders, (f"{len(offenders)} function(s) longer than {MAX_FUNCTION_LINES} "
                           "lines (def to last line):\n" + "\n".join(offenders))


def parameter_count(fn: FunctionNode) -> int:
    """Every parameter but a leading ``self``/``cls``: positional-only, positional,
    keyword-only, and ``*args`` and ``**kwargs`` one each (a catch-all is still a way in)."""
    a = fn.args
    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    return len(names) + (a.vararg is not None) + (a.kwarg is not None)


def functions_with_more_parameters(limit: int, path: Path) -> Iterator[tuple[int, str, int]]:
    """(def line, qualified name, parameter count) of each function over ``limit``."""
    for name, fn in functions(path):
        count = parameter_count(fn)
        if count > limit:
            yield fn.lineno, name, count


def test_parameter_counter(tmp_path: Path) -> None:
    # The counter itself: self and cls are not counted; *args, **kwargs, keyword-only and
    # positional-only parameters are, in methods and nested functions alike.
    source = "\n".join([
        "def fine(a, b, c, d, e, f, g, h): pass",
        "def star(a, b, c, d, e, f, g, *args, **kwargs): pass",
        "def kw(a, /, b, *, c, d, e, f, g, h, i): pass",
        "class C:",
        "    def method(self, a, b, c, d, e, f, g, h): pass",
        "    @classmethod",
        "    def make(cls, a, b, c, d, e, f, g, h, i): pass",
        "def outer():",
        "    def inner(a, b, c, d, e, f, g, h, *rest): pass",
        "    return inner",
    ])
    path = tmp_path / "m.py"
    path.write_text(source + "\n")
    found = [(name, n) for _, name, n in functions_with_more_parameters(MAX_PARAMETERS, path)]
    assert sorted(found) == [("C.make", 9), ("kw", 9), ("outer.inner", 9), ("star", 9)]


def test_no_function_takes_more_than_limit_parameters() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{line} {name} ({count} parameters)"
        for package in PARAMS_CHECKED
        for path in sorted((ROOT / package).rglob("*.py"))
        for line, name, count in functions_with_more_parameters(MAX_PARAMETERS, path)
    ]
    assert not offenders, (f"{len(offenders)} function(s) taking more than {MAX_PARAMETERS} "
                           "parameters (self/cls not counted, *args and **kwargs one each):\n"
                           + "\n".join(offenders))


# A method's facts (its stages, whether it builds on a language base, how it runs) are
# asked of its unit; only the unit itself may know it is MAEC.
METHOD_UNIT = ("maec_core/maec/", "maec_core/maec/method.py")
NAME_CHECKED = ("maec_core", "app", "worker")
NAME_TESTS = re.compile(
    r"""[=!]=\s*["']maec["']|["']maec["']\s*[=!]="""
    r"""|\bin\s*[(\[{](?:\s*["'][^"']*["']\s*,)*\s*["']maec["']"""
    r"""|\bis_maec\b|isinstance\([^)]*\bMaec\b|import\s+Maec\b|\bMaec\s*\)""")


def name_tests(text: str) -> Iterator[tuple[int, str]]:
    """(line, text) of each place ``text`` tells MAEC apart by its name or class."""
    for i, line in enumerate(text.splitlines(), 1):
        if NAME_TESTS.search(line):
            yield i, line.strip()


def test_name_test_finder() -> None:
    # The finder itself: comparisons, membership, flags and class checks, not mentions.
    found = [line for _, line in name_tests("\n".join([
        'if recipe.merge_method == "maec":',
        "ok = 'maec' != method",
        'if name in ("maec", "ties"):',
        "is_maec = True",
        "if isinstance(method, Maec):",
        "from maec_core.maec.method import Maec",
        's3_bucket: str = "maec"',
        'log = logging.getLogger("maec.worker")',
        'keys = manifest.get("maec")',
        'for k in (manifest.get("maec") or {}):',
        'if name in ["ties", "maec"]:',
    ]))]
    assert found == ['if recipe.merge_method == "maec":', "ok = 'maec' != method",
                     'if name in ("maec", "ties"):', "is_maec = True",
                     "if isinstance(method, Maec):", "from maec_core.maec.method import Maec",
                     'if name in ["ties", "maec"]:']


def test_no_method_is_told_apart_by_name_outside_its_unit() -> None:
    offenders = [
        f"{rel}:{line} {text}"
        for package in NAME_CHECKED
        for path in sorted((ROOT / package).rglob("*.py"))
        if not (rel := path.relative_to(ROOT).as_posix()).startswith(METHOD_UNIT)
        for line, text in name_tests(path.read_text())
    ]
    assert not offenders, (f"{len(offenders)} place(s) outside the MAEC unit tell MAEC apart "
                           "by name (ask the method: stages, own_vocab, held_input, "
                           "reuse_key, run, check_plan):\n" + "\n".join(offenders))


# A method with a pipeline of its own keeps its whole unit in one package of the core
# (``maec_core/<unit>/``, registered from its ``method`` module); what is in it is that
# method's private business. Asked of the import graph, not of the text: an import under
# another name, a lazy one, or one under TYPE_CHECKING counts the same.
IMPORT_CHECKED = ("maec_core", "app", "worker")


def method_units() -> list[str]:
    """The core's packages that hold a method's unit (the registry's own rule)."""
    return sorted(f"maec_core.{p.parent.name}" for p in (ROOT / "maec_core").glob("*/method.py"))


def outside_imports(edges: dict[str, set[str]], private: str, unit: str) -> list[str]:
    """``importer -> imported`` for each import of ``private`` (or a module under it) by a
    module outside ``unit`` (a package: it and every module under it are inside)."""
    def under(module: str, package: str) -> bool:
        return module == package or module.startswith(package + ".")

    return [f"{importer} -> {imported}"
            for importer in sorted(edges) if not under(importer, unit)
            for imported in sorted(edges[importer]) if under(imported, private)]


def test_outside_import_finder() -> None:
    # The finder itself: inside the unit is fine, outside is not, a prefix is no parent.
    edges = {"m.maec.pipeline": {"m.maec.params", "m.engine"}, "m.sweep.grid": {"m.maec.params"},
             "m.cli": {"m.maec"}, "m.maecish": {"m.maec_x"}, "app.x": {"m.maec.store"},
             "m.methods.ties": {"m.methods.linear"}, "m.plan": {"m.methods.ties"}}
    assert outside_imports(edges, "m.maec", "m.maec") == [
        "app.x -> m.maec.store", "m.cli -> m.maec", "m.sweep.grid -> m.maec.params"]
    assert outside_imports(edges, "m.methods.ties", "m.methods") == [
        "m.plan -> m.methods.ties"]


def _import_edges() -> dict[str, set[str]]:
    graph = grimp.build_graph(*IMPORT_CHECKED, exclude_type_checking_imports=False,
                              cache_dir=None)
    return {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}


def test_no_method_private_package_is_imported_outside_its_unit() -> None:
    units = method_units()
    assert "maec_core.maec" in units  # the rule still finds the one such unit there is
    edges = _import_edges()
    offenders = [line for unit in units for line in outside_imports(edges, unit, unit)]
    assert not offenders, (f"{len(offenders)} import(s) of a method's own package from "
                           "outside it (ask the method through its hooks, or move the code "
                           "into its unit):\n" + "\n".join(offenders))


def test_no_method_module_is_imported_outside_its_package() -> None:
    # A merge method is found by the registry, never imported by name: a module that
    # defines one is imported only from its own package.
    from maec_core.methods import all_methods

    modules = sorted({type(m).__module__ for m in all_methods()})
    assert "maec_core.methods.linear" in modules and len(modules) > 10
    edges = _import_edges()
    offenders = [line for module in modules
                 for line in outside_imports(edges, module, module.rsplit(".", 1)[0])]
    assert not offenders, (f"{len(offenders)} import(s) of a merge method's module from "
                           "outside its package:\n" + "\n".join(offenders))


def test_front_door_contract_names_every_other_module_of_the_core() -> None:
    # The service reaches the core only through maec_core.service: the import contract
    # forbids every other module by name, so a new module must join its list.
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contract = next(c for c in config["tool"]["importlinter"]["contracts"]
                    if c["id"] == "service-front-door")
    core = ROOT / "maec_core"
    children = {p.stem for p in core.glob("*.py") if p.name != "__init__.py"}
    children |= {p.parent.name for p in core.glob("*/__init__.py")}
    expected = sorted(f"maec_core.{c}" for c in children - {"service"})
    assert sorted(contract["forbidden_modules"]) == expected
    assert sorted(contract["source_modules"]) == ["app", "worker"]
