"""The house (docs/DESIGN.md §9): rooms in the order data flows, none importing a room above it or
beside it; no function over 80 lines; no folder named `target` (ignored by GitHub's standard Python
.gitignore template, so new files there would silently go untracked)."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "dspark"
# room -> level; a room imports only rooms of lower levels (rooms of one level are siblings)
LEVELS = {
    "errors": 0, "util": 1, "sampling": 2, "model": 3, "draft": 4, "schedule": 5, "decode": 6,
    "serve": 7, "train": 7, "eval": 7, "cli": 8,
}
MAX_FUNCTION_LINES = 80


def room_of(module: str) -> str | None:
    """`dspark.decode.step` -> `decode`; None for the package itself."""
    parts = module.split(".")
    return parts[1] if parts[0] == "dspark" and len(parts) > 1 else None


def modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parent).with_suffix("")
        out.append((".".join(p for p in rel.parts if p != "__init__"), path))
    return out


def imported(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, module) of every dspark import, at any depth (imports inside functions count too)."""
    found = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found += [(node.lineno, f"{base}.{a.name}" if room_of(base) is None else base) for a in node.names]
    return [(line, name) for line, name in found if name.split(".")[0] == "dspark"]


def test_every_room_has_a_level():
    rooms = {room_of(m) for m, _ in modules()} - {None}
    assert rooms == set(LEVELS), f"rooms without a level in DESIGN §9 order: {rooms ^ set(LEVELS)}"


def test_no_room_imports_one_above_or_beside_it():
    bad = []
    for module, path in modules():
        mine = room_of(module)
        if mine is None:
            continue
        for line, name in imported(ast.parse(path.read_text()), module, path.name == "__init__.py"):
            theirs = room_of(name)
            if theirs is not None and theirs != mine and LEVELS[theirs] >= LEVELS[mine]:
                bad.append(f"{path.relative_to(SRC)}:{line} ({mine}) imports {name} ({theirs})")
    assert not bad, "upward or sideways imports:\n" + "\n".join(bad)


def test_no_function_over_80_lines():
    long = []
    for _, path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "functions over 80 lines:\n" + "\n".join(long)


def test_no_folder_named_target():
    root = SRC.parents[1]
    found = [p for p in (root / "src").rglob("target") if p.is_dir()]
    assert not found, f"folders named target (ignored by common .gitignore templates): {found}"


@pytest.mark.parametrize("source, expected", [
    ("from dspark.model.loading import load_target", ["dspark.model.loading"]),
    ("from dspark import sampling", ["dspark.sampling"]),
    ("def f():\n    from ..schedule import sps", ["dspark.schedule"]),
    ("import dspark.decode.step", ["dspark.decode.step"]),
])
def test_the_checker_sees_every_form_of_import(source, expected):
    """Guards the checks above against silently passing: every import form is found, inside functions too."""
    found = [name for _, name in imported(ast.parse(source), "dspark.draft.base", False)]
    assert found == expected
