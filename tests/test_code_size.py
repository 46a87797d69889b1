"""The library stays readable: no class over 200 code lines and no function over 60 anywhere in
mfsdp/ (blanks, comments and docstrings not counted, by ``benchmarks/code_lines.py``'s rule)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMITS = {"class": 200, "function": 60}


def _counter():
    spec = importlib.util.spec_from_file_location("code_lines", ROOT / "benchmarks" / "code_lines.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_counter_measures_bodies_without_docstrings():
    sizes = _counter().definition_sizes('class A:\n    """Doc."""\n    def f(self):\n        """Doc."""\n'
                                        '        # a comment\n        return 1\n\n\ndef g():\n    pass\n')
    assert sizes == [("class", "A", 1, 3), ("function", "A.f", 3, 2), ("function", "g", 9, 2)]


def test_no_class_or_function_is_over_its_limit():
    counter = _counter()
    files = sorted((ROOT / "mfsdp").rglob("*.py"))
    rooms = {p.relative_to(ROOT / "mfsdp").parts[0] for p in files}
    assert {"runtime", "manager", "train", "memory", "offload", "api.py"} <= rooms, rooms
    over = [f"{path.relative_to(ROOT)}:{line} {kind} {name}: {size} code lines"
            for path in files for kind, name, line, size in counter.definition_sizes(path.read_text())
            if size > LIMITS[kind]]
    assert not over, "\n".join(over)
