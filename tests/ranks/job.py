"""The multi-rank jobs of tests/test_ranks*.py, run by torchrun (gloo, CPU): one script, one
scenario per run (`python -m torch.distributed.run --nproc-per-node N tests/ranks/job.py
SCENARIO OUT_DIR`). Each rank writes what it saw to OUT_DIR/rank<r>.json (checks that passed
or the error it ended with); the tests read those and the launcher's exit code.

Rank 0's producer runs on SimEngine (a simulation: random tokens, no model) except in
`vllm_parity`: the trainer side (FSDP2, DDP, the gather, the step) is real torch.distributed.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from asyncroll import Producer, SamplingConfig  # noqa: E402
from asyncroll.distributed import RankFailed, Ranks  # noqa: E402
from asyncroll.distributed.gather import full_weights  # noqa: E402
from asyncroll.engines import SimEngine  # noqa: E402
from asyncroll.train import to_batch  # noqa: E402
from asyncroll.train.micro import split_batch  # noqa: E402
from asyncroll.train.step import LossConfig, train_step  # noqa: E402

VOCAB = 64
TIMEOUT_S = float(os.environ.get("RANKS_TIMEOUT_S", "20"))


def tiny_llama(seed: int = 0, *, tie: bool = True) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=tie,
        attention_bias=True,
    )
    model = LlamaForCausalLM(config).to(torch.float64)
    with torch.no_grad():  # every tensor perturbed: norms and biases too, not only weights
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


VERIFIER_BROKEN = False  # the producer_stop fault sets it: every group fails from then on


class _Out:
    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


class TinyLM(torch.nn.Module):
    """A causal-LM-shaped model of plain torch (no transformers import: the fault jobs start
    in a fraction of the time), as `model(input_ids, attention_mask=...).logits`."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: Any = None) -> _Out:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return _Out(self.head(x))


def reward(group: Any) -> list[float]:
    if VERIFIER_BROKEN:
        raise RuntimeError("the verifier is broken (injected)")
    return [float((s.tokens % 2 == 0).mean()) for s in group.samples]


def producer(**options: Any) -> Producer:
    engine = SimEngine(vocab_size=VOCAB, lengths="uniform", min_new_tokens=1, seed=1)
    prompts = [[2 + i % 50, 3, 4][: 1 + i % 3] for i in range(options.pop("prompts", 200))]
    return Producer(
        engine,
        prompts,
        reward,
        group_size=4,
        batch_size=options.pop("batch_size", 6),
        sampling=SamplingConfig(max_new_tokens=9, temperature=1.0),
        **options,
    )


