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


LAYERS = ("ground", "cards", "artifacts", "fingerprint", "runtime", "doctor", "detectors", "analysis", "report", "api",
          "launch", "lint", "fault_injection", "cli")
"""The floors, lowest first: a module imports from its own floor or below, never above. ground: the modules
at distdebug/'s top (findings, context, errors, config, envvars, procs) that every floor shares; api: the
package itself (watch(), step()); cli: distdebug/cli/ and __main__. The folders' roles: README's layout."""


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
    for path in list((PKG / "detectors").rglob("*.py")) + list((ROOT / "fault_injection").glob("*.py")):
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


# ---------------------------------------------------------------- the run directory's contract (issue 47, item 3)
def _record_kinds() -> set[str]:
    from distdebug.artifacts import schema

    return {v for k, v in vars(schema).items() if k.isupper() and isinstance(v, str) and k != "MANIFEST_SCHEMA"}


def _run_dir_names() -> set[str]:
    from distdebug.artifacts import layout

    names = {v for k, v in vars(layout).items() if k.isupper() and isinstance(v, str)}
    return names | {part for v in names for part in v.split("/") if "{" not in part}


def _is_kind(expr: ast.AST) -> bool:
    """``kind``, ``x.kind``, ``r.get("kind")``, ``r["kind"]``: an expression holding a record's kind."""
    if isinstance(expr, ast.Name):
        return expr.id == "kind"
    if isinstance(expr, ast.Attribute):
        return expr.attr == "kind"
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr == "get":
        return bool(expr.args) and isinstance(expr.args[0], ast.Constant) and expr.args[0].value == "kind"
    if isinstance(expr, ast.Subscript):
        return isinstance(expr.slice, ast.Constant) and expr.slice.value == "kind"
    return False


def _strings(expr: ast.AST) -> list[str]:
    """The string constants of an expression (a tuple or set of them, an f-string's literal parts)."""
    return [n.value for n in ast.walk(expr) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _run_dir_name(text: str, names: set[str]) -> bool:
    """A run directory's file or folder name (or a rank's, a node's or a profiler window's), as a literal."""
    return text.strip("/") in names or any(p in text for p in ("rank-", "node-", "steps-"))


def contract_breaches(tree: ast.AST, kinds: set[str], names: set[str]) -> list[tuple[int, str]]:
    """(line, what) for each record kind written as a literal (compared with a record's kind, given as one,
    emitted) and each run-directory path built by hand (a layout name or a rank/node folder's name joined,
    globbed or opened)."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_kind(s) for s in sides):
                out += [(node.lineno, f"kind {v!r}") for s in sides if not _is_kind(s) for v in _strings(s)
                        if v in kinds]
        elif isinstance(node, ast.Dict):
            out += [(node.lineno, f"kind {v.value!r}") for k, v in zip(node.keys, node.values, strict=True)
                    if isinstance(k, ast.Constant) and k.value == "kind" and isinstance(v, ast.Constant)
                    and v.value in kinds]
        elif isinstance(node, ast.Call):
            f = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if f in ("emit", "of_kind", "record") and node.args and isinstance(node.args[0], ast.Constant) \
                    and node.args[0].value in kinds:
                out.append((node.lineno, f"kind {node.args[0].value!r}"))
            out += [(node.lineno, f"kind {k.value.value!r}") for k in node.keywords
                    if k.arg == "kind" and isinstance(k.value, ast.Constant) and k.value.value in kinds]
            if f in ("rank_of_dir", "node_of_file"):  # a folder listing read by hand: layout.rank_dirs()
                out.append((node.lineno, f"enumeration {f}"))
            joins = f == "join" and isinstance(node.func, ast.Attribute) \
                and ast.unparse(node.func.value).endswith("path")
            if f in ("glob", "rglob", "joinpath", "Path", "open", "startswith", "endswith") or joins:
                out += [(node.lineno, f"path {v!r}") for a in node.args for v in _strings(a) if _run_dir_name(v, names)]
        elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Div, ast.Add)):
            out += [(node.lineno, f"path {v!r}") for side in (node.left, node.right) for v in _strings(side)
                    if _run_dir_name(v, names)]
        elif isinstance(node, ast.JoinedStr) and any(isinstance(v, ast.FormattedValue) for v in node.values):
            out += [(node.lineno, f"path {v!r}") for v in _strings(node) if "/" in v and _run_dir_name(v, names)]
    return sorted(set(out))


def test_the_contract_check_sees_a_kind_literal_and_a_hand_built_path():
    kinds, names = _record_kinds(), _run_dir_names()
    assert {"step", "finding", "injected"} <= kinds and {"events.jsonl", "nodes", "manifest.json"} <= names
    src = ('if r.get("kind") == "step": pass\nif kind in ("end", "start"): pass\nctx.emit("memory", x=1)\n'
           'w({"kind": "finding"})\np = run_dir / "nodes" / f"node-{n:03d}.json"\nrun.glob("rank-*")\n'
           'if r.get("kind") == schema.STEP: pass\nx = {"step": 1}\nif k not in ("step", "kind"): pass\n'
           '" ".join(["nodes"])\nos.path.join(d, "events.jsonl")\nr = layout.rank_of_dir(c.name)\n'
           'open(f"{d}/events.jsonl")\nname.startswith("rank-")\nschema.record("step", rank=0)\n'
           'x = f"step {n}"\n')
    assert contract_breaches(ast.parse(src), kinds, names) == [
        (1, "kind 'step'"), (2, "kind 'end'"), (2, "kind 'start'"), (3, "kind 'memory'"), (4, "kind 'finding'"),
        (5, "path 'node-'"), (5, "path 'nodes'"), (6, "path 'rank-*'"), (11, "path 'events.jsonl'"),
        (12, "enumeration rank_of_dir"), (13, "path '/events.jsonl'"), (14, "path 'rank-'"), (15, "kind 'step'")]


def test_the_run_directory_is_reached_only_through_artifacts():
    """Every path of the run directory, every enumeration of its ranks and nodes and every record kind goes
    through distdebug/artifacts/ (layout's paths, rank_dirs(), node_files(), trace_windows(); schema's
    kinds): the directory's contract is one module's, and a change of it one edit."""
    kinds, names = _record_kinds(), _run_dir_names()
    found = []
    for path in sources():
        if "artifacts" in path.relative_to(ROOT).parts:
            continue
        found += [f"{path.relative_to(ROOT)}:{line} {what}"
                  for line, what in contract_breaches(ast.parse(path.read_text()), kinds, names)]
    assert found == []
