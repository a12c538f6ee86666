"""No two modules of the project import each other, directly or through others, counting the
imports inside functions too (a lazy import hides a cycle from Python, not from the reader); and
each package imports only the layers below it (docs/architecture.md draws them)."""

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


# The layers, lowest first: a package imports only packages of lower layers (and itself), so no
# two packages import each other and nothing below reaches up (docs/architecture.md draws this).
# fedopd.cache and fedopd.opd are the spec's interface paths, re-exporting fedopd.distill.
LAYERS = [
    {"fedopd", "fedopd.core"},
    {"fedopd.sandbox"},
    {"fedopd.data", "fedopd.models"},
    {"fedopd.rollout", "fedopd.distill"},
    {"fedtops_strategy", "fedopd.engine", "fedopd.cache", "fedopd.opd"},
    {"fedopd.config"},
    {"client_app"},
    {"server_app"},
    {"eval"},
]
# Commands (python -m ...): on top of fedopd, importing any of its packages and nothing outside it;
# nothing imports them.
COMMANDS = {"fedopd.preflight", "fedopd.config.__main__", "fedopd.data.__main__", "fedopd.sandbox.train"}


def unit(module: str) -> str:
    """The package a module belongs to for layering: fedopd's subpackages, else the top package."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "fedopd" and len(parts) > 1 else parts[0]


def layering_violations(graph: dict[str, set[str]], layers: list[set[str]], commands: set[str]) -> list[str]:
    level = {u: i for i, layer in enumerate(layers) for u in layer}
    out = []
    for module, imported in sorted(graph.items()):
        for target in sorted(imported):
            if target in commands:
                out.append(f"{module} imports the command {target}")
            elif module in commands:
                if unit(target).split(".")[0] != "fedopd":
                    out.append(f"the command {module} imports {target}, outside fedopd")
            elif unit(module) != unit(target) and level.get(unit(target), len(layers)) >= level.get(unit(module), -1):
                out.append(f"{module} ({unit(module)}) imports {target} ({unit(target)}), not a lower layer")
    return out


def test_the_layering_check_finds_an_upward_a_sideways_and_a_command_import():
    layers = [{"fedopd.core"}, {"fedopd.data", "fedopd.models"}, {"fedopd.config"}]
    graph = {
        "fedopd.core.errors": set(),
        "fedopd.data.registry": {"fedopd.core.errors", "fedopd.config.parse"},  # upward
        "fedopd.models.load": {"fedopd.data.registry"},  # sideways
        "fedopd.config.parse": {"fedopd.data.registry", "fedopd.cmd"},  # a command
        "fedopd.cmd": {"fedopd.config.parse", "server_app.app"},  # outside fedopd
    }
    assert layering_violations(graph, layers, {"fedopd.cmd"}) == [
        "the command fedopd.cmd imports server_app.app, outside fedopd",
        "fedopd.config.parse imports the command fedopd.cmd",
        "fedopd.data.registry (fedopd.data) imports fedopd.config.parse (fedopd.config), not a lower layer",
        "fedopd.models.load (fedopd.models) imports fedopd.data.registry (fedopd.data), not a lower layer",
    ]


def test_every_package_imports_only_lower_layers():
    graph = import_graph()
    assert {unit(m) for m in graph if m not in COMMANDS} == set().union(*LAYERS)  # every package has a layer
    assert layering_violations(graph, LAYERS, COMMANDS) == []


def test_nothing_in_fedopd_imports_the_apps_or_eval():
    graph = import_graph()
    assert [(m, t) for m, ts in graph.items() if m.startswith("fedopd") for t in ts if unit(t) in ("client_app", "server_app", "eval")] == []


def test_rollout_engines_and_model_errors_import_in_one_direction():
    graph = import_graph()
    assert "fedopd.rollout.interface" in graph["fedopd.rollout.vllm_engine"]
    assert not graph["fedopd.rollout.vllm_engine"] & {"fedopd.rollout.hf", "fedopd.rollout.factory"}
    assert "fedopd.models.load" not in graph["fedopd.sandbox.tiny"] | graph["fedopd.sandbox"]


def test_no_import_cycle():
    assert cycles(import_graph()) == []
