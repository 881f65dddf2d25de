"""Where `ServerProcess` puts `vllm serve` for the scheduler (issue #24, item 5).

While it generates, a CPU `vllm serve`'s engine core and worker busy-poll each other
(`sched_yield` loops in vLLM's shared-memory queues). In a session of its own the server had a
scheduling group of its own (Linux `sched_autogroup`), and under `under-load` that group held
both cores for up to 15-20 s at a time while every other thread waited, the test process's
event loop included: in `test_keep_pause_...[server]` the loop's main thread ran 37 ms and
waited 41.5 s in the run queue over the test's 41.6 s, lagging up to 19.4 s (31.6 s in an
earlier run, where a 16k-token request's first token arrived only at its end). The in-process
`[vllm]` engine's processes slept through every such stall. In the caller's session (a process
group of its own, so `stop` still signals the whole server) the kernel shares one group between
the test's threads and the server's: the same module under the same load never lagged more than
0.16 s (that test: main thread 2.9 s run, 24.5 s waiting, over 202 s: the server is slower).
"""

from __future__ import annotations

import os

from asyncroll.engines.server.launch import ServerProcess


def test_the_server_runs_in_the_callers_session_in_a_process_group_of_its_own(
    vllm_server: ServerProcess,
) -> None:
    assert os.getpgid(vllm_server.pid) == vllm_server.pid  # `stop` signals the whole group
    assert os.getpgid(vllm_server.pid) != os.getpgid(0)  # Ctrl-C and the like stay the caller's
    assert os.getsid(vllm_server.pid) == os.getsid(0)  # one scheduling group with the caller
