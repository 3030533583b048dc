"""Fork servers (kvbridge.demo.forkserver): a preloaded server runs its module as
``python -m`` would, but without importing it; the launcher the caller watches ends as the
server does; fork servers are per environment; a malformed request, a dead fork server or
a dead caller leaves nothing behind.

The "engine" is a module written here: its library records which process imported it,
so a test can tell a server that skipped the import from one that did not."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge.demo import forkserver, servers
from kvbridge.demo.servers import free_port

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

ENGINE = """
import http.server, json, os, sys, time
import kvb_fake_lib


def main():
    info = {
        "pid": os.getpid(), "pgid": os.getpgid(0), "imported_by": kvb_fake_lib.IMPORTED_BY,
        "name": __name__, "spec": sys.modules["__main__"].__spec__.name, "argv": sys.argv[1:],
        "cwd": os.getcwd(), "path0": sys.path[0], "mark": os.environ.get("KVB_MARK"),
        "nice": os.getpriority(os.PRIO_PROCESS, 0), "cpus": sorted(os.sched_getaffinity(0)),
        "worker_imported_by": getattr(sys.modules.get("kvb_fake_worker"), "IMPORTED_BY", None),
    }
    print("INFO " + json.dumps(info), flush=True)
    if sys.argv[1] == "exit":
        sys.exit(int(sys.argv[2]))

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[2])), H).serve_forever()


if __name__ == "__main__":  # as an engine's entry module: importing it runs nothing
    main()
"""


@pytest.fixture(scope="module")
def engine_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("engine")
    (root / "kvb_fake_lib.py").write_text("import os\nIMPORTED_BY = os.getpid()\n")
    (root / "kvb_fake_engine.py").write_text(ENGINE)
    # what an engine's own child processes import, not the entry module
    (root / "kvb_fake_worker.py").write_text("import os\nIMPORTED_BY = os.getpid()\n")
    return str(root)


@pytest.fixture(autouse=True)
def _fresh_fork_servers():
    yield
    forkserver.stop_all()


class Engine(servers.ServerProcess):
    name = "fake engine"
    stop_grace_s = 5.0
    preload = True
    preload_ignored_env = ("KVBRIDGE_CONFIG",)

    def __init__(self, engine_path: str, tmp_path: Path, *args: str, **kwargs) -> None:
        env = {"PYTHONPATH": engine_path, **kwargs.pop("env", {})}
        super().__init__(env=env, log_path=tmp_path / f"engine-{free_port()}.log", **kwargs)
        self.args = list(args) or ["serve", str(self.port)]

    def command(self) -> list[str]:
        return [self.python, "-m", "kvb_fake_engine", *self.args]

    def info(self) -> dict:
        """What the engine printed first (it prints before it serves or exits)."""
        for line in self.log_path.read_text().splitlines():
            if line.startswith("INFO "):
                return json.loads(line[5:])
        raise AssertionError(f"no INFO line in {self.log_path}:\n{self.log_tail()}")


def run(server: Engine) -> dict:
    """Start ``server`` and wait until it serves (its INFO line is written by then)."""
    server.start().wait_ready(timeout=60, warm_up=False)
    return server.info()


def wait_exit(pid: int, timeout: float) -> bool:
    """True once process ``pid`` (not necessarily our child) has exited, within ``timeout``."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def test_a_preloaded_server_runs_its_module_as_python_m_does(engine_path, tmp_path) -> None:
    plain = Engine(engine_path, tmp_path, env={"KVB_MARK": "a"})
    plain.preload = False
    forked = Engine(engine_path, tmp_path, env={"KVB_MARK": "a"})
    try:
        want, got = run(plain), run(forked)
        assert want["imported_by"] == want["pid"]
        assert got["imported_by"] != got["pid"], "the forked server imported its library"
        # in the launcher's process group, which stop() signals and pids() lists
        assert got["pgid"] == forked.pid and got["pid"] in forked.pids()
        for key in ("pid", "pgid", "imported_by", "argv"):
            del want[key], got[key]
        assert got == want  # __main__, its spec, cwd, sys.path[0], environment, ...
        assert got["name"] == "__main__" and got["spec"] == "kvb_fake_engine"
    finally:
        plain.stop()
        forked.stop()
    assert not forked.alive() and not plain.alive()


def test_the_launcher_ends_as_its_server_does(engine_path, tmp_path) -> None:
    exits = Engine(engine_path, tmp_path, "exit", "3").start()
    assert exits._proc.wait(60) == 3
    assert exits.info()["imported_by"] != exits.info()["pid"]
    killed = Engine(engine_path, tmp_path)
    try:
        os.kill(run(killed)["pid"], signal.SIGKILL)
        assert killed._proc.wait(60) == -signal.SIGKILL
    finally:
        killed.stop()


