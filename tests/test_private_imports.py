"""No module of mfsdp/ imports another module's private (underscore) name; private torch APIs go
through ``mfsdp._compat``, the one private module others may import. A private name another module
needs is made public where it lives."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mfsdp"



def _private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") and part != "_compat"
               for part in dotted.split("."))


def private_imports(name: str, source: str, is_package: bool = False) -> list[str]:
    """The private mfsdp names module ``name`` imports (``pkg.module._name``), at any depth."""
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("mfsdp.") and _private(a.name)]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            if base == "mfsdp" or base.startswith("mfsdp."):
                found += [f"{base}.{a.name}" for a in node.names if _private(f"{base}.{a.name}")]
    return found


def test_the_walker_finds_private_imports():
    source = ("from mfsdp import _compat\nfrom mfsdp._compat import fake_tensor_mode\nimport mfsdp.a._b\n"
              "def f():\n    from mfsdp.models.llama import _local, public\n    from ._x import y\n"
              "    from .b import __version__\n")
    assert private_imports("mfsdp.pkg.mod", source) == ["mfsdp.a._b", "mfsdp.models.llama._local", "mfsdp.pkg._x.y"]
    assert private_imports("mfsdp.pkg", "from .m import _n", is_package=True) == ["mfsdp.pkg.m._n"]


def test_no_module_imports_another_modules_private_name():
    found = set()
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        if name != "mfsdp._compat":
            found |= {(name, imported) for imported in private_imports(name, path.read_text(), is_package)}
    assert not found, sorted(found)
