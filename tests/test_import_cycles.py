"""No two modules of the project import each other, directly or through others, counting the
imports inside functions too (a lazy import hides a cycle from Python, not from the reader)."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("fedopd", "fedtops_strategy", "server_app", "client_app", "eval")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports(path: Path, modules: set[str]) -> set[str]:
    """The project modules that ``path`` imports anywhere in its body (``from a import b`` counts
    as ``a.b`` when that is a module, else ``a``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names]
        else:
            continue
        found.update(n for n in names if n in modules)
    return found


def import_graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")]
    modules = {module_name(p) for p in files}
    return {module_name(p): project_imports(p, modules) - {module_name(p)} for p in files}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component with more than one module (Tarjan)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_lazy_cycle_and_nothing_else():
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


# Cycles still there, all through function-level imports: the config validates names against
# the registries it imports lazily, and models <-> vocab. Listed so that no new one appears; remove
# an entry when its cycle goes.
KNOWN = [
    ["fedopd.config", "fedopd.data", "fedopd.data_partition", "fedopd.data_prompts", "fedopd.presets"],
    ["fedopd.models", "fedopd.vocab"],
]


def test_rollout_engines_and_model_errors_import_in_one_direction():
    graph = import_graph()
    assert "fedopd.rollout_types" in graph["fedopd.rollout_vllm"] and "fedopd.rollout" not in graph["fedopd.rollout_vllm"]
    assert "fedopd.models" not in graph["fedopd.tiny"] | graph["fedopd.sandbox"]
    found = cycles(graph)
    assert not any(
        {"fedopd.rollout", "fedopd.rollout_vllm"} <= set(c)
        or {"fedopd.models", "fedopd.tiny"} <= set(c)
        or {"fedopd.models", "fedopd.sandbox"} <= set(c)
        for c in found
    )


def test_no_import_cycle_beyond_the_known_ones():
    assert [c for c in cycles(import_graph()) if c not in KNOWN] == []
