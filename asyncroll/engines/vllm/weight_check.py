"""Whether an engine serves what the trainer sent: checked in each vLLM worker after a reload,
judged in the trainer's process.

What a checksum of vLLM's parameters can prove is limited, so the worker checks three things:

* **Coverage** (every update, cheap): every tensor of the served checkpoint's own files (their
  names, read from the safetensors headers) was received, and every layer with weights got a
  tensor. A partial update (a layer's q without its k, a renamed tensor) leaves vLLM's
  parameters half old without any error of vLLM's.
* **Arrival** (`verify`): the sha256 of each tensor the worker read equals the sha256 of the
  tensor the trainer sent (computed in the trainer's process), so no file or transfer lost,
  truncated or swapped a tensor.
* **Served values** (`verify`): vLLM's parameters are not the checkpoint's. q/k/v and gate/up
  are packed into one parameter, the CPU backend repacks linear weights for its kernels into
  opaque buffers (the parameter left behind has shape 0), and a tied output head keeps a
  packed copy of the embedding that no parameter shows. vLLM's own `compute_weight_checksums`
  hashes those parameters, so it proves nothing about them (an empty tensor always hashes the
  same; the stale tied head of issue #24 passes it). Here, a parameter that still holds the
  checkpoint's tensor under its name (embeddings, norms) is hashed and compared bit for bit;
  every linear layer, packed, repacked or tied, is *run*: its own kernel on a seeded probe
  input must give what the received tensors give (`F.linear`), within the kernel's float
  error. A stale or wrong weight of the size of a training step is found in float32 (relative
  tolerance 1e-4); in 16-bit types only changes above 2% of the output are.

Tensor-parallel workers hold shards: their linear layers are not probed (reported as
unchecked), arrival and coverage still hold.

The check allocates little on the device: a received tensor is cast to the served dtype on the
host before it is hashed, and the probe's float32 reference runs a block of at most
`PROBE_SCRATCH_BYTES` of weight rows at a time. vLLM 0.34's extensible KV cache caps what
torch may allocate on a GPU once the cache is sized (`set_per_process_memory_fraction`, lifted
only inside vLLM's own reload, `kv_cache_lent_for_weight_update`), and the check runs after the
reload, under that cap: a float32 copy of a large output head (2.2 GB for a 7B model's
152,064 x 3,584) would not fit the headroom left beside the cache (`reload_headroom_bytes`,
1 GiB by default).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

# Tensors some checkpoints carry that vLLM computes itself and never loads.
_COMPUTED = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
_PROBE_ROWS = 2
PROBE_SCRATCH_BYTES = 64 << 20
"""The most float32 weight the probe's reference holds on the device at once."""
_SHOWN = 8  # names listed per problem in an error


class WeightMismatchError(RuntimeError):
    """What an engine (or a replica) serves is not what the trainer sent; the message names
    the replica and the tensors."""


class WeightLayoutError(ValueError):
    """An update holds tensors the served model cannot take (a shape, a dtype): refused
    before anything is sent, so the engine still serves what it served; the message names
    each tensor."""


Layout = tuple[tuple[int, ...], str]  # a checkpoint tensor's shape and safetensors dtype
_FLOATS = frozenset({"F16", "BF16", "F32", "F64"})  # vLLM casts any of these to its dtype


def served_files(folder: str) -> list[Path]:
    """The safetensors files of `folder` that hold the served weights under the names an
    update carries (Hugging Face's), as vLLM picks them: those `model.safetensors.index.json`
    names when there is one (a folder may keep other files beside them), else every file but
    Mistral's `consolidated*.safetensors`, a second copy of the same weights under Mistral's
    own names that Mistral repos ship beside the Hugging Face files (vLLM loads one copy, never
    both); a folder of consolidated files alone is its own copy. Empty when `folder` is not a
    local folder (a hub id)."""
    import json

    path = Path(folder)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    index = path / "model.safetensors.index.json"
    if files and index.is_file():
        named = set(json.loads(index.read_text())["weight_map"].values())
        return [f for f in files if f.name in named]
    return [f for f in files if not f.name.startswith("consolidated")] or files


