"""`asyncroll` command line.

`demo` trains the tiny local model with GRPO on CPU with real vLLM rollouts; `simulate` runs the
producer against SimEngine (a simulation: random tokens, no model) to show its accounting;
`report` turns a run's record into a static HTML report.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TextIO

import psutil
from tqdm import tqdm

from asyncroll import __version__
from asyncroll.app import demo_chat, demo_tool
from asyncroll.app.demo import LORA_DEFAULTS, DemoConfig, demo_config, run_demo
from asyncroll.engines.base import SamplingConfig
from asyncroll.engines.sim import SimConfig, SimEngine
from asyncroll.producer import Producer
from asyncroll.record.format import RecordError
from asyncroll.report import STEPS_PER_CHUNK, build_report
from asyncroll.types import RolloutGroup

DESCRIPTION = """\
asyncroll: an async, single-node RL rollout engine for LLM post-training (vLLM in-process,
bounded buffer, exact accounting, no Ray). The library is used from Python (see README.md);
these commands show it at work; `asyncroll COMMAND --help` describes one and its options.
"""

DEMO_DESCRIPTION = """\
Build a 361k-parameter Llama and its tokenizer locally (nothing is downloaded), serve it with
vLLM in this process and train it with GRPO on the "echo" task (prompt "q:", reward = share of
response tokens equal to "q"), with --task tool_echo on a multi-turn task, with --task
openai_echo on the same task run by an agent written with the `openai` client against an
OpenAI-compatible endpoint per episode, or with --task chat on a question in a chat template,
scored on the decoded reply and evaluated on held-out questions every --eval-every steps
(eval.jsonl, and the curve in demo.png). Generation
overlaps training within --max-staleness versions. With --lora the trainer trains a LoRA
adapter (base weights frozen) and each step moves only the adapter into vLLM. Writes
metrics.jsonl, summary.txt, demo.png and engine.log to --out.

