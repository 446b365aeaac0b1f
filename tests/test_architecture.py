"""The layering the code promises (docs/DESIGN.md), checked from its imports.

Every import of engine/ and poseidon_cli/ counts: an import statement at module level, inside
a function, or under ``if TYPE_CHECKING:`` (a deferred import only hides a circle that a
module-level one would close), a call of ``importlib.import_module`` or ``__import__`` with
a module's name, a "module:attr" string (main.py's table of commands) and a table of module
names (warming.py's), for importlib to load later. No module may reach itself through imports, and nothing in engine/ outside
engine/perf/ may import engine/perf/ (the performance tools are a floor above the trainer:
nothing there is needed to train).
"""
from __future__ import annotations

import ast
import functools
import re
from collections.abc import Collection, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "poseidon_cli")
#: a module named in a string, to be loaded by importlib: "poseidon_cli.commands.train:train"
LOADED_BY_NAME = re.compile(r"^(engine|poseidon_cli)(\.\w+)+:\w+$")
#: a module's name alone: counted in a table of such names ("engine.kernels.cpu", ...), not
#: in a command line (``python -m poseidon_cli.main``), which starts a process
MODULE_NAME = re.compile(r"^(engine|poseidon_cli)(\.\w+)+$")
#: the functions that import a module named by their first argument
IMPORTERS = ("import_module", "__import__")


def modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the packages (a package is its __init__)."""
    out = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    return out


def imports_of(name: str, path: Path, known: dict[str, Path],
               missing: list[str] | None = None) -> set[str]:
    """The modules of ours that ``name`` imports anywhere in its file; ``missing`` collects the
    imports of ours that name no module (a move that left an import behind)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def add(target: str) -> None:
        if target.split(".")[0] in PACKAGES and target not in known and missing is not None:
            missing.append(f"{name} imports {target}")
        # a dotted import loads every package on its way: count the deepest module we have
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    def resolve(module: str, level: int) -> str:
        """``module`` named ``level`` packages up from this one (0: absolute)."""
        if not level:
            return module
        base = package.split(".")
        base = base[:len(base) - (level - 1)]
        return ".".join(base + ([module] if module else []))

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                LOADED_BY_NAME.match(node.value):  # "module:attr" for importlib (main.py)
            add(node.value.partition(":")[0])
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and node.elts and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str)
                and MODULE_NAME.match(e.value) for e in node.elts):
            for e in node.elts:  # a table of modules to load by name (warming.py's PARTS)
                add(e.value)
        elif isinstance(node, ast.Call) and node.args and \
                isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str) \
                and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) \
                in IMPORTERS:
            add(resolve(node.args[0].value.lstrip("."),
                        len(node.args[0].value) - len(node.args[0].value.lstrip("."))))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            mod = resolve(node.module or "", node.level)
            for alias in node.names:  # `from pkg import sub` imports the module pkg.sub
                if f"{mod}.{alias.name}" in known:
                    add(f"{mod}.{alias.name}")
                else:
                    add(mod)
    return found


@functools.cache
def walk() -> tuple[dict[str, frozenset[str]], tuple[str, ...]]:
    """The import graph of the packages and the imports naming no module, parsed once for
    the file's tests."""
    known = modules()
    missing: list[str] = []
    g = {name: frozenset(imports_of(name, path, known, missing)) for name, path in known.items()}
    return g, tuple(missing)


def graph() -> dict[str, frozenset[str]]:
    return walk()[0]


def circles(g: Mapping[str, Collection[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_the_walk_sees_deferred_and_type_checking_imports():
    known = modules()
    assert "engine.comm.syncer" in known and "poseidon_cli.launch.worker" in known
    g = graph()
    # a module-level import, one inside a function, one from a package's submodule
    assert "engine.context" in g["poseidon_cli.commands.train"]  # inside a function
    assert "engine.snapshots" in g["engine.solver_snapshots"]
    assert "poseidon_cli.commands.train" in g["poseidon_cli.main"]  # by name, for importlib
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_walk_sees_modules_loaded_by_name(tmp_path):
    """importlib with a relative or an absolute name, __import__, and a table of names."""
    f = tmp_path / "fake.py"
    f.write_text("import importlib\n"
                 "importlib.import_module('.base', __name__)\n"
                 "__import__('engine.blob')\n"
                 "PARTS = ('engine.net', 'engine.solver')\n"
                 "argv = ['-m', 'engine.blob_not_loaded']\n")
    got = imports_of("engine.layers.fake", f, modules())
    assert {"engine.layers.base", "engine.blob", "engine.net", "engine.solver"} <= got


def test_every_import_of_ours_names_a_module():
    assert walk()[1] == ()


def test_no_module_reaches_itself_through_imports():
    assert circles(graph()) == []


def test_nothing_below_perf_imports_perf():
    g = graph()
    below = {name: sorted(t for t in targets if t == "engine.perf" or t.startswith("engine.perf."))
             for name, targets in g.items()
             if name.startswith("engine.") and not name.startswith("engine.perf")}
    assert {name: t for name, t in below.items() if t} == {}


def test_no_command_imports_another():
    """Each command is one module of poseidon_cli/commands/ (each bench's, of
    poseidon_cli/benches/); what two share lives beside them. The `bench` group, which loads
    its subcommands by name as main.py loads the commands, is a dispatcher, not a command."""
    g = graph()
    commands = {m for m in g if (m.startswith("poseidon_cli.commands.")
                                 and m != "poseidon_cli.commands.bench")
                or re.fullmatch(r"poseidon_cli\.benches\.\w+_cmd", m)}
    assert len(commands) >= 16
    for m in sorted(commands):
        assert not g[m] & commands, f"{m} imports {sorted(g[m] & commands)}"


#: the most lines a module of ours may have: a file over it holds several jobs
MAX_LINES = 500


def test_no_module_is_over_500_lines():
    """Files with one job each (the generated protobuf modules aside)."""
    long = {name: n for name, path in modules().items()
            if not name.startswith("engine.pb.")
            and (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"
