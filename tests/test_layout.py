"""The layout's promises (docs/architecture.md): internals are private, the code that runs in
vLLM's worker processes says so, the backends are packages, and the public imports work."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import asyncroll

PACKAGE = Path(asyncroll.__file__).resolve().parent
ROOT = PACKAGE.parent
WORKER_MODULE = "asyncroll.engines.vllm.in_worker"


def _docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def test_the_producer_internals_are_one_private_package() -> None:
    internals = {"core", "admission", "flights", "control", "attempt", "lifecycle", "engine_call"}
    assert {p.stem for p in (PACKAGE / "_core").glob("*.py")} >= internals
    flat = {p.stem for p in PACKAGE.glob("*.py")}
    assert not flat & internals, f"internals outside _core/: {sorted(flat & internals)}"
    assert "Nothing here is API" in _docstring(PACKAGE / "_core" / "__init__.py")


def test_the_docs_never_tell_users_to_import_the_internals() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = [
        f"{page.name}: {m.group(0)}"
        for page in pages
        for m in re.finditer(r"(from|import) asyncroll\._core\b[^\n]*", page.read_text())
    ]
    assert not found, found


def test_the_code_that_runs_in_vllm_workers_is_marked_and_named_by_its_path() -> None:
    path = ROOT / Path(*WORKER_MODULE.split(".")).with_suffix(".py")
    assert "Runs inside vLLM's worker processes" in _docstring(path)
    # every name handed to vLLM as a worker extension is this module's
    named = re.compile(r"\"(asyncroll\.[\w.]+)\.WeightLoaderExtension\"")
    for source in PACKAGE.rglob("*.py"):
        for name in named.findall(source.read_text()):
            assert name == WORKER_MODULE, f"{source}: {name}"


def test_the_backends_are_packages_beside_the_protocol() -> None:
    engines = PACKAGE / "engines"
    assert {p.name for p in engines.glob("*.py")} == {"__init__.py", "base.py", "sim.py"}
    for backend in ("vllm", "server"):
        assert (engines / backend / "__init__.py").exists()


def test_the_public_imports_work() -> None:
    from asyncroll import Producer, ProducerConfig, SimEngine
    from asyncroll.engines import Engine, SimConfig

    assert all((Producer, ProducerConfig, SimEngine, Engine, SimConfig))
    import asyncroll.engines as engines

    # resolved lazily (they import vLLM / aiohttp): the names point at the backend packages
    assert "VLLMEngine" in engines.__all__ and "VLLMServerEngine" in engines.__all__
    source = (PACKAGE / "engines" / "__init__.py").read_text()
    assert "asyncroll.engines.vllm.engine import VLLMEngine" in source
    assert "asyncroll.engines.server.engine import VLLMServerEngine" in source


def test_the_command_is_the_apps() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'asyncroll = "asyncroll.app.cli:main"' in pyproject
    from asyncroll.app.cli import main

    assert callable(main)


def test_no_module_takes_a_standard_library_module_s_name() -> None:
    """`from asyncroll._core import signal` next to `import signal` reads as the stdlib's; a
    module is named for what it does. `asyncroll.types` is a public import path users write,
    so it keeps its name."""
    import sys

    public = {PACKAGE / "types.py"}
    clashes = [
        str(path.relative_to(ROOT))
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.stem in sys.stdlib_module_names and path not in public
    ]
    assert not clashes, clashes
