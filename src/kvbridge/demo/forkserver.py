"""Fork servers: start an engine server without paying for its entry module's import.

A fork server is an interpreter that has imported an engine's entry module once (vLLM's
API server: about 10 CPU-seconds of a test server's 23 on a 2-core machine; SGLang's
launcher about 9, its router about 6) and forks a server from that state on request. The
forked server then runs the module as ``python -m`` does (``runpy``, as ``__main__``), with
its own arguments, standard streams, working directory, process group, CPU affinity and
niceness. What the server starts in turn (vLLM's engine core, SGLang's scheduler) starts as
the engine starts it: a spawned child imports for itself; a forked one (vLLM's engine core
on CPU; SGLang's scheduler in the tests, ``tests/sglang_stubs/sglang_fork_children``)
finds imported whatever the fork server imported, which can include the children's
modules (``also``).

Contract:

- Who calls: :meth:`~kvbridge.demo.servers.ServerProcess.start` when the server class has
  ``preload`` set (the engine tests' conftests); :func:`fork_server` returns the one for
  an interpreter, module and environment, started on first use. Nothing else uses this.
- One environment per fork server: modules may read variables while they import, so a
  server forks only from a fork server that imported under its own environment, less
  the variables in ``ignored`` (those its engine reads after start-up, such as
  ``KVBRIDGE_CONFIG``); another environment gets a fork server of its own.
- The server's launcher (:class:`~kvbridge.demo.servers.ServerProcess`'s child, which
  stays what the caller watches and signals) connects, hands over its standard streams
  and waits; the forked server joins the launcher's process group, and when it ends the
  launcher ends with its exit status (or its signal). If the fork server cannot be
  reached, the launcher runs the command itself (``exec``), as without a fork server.
- Lifetime: a fork server runs until :func:`stop_all` (at exit), until the process that
  started it dies, or until none of its servers has run for :data:`IDLE_EXIT_S`; its
  servers get SIGTERM when it dies (``PR_SET_PDEATHSIG``). A launcher whose request it
  did not take (it had exited) runs the command itself.
- Trust: it serves only connections of its own user (``SO_PEERCRED``) on an abstract
  Unix socket, and reads a bounded request.

This module is also the program of the fork server and of the launcher (``python -m
kvbridge.demo.forkserver serve|launch ...``), so it imports only the standard library:
the fork server must import nothing the engine's own start would not.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import itertools
import json
import os
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

MAX_REQUEST_BYTES = 1 << 20
"""Largest request a fork server reads (arguments and environment as JSON)."""
REQUEST_TIMEOUT_S = 10.0
"""How long a fork server waits for a connected launcher's request."""
IDLE_EXIT_S = 120.0
"""A fork server with no server running exits after this long without a request: each
holds its imports (vLLM's API server about 0.6 GB), and an environment may be used by
one module only."""
ALWAYS_IGNORED = ("PYTEST_CURRENT_TEST",)
"""Variables no fork server is keyed by: pytest names the test phase that runs in
``PYTEST_CURRENT_TEST``, which changes from one server's start to the next."""
PROCESS_GROUP: dict = (
    {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}
)
"""``Popen`` arguments for a process group of its own in the caller's session (why:
:data:`kvbridge.demo.servers._GROUP`, which is this)."""
_PID = struct.Struct("!i")
"""The fork server's first answer: the forked server's pid."""
_STATUS = struct.Struct("!i")
"""Its second and last: the server's wait status, once it has exited."""
_LENGTH = struct.Struct("!I")
_PR_SET_PDEATHSIG = 1
_MODULE = "kvbridge.demo.forkserver"  # not __name__: that is "__main__" where it runs


