"""Trainer-side checks on a GPU with nothing but the machine's own CUDA torch: no vLLM, no
network (`gpu_check.sh --steps torch`; the vLLM steps are for GPUs where vLLM is installed).

* `token_logprobs` at a 152k vocabulary, bf16 and float32 logits, every sampling filter: its
  logprobs and gradient against the same computation in float64, and (CUDA) the peak GPU
  memory of forward and of backward above what it holds before, against the bound its
  docstring promises (a quarter of the logits' size; the gradient of the logits aside);
* `policy_loss` (no correction, and decoupled PPO) on those logprobs: loss and gradient
  against float64;
* `wrap_lora` training steps on a bf16 model: A and B float32, the base frozen bit for bit,
  the loss going down, and the adapter's merged weights serving the wrapped model's logits;
* the codec with CUDA tensors in a group's metadata: they round-trip, bf16 is refused.

asyncroll needs msgspec, numpy, anyio, tqdm and psutil besides torch. Where the machine lacks
some, `--wheelhouse DIR` unpacks their wheels from DIR (made beforehand where there is a
network, for the machine's Python, e.g. 3.12:
`pip download msgspec numpy anyio tqdm psutil --only-binary=:all: --python-version 3.12
--platform manylinux2014_x86_64 -d DIR`); nothing is installed.

    python benchmarks/gpu_check_torch.py --out OUT                     # CUDA, 2 x 256 x 152,064
    python benchmarks/gpu_check_torch.py --device cpu --vocab 4096 --length 32 --out OUT

Writes OUT/torch_check.json and OUT/torch_check.md; exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
NEEDED = ("msgspec", "numpy", "anyio", "tqdm", "psutil")
FILTERS: dict[str, dict[str, Any]] = {
    "none": {},
    "top-p 0.9": {"top_p": 0.9},
    "top-k 50": {"top_k": 50},
    "top-k 50 + top-p 0.9": {"top_k": 50, "top_p": 0.9},
    "top-k vocab/2": {"top_k": "vocab/2"},
    "top-k vocab": {"top_k": "vocab"},
}
TEMPERATURE = 0.7
MEMORY_SHARE = 0.25  # token_logprobs' promised bound on its extra memory, of the logits' size
# Logprob error against float64 (the sum runs over the whole vocabulary in float32), and the
# gradient's relative to its largest entry: bf16 logits get a bf16 gradient (8-bit mantissa).
LOGPROB_ATOL = 1e-4
GRADIENT_RTOL = {"float32": 1e-5, "bfloat16": 8e-3}
SET_AGREEMENT = 0.999  # top-p: float32 and float64 cumsums may split a boundary tie differently


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", help="cuda (the check) or cpu (its logic)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=152_064)
    parser.add_argument("--wheelhouse", type=Path, help="unpack missing dependencies from here")
    parser.add_argument("--out", type=Path, default=ROOT / "gpu-check-out" / "torch")
    args = parser.parse_args(argv)
    missing = _ready(args.wheelhouse, args.out / "site")
    if missing:
        print(f"gpu_check_torch: missing {', '.join(missing)}: give --wheelhouse (see --help)")
        return 1
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check_torch: --device cuda needs a CUDA GPU; torch.cuda.is_available() is False")
        return 1
    device = torch.device(args.device)
    shape = (args.batch, args.length, args.vocab)
    results: list[dict[str, Any]] = []
    for dtype in (torch.bfloat16, torch.float32):
        for name, options in FILTERS.items():
            results.append(_timed(f"token_logprobs {_name(dtype)} {name}", check_logprobs,
                                  device, shape, dtype, options))  # fmt: skip
        results.append(_timed(f"policy_loss {_name(dtype)}", check_policy_loss, device, shape,
                              dtype))  # fmt: skip
    results.append(_timed("wrap_lora training", check_wrap_lora, device))
    results.append(_timed("codec with device tensors", check_codec, device))
    _report(results, device, shape, args.out)
    return 0 if all(r["passed"] for r in results) else 1


def _ready(wheelhouse: Path | None, site: Path) -> list[str]:
    """Make asyncroll importable: its folder on sys.path, and the missing dependencies'
    wheels (matching this Python, or pure) unpacked from `wheelhouse`. Returns what still
    cannot be imported."""
    import importlib.util

    sys.path.insert(0, str(ROOT))
    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    if missing and wheelhouse is not None:
        tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
        for wheel in sorted(wheelhouse.glob("*.whl")):
            project = wheel.name.split("-")[0].lower()
            fits = f"-{tag}-" in wheel.name or wheel.name.endswith("-none-any.whl")
            if project in missing and fits and ("x86_64" in wheel.name or "any" in wheel.name):
                zipfile.ZipFile(wheel).extractall(site)
        sys.path.insert(0, str(site))
        importlib.invalidate_caches()
        missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    return missing


def _name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _timed(name: str, check: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        found = check(*args)
    except Exception as exc:  # a check that raises fails, and the others still run
        found = {"passed": False, "error": f"{type(exc).__name__}: {exc}"}
    found.update(name=name, seconds=round(time.perf_counter() - start, 3))
    print(f"gpu_check_torch: {'ok  ' if found['passed'] else 'FAIL'} {name}: {found}", flush=True)
    return found


def _logits(device: Any, shape: tuple[int, int, int], dtype: Any, seed: int = 0) -> Any:
    import torch

    generator = torch.Generator(device).manual_seed(seed)
    return (2 * torch.randn(shape, generator=generator, device=device)).to(dtype)


def _peak(device: Any, run: Callable[[], Any]) -> tuple[Any, int | None]:
    """`run()` and the peak bytes it allocated above what was allocated before (CUDA only)."""
    import torch

    if device.type != "cuda":
        return run(), None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = run()
    torch.cuda.synchronize(device)
    return out, torch.cuda.max_memory_allocated(device) - before


def check_logprobs(
    device: Any, shape: tuple[int, int, int], dtype: Any, options: dict[str, Any]
) -> dict[str, Any]:
    import torch

    from asyncroll.train import token_logprobs

    vocab = shape[-1]
    sizes = {"vocab/2": vocab // 2, "vocab": vocab}
    options = {k: sizes.get(v, v) for k, v in options.items()}
    logits = _logits(device, shape, dtype).requires_grad_(True)
    ids = torch.randint(vocab, shape[:2], generator=torch.Generator(device).manual_seed(1),
                        device=device)  # fmt: skip
    out, forward = _peak(device, lambda: token_logprobs(logits, ids, temperature=TEMPERATURE,
                                                        **options))  # fmt: skip
    (grad,), backward = _peak(device, lambda: torch.autograd.grad(out.sum(), logits))
    found: dict[str, Any] = {"logits_bytes": logits.nbytes}
    if forward is not None and backward is not None:
        found["forward_share"] = round(forward / logits.nbytes, 4)
        found["backward_share"] = round((backward - grad.nbytes) / logits.nbytes, 4)
    wide = logits.detach().double().requires_grad_(True)
    ref = token_logprobs(wide, ids, temperature=TEMPERATURE, **options)
    (ref_grad,) = torch.autograd.grad(ref.sum(), wide)
    ref = ref.detach()
    if not options:  # float64 log_softmax: the definition itself
        plain = torch.log_softmax(wide.detach() / TEMPERATURE, dim=-1)
        picked = plain[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
        found["definition_error"] = float((ref[:, 1:] - picked).abs().max())
    same_set = out.isneginf() == ref.isneginf()
    both = out.isfinite() & ref.isfinite()
    found["set_agreement"] = float(same_set.double().mean())
    found["logprob_error"] = float((out.detach().double() - ref)[both].abs().max())
    scale = float(ref_grad.abs().max()) or 1.0
    found["gradient_error"] = float((grad.double() - ref_grad).abs().max()) / scale
    found["passed"] = bool(
        found["set_agreement"] >= (SET_AGREEMENT if "top_p" in options else 1.0)
        and found["logprob_error"] <= LOGPROB_ATOL
        and found.get("definition_error", 0.0) <= 1e-9
        and found["gradient_error"] <= GRADIENT_RTOL[_name(dtype)]
        and found.get("forward_share", 0.0) <= MEMORY_SHARE
        and found.get("backward_share", 0.0) <= MEMORY_SHARE
    )
    return found


def check_policy_loss(device: Any, shape: tuple[int, int, int], dtype: Any) -> dict[str, Any]:
    import torch

    from asyncroll.train import Correction, TrainBatch, policy_loss, token_logprobs

    b, length, vocab = shape
    ids = torch.randint(vocab, (b, length), generator=torch.Generator(device).manual_seed(2),
                        device=device)  # fmt: skip
    loss_mask = torch.ones(b, length, dtype=torch.bool, device=device)
    loss_mask[:, : length // 4] = False  # the prompt
    with torch.no_grad():  # the behaviour policy: near the trained one, as after a step
        noise = torch.randn(b, length, generator=torch.Generator(device).manual_seed(3),
                            device=device)  # fmt: skip
        old = token_logprobs(_logits(device, shape, dtype), ids, temperature=TEMPERATURE)
        old = (old + 0.05 * noise).masked_fill(~loss_mask, 0.0)
    batch = TrainBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(loss_mask),
        loss_mask=loss_mask,
        old_logprobs=old.float(),
        versions=torch.zeros(b, length, dtype=torch.int32, device=device),
        advantages=torch.linspace(-1, 1, b, device=device),
        rewards=torch.zeros(b, device=device),
        group_index=torch.zeros(b, dtype=torch.int64, device=device),
    )
    found: dict[str, Any] = {}
    for label, correction in (("ppo", None), ("decoupled", Correction())):
        losses, grads = [], []
        for width in (dtype, torch.float64):
            logits = _logits(device, shape, dtype).to(width).requires_grad_(True)
            logprobs = token_logprobs(logits, ids, temperature=TEMPERATURE)
            proximal = logprobs.detach() if correction is not None else None
            loss, _ = policy_loss(logprobs, batch, correction=correction,
                                  proximal_logprobs=proximal)  # fmt: skip
            (grad,) = torch.autograd.grad(loss, logits)
            losses.append(float(loss.detach()))
            grads.append(grad.double())
        scale = float(grads[1].abs().max()) or 1.0
        found[f"{label}_loss"] = losses[1]
        found[f"{label}_loss_error"] = abs(losses[0] - losses[1]) / max(abs(losses[1]), 1.0)
        found[f"{label}_gradient_error"] = float((grads[0] - grads[1]).abs().max()) / scale
    found["passed"] = all(
        v <= (LOGPROB_ATOL if k.endswith("loss_error") else GRADIENT_RTOL[_name(dtype)])
        for k, v in found.items()
        if k.endswith("_error")
    )
    return found


def check_wrap_lora(device: Any) -> dict[str, Any]:
    import torch
    from torch import nn

    from asyncroll.lora import LoraConfig, merged_weights
    from asyncroll.train import (
        adapter_of,
        lora_layers,
        token_logprobs,
        trainable_parameters,
        wrap_lora,
    )

    class Toy(nn.Module):
        """Embedding, two blocks of q/v projections, an untied head: what wrap_lora needs."""

        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(512, 64)
            self.layers = nn.ModuleList(
                nn.ModuleDict({"q_proj": nn.Linear(64, 64), "v_proj": nn.Linear(64, 64)})
                for _ in range(2)
            )
            self.lm_head = nn.Linear(64, 512, bias=False)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.embed_tokens(ids)
            for layer in self.layers:
                h = h + torch.tanh(layer["q_proj"](h)) * layer["v_proj"](h)
            out: torch.Tensor = self.lm_head(h)
            return out

    torch.manual_seed(0)
    config = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    model = wrap_lora(Toy().to(device, torch.bfloat16), config)
    frozen = {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" not in k}
    ids = torch.randint(512, (4, 24), generator=torch.Generator(device).manual_seed(4),
                        device=device)  # fmt: skip
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-2)
    losses = []
    for _ in range(8):
        loss = -token_logprobs(model(ids), ids)[:, 1:].float().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    state = model.state_dict()
    adapter = adapter_of(model)
    found: dict[str, Any] = {"losses": [round(x, 4) for x in losses]}
    found["float32_adapter"] = all(
        p.dtype == torch.float32 for _, layer in lora_layers(model) for p in layer.parameters()
        if p.requires_grad
    )  # fmt: skip
    found["base_frozen"] = all(torch.equal(state[k], v) for k, v in frozen.items())
    # The merged float32 weights serve what the wrapped float32 model computes.
    wide = Toy().to(device)
    base = {k.replace(".base_layer.", "."): v.float() for k, v in frozen.items()}
    wide.load_state_dict(merged_weights(base, adapter))
    reference = wrap_lora(Toy().to(device), config)
    reference.load_state_dict({k: v.float() for k, v in state.items()})
    with torch.no_grad():
        found["merged_error"] = float((wide(ids) - reference(ids)).abs().max())
    found["passed"] = bool(
        found["float32_adapter"]
        and found["base_frozen"]
        and losses[-1] < losses[0]
        and found["merged_error"] <= 1e-4
    )
    return found


def check_codec(device: Any) -> dict[str, Any]:
    import numpy as np
    import torch

    from asyncroll import codec
    from asyncroll.types import RolloutGroup, RolloutState, Status

    sample = RolloutState(
        tokens=np.arange(4, dtype=np.int32),
        logprobs=np.zeros(4, dtype=np.float32),
        versions=np.zeros(4, dtype=np.int32),
        status=Status.COMPLETED,
        finish_reason="length",
        reward=1.0,
    )
    values = {
        "float32": torch.randn(3, 5, device=device),
        "int64": torch.arange(7, device=device),
        "bool": torch.rand(4, device=device) > 0.5,
    }
    group = RolloutGroup(uid=1, prompt_id="p", task="t", prompt_tokens=np.arange(3, dtype=np.int32),
                         samples=(sample,), status=Status.COMPLETED, metadata=values)  # fmt: skip
    back = codec.decode(codec.encode(group)).metadata
    found: dict[str, Any] = {
        "round_trip": all(np.array_equal(back[k], v.cpu().numpy()) for k, v in values.items())
    }
    bf16 = msgspec_replace(group, {"x": torch.ones(2, device=device, dtype=torch.bfloat16)})
    try:
        codec.encode(bf16)
        found["bfloat16_refused"] = False
    except codec.CodecError:
        found["bfloat16_refused"] = True
    found["passed"] = found["round_trip"] and found["bfloat16_refused"]
    return found


def msgspec_replace(group: Any, metadata: dict[str, Any]) -> Any:
    import msgspec

    return msgspec.structs.replace(group, metadata=metadata)


def _report(results: list[dict[str, Any]], device: Any, shape: tuple[int, ...], out: Path) -> None:
    import torch

    out.mkdir(parents=True, exist_ok=True)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    info = {"device": where, "torch": torch.__version__, "shape": shape}
    (out / "torch_check.json").write_text(json.dumps({**info, "results": results}, indent=1))
    lines = [f"## Trainer-side checks on {where} (torch {torch.__version__}), logits {shape}", "",
             "| check | passed | seconds | details |", "|---|---|---|---|"]  # fmt: skip
    for r in results:
        details = ", ".join(f"{k} {v}" for k, v in r.items()
                            if k not in ("name", "passed", "seconds"))  # fmt: skip
        lines.append(f"| {r['name']} | {r['passed']} | {r['seconds']} | {details} |")
    (out / "torch_check.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