def test_niceness_and_cores_of_the_server_apply(engine_path, tmp_path) -> None:
    # the fork server starts for the first, unpinned at niceness 0; the second sets its own
    first = Engine(engine_path, tmp_path)
    second = Engine(engine_path, tmp_path, nice=5, cpus=[0])
    try:
        servers.start_all([first, second], timeout=120)
        one, two = first.info(), second.info()
        assert one["imported_by"] == two["imported_by"] != two["pid"]
        assert (one["nice"], two["nice"], two["cpus"]) == (0, 5, [0])
    finally:
        first.stop()
        second.stop()


def test_servers_share_a_fork_server_only_with_the_same_environment(engine_path, tmp_path) -> None:
    group = [
        Engine(engine_path, tmp_path, env={"KVB_MARK": "a"}),
        Engine(engine_path, tmp_path, env={"KVB_MARK": "a", "KVBRIDGE_CONFIG": "{}"}),
        Engine(engine_path, tmp_path, env={"KVB_MARK": "b"}),
    ]
    try:
        servers.start_all(group, timeout=120)
        a, ignored, b = (s.info() for s in group)
        assert a["imported_by"] == ignored["imported_by"] != b["imported_by"]
        assert (a["mark"], b["mark"]) == ("a", "b")
    finally:
        for s in group:
            s.stop()


def test_a_fork_server_also_imports_what_the_engine_s_children_need(engine_path, tmp_path) -> None:
    """``preload_also``: the modules an engine's children import (SGLang's scheduler,
    forked from the server in the tests) are imported once, by the fork server, and
    the fork server is not shared with servers that preload less."""
    bare = Engine(engine_path, tmp_path)
    fuller = Engine(engine_path, tmp_path)
    fuller.preload_also = ("kvb_fake_worker",)
    try:
        servers.start_all([bare, fuller], timeout=120)
        without, with_worker = bare.info(), fuller.info()
        assert without["worker_imported_by"] is None
        assert with_worker["worker_imported_by"] == with_worker["imported_by"]
        assert with_worker["imported_by"] not in (without["imported_by"], with_worker["pid"])
    finally:
        bare.stop()
        fuller.stop()


def test_without_its_fork_server_a_launcher_runs_the_command_itself(engine_path) -> None:
    env = {**os.environ, "PYTHONPATH": engine_path}
    command = [sys.executable, "-m", "kvb_fake_engine", "exit", "4"]
    stopped = forkserver.fork_server(sys.executable, "kvb_fake_engine", env)
    stopped.stop()
    idle = forkserver.ForkServer(sys.executable, "kvb_fake_engine", env, idle_exit_s=0.5)
    assert idle.proc.wait(60) == 0, "the idle fork server did not exit"
    for gone in (stopped, idle):
        done = subprocess.run(
            gone.launch_command(os.getpid(), command),
            check=False,
            env=env,
            capture_output=True,
            timeout=60,
        )
        assert done.returncode == 4, done.stderr
        info = json.loads(done.stdout.decode().split("INFO ", 1)[1])
        assert info["imported_by"] == info["pid"]
    # and the next server gets a new fork server
    assert forkserver.fork_server(sys.executable, "kvb_fake_engine", env) is not stopped


def test_a_malformed_request_is_dropped_and_the_fork_server_serves_on(
    engine_path, tmp_path
) -> None:
    first = Engine(engine_path, tmp_path)
    fork = forkserver.fork_server(first.python, "kvb_fake_engine", first.environment())
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # too long
        s.connect("\0" + fork.name)
        socket.send_fds(s, [forkserver._LENGTH.pack(1 << 30)], [0, 1, 2])
        assert s.recv(4) == b""  # closed, no server
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # no streams, not JSON
        s.connect("\0" + fork.name)
        s.sendall(forkserver._LENGTH.pack(3) + b"{{{")
        assert s.recv(4) == b""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # a JSON list
        s.connect("\0" + fork.name)
        socket.send_fds(s, [forkserver._LENGTH.pack(2) + b"[]"], [0, 1, 2])
        assert s.recv(4) == b""
    try:
        info = run(first)
        assert info["imported_by"] == fork.proc.pid != info["pid"]
    finally:
        first.stop()
    assert fork.log_path.read_text().count("dropped a request") == 3


OWNER = """
import sys, time
from kvbridge.demo.servers import ServerProcess
sys.path.insert(0, sys.argv[1])
from test_forkserver import Engine
from pathlib import Path
server = Engine(sys.argv[2], Path(sys.argv[3])).start()
server.wait_ready(timeout=60, warm_up=False)
print(server.info()["pid"], server.info()["imported_by"], flush=True)
time.sleep(600)
"""


def test_servers_end_with_the_process_that_started_them(engine_path, tmp_path) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(Path(__file__).parent), engine_path, str(tmp_path)],
        stdout=subprocess.PIPE,
    )
    try:
        server_pid, fork_pid = map(int, owner.stdout.readline().split())
        assert server_pid != fork_pid
    finally:
        owner.kill()
        owner.wait()
    assert wait_exit(fork_pid, 30), "the fork server outlived its owner"
    assert wait_exit(server_pid, 30), "the server outlived its fork server"