def _die_with_parent(parent: int) -> None:
    """SIGTERM to this process when its parent exits; exit now if it already has."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        os._exit(1)


# --- the fork server (-m kvbridge.demo.forkserver serve FD MODULE OWNER IDLE_EXIT_S) ---


def _read_request(conn: socket.socket) -> tuple[dict, list[int]] | None:
    """One launcher's request and its three standard streams; ``None`` if it is not a
    well-formed request of this user's within the bounds."""
    conn.settimeout(REQUEST_TIMEOUT_S)
    fds: list[int] = []
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        _pid, uid, _gid = struct.unpack("3i", creds)
        if uid != os.getuid():
            raise ValueError(f"a connection of user {uid}")
        data, fds, _flags, _addr = socket.recv_fds(conn, 65536, 3)
        if len(data) < _LENGTH.size or len(fds) != 3:
            raise ValueError("no length or not three streams")
        (length,) = _LENGTH.unpack_from(data)
        if length > MAX_REQUEST_BYTES:
            raise ValueError(f"request of {length} bytes")
        body = bytearray(data[_LENGTH.size :])
        while len(body) < length:
            chunk = conn.recv(min(65536, length - len(body)))
            if not chunk:
                raise ValueError("request cut short")
            body += chunk
        request = json.loads(body)
        if not isinstance(request, dict):
            raise ValueError("request is not an object")
        conn.settimeout(None)
        return request, fds
    except (OSError, ValueError) as exc:
        print(f"kvbridge fork server: dropped a request: {exc!r}", file=sys.stderr)
        for fd in fds:
            os.close(fd)
        return None


def _serve(
    listener: socket.socket, owner: int, idle_exit_s: float
) -> tuple[socket.socket, dict, list[int]]:
    """Fork a server per request until the owner exits, or until no server of ours has
    run for ``idle_exit_s``; returns only in a forked child, with the launcher's
    connection, request and streams."""
    owner_fd = os.pidfd_open(owner)
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, connection)
    while True:
        idle = None if children else idle_exit_s
        ready, _, _ = select.select([listener, owner_fd, *children], [], [], idle)
        if owner_fd in ready:
            sys.exit(0)  # the test process is gone: so are we, and our servers with us
        if not ready:
            sys.exit(0)  # idle: a launcher that connects now runs its command itself
        for fd in ready:
            if fd in children:
                pid, conn = children.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                with contextlib.suppress(OSError):  # the launcher may be gone (killed)
                    conn.sendall(_STATUS.pack(status))
                conn.close()
        if listener not in ready:
            continue
        conn, _ = listener.accept()
        got = _read_request(conn)
        if got is None:
            conn.close()
            continue
        request, fds = got
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            listener.close()
            os.close(owner_fd)
            for pidfd, (_, other) in children.items():
                os.close(pidfd)
                other.close()
            return conn, request, fds
        for fd in fds:
            os.close(fd)
        children[os.pidfd_open(pid)] = (pid, conn)
        with contextlib.suppress(OSError):  # the launcher may be gone (killed)
            conn.sendall(_PID.pack(pid))


