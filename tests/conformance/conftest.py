"""Fixtures of the transport conformance suite: real NIXL and real Mooncake, two
processes on loopback. A transport that cannot be created fails these tests (with the
fix in the message); it is never skipped."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvbridge.transports.testing import Local, Peer, unique

TRANSPORTS = ["nixl", "mooncake"]


@pytest.fixture(scope="module", params=TRANSPORTS)
def transport_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def peer(transport_name: str) -> Iterator[Peer]:
    with Peer(transport_name, unique("peer")) as p:
        yield p


@pytest.fixture(scope="module")
def local(transport_name: str, peer: Peer) -> Iterator[Local]:
    loc = Local(transport_name)
    loc.peer_id = loc.connect(peer)  # type: ignore[attr-defined]
    yield loc
    loc.close()
