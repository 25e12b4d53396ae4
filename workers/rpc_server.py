"""The farm's TVM RPC server: TVM's own server plus a cache of prebuilt device code.

    python -m workers.rpc_server --tracker HOST:PORT --key KEY [--port P] [--no-fork]

It is `tvm.rpc.Server` with one addition in every session process: the global function
`farm.device.name(kind)` says what the device is, and
`farm.cubin.put(sha256, path)` stores a cubin that the build node compiled from CUDA source
with that hash, and `tvm_callback_cuda_compile` (which TVM's CUDA runtime calls when it
loads a module holding only source) returns it instead of compiling on the GPU node.
Sources it was not given are compiled as TVM would (NVRTC, or nvcc with
TVM_CUDA_COMPILE_MODE=nvcc). A stock `tvm.exec.rpc_server` works with the farm too: it
just compiles every kernel itself at load time.

TVM serves each session in a child process (spawned with --no-fork, which CUDA needs: a
forked process fails its first allocation). A spawned one takes seconds to start (Python,
TVM's import, the CUDA context), and a session's candidates wait for it: so with --no-fork
the next session's process is spawned ahead of time (`Standby`: TVM imported, the device's
context made) and handed the session's socket when a client connects, the one after it spawned
at once; the first is spawned before this process imports TVM. If that child crashes, TVM's
listen loop raises and its thread ends, leaving a server that never accepts again; here the
crash is logged and the server goes on accepting, and should the listening thread end anyway
it is started again, so one bad kernel never takes the device out of the farm. (TVM's
`rpc.Server` listens in a child process of its own, which imports TVM a second time; this
process listens itself. If it dies, the worker that started it starts it again.)

A tracker that goes away (killed, restarted) is tried again every `TRACKER_RETRY_SECONDS` for
as long as it takes, and the server registers with it as soon as it is back. TVM's own server
notices the loss within 2 s (it pings the tracker when idle, and registers again when a session
ends) but retries only every 5 s and gives up after 60 s, when its listening thread ends and
leaves a server that neither registers again nor exits to be restarted.

SECURITY: an RPC server runs whatever module it is sent. Bind it to a private network only.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import socket
import time
from pathlib import Path
from typing import Any

from farm.core.tvm_import import import_tvm

log = logging.getLogger("farm.rpc_server")

TRACKER_RETRY_SECONDS = 0.5

_CUBINS: dict[str, bytes] = {}


def _put_cubin(sha: str, path: str) -> None:
    _CUBINS[sha] = Path(path).read_bytes()


def _cuda_compile(code: str, *args: object) -> bytes:
    sha = hashlib.sha256(code.encode()).hexdigest()
    if sha in _CUBINS:
        return _CUBINS[sha]
    from tvm.support import nvcc

    return nvcc.tvm_callback_cuda_compile(code)


def _device_name(kind: str) -> str:
    """What the device is, e.g. "NVIDIA H200" or "CPU AMD EPYC 9354 32-Core Processor (node7)"."""
    import socket

    import tvm

    from farm.core.host import cpu_model

    if kind == "cuda":
        return str(tvm.cuda(0).device_name)
    return f"CPU {cpu_model()} ({socket.gethostname()})"


def _register() -> None:
    import tvm_ffi

    tvm_ffi.register_global_func("farm.cubin.put", _put_cubin, override=True)
    tvm_ffi.register_global_func("farm.device.name", _device_name, override=True)
    tvm_ffi.register_global_func("tvm_callback_cuda_compile", _cuda_compile, override=True)


def connect_to_tracker(addr: tuple[str, int]) -> socket.socket:
    """A connection to the tracker at `addr`, tried every TRACKER_RETRY_SECONDS until it answers
    (it replaces tvm.rpc.base.connect_with_retry in the server: see the module docstring)."""
    from tvm.rpc import base

    lost_at = None
    while True:
        sock = socket.socket(base.get_addr_family(addr), socket.SOCK_STREAM)
        try:
            sock.connect(addr)
        except OSError as e:
            sock.close()
            if lost_at is None:
                lost_at = time.monotonic()
                log.warning("cannot reach the RPC tracker at %s:%d (%s); trying every %.1f s", *addr, e,
                            TRACKER_RETRY_SECONDS)
            time.sleep(TRACKER_RETRY_SECONDS)
            continue
        if lost_at is not None:
            log.info("the RPC tracker at %s:%d answers again after %.1f s", *addr, time.monotonic() - lost_at)
        return sock


def serve_loop(sock: object, load_library: object, work_path: object) -> None:
    """TVM's session loop (tvm.rpc.server._serve_loop) with the farm's functions registered.

    It is a module-level function so that a spawned session process imports this module.
    """
    import os

    from tvm.rpc import server

    os.chdir(work_path.path)  # where TVM's own session process starts (a standby started elsewhere)
    _register()
    server._server_env(load_library, work_path)
    server._ffi_api.ServerLoop(sock.fileno())  # type: ignore[attr-defined]


def _standby(conn: Any, kind: str) -> None:
    """A session process started ahead of its session: import TVM, make the device's context,
    then run the session loop it is sent (`Standby.start`)."""
    import os
    import tempfile

    tvm = import_tvm()
    # It was spawned from the last session's folder, which that session removes when it ends.
    os.chdir(tempfile.gettempdir())
    if kind == "cuda":
        tvm.runtime.empty((1,), "float32", tvm.cuda(0))  # the CUDA context, made now, not by the session
    message = conn.recv()
    if message is not None:
        target, args = message
        target(*args)


class Standby:
    """Stands in for `multiprocessing.Process` in TVM's session code (`_serving` makes one per
    session, then starts, joins and perhaps terminates it): the process it starts is one spawned
    ahead of time (`_standby`), and starting it spawns the next one. A standby that died before
    its session (out of memory, say) is replaced by a process spawned then, as TVM would."""

    kind = "cuda"
    _next: Any = None  # (process, connection) of the next session's standby

    def __init__(self, target: Any, args: tuple[Any, ...]) -> None:
        self._target, self._args = target, args
        self._proc: Any = None

    @classmethod
    def spawn(cls) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_standby, args=(child, cls.kind), daemon=True, name="farm-session-standby")
        proc.start()
        child.close()
        cls._next = (proc, parent)

    def start(self) -> None:
        import multiprocessing

        proc, conn = Standby._next or (None, None)
        Standby.spawn()
        try:
            if proc is None or not proc.is_alive():
                raise EOFError("no standby")
            conn.send((self._target, self._args))
            self._proc = proc
        except (EOFError, OSError) as e:  # it died: a session process spawned now, as TVM would
            log.warning("the standby session process was gone (%s); spawning one", e)
            self._proc = multiprocessing.get_context("spawn").Process(target=self._target, args=self._args)
            self._proc.start()
        finally:
            if conn is not None:
                conn.close()

    def join(self, timeout: float | None = None) -> None:
        self._proc.join(timeout)

    def is_alive(self) -> bool:
        return bool(self._proc.is_alive())

    def terminate(self) -> None:
        self._proc.terminate()

    @property
    def pid(self) -> int:
        return int(self._proc.pid)

    @property
    def exitcode(self) -> int | None:
        return self._proc.exitcode  # type: ignore[no-any-return]


def _install(standby: bool) -> None:
    """Runs once in the server process before it serves: route sessions through `serve_loop`, keep
    serving after a session process crashed, and wait for a tracker that went away; with
    `standby` (--no-fork), serve each session in a process spawned ahead of it (Standby, whose
    first process main() spawned)."""
    import os
    import types

    from tvm.rpc import base, server

    # By its importable name: under `python -m` this module is __main__, and a spawned
    # session process (--no-fork) unpickles its target by module and name.
    from workers import rpc_server

    serving = server._serving

    def serving_survives_crashes(sock: Any, addr: Any, opts: Any, load_library: Any) -> None:
        cwd = os.getcwd()
        try:
            serving(sock, addr, opts, load_library)
        except Exception as e:  # "Child process ... exited unsuccessfully", or it could not start
            log.warning("session from %s failed: %s", addr, e)
            os.chdir(cwd)
            sock.close()

    server._serve_loop = rpc_server.serve_loop
    server._serving = serving_survives_crashes
    base.connect_with_retry = rpc_server.connect_to_tracker
    if standby:
        # What the session code calls `multiprocessing.Process` (it is the module's only use after start-up).
        server.multiprocessing = types.SimpleNamespace(Process=rpc_server.Standby)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (keep it private)")
    parser.add_argument("--port", type=int, default=9091, help="first port to try")
    parser.add_argument("--port-end", type=int, default=9999, help="last port to try")
    parser.add_argument("--tracker", required=True, help="RPC tracker as HOST:PORT")
    parser.add_argument("--key", required=True, help="device key to register under")
    parser.add_argument("--no-fork", action="store_true", help="spawn session processes (CUDA)")
    parser.add_argument("--kind", choices=("cuda", "llvm"), default="cuda",
                        help="with --no-fork: the device a standby session process gets ready")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    kind = args.kind if args.no_fork else None
    if kind is not None:
        # The first session's process warms up (TVM's import, the device's context) while this
        # one imports TVM and registers: a session is asked for as soon as the server registers.
        from workers import rpc_server  # by its importable name (see _install)

        rpc_server.Standby.kind = kind
        rpc_server.Standby.spawn()

    import_tvm()
    from tvm.rpc import server

    host, port = args.tracker.rsplit(":", 1)
    _install(kind is not None)
    while True:
        # TVM's rpc.Server runs this state in a child process of its own, which imports TVM again
        # (seconds on a busy GPU node, before the server can register); here it runs in this one.
        state = server.PopenRPCServerState(args.host, args.port, args.port_end, tracker_addr=(host, int(port)),
                                           key=args.key, silent=True)
        log.info("serving key %s on %s:%d", args.key, args.host, state.port)
        state.thread.join()
        state.sock.close()
        log.warning("RPC server for key %s ended (a session crashed); restarting", args.key)
        time.sleep(0.5)


if __name__ == "__main__":
    main()