def _run_server(server: int, request: dict, fds: list[int], module: str) -> None:
    """In the forked child: become the launcher's server, then run ``module`` as
    ``python -m`` does (never returns: the module's exit is the process's)."""
    try:
        os.setpgid(0, int(request["pgid"]))  # fails once the launcher's group is gone
    except OSError:
        os._exit(1)
    _die_with_parent(server)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if request.get("cpus"):
        os.sched_setaffinity(0, request["cpus"])
    if request.get("nice"):
        os.setpriority(os.PRIO_PROCESS, 0, int(request["nice"]))
    sys.path[0] = os.getcwd()  # what ``-m`` puts first
    sys.argv = [sys.argv[0], *request["args"]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    sys.exit(0)


def _fork_server_main(
    listen_fd: int, module: str, owner: int, idle_exit_s: float, also: list[str]
) -> None:
    listener = socket.socket(fileno=listen_fd)
    for name in also:  # first: ``module`` must be left unimported (it runs as __main__)
        importlib.import_module(name)
    importlib.import_module(module)
    # as under ``python -m``, the module itself runs only as __main__ (its imports stay)
    del sys.modules[module]
    package, _, name = module.rpartition(".")
    if package:
        with contextlib.suppress(AttributeError):
            delattr(sys.modules[package], name)
    if threading.active_count() != 1:  # a fork would copy held locks and lose the threads
        raise RuntimeError(f"importing {module} started threads: {threading.enumerate()}")
    server = os.getpid()
    conn, request, fds = _serve(listener, owner, idle_exit_s)
    conn.close()  # the fork server keeps its copy to send the status
    _run_server(server, request, fds, module)


# --- a server's launcher (-m kvbridge.demo.forkserver launch PPID NAME COMMAND...) -----


def _receive(sock: socket.socket, size: int) -> bytes:
    """``size`` bytes, or ``b""`` if the connection ends first."""
    data = b""
    while len(data) < size:
        try:
            chunk = sock.recv(size - len(data))
        except OSError:
            return b""
        if not chunk:
            return b""
        data += chunk
    return data


def _launcher_main(parent: int, name: str, command: list[str]) -> None:
    _die_with_parent(parent)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect("\0" + name)
    except OSError:
        os.execvp(command[0], command)  # no fork server: run the command ourselves
    body = json.dumps(
        {
            "args": command[3:],
            "env": dict(os.environ),
            "cwd": os.getcwd(),
            "pgid": os.getpgid(0),
            "cpus": sorted(os.sched_getaffinity(0)),
            "nice": os.getpriority(os.PRIO_PROCESS, 0),
        }
    ).encode()
    try:
        socket.send_fds(sock, [_LENGTH.pack(len(body)) + body], [0, 1, 2])
        forked = _receive(sock, _PID.size)
    except OSError:
        forked = b""
    if not forked:  # it exited (idle) before it took our request: no server was forked
        os.execvp(command[0], command)
    data = _receive(sock, _STATUS.size)
    if not data:
        print(f"kvbridge: the fork server {name} went away", file=sys.stderr)
        sys.exit(1)
    (status,) = _STATUS.unpack(data)
    if os.WIFSIGNALED(status):  # end as the server did
        sig = os.WTERMSIG(status)
        if sig != signal.SIGKILL:  # SIGKILL's action cannot be set (nor needs to be)
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    sys.exit(os.waitstatus_to_exitcode(status))


# --- the caller's side ------------------------------------------------------------------


class ForkServer:
    """One fork server process (see the module's contract); :func:`fork_server` makes them."""

    _numbers = itertools.count()

    def __init__(
        self,
        python: str,
        module: str,
        env: Mapping[str, str],
        nice: int = 0,
        idle_exit_s: float = IDLE_EXIT_S,
        also: Iterable[str] = (),
    ) -> None:
        self.python = python
        self.module = module
        self.name = f"kvbridge-forkserver-{os.getpid()}-{next(self._numbers)}"
        fd, log = tempfile.mkstemp(prefix=f"{self.name}-", suffix=".log")
        self.log_path = Path(log)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind("\0" + self.name)
            listener.listen(64)  # launchers connect while it imports; it accepts after
            self.proc = subprocess.Popen(
                [
                    *(python, "-m", _MODULE, "serve", str(listener.fileno()), module),
                    *(str(os.getpid()), str(idle_exit_s), *also),
                ],
                stdin=subprocess.DEVNULL,
                stdout=fd,
                stderr=subprocess.STDOUT,
                env=dict(env),
                pass_fds=[listener.fileno()],
                **PROCESS_GROUP,  # as the servers: a group of its own in our session
                preexec_fn=(lambda: os.nice(nice)) if nice else None,  # noqa: PLW1509
            )
        finally:
            listener.close()  # once it exits, a launcher's connect fails (and it execs)
            os.close(fd)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def launch_command(self, parent: int, command: list[str]) -> list[str]:
        """The argv of a launcher that asks this fork server for ``command``."""
        return [self.python, "-m", _MODULE, "launch", str(parent), self.name, *command]

    def stop(self) -> None:
        """SIGTERM; its servers get SIGTERM as it exits."""
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


_servers: dict[tuple, ForkServer] = {}
_lock = threading.Lock()


def fork_server(
    python: str,
    module: str,
    env: Mapping[str, str],
    ignored: Iterable[str] = (),
    nice: int = 0,
    also: Sequence[str] = (),
) -> ForkServer:
    """The running fork server of ``python`` that imported ``module`` (and the modules
    ``also``, which the server's own children import) under ``env`` (less the variables
    ``ignored``); a new one if there is none (it imports while the first launchers wait).
    ``nice``: the new one's niceness."""
    skip = {*ignored, *ALWAYS_IGNORED}
    key = (python, module, *also, frozenset((k, v) for k, v in env.items() if k not in skip))
    with _lock:
        server = _servers.get(key)
        if server is None or not server.alive():
            server = _servers[key] = ForkServer(python, module, env, nice, also=also)
        return server


def stop_all() -> None:
    """Stop every fork server (the caller's ``atexit``)."""
    with _lock:
        servers = list(_servers.values())
        _servers.clear()
    for server in servers:
        with contextlib.suppress(Exception):
            server.stop()


if __name__ == "__main__":  # python -m kvbridge.demo.forkserver ...
    if sys.argv[1] == "serve":
        _fork_server_main(
            int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), float(sys.argv[5]), sys.argv[6:]
        )
    elif sys.argv[1] == "launch":
        _launcher_main(int(sys.argv[2]), sys.argv[3], sys.argv[4:])