def shard_fsdp(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers if isinstance(model, TinyLM) else model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def split_for(ranks: Ranks, max_tokens: int = 24) -> Any:
    return lambda result: split_batch(
        to_batch(result.groups), ranks.world_size, max_tokens=max_tokens
    )


def gathered_state(model: torch.nn.Module, keep: bool) -> dict[str, torch.Tensor]:
    return dict(full_weights(model, keep=keep, bucket_bytes=1 << 20).tensors)


# -- scenarios -----------------------------------------------------------------------------


async def scenario_train(ranks: Ranks, out: dict[str, Any]) -> None:
    """Batches to every rank; FSDP2 and DDP steps equal one process's step on the whole
    batch; the gather equals the unsharded model; LoRA moves only the adapter."""
    from torch.nn.parallel import DistributedDataParallel

    reference = tiny_llama() if ranks.rollout else None
    fsdp = shard_fsdp(tiny_llama())
    ddp = DistributedDataParallel(tiny_llama())
    start = gathered_state(fsdp, keep=ranks.rollout)
    if reference is not None:
        out["gather_exact"] = all(
            torch.equal(start[n], p.detach()) for n, p in reference.named_parameters()
        ) and len(start) == len(list(reference.parameters()))
    config = LossConfig(clip=0.2, clip_high=0.28, kl_coef=0.0)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (fsdp, ddp)]
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5) if reference else None
    prod = producer() if ranks.rollout else None
    async with prod if prod is not None else _nothing():
        got = await ranks.batch(prod, split_for(ranks))
        assert got is not None
        shard, result = got
        rows = torch.cat([m.rows for m in shard.micro_batches])
        every = [None] * ranks.world_size
        dist.all_gather_object(every, rows[rows >= 0].tolist())
        counts = [len(m.micro_batches) for m in [shard]]
        all_counts = [None] * ranks.world_size
        dist.all_gather_object(all_counts, counts[0])
        stats_f = train_step(fsdp, optimizers[0], shard, config)
        stats_d = train_step(ddp, optimizers[1], shard, config)
        out["micro_batches"] = all_counts
        after_f = gathered_state(fsdp, keep=ranks.rollout)
        after_d = gathered_state(ddp, keep=ranks.rollout)
        if reference is not None:
            whole = to_batch(result.groups)
            out["rows_once"] = sorted(r for part in every for r in part) == list(
                range(whole.input_ids.shape[0])
            )
            (one,) = split_batch(whole, 1, max_tokens=10_000)
            stats_1 = train_step(reference, ref_opt, one, config, world_size=1)
            ref_state = {n: p.detach() for n, p in reference.named_parameters()}
            out["fsdp_names"] = sorted(after_f) == sorted(ref_state)
            out["ddp_names"] = sorted(after_d) == sorted(ref_state)
            out["fsdp_max_diff"] = max(
                float((after_f[n] - ref_state[n]).abs().max()) for n in ref_state
            )
            out["ddp_max_diff"] = max(
                float((after_d[n] - ref_state[n]).abs().max()) for n in ref_state
            )
            out["moved"] = max(float((after_f[n] - start[n]).abs().max()) for n in ref_state)
            out["loss"] = [stats_1["train/loss"], stats_f["train/loss"], stats_d["train/loss"]]
            out["tokens"] = [stats_1["train/tokens"], stats_f["train/tokens"]]
        if ranks.rollout:  # the peers' shape: the engine pulls a DTensor inside its transfer
            from asyncroll.engines.vllm.weights_file import detached

            try:
                detached(fsdp.named_parameters())
            except TypeError as exc:
                out["dtensor_refused"] = str(exc)
        version = await ranks.update_weights(fsdp, prod, bucket_bytes=16 << 10)
        out["version"] = version
        out["buckets"] = ranks.last_gather.buckets if ranks.last_gather else None
        out["peak_bucket_bytes"] = ranks.last_gather.peak_bucket_bytes if ranks.last_gather else 0
        await lora_checks(ranks, out)
        out["checks"] = "done"


async def lora_checks(ranks: Ranks, out: dict[str, Any]) -> None:
    """A LoRA model sharded with FSDP2: only the adapter is gathered, equal to
    `adapter_of` on the unsharded model."""
    from asyncroll.distributed.gather import adapter_from
    from asyncroll.lora import LoraConfig
    from asyncroll.train import adapter_of, wrap_lora

    config = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))

    def lora_model() -> torch.nn.Module:
        model = wrap_lora(tiny_llama(), config)
        torch.manual_seed(1)
        with torch.no_grad():  # B starts at 0: make the adapter say something
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_(0, 0.1)
        return model

    sharded = shard_fsdp(lora_model())
    full = await ranks.run(
        full_weights, sharded, keep=ranks.rollout, bucket_bytes=4 << 10, adapter=True
    )
    if ranks.rollout:
        got = adapter_from(sharded, full.tensors)
        want = adapter_of(lora_model())
        out["lora_names"] = sorted(got.tensors) == sorted(want.tensors)
        out["lora_exact"] = all(torch.equal(got.tensors[n], want.tensors[n]) for n in want.tensors)
        out["lora_config"] = got.config == want.config
        out["lora_only"] = full.stats.tensors == len(want.tensors)


