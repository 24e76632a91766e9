"""Tier 1: the house's load-bearing walls (issue 19): no import circle anywhere in distdebug/, the
shared types on the ground floor, and typed detector contexts. Read from the source, no imports run."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "distdebug"


FAULTS = ROOT / "fault_injection"


def module_name(path: Path) -> str:
    """The name a module is imported under: fault_injection/ is distdebug.fault_injection (pyproject's
    package-dir, distdebug/__init__'s finder in a checkout)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "fault_injection":
        parts.insert(0, "distdebug")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> list[Path]:
    return sorted([*PKG.rglob("*.py"), *FAULTS.glob("*.py")])


def import_graph() -> dict[str, set[str]]:
    """Every module of distdebug/ and fault_injection/ to the modules of both it imports: module level, inside
    functions and under TYPE_CHECKING alike (a circle of types is still a circle a reader has to untangle),
    relative imports resolved. ``from package import name`` depends on ``package.name`` when that is a module,
    else on the package (its __init__)."""
    mods = {module_name(p): p for p in sources()}
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for a in node.names:
                    full = f"{base}.{a.name}"
                    targets.append(full if full in mods else base)
            for t in targets:
                if t.startswith("fault_injection"):
                    t = "distdebug." + t
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t.startswith("distdebug") and t != name:
                    out.add(t)
        graph[name] = out
    return graph


LAYERS = ("ground", "artifacts", "fingerprint", "runtime", "doctor", "detectors", "analysis", "report", "api",
          "launch", "lint", "fault_injection", "cli")
"""The floors, lowest first: a module imports from its own floor or below, never above. ground: the modules
at distdebug/'s top (findings, context, errors, config, envvars, procs) that every floor shares; api: the
package itself (watch(), step()); cli: distdebug/cli.py and __main__. The folders' roles: README's layout."""


def floor(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "api"
    if (PKG / parts[1]).is_dir() or parts[1] == "fault_injection":
        return parts[1]
    return "cli" if parts[1] in ("cli", "__main__") else "ground"


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a floor to a floor above it, as 'importer -> imported'."""
    return sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps
                  if LAYERS.index(floor(b)) > LAYERS.index(floor(a)))


def floor_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {floor(a): set() for a in graph}
    for a, deps in graph.items():
        out[floor(a)] |= {floor(b) for b in deps if floor(b) != floor(a)}
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_distdebug():
    graph = import_graph()
    assert len(graph) > 100 and graph["distdebug.runtime.session"]  # the graph is really read, both packages
    assert "distdebug.fault_injection.base" in graph["distdebug.fault_injection.nan_grad"]  # relative, resolved
    assert cycles(graph) == []
    assert cycles(floor_graph(graph)) == []


def test_imports_run_one_way_down_the_floors():
    graph = import_graph()
    assert {floor(m) for m in graph} == set(LAYERS)  # every floor is there, and nothing outside them
    assert upward(graph) == []


def test_the_floor_checks_see_an_import_that_runs_back_up():
    graph = {"distdebug.runtime.session": {"distdebug.detectors.base"}, "distdebug.detectors.base": set(),
             "distdebug.findings": set(), "distdebug.fault_injection.x": {"distdebug.runtime.session"}}
    assert upward(graph) == ["distdebug.runtime.session -> distdebug.detectors.base"]
    assert floor_graph(graph)["fault_injection"] == {"runtime"} and floor("distdebug") == "api"
    graph["distdebug.detectors.base"] = {"distdebug.runtime.session"}
    assert cycles(floor_graph(graph)) == [["detectors", "runtime"]]


def test_shared_types_sit_on_the_ground_floor():
    graph = import_graph()
    # findings.py and context.py import nothing of distdebug's but each other's ground floor.
    assert graph["distdebug.findings"] == set()
    assert graph["distdebug.context"] <= {"distdebug.findings"}
    # Every floor takes Finding/Severity from the ground floor, not from the detectors package; the detector
    # interface's face (detectors/base.py) is for detectors and faults (a fault is a detector), the session
    # takes the class from its own floor (runtime/detector.py).
    for name, deps in graph.items():
        if not name.startswith(("distdebug.detectors", "distdebug.fault_injection")):
            assert "distdebug.detectors.base" not in deps, name


def test_severity_order_is_not_called_rank():
    from distdebug.findings import Severity

    assert [s.order for s in Severity] == [0, 1, 2, 3]
    assert not hasattr(Severity.ERROR, "rank")


def test_every_detector_types_its_context():
    untyped = []
    for path in list((PKG / "detectors").glob("*.py")) + list((ROOT / "fault_injection").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.arg) and node.arg == "ctx":
                if node.annotation is None or "RankContext" not in ast.unparse(node.annotation):
                    untyped.append(f"{path.name}:{node.lineno}")
            if isinstance(node, ast.AnnAssign) and ast.unparse(node.target) == "self.ctx":
                if "RankContext" not in ast.unparse(node.annotation):
                    untyped.append(f"{path.name}:{node.lineno}")
    assert untyped == []


def _env_reads(tree: ast.AST) -> list[ast.AST]:
    """os.environ.get(X), os.getenv(X), os.environ[X] (read) where X is a DISTDEBUG_* literal or an
    envvars constant."""
    def distdebug_name(x: ast.AST) -> bool:
        if isinstance(x, ast.Constant) and isinstance(x.value, str):
            return x.value.startswith("DISTDEBUG_")
        return isinstance(x, ast.Attribute) and isinstance(x.value, ast.Name) and x.value.id == "envvars"

    out: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and distdebug_name(node.args[0]):
            f = ast.unparse(node.func)
            if f in ("os.environ.get", "os.getenv", "environ.get", "getenv", "os.environ.pop"):
                out.append(node)
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and distdebug_name(node.slice) \
                and ast.unparse(node.value) in ("os.environ", "environ"):
            out.append(node)
    return out


def test_distdebug_variables_are_read_only_through_envvars():
    assert len(_env_reads(ast.parse('import os\nos.environ.get("DISTDEBUG_X")\nos.environ[envvars.RUN_DIR]'))) == 2
    found = []
    for path in list(PKG.rglob("*.py")) + list((ROOT / "fault_injection").glob("*.py")):
        if path.name == "envvars.py":
            continue
        found += [f"{path.relative_to(ROOT)}:{n.lineno}" for n in _env_reads(ast.parse(path.read_text()))]
    assert found == []


def _private_names(tree: ast.AST) -> tuple[set[str], list[tuple[int, str]]]:
    """(private names this module defines: functions, classes, attributes it assigns, module globals;
    private attributes it reads on objects other than self/cls, with their lines)."""
    defined: set[str] = set()
    used: list[tuple[int, str]] = []
    foreign = set()  # names bound to modules outside distdebug (os._exit, torch._C are their business)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            foreign |= {(a.asname or a.name.split(".")[0]) for a in node.names if not a.name.startswith("distdebug")}
        elif isinstance(node, ast.ImportFrom) and not (node.module or "").startswith("distdebug"):
            foreign |= {a.asname or a.name for a in node.names}

    def root(expr: ast.expr) -> str | None:
        while isinstance(expr, ast.Attribute):
            expr = expr.value
        return expr.id if isinstance(expr, ast.Name) else None

    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name.startswith("_"):
            defined.add(node.name)
        elif isinstance(node, ast.Name) and node.id.startswith("_") and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            defined.add(node.target.id)
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if isinstance(node.ctx, ast.Store):
                defined.add(node.attr)
            elif root(node.value) not in ("self", "cls", *foreign):
                used.append((node.lineno, node.attr))
    return defined, used


def test_no_module_reads_another_modules_private_members():
    # A private name read on some object, defined in another distdebug module and not in this one, is a
    # reach into that module's internals (the watchdog once read the session's _emit): use its public side.
    trees = {module_name(p): ast.parse(p.read_text()) for p in PKG.rglob("*.py")}
    defs = {name: _private_names(tree)[0] for name, tree in trees.items()}
    offenders = []
    for name, tree in trees.items():
        _, used = _private_names(tree)
        for line, attr in used:
            owners = [m for m, d in defs.items() if attr in d and m != name]
            if owners and attr not in defs[name]:
                offenders.append(f"{name}:{line} .{attr} (defined in {', '.join(sorted(owners))})")
    assert offenders == []


def test_the_private_member_check_sees_a_reach():
    src = "import os\ndef f(s):\n    s._emit(1)\n    self._ok = 1\n    os._exit(0)\n"
    defined, used = _private_names(ast.parse(src))
    assert used == [(3, "_emit")] and "_ok" in defined


def _top_level_imports(tree: ast.AST, names: set[str]) -> list[int]:
    """Lines importing one of ``names`` as a top-level package (absolute imports only)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            hit = any(a.name.partition(".")[0] in names for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            hit = node.level == 0 and (node.module or "").partition(".")[0] in names
        else:
            continue
        if hit:
            lines.append(node.lineno)
    return lines


def test_fault_injection_and_recipes_are_imported_under_one_name():
    """distdebug.fault_injection and distdebug.recipes, never the checkout's top-level folder names (issue 45,
    item 7): installed, only distdebug exists; in a checkout both names would load, and a fault class loaded
    twice is two classes (a second registry, isinstance failing against itself). Everywhere for
    fault_injection, tests included; the library and CLI for recipes (the recipes and the test scripts that
    borrow their _common are scripts, importing by path as a user's script would)."""
    assert _top_level_imports(ast.parse("import fault_injection.x\nfrom recipes import y\nfrom . import z"),
                              {"fault_injection", "recipes"}) == [1, 2]
    offenders = []
    product = [*PKG.rglob("*.py"), *(ROOT / "fault_injection").glob("*.py"), ROOT / "cli.py"]
    everywhere = [*(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").glob("*.py")]
    for path in product + everywhere:
        names = {"fault_injection", "recipes"} if path in product else {"fault_injection"}
        offenders += [f"{path.relative_to(ROOT)}:{n}" for n in _top_level_imports(ast.parse(path.read_text()), names)]
    assert offenders == []