def checkpoint_layout(folder: str) -> dict[str, Layout] | None:
    """Each tensor's shape and safetensors dtype ("F32", "BF16", ...) in the served
    checkpoint's files (`served_files`, headers only); None when `folder` is not a local
    folder (a hub id)."""
    from safetensors import safe_open

    files = served_files(folder)
    if not files:
        return None
    layout: dict[str, Layout] = {}
    for file in files:
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open is no mapping)
                piece = f.get_slice(name)
                layout[name] = (tuple(piece.get_shape()), piece.get_dtype())
    return layout


def check_layout(
    named: Sequence[tuple[str, Any]], served: dict[str, Layout] | None, where: str
) -> None:
    """Raise `WeightLayoutError` naming `where` and every tensor of `named` whose shape is
    not its served checkpoint tensor's, or whose dtype the model cannot take (a float of 16
    to 64 bits for a float tensor, else the same dtype). vLLM's reload takes a wrong shape by
    resizing the parameter and then fails, without naming the tensor, and so does every later
    update: this runs before anything is sent. Names the checkpoint lacks are left to the
    reload's own checks, unless it lacks every one: then nothing would load, and the engine
    would refuse to generate after the update, so that is refused too, naming the prefix the
    names carry (`torch.compile`'s `_orig_mod.`, DDP's `module.`). `served` None (a hub id)
    checks nothing."""
    if served is None:
        return
    if named and not any(name in served for name, _ in named):
        raise WeightLayoutError(
            f"{where}: {_all_missing(named, served)}. Refused: nothing was loaded"
        )
    problems = []
    for name, tensor in named:
        if name not in served:
            continue
        shape, dtype = served[name]
        if tuple(tensor.shape) != shape:
            problems.append(
                f"{name} has shape {tuple(tensor.shape)}; the served checkpoint's is {shape}"
            )
        elif _dtype_name(tensor.dtype) != dtype and not (
            dtype in _FLOATS and _dtype_name(tensor.dtype) in _FLOATS
        ):
            problems.append(f"{name} is {tensor.dtype}; the served checkpoint's is {dtype}")
    if problems:
        shown = "; ".join(problems[:_SHOWN])
        more = f"; and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
        raise WeightLayoutError(f"{where}: {shown}{more}. Refused: nothing was loaded")


def _all_missing(named: Sequence[tuple[str, Any]], served: dict[str, Layout]) -> str:
    """Why an update none of whose names the checkpoint has would load nothing, with the
    prefix to strip when its names are the checkpoint's behind one."""
    prefixes: set[str | None] = set()
    for name, _ in named:
        cuts = [i + 1 for i, ch in enumerate(name) if ch == "."]
        prefixes.add(next((name[:i] for i in cuts if name[i:] in served), None))
    first = named[0][0]
    prefix = prefixes.pop() if len(prefixes) == 1 else None
    if prefix is not None:
        return (
            f"none of the {len(named)} tensors' names is the served checkpoint's: they all "
            f"start with {prefix!r}, which its names lack ({first!r} is its "
            f"{first[len(prefix) :]!r}); send the names without it (`torch.compile` adds "
            "'_orig_mod.', DDP 'module.': take named_parameters() of the module inside)"
        )
    return (
        f"none of the {len(named)} tensors' names is the served checkpoint's (e.g. {first!r}; "
        f"it has e.g. {next(iter(served))!r}): send the model's own parameter names"
    )


def _dtype_name(dtype: Any) -> str:
    """A torch dtype's safetensors name (the torch name for one safetensors lacks)."""
    import torch

    names = {
        torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32",
        torch.float64: "F64", torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16",
        torch.int32: "I32", torch.int64: "I64", torch.bool: "BOOL",
        torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    }  # fmt: skip
    return names.get(dtype, str(dtype))


