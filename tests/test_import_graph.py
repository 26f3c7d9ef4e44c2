"""localrun's modules import one another without circles, at module level or inside functions
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


def test_localrun_has_no_import_circles():
    known = module_names("localrun")
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
