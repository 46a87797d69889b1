"""Count code lines of Python files: lines that hold a token other than a comment, a newline or
a docstring (a string expression standing alone as the first statement of a module, class or
function). Blank lines, comments and docstrings do not count.

    python benchmarks/code_lines.py mfsdp/runtime mfsdp/memory
    python benchmarks/code_lines.py --rev 89acf2b mfsdp/runtime mfsdp/memory
"""
import argparse
import ast
import io
import subprocess
import sys
import tokenize
from pathlib import Path


def code_lines(source: str) -> int:
    return len(_code_line_numbers(source))


def definition_sizes(source: str) -> list[tuple[str, str, int, int]]:
    """(kind, qualified name, first line, code lines) of every class and function of ``source``, each
    counting the code lines of its whole body, nested definitions included."""
    lines, out = _code_line_numbers(source), []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                size = sum(1 for n in lines if child.lineno <= n <= child.end_lineno)
                out.append(("class" if isinstance(child, ast.ClassDef) else "function", name, child.lineno, size))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return out


def _code_line_numbers(source: str) -> set[int]:
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER, tokenize.ENCODING}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return lines - docstrings


def _sources(paths, rev):
    for path in paths:
        if rev is None:
            files = [path] if path.endswith(".py") else sorted(str(p) for p in Path(path).rglob("*.py"))
            for name in files:
                yield name, Path(name).read_text()
        else:
            listed = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, path],
                                    check=True, capture_output=True, text=True).stdout.split()
            for name in sorted(n for n in listed if n.endswith(".py")):
                yield name, subprocess.run(["git", "show", f"{rev}:{name}"], check=True,
                                           capture_output=True, text=True).stdout


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--rev", help="count a git revision's files instead of the working tree")
    parser.add_argument("-v", "--verbose", action="store_true", help="one line per file")
    args = parser.parse_args(argv)
    total = 0
    for name, source in _sources(args.paths, args.rev):
        n = code_lines(source)
        total += n
        if args.verbose:
            print(f"{n:6d} {name}")
    print(f"{total:6d} total")


if __name__ == "__main__":
    sys.exit(main())