def digest(tensor: Any) -> str:
    """sha256 of a tensor's bytes (its dtype and shape as they are). Read as bytes by torch:
    numpy has no bfloat16 (nor float8), which a GPU model serves."""
    import torch

    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy()).hexdigest()


def digests(named: Iterable[tuple[str, Any]]) -> dict[str, str]:
    return {name: digest(t) for name, t in named}


def required_names(model: Any, folder: str) -> set[str] | None:
    """The tensors an update must carry: those of the served checkpoint's files (`folder`),
    less an output head tied to the embedding (some checkpoints store it, a trainer's
    `named_parameters()` lists the shared tensor once) and tensors vLLM computes; None when
    `folder` is not a local folder (a hub id)."""
    names = checkpoint_names(folder)
    if names is not None and _tied_embedding_name(model) is not None:
        names.discard("lm_head.weight")
    return names


def checkpoint_names(model: str) -> set[str] | None:
    """Names of the tensors in the served checkpoint's safetensors files (`served_files`,
    headers only), less those vLLM computes; None when `model` is not a local folder (a hub
    id)."""
    from safetensors import safe_open

    files = served_files(model)
    if not files:
        return None
    names: set[str] = set()
    for file in files:
        with safe_open(str(file), "pt") as f:
            names.update(f.keys())
    return {n for n in names if not n.endswith(_COMPUTED)}


def served_mismatches(
    model: Any,
    received: Callable[[str], Any],
    names: set[str],
    packed: dict[str, list[str]],
    tensor_parallel: int,
) -> tuple[list[str], list[str]]:
    """Tensors of `names` (fetched with `received`) that `model` does not serve: (mismatched,
    unchecked), each entry a checkpoint name with why. See the module docstring."""
    import torch

    mismatched: list[str] = []
    checked: set[str] = set()
    for name, param in model.named_parameters():
        if (
            name in names
            and param.numel() > 0
            and tuple(param.shape) == tuple(received(name).shape)
        ):
            checked.add(name)
            if digest(param) != digest(received(name).to("cpu").to(param.dtype)):  # on the host
                mismatched.append(f"{name} (parameter differs)")
    if tensor_parallel > 1:
        return mismatched, sorted(names - checked)
    embedding = _tied_embedding_name(model)
    generator = torch.Generator().manual_seed(0)
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())  # as served
    for path, module in model.named_modules():
        parts = _linear_sources(path, module, packed, embedding)
        if parts is None or not all(n in names for n in parts[0] + parts[1]):
            continue
        checked.update(parts[0] + parts[1])
        weights, biases = ([received(n) for n in names_] for names_ in parts)
        error = _probe(module, weights, biases, dtype, generator)
        if error is not None:
            mismatched.append(f"{' + '.join(parts[0])} ({error})")
    return mismatched, sorted(names - checked)


def _tied_embedding_name(model: Any) -> str | None:
    """The name of the embedding an output head shares, if it does."""
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if weight is None:
        return None
    for name, param in model.named_parameters():  # shared parameters are listed once
        if param is weight:
            return name if not name.startswith("lm_head.") else None
    return None


