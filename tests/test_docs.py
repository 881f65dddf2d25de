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
        found = re.findall(r"(?i)\bissue #?\d+|#\d{1,3}\b", page.read_text())
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
