#!/usr/bin/env python3
"""Catch a TCP server that stops accepting, without stopping it (no ptrace).

A diagnostic for the Mooncake first-contact stall (docs/vllm-connector-notes.md): a
client's lanes wait 10 s while the server process leaves their connections in its
listener's accept queue. Polls ``/proc/net/tcp{,6}`` every 0.1 s (a LISTEN row's
``rx_queue`` is its accept backlog); when a listener keeps a backlog for over a second,
writes ``OUT/k.HHMMSS.txt`` with, for every process whose command line contains
``--match`` (default ``VLLM``):

- each thread's state, nice, ``wchan``, ``syscall`` (number and arguments) and kernel stack;
- each epoll fd's ``fdinfo`` (the fds that epoll instance watches), and which fd is the
  backlogged listener.

So one can tell an io thread asleep in ``epoll_wait`` without the listener among its fds
(its pending accept was lost) from one blocked on a futex (a lock) from one runnable but
not scheduled. At most ``--dumps`` dumps. Run as root, at high priority so it runs on a
saturated machine: ``nice -n -15 scripts/accept-backlog-watch.py OUT``; stop it with
Ctrl-C or kill.
"""

from __future__ import annotations

import argparse
import glob
import os
import time


def backlogged() -> dict[int, tuple[int, str]]:
    """Listening ports with a non-empty accept queue: port -> (backlog, socket inode)."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                col = row.split()
                if col[3] == "0A":  # TCP_LISTEN
                    backlog = int(col[4].split(":")[1], 16)
                    if backlog:
                        found[int(col[1].rsplit(":", 1)[1], 16)] = (backlog, col[9])
    return found


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as exc:
        return f"<{exc.strerror}>"


def dump(path: str, match: str, inodes: set[str]) -> None:
    with open(path, "w") as out:
        for proc in sorted(glob.glob("/proc/[0-9]*")):
            cmd = _read(proc + "/cmdline").replace("\0", " ")
            if match not in cmd:
                continue
            out.write(f"##### {proc} {cmd[:120]}\n")
            for fd in sorted(os.listdir(proc + "/fd") if os.path.isdir(proc + "/fd") else [], key=int):
                try:
                    target = os.readlink(f"{proc}/fd/{fd}")
                except OSError:
                    continue
                if "eventpoll" in target:
                    out.write(f"epoll fd {fd}:\n{_read(f'{proc}/fdinfo/{fd}')}\n")
                elif target[8:-1] in inodes:
                    out.write(f"backlogged listener: fd {fd} ({target})\n")
            for task in sorted(glob.glob(proc + "/task/*")):
                fields = _read(task + "/stat").rsplit(") ", 1)[-1].split()
                state, nice = (fields[0], fields[16]) if len(fields) > 16 else ("?", "?")
                out.write(
                    f"--- {task} {_read(task + '/comm')} {state} nice={nice} wchan={_read(task + '/wchan')} "
                    f"syscall={_read(task + '/syscall')}\n{_read(task + '/stack')}\n"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="folder for the dumps")
    parser.add_argument("--match", default="VLLM", help="dump processes whose command line contains this")
    parser.add_argument("--after", type=float, default=1.0, help="seconds a backlog must last")
    parser.add_argument("--dumps", type=int, default=3)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    since: dict[int, float] = {}
    done = 0
    while done < args.dumps:
        now, ports = time.monotonic(), backlogged()
        since = {port: since.get(port, now) for port in ports}
        old = [port for port, t0 in since.items() if now - t0 > args.after]
        if old:
            tag = time.strftime("%H%M%S")
            dump(os.path.join(args.out, f"k.{tag}.txt"), args.match, {ports[p][1] for p in old})
            print(f"{tag}: ports {old} backlogged {[ports[p][0] for p in old]} for {now - since[old[0]]:.1f} s", flush=True)
            done += 1
            since = {}
        time.sleep(0.1)


if __name__ == "__main__":
    main()