The terminal shows the progress bar and the summary; vLLM's and the library's logs (and anything
else the engine's processes print) go to OUT/engine.log. --verbose prints everything instead.
"""

REPORT_DESCRIPTION = """\
Turn a run's record (RUN_DIR/record/) into a static HTML report, RUN_DIR/report/index.html by
default, that opens from disk with no server and no network: the curves of the step metrics,
the steps and their groups, and any sample token by token, coloured by loss mask, policy version
or the gap between the trainer's and the sampler's logprobs; searchable by prompt id and reward.
"""

SIMULATE_DESCRIPTION = """\
Run the producer against SimEngine, a simulation (random tokens, timers, injected failures; no
model), and print its accounting: groups started, consumed, failed, filtered, wasted tokens and
groups per second. It measures the producer only, never a model.
"""

# The demo's numeric options and their help; each one's type and default are DemoConfig's (and
# tool_echo's, demo_tool.DEFAULTS, and --lora's, demo.LORA_DEFAULTS), so the command line cannot
# drift from the library's defaults.
# An option not given is left out of the parsed arguments: `demo_config` fills in the task's.
DEMO_NUMBERS = (
    ("--steps", "training steps"),
    ("--group-size", "samples per prompt"),
    ("--batch-groups", "groups per training batch"),
    ("--max-new-tokens", "tokens per response, or per turn of tool_echo"),
    ("--max-staleness", "versions a token may lag when trained on; 0: synchronous"),
    ("--lr", "AdamW learning rate"),
    ("--entropy", "weight of an entropy bonus on the trained tokens"),
    (
        "--blind-entropy",
        "weight of an entropy bonus on the tokens of the problems GRPO is blind "
        "to (every sample scored the same, below 1), up to --blind-target nats each",
    ),
    ("--blind-target", "nats: the entropy --blind-entropy raises a blind problem's tokens to"),
    (
        "--blind-push",
        "weight of an unlikelihood term on the sampled tokens of the problems GRPO "
        "is blind to, while their context's entropy is below --blind-target",
    ),
    ("--eval-every", "chat: steps between evaluations on the held-out questions; 0: none"),
)


def main(argv: Sequence[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        try:
            config = _demo_config(args)
        except ValueError as exc:
            parser.error(str(exc))
        if config.ranks > 1:  # the launcher takes this process over: signals reach it
            from asyncroll.app.demo_ranks import command

            argv = command(config, args.verbose)
            os.execv(argv[0], argv)
        log_path = Path(config.out) / "engine.log"
        with engine_output(log_path, verbose=args.verbose) as console:
            asyncio.run(run_demo(config, console=console))
    elif args.command == "report":
        _report(parser, args)
    else:
        asyncio.run(_simulate(args))


def _demo_config(args: argparse.Namespace) -> DemoConfig:
    """The demo's config of its parsed options; an option not given takes the task's default."""
    options = {k: v for k, v in vars(args).items() if k not in ("command", "verbose")}
    return demo_config(**options)


def _parser() -> argparse.ArgumentParser:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="asyncroll", description=DESCRIPTION, formatter_class=formatter
    )
    parser.add_argument("--version", action="version", version=f"asyncroll {__version__}")
    sub = parser.add_subparsers(title="commands", dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser(
        "demo",
        help="train a tiny local model with GRPO and real vLLM rollouts (CPU ok)",
        description=DEMO_DESCRIPTION,
        formatter_class=formatter,
    )
    d = DemoConfig()
    for flag, text in DEMO_NUMBERS:
        name = flag.removeprefix("--").replace("-", "_")
        default = getattr(d, name)
        demo.add_argument(
            flag,
            type=type(default),
            default=argparse.SUPPRESS,
            help=f"{text} ({_defaults(name, default)})",
        )
    demo.add_argument("--seed", type=int, default=d.seed, help="model, prompts and sampling seed")
    demo.add_argument(
        "--out",
        default=d.out,
        help="folder for metrics, plot, logs, checkpoints (default %(default)s)",
    )
    demo.add_argument(
        "--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: never)"
    )
    demo.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    demo.add_argument(
        "--ranks",
        type=int,
        default=d.ranks,
        help="train with FSDP2 over this many ranks under torchrun (gloo on CPU); rank 0 owns "
        "vLLM and the producer (echo task only; default %(default)s: this process)",
    )
    demo.add_argument(
        "--task",
        default=d.task,
        help="echo (single turn), tool_echo (multi-turn: a tool answers each turn with a "
        "letter the policy must echo on its next turn), openai_echo (tool_echo by an "
        "OpenAI-client agent: each turn a chat.completions call with tools, answered by the "
        "policy through asyncroll.agents; tool_echo's defaults) or chat (a question in a chat "
        "template, a verifier on the decoded reply, greedy evaluation on held-out questions; "
        "default %(default)s)",
    )
    demo.add_argument(
        "--credit",
        default=d.credit,
        help="tool_echo, openai_echo: GRPO advantages per policy turn (turn) or one per "
        "episode (episode); default %(default)s",
    )
    demo.add_argument(
        "--filter",
        default=argparse.SUPPRESS,  # demo_config fills in the task's
        help="nonzero_std: drop groups whose samples all scored the same (GRPO gives them no "
        f"advantage); none: train on every group ({_defaults('filter', d.filter)})",
    )
    demo.add_argument(
        "--entropy-on",
        default=argparse.SUPPRESS,  # demo_config fills in the task's
        help="the tokens the --entropy bonus is the mean over: all trained tokens, or failed: "
        "those of the problems (a group's turn under --credit turn) whose samples all scored 0, "
        f"where GRPO has no signal ({_defaults('entropy_on', d.entropy_on)})",
    )
    demo.add_argument(
        "--push-on",
        default=argparse.SUPPRESS,  # demo_config fills in the task's
        help="the problems --blind-push acts on: blind (every sample scored the same, below 1) "
        f"or failed (every sample scored 0) ({_defaults('push_on', d.push_on)})",
    )
    demo.add_argument(
        "--correction",
        default=d.correction,
        help="off-policy correction of stale tokens: none, decoupled, tis, mask, seq-mask "
        "(asyncroll.train.loss.CORRECTIONS; docs/off-policy.md says which to pick when; "
        "default %(default)s)",
    )
    demo.add_argument(
        "--lora",
        action="store_true",
        help="train a LoRA adapter of every attention and MLP projection instead of every "
        "weight, and move only the adapter into vLLM each step (docs/lora-training.md)",
    )
    demo.add_argument(
        "--lora-rank", type=int, default=d.lora_rank, help="--lora: rank (default %(default)s)"
    )
    demo.add_argument(
        "--lora-alpha",
        type=float,
        default=d.lora_alpha,
        help="--lora: alpha; the update is scaled by alpha / rank (default %(default)s)",
    )
    demo.add_argument(
        "--verbose",
        action="store_true",
        help="print vLLM's and the library's logs on the terminal instead of OUT/engine.log",
    )
    report = sub.add_parser(
        "report",
        help="turn a run's record into a static HTML report (opens from disk)",
        description=REPORT_DESCRIPTION,
        formatter_class=formatter,
    )
    report.add_argument("run_dir", metavar="RUN_DIR", help="the run's folder (holds record/)")
    report.add_argument("--out", help="folder of the report (default RUN_DIR/report)")
    report.add_argument(
        "--steps-per-chunk",
        type=int,
        default=STEPS_PER_CHUNK,
        help="steps per data file the page loads when one of their groups is opened "
        "(default %(default)s)",
    )
    sim = sub.add_parser(
        "simulate",
        help="run the producer against SimEngine, a simulation (random tokens, no model)",
        description=SIMULATE_DESCRIPTION,
        formatter_class=formatter,
    )
    sim.add_argument(
        "--prompts", type=int, default=2000, help="prompts to run (default %(default)s)"
    )
    sim.add_argument(
        "--group-size", type=int, default=8, help="samples per prompt (default %(default)s)"
    )
    sim.add_argument("--max-new-tokens", type=int, default=256, help="tokens per sample at most")
    sim.add_argument("--batch", type=int, default=32, help="groups per produce_batch")
    sim.add_argument("--fail-rate", type=float, default=0.1, help="share of engine calls that fail")
    sim.add_argument("--per-token-latency", type=float, default=0.0, help="simulated seconds")
    sim.add_argument("--payload-bytes", type=int, default=0, help="per sample, like routed experts")
    sim.add_argument("--filter", default="nonzero_std", help="'nonzero_std' or 'none'")
    sim.add_argument("--seed", type=int, default=0, help="seed of the simulation")
    return parser


def _report(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    start = time.perf_counter()
    try:
        index = build_report(args.run_dir, args.out, steps_per_chunk=args.steps_per_chunk)
    except (RecordError, ValueError) as exc:
        parser.exit(1, f"asyncroll report: {exc}\n")
    size = sum(p.stat().st_size for p in index.parent.rglob("*") if p.is_file())
    print(
        f"report: {index} ({size / 2**20:.1f} MiB, {time.perf_counter() - start:.1f} s); "
        "open it in a browser"
    )


def _defaults(name: str, default: object) -> str:
    """Help text of an option's defaults: `DemoConfig`'s, and tool_echo's, chat's and --lora's
    where they differ."""
    tool = demo_tool.DEFAULTS.get(name, default)
    chat = demo_chat.DEFAULTS.get(name, default)
    lora = LORA_DEFAULTS.get(name, default)
    return (
        f"default {default}"
        + (f"; tool_echo: {tool}" if tool != default else "")
        + (f"; chat: {chat}" if chat != default else "")
        + (f"; --lora: {lora}" if lora != default else "")
    )


@contextlib.contextmanager
def engine_output(path: Path, *, verbose: bool) -> Iterator[TextIO]:
    """Send everything this process and the processes it starts write to stdout and stderr
    (vLLM's logs, its workers' C++ chatter, Python warnings, the library's log records) to
    `path`, and yield a stream to the terminal for the progress bar and the summary.

    Redirecting the file descriptors, not `sys.stdout`, is what reaches vLLM's engine and
    worker processes: they inherit them when they start. On exit (an exception included) the
    terminal comes back first, so a traceback is shown where the user looks. `verbose`: no
    redirection; the library's INFO records are shown too.
    """
    if verbose:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        yield sys.stdout
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    console = open(os.dup(saved[1]), "w", buffering=1, closefd=True)  # noqa: SIM115
    handler: logging.Handler | None = None
    library = logging.getLogger("asyncroll")
    level = library.level
    try:
        with path.open("ab") as log_file:
            for fd in (1, 2):
                os.dup2(log_file.fileno(), fd)
        handler = logging.FileHandler(path, encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        library.addHandler(handler)
        library.setLevel(logging.INFO)
        print(f"engine and library logs: {path} (--verbose shows them here)", file=console)
        yield console
    finally:
        if handler is not None:
            library.removeHandler(handler)
            library.setLevel(level)
            handler.close()
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        console.close()


async def _parity_reward(group: RolloutGroup) -> list[float]:
    return [float(len(s.tokens) and s.tokens[0] % 2 == 0) for s in group.samples]


async def _simulate(args: argparse.Namespace) -> None:
    engine = SimEngine(
        SimConfig(
            vocab_size=32000,
            lengths="uniform",
            fail_rate=args.fail_rate,
            per_token_latency_s=args.per_token_latency,
            payload_bytes_per_sample=args.payload_bytes,
            seed=args.seed,
        )
    )
    prompts = [[1 + (i * 7 + j) % 31000 for j in range(16)] for i in range(args.prompts)]
    producer = Producer(
        engine,
        prompts,
        _parity_reward,
        group_size=args.group_size,
        sampling=SamplingConfig(max_new_tokens=args.max_new_tokens),
        filter=None if args.filter == "none" else args.filter,
    )
    process = psutil.Process()
    start = time.perf_counter()
    print("SimEngine is a simulation: random tokens, no model. It measures the producer only.")
    with tqdm(total=args.prompts, unit="prompt", desc="simulate") as bar:
        async with producer:
            async for batch in producer.batches(args.batch):
                c = batch.totals
                bar.update(c.consumed_groups + c.failed_groups + c.filtered_groups - bar.n)
                bar.set_postfix(
                    failed=c.failed_groups,
                    filtered=c.filtered_groups,
                    reward=f"{c.reward_sum / max(c.reward_count, 1):.2f}",
                    rss_mib=process.memory_info().rss >> 20,
                )
    ledger = producer.check_ledger()
    seconds = time.perf_counter() - start
    c = producer.progress.counters
    rows = [
        ("groups started", ledger.started_groups),
        ("consumed groups", c.consumed_groups),
        ("failed groups", c.failed_groups),
        ("filtered groups", c.filtered_groups),
        ("generated tokens", c.generated_tokens),
        ("wasted tokens: failed", c.wasted_tokens_failed),
        ("wasted tokens: filtered", c.wasted_tokens_filtered),
        ("groups/s", f"{ledger.started_groups / seconds:,.0f}"),
        ("ledger", "balanced"),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    main()
