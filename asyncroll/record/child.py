"""The record's writer process: `python -m asyncroll.record.child INBOX_FD ACK_FD`.

`Record` starts it at the producer's entry and feeds it messages (`asyncroll.record.wire`)
on the pipe `INBOX_FD`; it writes each with `Lines` and, whenever it has caught up (nothing
more waiting on the pipe), flushes the file to the OS and acknowledges on `ACK_FD` the last
message written. Its life is the pipe's: at end of file (the producer closed it, or died) it
writes the steps still waiting for their metrics, flushes and exits, so it never outlives the
run and a killed trainer still leaves every line it handed over readable. It ignores SIGINT
and SIGTERM, which a terminal or a launcher sends to the whole process group: the producer's
exit, not the signal, says when the last line has been handed over.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import traceback
from multiprocessing.connection import Connection

import msgspec

from asyncroll.record.lines import Lines
from asyncroll.record.wire import MESSAGES, Ack, Message, Opening, WriterStats


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.nice(10)  # the run's processes come first: on a busy machine the record waits
    inbox = Connection(int(argv[1]), writable=False)
    acks = Connection(int(argv[2]), readable=False)
    encode = msgspec.msgpack.Encoder().encode
    start = MESSAGES.decode(inbox.recv_bytes())
    assert isinstance(start, Opening), start
    sys.path[:] = start.path  # the tokenizer's classes import as in the producer
    lines = None
    try:
        tokenizer = None if start.tokenizer is None else pickle.loads(start.tokenizer)
        lines = Lines(start, tokenizer)
        message: Message = start
        while True:
            lines.write(message)
            if not inbox.poll(0):  # caught up: what is written reaches the OS now
                lines.flush()
                acks.send_bytes(encode(Ack(seq=message.seq, stats=lines.stats)))
            try:
                data = inbox.recv_bytes()
            except EOFError:
                break
            message = MESSAGES.decode(data)
        lines.finish()
        acks.send_bytes(encode(Ack(seq=message.seq, stats=lines.stats)))
        return 0
    except BaseException as exc:  # a full disk, a bug: said once, on both sides
        traceback.print_exc()
        error = f"{type(exc).__name__}: {exc}"
        stats = lines.stats if lines is not None else WriterStats()
        with contextlib.suppress(OSError):  # the producer is gone: nobody to tell
            acks.send_bytes(encode(Ack(seq=-1, stats=stats, error=error)))
        return 1
    finally:
        if lines is not None:
            lines.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