async def scenario_fault(ranks: Ranks, out: dict[str, Any]) -> None:
    """FAULT (env): which rank misbehaves where; the others must end named within bounds."""
    fault, victim = os.environ["FAULT"], int(os.environ["FAULT_RANK"])
    model = shard_fsdp(TinyLM())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    prod = producer(max_dropped_in_a_row=8) if ranks.rollout else None
    me = ranks.rank == victim
    if me and fault == "producer_stop":
        fault_now()
        global VERIFIER_BROKEN
        VERIFIER_BROKEN = True  # every group fails: the producer stops the run
    async with prod if prod is not None else _nothing():
        for step in range(3):
            if me and fault == "wait_kill" and step == 1:
                fault_now()
                os.kill(os.getpid(), signal.SIGKILL)  # while rank 0 produces the batch
            got = await ranks.batch(prod, split_for(ranks))
            assert got is not None
            shard, _ = got
            if me and fault == "raise_step" and step == 1:
                fault_now()
                raise ValueError("boom in the step (injected)")
            if me and fault == "kill_step" and step == 1:
                fault_now()
                os.kill(os.getpid(), signal.SIGKILL)
            await ranks.run(train_step, model, optimizer, shard, LossConfig())
            if me and fault == "skip_gather" and step == 1:
                fault_now()
                await asyncio.sleep(3600)  # never joins the gather
            if me and fault == "kill_rank0" and step == 1:
                fault_now()
                os.kill(os.getpid(), signal.SIGKILL)  # rank 0, its producer with it
            if me and fault == "kill_gather" and step == 1:
                kill_in_the_gather(after=5)
            await ranks.update_weights(model, prod)
            out[f"step{step}"] = "ok"
            if fault == "sigterm_launcher" and step == 1:
                if ranks.rollout:
                    await asyncio.to_thread(Path(os.environ["READY_FILE"]).write_text, "ready")
                await asyncio.sleep(3600)  # the test SIGTERMs the launcher now


def fault_now() -> None:
    """Record when the injected fault happens (before it: a killed rank writes nothing
    after), for the survivors' detection time."""
    Path(os.environ["OUT_DIR"], "fault_at").write_text(repr(time.time()))


