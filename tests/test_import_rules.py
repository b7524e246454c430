"""docs/architecture.md's import table, checked: the agent and the kernels never import the host (they run on a
phone without plotly or torch), the kernels never import the agent, and the host reaches into the agent only through
its protocol, and, for the host executor, the agent's one executor (imports inside functions count too)."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = {"toolkit": "edgeprobe", "device_agent": "edgeprobe_agent", "kernels": "edgeprobe_kernels"}
# host module -> the agent modules it may import beyond the protocol (the table's exceptions)
HOST_EXCEPTIONS = {
    "graph/local.py": {"executor", "session", "ops"},
    "forward.py": {"executor", "session", "ops"},
    "cli/agent.py": {"__main__"},
}


def _imports(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return out


def test_each_package_imports_only_what_the_architecture_table_allows():
    wrong = []
    for folder, name in FOLDERS.items():
        for f in sorted((ROOT / folder).rglob("*.py")):
            rel = f.relative_to(ROOT / folder).as_posix()
            for mod in _imports(f):
                top, _, rest = mod.partition(".")
                if folder in ("device_agent", "kernels") and top == "edgeprobe":
                    wrong.append(f"{folder}/{rel} imports the host ({mod})")
                if folder == "kernels" and top == "edgeprobe_agent":
                    wrong.append(f"kernels/{rel} imports the agent ({mod})")
                if folder == "toolkit" and top == "edgeprobe_agent":
                    sub = rest.split(".")[0]
                    if sub != "protocol" and sub not in HOST_EXCEPTIONS.get(rel, ()):
                        wrong.append(f"toolkit/{rel} imports the agent's {mod}")
    assert not wrong, "; ".join(wrong)
