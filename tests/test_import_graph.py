"""localrun's and layerplan's modules import one another without circles, at module level or inside functions
(an import under `if TYPE_CHECKING:` is for type names only and does not count)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_names(package: str) -> dict[str, Path]:
    names = {}
    for path in (ROOT / package).rglob("*.py"):
        if "_build" in path.parts:
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of `known` that path imports (a name imported from a package that is itself a
    module counts as that module)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in known else node.module)
    return out & set(known)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
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
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circles_in_localrun_or_layerplan():
    known = {**module_names("localrun"), **module_names("layerplan")}
    graph = {name: imports(path, known) - {name} for name, path in known.items()}
    assert cycles(graph) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_server_touches_no_private_attribute_of_another_object():
    """The server is typed on the engine and the front end and goes through their public
    methods (no `loop._thread`, `llm._check_ids`, `engine.block_manager` reach-throughs)."""
    import re
    for path in sorted((ROOT / "localrun" / "server").glob("*.py")):
        code = "\n".join(line.split("#")[0] for line in path.read_text().splitlines())
        tree = ast.parse(path.read_text())
        private = [node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                   and node.attr.startswith("_") and not node.attr.startswith("__")
                   and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))]
        assert private == [], (path.name, private)
        assert not re.search(r"\.engine\.(block_manager|scheduler|kv_cache)\b", code), path.name


# The arrows each part must never draw (DESIGN.md's table; issue 17's guard rails).
ENGINE_NEVER = ("localrun.cli", "localrun.server", "localrun.models",                 # face, server, catalog
                "localrun.executor", "localrun.loader", "localrun.gguf_file", "localrun.config",  # build
                "localrun.api", "localrun.frontend")
BUILD = ("localrun.executor", "localrun.loader", "localrun.gguf_file", "localrun.config", "localrun.placement")
ENGINE_CORE = ("localrun.engine.sequence", "localrun.engine.block_manager", "localrun.engine.scheduler",
               "localrun.engine.spec_control")


def under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_engine_imports_no_face_server_catalog_or_build():
    known = module_names("localrun")
    bad = {name: sorted(i for i in imports(path, known) if under(i, ENGINE_NEVER))
           for name, path in known.items() if under(name, ("localrun.engine",)) and name != "localrun.engine_config"}
    assert {k: v for k, v in bad.items() if v} == {}


def test_the_build_layer_imports_no_engine():
    known = module_names("localrun")
    bad = {name: sorted(i for i in imports(known[name], known) if under(i, ("localrun.engine",)))
           for name in BUILD}
    assert {k: v for k, v in bad.items() if v} == {}


def test_layerplan_imports_no_localrun_and_torch_only_inside_functions():
    """layerplan stands alone: no localrun anywhere, and torch only where a function needs it
    (the GPU probe and calibration), so `plan` and the guard rails never load torch."""
    found = []
    for path in sorted((ROOT / "layerplan").rglob("*.py")):
        tree = ast.parse(path.read_text())
        in_functions = {id(n) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                        for n in ast.walk(node)}
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                top = name.split(".")[0]
                if top == "localrun" or (top == "torch" and id(node) not in in_functions):
                    found.append(f"{path.name}:{node.lineno} {name}")
    assert found == []


def test_the_engine_core_runs_without_torch():
    """The policy (sequences, blocks, scheduler, speculation control) imports no torch, even
    through its package: checked in a fresh interpreter."""
    import subprocess
    import sys
    code = ("import sys; " + "; ".join(f"import {m}" for m in ENGINE_CORE)
            + "; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_guards_see_a_forbidden_import(tmp_path):
    """The AST reader behind these guards finds an import inside a function and a from-import."""
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from localrun.server import app\n")
    assert imports(path, {"localrun.server": path, "localrun.server.app": path}) == {"localrun.server.app"}
