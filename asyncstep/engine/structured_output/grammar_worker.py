"""A grammar compile worker: ``python -m asyncstep.engine.structured_output.grammar_worker --fd N``.

The engine core's compile pool (:mod:`asyncstep.engine.structured_output.grammar_pool`)
starts it with one end of a socket pair as file descriptor ``N``, and its
stdin a pipe from the core that is never written: when that pipe closes
(the core died, however) the worker exits at once, whatever it is
compiling. It runs at a lower CPU priority than the engine (``nice``), so
a compile takes what the streams leave.

xgrammar's compile is C++ that cannot be interrupted in a thread (an
exception set on the thread, or a signal, is seen only once it returns:
``benchmarks/studies/grammar/README.md`` shows it), so a compile that may run too
long or take too much memory runs here first, where the core can watch its
time and memory and kill it. The worker keeps nothing between jobs
(xgrammar's cache off): it only finds out whether a grammar compiles and
what it costs; the core then builds the grammar it keeps itself. (A
compiled grammar crosses a process boundary only through xgrammar's JSON,
which copies the grammar-wide FSM once per rule, and so does the copy it
deserializes: its size and time grow with the square of a schema's
properties, far past the compile's own; ``benchmarks/studies/grammar/README.md``.)

Its messages are :mod:`asyncstep.engine.structured_output.grammar_messages`' (msgpack frames,
a 4-byte big-endian length each, as :mod:`asyncstep.channels.framing`;
never pickle). Nothing of the engine imports this module: it is the
worker's ``__main__``. Imports msgspec, the grammar compiler, the messages
and the process helpers (xgrammar once set up).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import struct
import sys
import time
from collections.abc import Sequence

import msgspec

from asyncstep.channels.framing import MAX_FRAME_BYTES
from asyncstep.engine.structured_output.grammar import GrammarCompiler
from asyncstep.engine.structured_output.grammar_messages import (
    NICENESS,
    CompileGrammar,
    GrammarCompiled,
    GrammarRefused,
    ToWorker,
    WorkerReady,
    WorkerSetup,
)
from asyncstep.errors import InvalidRequestError
from asyncstep.procs import exit_when_parent_dies

_HEADER = struct.Struct("!I")


def serve(sock: socket.socket) -> None:
    """Answer the core's messages on ``sock`` until it closes."""
    decoder = msgspec.msgpack.Decoder(ToWorker)
    encoder = msgspec.msgpack.Encoder()
    setup = decoder.decode(_receive(sock))
    if not isinstance(setup, WorkerSetup):
        raise RuntimeError(f"expected WorkerSetup, got {type(setup).__name__}")
    compiler = GrammarCompiler.from_vocabulary(setup.vocabulary, max_threads=setup.max_threads)
    del setup
    _send(sock, encoder.encode(WorkerReady()))
    while True:
        try:
            job = decoder.decode(_receive(sock))
        except EOFError:
            return
        if not isinstance(job, CompileGrammar):
            raise RuntimeError(f"expected CompileGrammar, got {type(job).__name__}")
        _send(sock, encoder.encode(_compile(compiler, job)))


def _compile(compiler: GrammarCompiler, job: CompileGrammar) -> GrammarCompiled | GrammarRefused:
    start = time.perf_counter()
    try:
        compiled = compiler.compile(job.kind, job.spec)
    except InvalidRequestError as exc:
        return GrammarRefused(str(exc))
    return GrammarCompiled(int(compiled.memory_size_bytes), time.perf_counter() - start)


def _receive(sock: socket.socket) -> bytes:
    """The next frame's payload; EOFError when the core closed the socket."""
    (size,) = _HEADER.unpack(_receive_exactly(sock, _HEADER.size))
    if size > MAX_FRAME_BYTES:
        raise RuntimeError(f"frame of {size} bytes is larger than {MAX_FRAME_BYTES}")
    return _receive_exactly(sock, size)


def _receive_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(min(size - len(data), 1 << 20))
        if not chunk:
            raise EOFError
        data += chunk
    return bytes(data)


def _send(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m asyncstep.engine.structured_output.grammar_worker",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--fd", type=int, required=True, help="the socket to the engine core")
    args = parser.parse_args(argv)
    exit_when_parent_dies(0.0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the front end
    os.nice(NICENESS)
    with socket.socket(fileno=args.fd) as sock, contextlib.suppress(EOFError, ConnectionError):
        serve(sock)  # until the core goes away
    return 0


if __name__ == "__main__":
    sys.exit(main())
