"""No two classes in asyncroll share a name: a reader (or a traceback) naming one class must not
leave it open which module it means."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "asyncroll"


def test_no_two_classes_share_a_name() -> None:
    where: defaultdict[str, list[str]] = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(str(path.relative_to(PACKAGE.parent)))
    shared = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not shared, shared
