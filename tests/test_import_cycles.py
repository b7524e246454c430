"""No import cycles between the modules of edgeprobe, edgeprobe_agent and edgeprobe_kernels: every import counts,
at module level or inside a function (a lazy import is still a dependency), read from the source with ast."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"edgeprobe": "toolkit", "edgeprobe_agent": "device_agent", "edgeprobe_kernels": "kernels"}


def _modules() -> dict:
    mods = {}
    for name, folder in PACKAGES.items():
        for p in (ROOT / folder).rglob("*.py"):
            parts = [name, *p.relative_to(ROOT / folder).with_suffix("").parts]
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return mods


def import_graph() -> dict:
    """module -> the modules of these packages it imports (a submodule named in `from pkg import sub` included)."""
    mods = _modules()
    graph = {m: set() for m in mods}
    for m, p in mods.items():
        base = m.split(".") if p.name == "__init__.py" else m.split(".")[:-1]
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                t = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else node.module
                targets = [t] + [f"{t}.{a.name}" for a in node.names if f"{t}.{a.name}" in mods]
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != m and not m.startswith(t + "."):  # a module's own package has run before it
                    graph[m].add(t)
    return graph


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            c = []
            while not c or c[-1] != v:
                c.append(stack.pop())
                on.discard(c[-1])
            if len(c) > 1:
                out.append(sorted(c))
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_lazy_and_relative_imports():
    g = import_graph()
    assert "edgeprobe_kernels.hvx_bridge" in g["edgeprobe_agent.backends"]  # imported inside functions
    assert "edgeprobe_agent.ops.registry" in g["edgeprobe_agent.experts"]   # from .ops.registry import ...
    assert "edgeprobe_agent.experts" in g["edgeprobe_agent.ops"]            # moe_ffn, loaded on first call


def test_no_import_cycles():
    assert cycles(import_graph()) == []