def _linear_sources(
    path: str, module: Any, packed: dict[str, list[str]], embedding: str | None
) -> tuple[list[str], list[str]] | None:
    """Checkpoint names of a linear layer's weight shards and bias shards (in packing order),
    or None for a module that is not a linear layer."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    if isinstance(module, ParallelLMHead):
        return ([embedding] if embedding else [f"{path}.weight"]), []
    if not isinstance(module, LinearBase):
        return None
    prefix, _, last = path.rpartition(".")
    stems = [f"{prefix}.{s}" for s in packed[last]] if last in packed else [path]
    biases = [f"{s}.bias" for s in stems] if getattr(module, "bias", None) is not None else []
    return [f"{s}.weight" for s in stems], biases


def _probe(
    module: Any, weights: Sequence[Any], biases: Sequence[Any], dtype: Any, generator: Any
) -> str | None:
    """Run the layer's own kernel on a seeded input of the served `dtype`; None when it
    computes what the received tensors compute, else how far off it is."""
    import torch

    device = _device(module)
    x = torch.randn(_PROBE_ROWS, weights[0].shape[1], generator=generator).to(device, dtype)
    with torch.no_grad():
        served = module.quant_method.apply(module, x, getattr(module, "bias", None)).float()
        expected = _reference(x.float(), weights, biases, device)
    if served.shape != expected.shape:
        return f"serves shape {tuple(served.shape)}, sent {tuple(expected.shape)}"
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    error = float((served - expected).abs().max())
    scale = float(expected.abs().max()) or 1.0
    return None if error <= tolerance * scale else f"output off by {error / scale:.2e} of its scale"


def _reference(x: Any, weights: Sequence[Any], biases: Sequence[Any], device: Any) -> Any:
    """`F.linear(x, cat(weights), cat(biases))` in float32, one block of weight rows at a time
    (each output column is the same dot product either way): at most `PROBE_SCRATCH_BYTES` of
    float32 weight on `device` at once, wherever the received tensors live."""
    import torch

    columns = []
    for weight in weights:
        rows = max(1, PROBE_SCRATCH_BYTES // (4 * max(int(weight.shape[1]), 1)))
        for start in range(0, int(weight.shape[0]), rows):
            block = weight[start : start + rows].to(device=device, dtype=torch.float32)
            columns.append(x @ block.T)
            del block
    out = torch.cat(columns, dim=1)
    if biases:
        out += torch.cat([b.to(device=device, dtype=torch.float32) for b in biases])
    return out


def _device(module: Any) -> Any:
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return "cpu"


def check(reports: Sequence[Any], sent: dict[str, str] | None, where: str) -> None:
    """Raise `WeightMismatchError` naming `where` and the tensors when any worker's report of a
    reload shows a problem (see the module docstring); `sent`: the trainer's digests (None: no
    arrival check)."""
    problems: list[str] = []
    if not reports:
        problems.append("no worker reported on the reload")
    for rank, report in enumerate(reports):
        if not isinstance(report, dict):
            problems.append(f"worker {rank} answered {report!r:.200}, not a reload report")
            continue
        worker = f"worker {rank}: " if len(reports) > 1 else ""
        _add(problems, worker + "no tensor reached layer(s)", report.get("unloaded"))
        _add(problems, worker + "tensor(s) missing from the update", report.get("missing"))
        if sent is not None:
            got = report.get("received")
            if not isinstance(got, dict):
                problems.append(worker + "no digests reported (is verify on in the worker?)")
                continue
            _add(problems, worker + "tensor(s) not received", sorted(sent.keys() - got.keys()))
            changed = sorted(n for n in sent.keys() & got.keys() if sent[n] != got[n])
            _add(problems, worker + "tensor(s) received with other bytes", changed)
            _add(problems, worker + "tensor(s) not served as sent", report.get("mismatched"))
    if problems:
        raise WeightMismatchError(f"{where}: " + "; ".join(problems))


def _add(problems: list[str], what: str, names: Any) -> None:
    if names:
        shown = ", ".join(map(str, list(names)[:_SHOWN]))
        more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
        problems.append(f"{what}: {shown}{more}")


class SafetensorsSource:
    """The tensors of a safetensors file, or of each *.safetensors file in a folder: read one
    at a time (a checkpoint is never held whole), and again by name for the served-value
    check."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self._file_of: dict[str, str] = {}
        for file in sorted(path.glob("*.safetensors")) if path.is_dir() else [path]:
            with safe_open(str(file), "pt") as f:
                self._file_of.update(dict.fromkeys(f.keys(), str(file)))

    def items(self) -> Iterator[tuple[str, Any]]:
        for name in self._file_of:
            yield name, self.get(name)

    def get(self, name: str) -> Any:
        from safetensors import safe_open

        with safe_open(self._file_of[name], "pt") as f:
            return f.get_tensor(name)
