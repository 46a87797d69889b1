"""The import graph of mfsdp/ has no cycle, counting imports inside functions and under TYPE_CHECKING
(what a reader follows), not only those that run at import time."""

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mfsdp"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imported_names(name: str, path: Path, known: set[str]) -> set[str]:
    """The absolute names ``name`` imports, a known module for each ``from pkg import module``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):  # every depth, TYPE_CHECKING blocks included
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known}
            found |= subs  # `from pkg import module` depends on that module, not on the package
            if len(subs) < len(node.names):
                found.add(base)
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    edges = set()
    for target in _imported_names(name, path, known):
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            edges.add(target)
    return edges


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return out


def test_walker_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_mfsdp_has_no_import_cycle():
    modules = _modules()
    graph = {name: _imports(name, path, set(modules)) & set(modules) for name, path in modules.items()}
    assert "mfsdp.runtime.context" in graph and "mfsdp.runtime.schedule" in graph["mfsdp.runtime.context"]
    cycles = _cycles(graph)
    assert not cycles, "import cycles in mfsdp/: " + "; ".join(" <-> ".join(c) for c in cycles)


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) & set(modules) for name, path in modules.items()}


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for child in graph[todo.pop()] - seen:
            seen.add(child)
            todo.append(child)
    return seen


ENTRY_POINTS = {"mfsdp.cli", "mfsdp.demo", "mfsdp.demo_finetune", "mfsdp.demo_dpo"}
"""The console commands: the only modules outside mfsdp.train that may start it."""


def test_nothing_below_the_training_command_imports_it():
    """The library (runtime, memory, models, data, manager and the top-level modules) never reaches
    mfsdp.train, directly or through another module: dependencies run one way."""
    graph = _graph()
    below = [name for name in graph if not name.startswith("mfsdp.train") and name not in ENTRY_POINTS]
    assert "mfsdp.memory.plan" in below and "mfsdp.runtime.module" in below and "mfsdp.offload" in below
    upward = {name: sorted(m for m in _reachable(graph, name) if m.startswith("mfsdp.train")) for name in below}
    assert not {k: v for k, v in upward.items() if v}, upward


def test_the_launcher_and_the_report_never_reach_the_loop():
    """The launcher checks and starts workers without importing the loop; the step report is built
    from a StepOutput and never sees the Trainer."""
    graph = _graph()
    loop = {"mfsdp.train.loop.trainer", "mfsdp.train.command.main"}
    assert not loop & _reachable(graph, "mfsdp.train.command.launcher"), _reachable(graph, "mfsdp.train.command.launcher") & loop
    assert not loop & _reachable(graph, "mfsdp.train.report.record")


CORE_VALUES = {"mfsdp._compat", "mfsdp.placement", "mfsdp.mixed_precision", "mfsdp.communication"}
"""The core's value modules the runtime reads (placements, dtypes, communication options) and the one
home of private torch APIs."""


def _foreign_imports(imported: dict[str, set[str]], allowed: dict[str, set[str]]) -> dict[str, list[str]]:
    """Per module, what it imports besides torch, the standard library and its ``allowed`` mfsdp
    modules."""
    out = {}
    for name, targets in imported.items():
        bad = sorted(t for t in targets if t.partition(".")[0] not in sys.stdlib_module_names | {"torch"}
                     and t not in allowed[name])
        if bad:
            out[name] = bad
    return out


def test_foreign_imports_are_found():
    imported = {"mfsdp.runtime.a": {"torch.nn", "weakref", "numpy", "mfsdp.runtime.b", "mfsdp.train"}}
    assert _foreign_imports(imported, {"mfsdp.runtime.a": {"mfsdp.runtime.b"}}) == {
        "mfsdp.runtime.a": ["mfsdp.train", "numpy"]}


def test_the_runtime_imports_only_torch_the_standard_library_and_the_core_values():
    """mfsdp/runtime imports torch, the standard library, itself and ``CORE_VALUES``; those import
    only torch and the standard library (README, Architecture)."""
    modules = _modules()
    runtime = {n for n in modules if n == "mfsdp.runtime" or n.startswith("mfsdp.runtime.")}
    assert {"mfsdp.runtime.module", "mfsdp.runtime.hooks"} <= runtime and CORE_VALUES <= set(modules)
    imported = {n: _imported_names(n, modules[n], set(modules)) for n in runtime | CORE_VALUES}
    allowed = {n: runtime | CORE_VALUES if n in runtime else set() for n in imported}
    foreign = _foreign_imports(imported, allowed)
    assert not foreign, foreign
