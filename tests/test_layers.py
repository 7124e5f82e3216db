"""The package's shape (docs/design.md, "Layers"): each layer imports only the layers below it,
no two modules import each other (directly or around a loop), and no module grows past 400
lines. Read from the source, so a change that breaks the shape fails here, not in review."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "plugin" / "torchrec_kvzch"
# Bottom to top. The package's __init__ (the public API), ops.py (the ops a served program
# calls) and the deprecated aliases of old import paths sit outside the layers: they may
# import any of them.
LAYERS = ["params", "table", "torchrec", "checkpoint", "serving", "job"]
FACADES = {"torchrec_kvzch", "torchrec_kvzch.ops", "torchrec_kvzch.sharding", "torchrec_kvzch.config", "torchrec_kvzch.train",
           "torchrec_kvzch.checkpoint.planner"}
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
    return LAYERS.index(module.split(".")[1])


def imports(path: Path) -> set[str]:
    """The package's modules that ``path`` imports, at any depth of the file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("torchrec_kvzch.")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torchrec_kvzch"):
            # `from torchrec_kvzch.table import id_map` names a module; `... import IdMap` a name
            out |= {f"{node.module}.{a.name}" if (PACKAGE.parent / f"{node.module}.{a.name}".replace(".", "/")).with_suffix(".py").exists()
                    else node.module for a in node.names}
    return {m for m in out if m != "torchrec_kvzch" and m != "torchrec_kvzch._C"}


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
GRAPH = {m: imports(p) for m, p in MODULES.items() if m not in FACADES}


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_a_module_imports_only_its_own_layer_and_those_below(module):
    upward = [m for m in GRAPH[module] if m not in FACADES and layer(m) > layer(module)]
    assert not upward, f"{module} (layer {LAYERS[layer(module)]}) imports {upward} from above it"
    assert not GRAPH[module] & FACADES, f"{module} imports a facade: {GRAPH[module] & FACADES}"


def test_no_modules_import_each_other():
    """No import cycle among the package's modules (a package's __init__ counts as importing
    its submodules' names, so only module-to-module edges are followed)."""
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(GRAPH.get(m, ())):
            if n.startswith(m + "."):  # a package importing its own submodules
                continue
            assert state.get(n) != 1, "import cycle: " + " -> ".join(path + [n])
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])


@pytest.mark.parametrize("path", sorted(p for p in PACKAGE.rglob("*") if p.suffix in (".py", ".cpp", ".h")),
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_is_longer_than_400_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE)} has {lines} lines: split it by concern"
