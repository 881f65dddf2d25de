"""The documentation cannot drift from the code: every code block of README.md and docs/ runs
(or is marked as not runnable, with the reason), every link and nav entry resolves, the
configuration reference lists every field and argument with the code's default, and the
metrics reference lists every key a producer reports.

A fenced block is marked by the line before it: `<!-- docs-test: skip (reason) -->` (only
compiled, for Python), or `<!-- docs-test: run -->` (a bash block, run line by line). Python
blocks run by default; any other language but `text` needs a marker.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest

from asyncroll.types import RolloutGroup

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
MARKER = re.compile(r"<!--\s*docs-test:\s*(skip|run)\b(.*?)-->")
FENCE = re.compile(r"^ *```(\S*)\s*$")


class Block(msgspec.Struct, frozen=True):
    page: str
    line: int
    lang: str
    marker: str | None  # "skip", "run" or None
    code: str

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(path: Path) -> list[Block]:
    found: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        lang = opening.group(1)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        before = lines[i - 1] if i else ""
        mark = MARKER.search(before)
        code = textwrap.dedent("\n".join(lines[i + 1 : end]))
        found.append(
            Block(str(path.relative_to(ROOT)), i + 1, lang, mark.group(1) if mark else None, code)
        )
        i = end + 1
    return found


ALL_BLOCKS = [b for page in PAGES for b in blocks(page)]


def test_every_block_is_run_or_marked() -> None:
    unmarked = [b.name for b in ALL_BLOCKS if b.lang not in ("python", "text") and b.marker is None]
    assert not unmarked, f"mark these with <!-- docs-test: skip (why) --> or run: {unmarked}"
    unknown = [b.name for b in ALL_BLOCKS if b.lang not in ("python", "bash", "text")]
    assert not unknown, f"give each fence a language (python, bash or text): {unknown}"


@pytest.mark.parametrize(
    "block", [b for b in ALL_BLOCKS if b.lang == "python"], ids=lambda b: b.name
)
def test_python_blocks_compile(block: Block) -> None:
    ast.parse(block.code, filename=block.name)


# Calls that start vLLM's processes (or the loop that would): at a script's top level, the
# processes vLLM spawns, which re-import the main script, would run them again and fail.
STARTS = {"asyncio.run", "VLLMEngine"}


def _called(call: ast.Call) -> str:
    return ast.unparse(call.func)


def _is_main_guard(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) in (
        "__name__ == '__main__'",
        "'__main__' == __name__",
    )


def _starts_on_import(code: str) -> list[str]:
    """The STARTS calls a module runs on import: outside functions, classes and the
    `if __name__ == "__main__":` block. None for an excerpt of an async function's body (an
    `await` at its top level): no script to paste."""
    found: list[str] = []
    todo: list[ast.AST] = [n for n in ast.parse(code).body if not _is_main_guard(n)]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, (ast.Await, ast.AsyncWith, ast.AsyncFor)):
            return []
        if isinstance(node, ast.Call) and _called(node) in STARTS:
            found.append(f"line {node.lineno}: {_called(node)}(...)")
        todo.extend(ast.iter_child_nodes(node))
    return sorted(found)


@pytest.mark.parametrize(
    "block", [b for b in ALL_BLOCKS if b.lang == "python"], ids=lambda b: b.name
)
def test_python_blocks_start_nothing_on_import(block: Block) -> None:
    """Safe to paste into a script: with `VLLMEngine`, vLLM's spawned processes re-import the
    main script, and a start at its top level fails there ("Engine core initialization
    failed ... Failed core proc(s): {}")."""
    starts = _starts_on_import(block.code)
    assert not starts, f'{block.name}: put these under `if __name__ == "__main__":`: {starts}'


def test_the_import_check_sees_a_start_outside_the_guard() -> None:
    guarded = (
        "import asyncio\nasync def main(): ...\nif __name__ == '__main__':\n    asyncio.run(main())"
    )
    assert _starts_on_import(guarded) == []
    assert _starts_on_import("import asyncio\nasyncio.run(main())") == ["line 2: asyncio.run(...)"]
    assert _starts_on_import("engine = VLLMEngine(model)") == ["line 1: VLLMEngine(...)"]
    assert _starts_on_import("engine = VLLMEngine(model)\nawait engine.close()") == []


def _env() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return os.environ | {"PYTHONPATH": str(ROOT), "PATH": f"{bin_dir}:{os.environ['PATH']}"}


@pytest.mark.parametrize(
    "block",
    [b for b in ALL_BLOCKS if b.lang == "python" and b.marker != "skip"],
    ids=lambda b: b.name,
)
def test_python_blocks_run(block: Block, tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-c", block.code],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, f"{block.name} failed:\n{run.stderr[-3000:]}"


@pytest.mark.parametrize(
    "block", [b for b in ALL_BLOCKS if b.marker == "run" and b.lang == "bash"], ids=lambda b: b.name
)
def test_bash_blocks_run(block: Block, tmp_path: Path) -> None:
    run = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.code],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, f"{block.name} failed:\n{run.stderr[-3000:]}"


# -- links and the site's navigation --------------------------------------------------------


def _local_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    return [link.split("#")[0] for link in links if not re.match(r"[a-z]+:", link)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_resolve(page: Path) -> None:
    for link in filter(None, _local_links(page)):
        target = (page.parent / link).resolve()
        assert target.exists(), f"{page.name} links to {link}, which does not exist"


def _slug(heading: str) -> str:
    """The anchor mkdocs (Python-Markdown's toc) gives a heading: its text without markup,
    lowercase, punctuation dropped, runs of spaces and hyphens made one hyphen."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+?)\s*$", text, flags=re.MULTILINE)}


def _all_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_anchors_resolve(page: Path) -> None:
    """`page.md#anchor` and `#anchor` name a heading of the page they point to."""
    broken = []
    for link in _all_links(page):
        if re.match(r"[a-z]+:", link) or "#" not in link:
            continue
        path, anchor = link.split("#", 1)
        target = (page.parent / path).resolve() if path else page
        if target.suffix == ".md" and target.exists() and anchor not in _anchors(target):
            broken.append(link)
    assert not broken, f"{page.name}: no heading has these anchors: {broken}"


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_site_pages_link_within_the_site(page: Path) -> None:
    """A docs page links to other pages of the site, not to files outside docs/ (the site
    does not serve them) nor to a bare repository host for one of its own pages."""
    outside = [
        link
        for link in _all_links(page)
        if not re.match(r"[a-z]+:", link)
        and link.split("#")[0]
        and not (page.parent / link.split("#")[0]).resolve().is_relative_to(DOCS)
    ]
    assert not outside, (
        f"{page.name} links outside docs/ (name the file in code instead): {outside}"
    )
    bare = [link for link in _all_links(page) if re.fullmatch(r"https?://github\.com/?", link)]
    assert not bare, f"{page.name} links to a bare site root: {bare}"


def test_the_anchor_check_sees_a_missing_heading() -> None:
    assert _slug("5. The loop, with evaluation") == "5-the-loop-with-evaluation"
    assert _slug("See it learn: `asyncroll demo --task chat`") == (
        "see-it-learn-asyncroll-demo-task-chat"
    )
    assert "which-preset" in _anchors(DOCS / "off-policy.md")
    assert "no-such-heading" not in _anchors(DOCS / "off-policy.md")


def _nav_pages() -> list[str]:
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:\n", 1)[1]
    return re.findall(r"([\w-]+\.md)\s*$", nav, flags=re.MULTILINE)


def test_the_nav_lists_every_page_and_each_exists() -> None:
    nav = _nav_pages()
    assert sorted(nav) == sorted(set(nav)), "a page is in the nav twice"
    missing = [p for p in nav if not (DOCS / p).exists()]
    assert not missing, f"nav entries without a page: {missing}"
    unlisted = sorted(p.name for p in DOCS.glob("*.md") if p.name not in nav)
    assert not unlisted, f"pages missing from mkdocs.yml's nav: {unlisted}"


def test_user_docs_name_no_issue_numbers() -> None:
    for page in PAGES:
        found = re.findall(r"(?i)\bissue #?\d+|(?<!\w)#\d{1,3}\b", page.read_text())  # not anchors
        assert not found, f"{page.name} names {found}: say what changed, not which issue"


# -- the configuration reference --------------------------------------------------------------


def _table(section: str) -> dict[str, str]:
    """`name -> default` from the first table under `## section` of configuration.md."""
    text = (DOCS / "configuration.md").read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].startswith("`") and not cells[0].startswith("`**"):
            rows[cells[0].strip("`")] = cells[1].strip("`")
    assert rows, f"no table under '## {section}'"
    return rows


def _same(cell: str, default: object) -> bool:
    if default is inspect.Parameter.empty:
        return cell == "required"
    try:
        value = ast.literal_eval(cell)
    except (ValueError, SyntaxError):
        named = getattr(default, "__name__", None) or f"{type(default).__name__}()"
        return cell == named
    return bool(value == default and type(value) is type(default))


def _fields(struct: type[msgspec.Struct]) -> dict[str, object]:
    return {f.name: f.default for f in msgspec.structs.fields(struct)}


def _arguments(cls: type) -> dict[str, object]:
    params = inspect.signature(cls.__init__).parameters.values()  # type: ignore[misc]
    return {
        p.name: p.default
        for p in params
        if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD
    }


def _config_sources() -> dict[str, dict[str, object]]:
    from asyncroll import Producer, ProducerConfig, SamplingConfig, SimConfig
    from asyncroll.engines import VLLMEngine, VLLMServerEngine
    from asyncroll.lora import LoraSlots

    return {
        "Producer": _arguments(Producer),
        "ProducerConfig": _fields(ProducerConfig),
        "SamplingConfig": _fields(SamplingConfig),
        "VLLMEngine": _arguments(VLLMEngine),
        "VLLMServerEngine": _arguments(VLLMServerEngine),
        "LoraSlots and LoraConfig": _fields(LoraSlots),
        "SimEngine": _fields(SimConfig),
    }


@pytest.mark.parametrize("section", list(_config_sources()))
def test_the_configuration_reference_matches_the_code(section: str) -> None:
    code = _config_sources()[section]
    documented = _table(section)
    assert sorted(documented) == sorted(code), (
        f"docs/configuration.md, '## {section}': add {sorted(set(code) - set(documented))}, "
        f"remove {sorted(set(documented) - set(code))}"
    )
    wrong = {n: (documented[n], code[n]) for n in code if not _same(documented[n], code[n])}
    assert not wrong, f"docs/configuration.md, '## {section}': (documented, code) {wrong}"


# -- the metrics reference --------------------------------------------------------------------


def test_the_metrics_reference_lists_every_key_a_producer_reports() -> None:
    from asyncroll import Producer, Prompt, SimConfig, SimEngine

    async def run() -> dict[str, float]:
        engine = SimEngine(SimConfig(vocab_size=100, fail_rate=0.3, seed=0))
        prompts = [Prompt(tokens=[1, 2, i + 3], task="a" if i % 2 else "b") for i in range(32)]
        producer = Producer(
            engine, prompts, lambda g: [float(s.tokens[0] % 2) for s in g.samples],
            group_size=2, batch_size=4, max_staleness=1, filter="nonzero_std",
        )  # fmt: skip
        async with producer:
            await producer.produce_batch()
            await producer.update_weights(None)
            return (await producer.produce_batch()).metrics()

    keys = asyncio.run(run())
    text = (DOCS / "metrics.md").read_text()
    names = {k.removeprefix("rollout/").removeprefix("total/").split("/")[0] for k in keys}
    missing = sorted(n for n in names if f"`{n}" not in text)
    assert not missing, f"docs/metrics.md does not list {missing}"
    from asyncroll.outcomes import FailureReason

    absent = [r.value for r in FailureReason if f"`{r.value}`" not in text]
    assert not absent, f"docs/metrics.md, 'Failure reasons': add {absent}"


def _eval_keys() -> set[str]:
    """The keys of an evaluation's `metrics()`, `eval/` dropped, with the parts that vary
    written as the metrics page writes them (`pass@<k>`, `_by_task/<task>`, ...)."""
    from asyncroll import Producer, Prompt, SamplingConfig, SimConfig, SimEngine
    from asyncroll.evaluation import Evaluator

    def reward(group: RolloutGroup) -> list[float]:
        return [float(s.tokens[0] % 2) for s in group.samples]

    async def run() -> dict[str, float]:
        engine = SimEngine(SimConfig(vocab_size=100, seed=0))
        held_out = [
            Prompt(tokens=[1, 2, i + 3], task="ab"[i % 2], metadata={"level": str(i % 3)})
            for i in range(8)
        ]
        producer = Producer(engine, [[1, 2, 3]] * 4, reward, group_size=2, batch_size=2)
        evaluator = Evaluator(
            producer, held_out, reward, samples=2, k=(1, 2), by=("level",),
            sampling=SamplingConfig(temperature=1.0, max_new_tokens=4),
        )  # fmt: skip
        async with producer:
            return (await evaluator.run()).metrics()

    keys = set()
    for key in asyncio.run(run()):
        key = re.sub(r"pass@\d+", "pass@<k>", key.removeprefix("eval/"))
        key = re.sub(r"_by_task/.*", "_by_task/<task>", key)
        keys.add(re.sub(r"_by_(?!task/)[^/]+/.*", "_by_<key>/<value>", key))
    return keys


def test_the_metrics_reference_lists_every_key_an_evaluation_reports() -> None:
    keys = _eval_keys()
    assert {"pass@<k>", "pass@<k>_by_task/<task>", "reward_mean_by_<key>/<value>"} <= keys
    page = (DOCS / "metrics.md").read_text()
    assert "\n### Evaluation" in page, "docs/metrics.md: add a section '### Evaluation'"
    text = page.split("\n### Evaluation", 1)[1].split("\n## ")[0]
    missing = sorted(k for k in keys if f"`{k}`" not in text)
    assert not missing, f"docs/metrics.md, 'Evaluation': add {missing}"


def test_the_api_page_covers_every_public_module() -> None:
    """Every `::: name` of docs/api.md exists (a module, or a name its module exports,
    without importing vLLM), and every public module has an entry."""
    import importlib
    import importlib.util

    entries = re.findall(r"^::: ([\w.]+)$", (DOCS / "api.md").read_text(), flags=re.MULTILINE)
    for entry in entries:
        module, _, attr = entry.rpartition(".")
        try:
            is_module = importlib.util.find_spec(entry) is not None
        except ModuleNotFoundError:  # `module` is a module, not a package
            is_module = False
        if not is_module:
            names = vars(importlib.import_module(module))
            assert attr in names or attr in names.get("__all__", ()), f"api.md: {entry} is gone"
    public = ["asyncroll", "asyncroll.engines", "asyncroll.train", "asyncroll.lora"]
    public += ["asyncroll.chat", "asyncroll.evaluation", "asyncroll.codec"]
    uncovered = [m for m in public if not any(e == m or e.startswith(f"{m}.") for e in entries)]
    assert not uncovered, f"docs/api.md has no entry for {uncovered}"


# -- the invariants ---------------------------------------------------------------------------


def _design_invariants() -> dict[int, tuple[str, str]]:
    """number -> (title, the whole row) from docs/design.md's table of invariants."""
    text = (DOCS / "design.md").read_text().split("\n## Invariants\n", 1)[1]
    rows = re.findall(r"^\| (\d+) \| \*\*(.+?)\.?\*\*(.*)$", text, flags=re.MULTILINE)
    return {int(n): (title, rest) for n, title, rest in rows}


def test_the_readme_lists_the_invariants_of_the_design_under_the_same_numbers() -> None:
    readme = (ROOT / "README.md").read_text().split("\n## Guarantees\n", 1)[1]
    listed = {
        int(n): title.rstrip(".")
        for n, title in re.findall(r"^(\d+)\. \*\*(.+?)\*\*", readme, flags=re.MULTILINE)
    }
    design = {n: title for n, (title, _) in _design_invariants().items()}
    assert design and listed == design


def test_every_test_the_design_names_exists() -> None:
    tests = {p.name: p for p in (ROOT / "tests").rglob("test_*.py")}
    for n, (_, row) in _design_invariants().items():
        for path, name in re.findall(r"`(?:tests/(?:vllm/)?)?(test_\w+\.py)(?:::(\w+))?", row):
            assert path in tests, f"invariant {n} names {path}, which does not exist"
            if name:
                source = tests[path].read_text()
                assert f"def {name}(" in source, f"invariant {n} names {path}::{name}: gone"
