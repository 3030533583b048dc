"""The test suite's pool of shared engine servers (``tests/support/engine_pool.py``), with
stand-in servers: reuse by key, leases counted, idle servers bounded, a server no later
user needs stopped at release, a leak fails the releasing user and the server is not
handed out again, a dead server is replaced."""

from __future__ import annotations

import pytest
from engine_pool import EnginePool


class Server:
    def __init__(self, name: str) -> None:
        self.name, self.running, self.started = name, True, True

    def alive(self) -> bool:
        return self.running

    def stop(self) -> None:
        self.running = False


def _pool(keep_idle: int = 1) -> EnginePool[Server]:
    return EnginePool(alive=Server.alive, stop=Server.stop, keep_idle=keep_idle)


def test_one_server_per_key_shared_by_every_user_until_the_session_ends() -> None:
    pool = _pool()
    a = pool.get("a", lambda: Server("a"))
    assert pool.get("a", lambda: Server("a2")) is a and pool.created == 1
    pool.release("a")
    pool.release("a")
    assert a.running, "the last user's release keeps it for a later module"
    with pool.lease("a", lambda: Server("a3")) as again:
        assert again is a
    b = pool.get("b", lambda: Server("b"))
    assert b is not a and pool.created == 2
    pool.close()
    assert not a.running and not b.running


def test_at_most_keep_idle_idle_servers_are_kept_oldest_stopped_first() -> None:
    pool = _pool(keep_idle=1)
    a, b = pool.get("a", lambda: Server("a")), pool.get("b", lambda: Server("b"))
    pool.release("a")
    assert a.running
    pool.release("b")
    assert not a.running and b.running
    assert pool.get("a", lambda: Server("a-new")).name == "a-new"


def test_a_server_left_busy_fails_its_user_and_is_not_handed_out_again() -> None:
    pool = _pool()
    a = pool.get("a", lambda: Server("a"))

    def leaked(server: Server) -> None:
        raise AssertionError(f"{server.name}'s KV cache usage stayed at 0.25")

    with pytest.raises(AssertionError, match=r"stayed at 0\.25"):
        pool.release("a", leaked)
    assert not a.running
    assert pool.get("a", lambda: Server("a-new")).name == "a-new"


def test_a_server_that_died_is_replaced() -> None:
    pool = _pool()
    a = pool.get("a", lambda: Server("a"))
    pool.release("a")
    a.running = False  # killed by a test, or stopped by a failed start_all
    assert pool.get("a", lambda: Server("a-new")).name == "a-new" and pool.created == 2


def test_a_release_with_no_later_user_stops_the_server_after_its_idle_check() -> None:
    pool = _pool(keep_idle=2)
    a = pool.get("a", lambda: Server("a"))
    pool.get("a", lambda: Server("a2"))
    checked: list[str] = []
    pool.release("a", lambda s: checked.append(s.name), keep=False)
    assert a.running, "another user still leases it"
    with pool.lease("a", lambda: Server("a3"), keep=False) as again:
        assert again is a
    pool.release("a", lambda s: checked.append(s.name), keep=False)
    assert not a.running and checked == ["a", "a"]
    assert pool.get("a", lambda: Server("a-new")).name == "a-new"