def kill_in_the_gather(after: int) -> None:
    """SIGKILL this rank inside the gather: at its `after`-th `full_tensor()`, the other ranks
    waiting in theirs."""
    from torch.distributed.tensor import DTensor

    gather, calls = DTensor.full_tensor, [0]

    def full_tensor(self: DTensor, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == after:
            fault_now()
            os.kill(os.getpid(), signal.SIGKILL)
        return gather(self, **kwargs)

    DTensor.full_tensor = full_tensor  # type: ignore[method-assign]


class _nothing:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


async def scenario_vllm_parity(ranks: Ranks, out: dict[str, Any]) -> None:
    """Rank 0 serves the tiny model's ORIGINAL weights with a real VLLMEngine; every rank
    loads the perturbed model of tests/vllm/test_weight_parity.py (every tensor moved) and
    shards it with FSDP2, then with DDP; after each sharded update the engine serves what a
    fresh engine on the perturbed weights served (that module's reference). vLLM's processes
    see none of torchrun's variables and none of its ports."""
    import pickle

    from torch.nn.parallel import DistributedDataParallel
    from transformers import LlamaForCausalLM

    case = Path(os.environ["PARITY_CASE"])
    models = {
        "fsdp2": lambda: shard_fsdp(LlamaForCausalLM.from_pretrained(case, dtype=torch.float32)),
        "ddp": lambda: DistributedDataParallel(
            LlamaForCausalLM.from_pretrained(case, dtype=torch.float32)
        ),
    }
    if not ranks.rollout:
        for name, make in models.items():
            out[name] = await ranks.update_weights(make(), None, bucket_bytes=256 << 10)
        await ranks.alone("after the updates", None)  # rank 0 is killed meanwhile
        return
    from asyncroll.engines import VLLMEngine
    from asyncroll.launcher_env import launcher_variables
    from tests.conftest import VLLM_MAX_MODEL_LEN as MAX_LEN
    from tests.vllm.test_weight_parity import serve

    reference = pickle.loads((case / "reference.pickle").read_bytes())
    async with VLLMEngine(os.environ["ORIGINAL_MODEL"], max_model_len=MAX_LEN, seed=0) as engine:
        prod = Producer(engine, [[0, 5, 6]], lambda g: [0.0] * g.num_samples, group_size=2)
        async with prod:
            for name, make in models.items():
                version = await ranks.update_weights(make(), prod, bucket_bytes=256 << 10)
                served = await serve(engine, "parity")
                out[name] = version
                out[f"{name}_tokens"] = [o.tokens.tolist() for o in served] == [
                    r.tokens.tolist() for r in reference
                ]
                out[f"{name}_logprob_gap"] = max(
                    float(abs(o.logprobs - r.logprobs).max())
                    for o, r in zip(served, reference, strict=True)
                )
                out[f"{name}_labels"] = all((o.versions == version).all() for o in served)
            port = os.environ["MASTER_PORT"]
            children = psutil.Process().children(recursive=True)
            out["vllm_processes"] = len(children)
            out["vllm_launcher_variables"] = {  # name: [the trainer's value, vLLM's values]
                name: [os.environ.get(name), sorted({c.environ()[name] for c in children
                                                     if name in c.environ()})]
                for name in {v for c in children for v in launcher_variables(c.environ())}
            }  # fmt: skip
            out["vllm_ports"] = sorted(
                {c.laddr.port for p in children for c in p.net_connections() if c.laddr}
            )
            out["master_port"] = int(port)
            # Then rank 0 dies as an out-of-memory kill would: vLLM's processes must end
            # with it (asyncroll's reaper) and rank 1 must end naming it.
            out["vllm_pids"] = [c.pid for c in children]
            (Path(os.environ["OUT_DIR"]) / "rank0.json").write_text(json.dumps(out))
            fault_now()
            os.kill(os.getpid(), signal.SIGKILL)


async def scenario_checkpoint(ranks: Ranks, out: dict[str, Any]) -> None:
    """CKPT_MODE=save: two steps, a checkpoint, then exit (as a killed run would); resume:
    load it (with any number of ranks) and train to the end of the prompts. Rank 0 records
    the prompts it trained and the weights it holds."""
    from asyncroll.distributed import checkpoint

    folder = Path(os.environ["CKPT"])
    model = shard_fsdp(TinyLM())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    prod = producer(prompts=24, batch_size=3) if ranks.rollout else None
    seen: list[str] = []
    if os.environ["CKPT_MODE"] == "resume":
        meta = await checkpoint.load(ranks, folder, model=model, optimizer=optimizer, producer=prod)
        out["meta"] = [meta.version, meta.step, meta.world_size]
        out["loaded_weights"] = _digest(gathered_state(model, keep=ranks.rollout))
    async with prod if prod is not None else _nothing():
        for _ in range(2 if os.environ["CKPT_MODE"] == "save" else 100):
            got = await ranks.batch(prod, split_for(ranks))
            if got is None:
                break
            shard, result = got
            if result is not None:
                seen += [g.prompt_id for g in result.groups]
            await ranks.run(train_step, model, optimizer, shard, LossConfig())
            await ranks.update_weights(model, prod)
            out["version"] = ranks.last_version
        if os.environ["CKPT_MODE"] == "save":
            meta = await checkpoint.save(
                ranks, folder, model=model, optimizer=optimizer, producer=prod, step=2
            )
            out["meta"] = [meta.version, meta.step, meta.world_size]
            out["saved_weights"] = _digest(gathered_state(model, keep=ranks.rollout))
    out["prompts"] = seen


def _digest(state: dict[str, torch.Tensor]) -> str:
    import hashlib

    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(name.encode() + state[name].numpy().tobytes())
    return digest.hexdigest()


SCENARIOS = {
    "train": scenario_train,
    "checkpoint": scenario_checkpoint,
    "fault": scenario_fault,
    "vllm_parity": scenario_vllm_parity,
}


async def main(name: str, out_dir: Path) -> None:
    out: dict[str, Any] = {"pid": os.getpid()}
    rank = int(os.environ["RANK"])
    path = out_dir / f"rank{rank}.json"
    started = time.monotonic()
    try:
        async with Ranks(timeout_s=TIMEOUT_S, keepalive_s=TIMEOUT_S / 10) as ranks:
            await SCENARIOS[name](ranks, out)
    except BaseException as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["failed_rank"] = exc.rank if isinstance(exc, RankFailed) else None
        out["traceback"] = traceback.format_exc()
        raise
    finally:
        out["seconds"] = time.monotonic() - started
        out["ended_at"] = time.time()
        path.write_text(json.dumps(out))


if __name__ == "__main__":
    os.environ["OUT_DIR"] = sys.argv[2]
    asyncio.run(main(sys.argv[1], Path(sys.argv[2])))
