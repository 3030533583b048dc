#!/usr/bin/env python3
"""Catch a TCP socket whose receiver stops reading, without stopping it (no ptrace).

A diagnostic for the Mooncake first-contact stall (docs/reference/vllm.md): a
client's lanes wait 10 s for a server that neither accepts their connections nor reads
their requests. Polls ``/proc/net/tcp{,6}`` every 0.1 s. A socket is *stuck* when its
receive queue stays non-empty without ever shrinking for longer than ``--after``
seconds: for a listener the queue is its accept backlog (connections nobody accepts;
they also show as established rows that no process holds), for an established
connection the bytes nobody reads. ``--ports LO-HI`` limits the watch to sockets with a
local or remote port in that range (Mooncake's TCP data ports lie in 15000-17000). At a
stuck socket it writes ``OUT/kN.HHMMSS.txt`` with, for every process whose command line
contains ``--match`` (default ``VLLM``):

- its TCP sockets with a non-empty queue (state, addresses, queues, age of the stuck
  ones), each with the fd that holds it;
- each epoll fd's ``fdinfo`` (the fds that epoll instance watches);
- each thread's state, nice, ``wchan``, ``syscall`` (name or number, first argument)
  and kernel stack.

So one can tell an io thread asleep in ``epoll_wait`` on an epoll set that lacks the
stuck fd (or holds it, yet was not woken) from one blocked on a futex (a lock) from one
woken but waiting for a CPU (``R`` with ``do_epoll_wait`` on its stack). A stall that
lasts gives a dump every ``--after`` seconds, at most ``--dumps`` in all. The watcher
moves itself to a session (an autogroup) of its own at its nice value, so that on a
saturated machine its table read and its thread snapshot are one moment: run it as
root, ``nice -n -15 scripts/stuck-socket-watch.py OUT --ports 15000-17000``, and stop it
with Ctrl-C or kill. It also says when one of its polls was held up. Mind that it
perturbs what it watches: beside it the stall stopped happening (notes).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import time
from typing import NamedTuple

_STATES = {"01": "ESTAB", "0A": "LISTEN"}
# x86-64 numbers of the calls a sleeping thread of these processes is usually in.
_SYSCALLS = {
    "0": "read",
    "7": "poll",
    "23": "select",
    "24": "sched_yield",
    "43": "accept",
    "45": "recvfrom",
    "47": "recvmsg",
    "202": "futex",
    "230": "clock_nanosleep",
    "232": "epoll_wait",
    "270": "pselect6",
    "271": "ppoll",
    "281": "epoll_pwait",
    "288": "accept4",
    "441": "epoll_pwait2",
}


class Sock(NamedTuple):
    state: str
    local: str
    remote: str
    tx: int
    rx: int
    inode: str


def _addr(hexaddr: str) -> str:
    host, port = hexaddr.rsplit(":", 1)
    if len(host) == 8:  # IPv4, little-endian
        ip = ".".join(str(int(host[i : i + 2], 16)) for i in (6, 4, 2, 0))
    elif host.startswith("0000000000000000FFFF0000"):  # IPv4-mapped IPv6
        ip = ".".join(str(int(host[i : i + 2], 16)) for i in (30, 28, 26, 24))
    else:
        ip = "[" + host + "]"
    return f"{ip}:{int(port, 16)}"


def sockets() -> list[Sock]:
    """Listeners and established connections with a non-empty receive queue."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                col = row.split()
                if col[3] in _STATES:
                    tx, rx = (int(v, 16) for v in col[4].split(":"))
                    if rx:
                        found.append(
                            Sock(_STATES[col[3]], _addr(col[1]), _addr(col[2]), tx, rx, col[9])
                        )
    return found


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as exc:
        return f"<{exc.strerror}>"


def _in_range(sock: Sock, ports: tuple[int, int] | None) -> bool:
    if ports is None:
        return True
    return any(ports[0] <= int(a.rsplit(":", 1)[1]) <= ports[1] for a in (sock.local, sock.remote))


def dump(path: str, match: str, queued: list[Sock], stuck: dict[str, float]) -> None:
    by_inode = {s.inode: s for s in queued}
    with open(path, "w") as out:
        for proc in sorted(glob.glob("/proc/[0-9]*")):
            cmd = _read(proc + "/cmdline").replace("\0", " ")
            if match not in cmd or proc == f"/proc/{os.getpid()}":
                continue
            out.write(f"##### {proc} {cmd[:120]}\n")
            try:
                fds = os.listdir(proc + "/fd")
            except OSError:
                continue  # exited meanwhile
            for fd in sorted(fds, key=int):
                try:
                    target = os.readlink(f"{proc}/fd/{fd}")
                except OSError:
                    continue
                if "eventpoll" in target:
                    out.write(f"epoll fd {fd}:\n{_read(f'{proc}/fdinfo/{fd}')}\n")
                elif target.startswith("socket:[") and target[8:-1] in by_inode:
                    s = by_inode[target[8:-1]]
                    age = f" STUCK {stuck[s.inode]:.1f} s" if s.inode in stuck else ""
                    out.write(
                        f"socket fd {fd}: {s.state} {s.local} <- {s.remote} rx={s.rx} "
                        f"tx={s.tx}{age}\n"
                    )
            for task in sorted(glob.glob(proc + "/task/*")):
                fields = _read(task + "/stat").rsplit(") ", 1)[-1].split()
                state, nice = (fields[0], fields[16]) if len(fields) > 16 else ("?", "?")
                call = _read(task + "/syscall").split()
                name = _SYSCALLS.get(call[0], call[0]) if call else "?"
                first = (
                    f"({int(call[1], 16)}, ...)"
                    if len(call) > 1 and call[1].startswith("0x")
                    else ""
                )
                out.write(
                    f"--- {task} {_read(task + '/comm')} {state} nice={nice} "
                    f"wchan={_read(task + '/wchan')} "
                    f"syscall={name}{first}\n{_read(task + '/stack')}\n"
                )


def _own_cpu_share() -> None:
    """Run in an autogroup of our own at our nice value. With autogroups on (Linux's default
    for desktops and many VMs: ``/proc/sys/kernel/sched_autogroup_enabled``), CPU time is
    shared between sessions first and nice only orders threads within one, so a watcher
    in the shell's session waits seconds behind vLLM servers that each run in their own."""
    with contextlib.suppress(OSError):  # already a session leader
        os.setsid()
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(os.nice(0)))
    except OSError:
        pass  # no autogroups, or not root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="folder for the dumps")
    parser.add_argument(
        "--match", default="VLLM", help="dump processes whose command line contains this"
    )
    parser.add_argument(
        "--after", type=float, default=1.0, help="seconds a queue must stay without shrinking"
    )
    parser.add_argument(
        "--ports", help="LO-HI: watch only sockets with a local or remote port in this range"
    )
    parser.add_argument("--dumps", type=int, default=3)
    args = parser.parse_args()
    ports = tuple(int(p) for p in args.ports.split("-")) if args.ports else None
    os.makedirs(args.out, exist_ok=True)
    _own_cpu_share()
    # inode -> (non-empty and not shrinking since, last rx)
    since: dict[str, tuple[float, int]] = {}
    done, quiet_until, last = 0, 0.0, time.monotonic()
    while done < args.dumps:
        start = time.monotonic()
        queued = sockets()
        now = time.monotonic()
        if now - start > 0.5 or start - last > 1.0:  # the watcher itself was held up: say where
            print(
                f"{time.strftime('%H%M%S')}: reading the socket tables took {now - start:.1f} s "
                f"after a {start - last:.1f} s sleep of 0.1 s",
                flush=True,
            )
        watched = [s for s in queued if _in_range(s, ports)]
        since = {
            s.inode: (
                since[s.inode][0] if s.inode in since and s.rx >= since[s.inode][1] else now,
                s.rx,
            )
            for s in watched
        }
        stuck = {inode: now - t0 for inode, (t0, _) in since.items() if now - t0 > args.after}
        if stuck and now >= quiet_until:
            tag = time.strftime("%H%M%S")
            dump(os.path.join(args.out, f"k{done}.{tag}.txt"), args.match, queued, stuck)
            for s in watched:
                if s.inode in stuck:
                    print(
                        f"{tag}: {s.state} {s.local} <- {s.remote} rx={s.rx} for "
                        f"{stuck[s.inode]:.1f} s",
                        flush=True,
                    )
            done, quiet_until = done + 1, now + args.after
        last = time.monotonic()
        time.sleep(0.1)


if __name__ == "__main__":
    main()
