"""The proxy's view of its prefill and decode instances: load and side-channel address.

:class:`Pool` picks the instance with the fewest requests in flight (ties broken
round-robin) and skips instances marked down until they are marked up again (the proxy
probes a down instance in the background; a client's request never does). Prefill
instances also carry their kvbridge side-channel address, learned by a ``discover``
request and refreshed from every prefill response (a restarted instance has a new
epoch, maybe a new port). Used from one asyncio loop; not thread-safe.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Instance:
    url: str
    role: str
    inflight: int = 0
    served: int = 0
    failures: int = 0
    down_since: float | None = None
    """When it was marked down (None: up)."""
    last_error: str = ""
    addresses: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Prefill only: data-parallel rank -> that rank's kvbridge side channel
    (``{"address", "engine_id", "epoch", "ranks", "dp_rank"}``); rank 0 alone on an
    instance without data parallelism."""
    dp_size: int | None = None
    """Prefill only: how many DP ranks requests are routed over (None: not probed yet;
    0: the instance does not route by rank, so its one address is used unrouted)."""
    _order: int = field(default=0, repr=False)
    _dp_turn: int = field(default=0, repr=False)

    @property
    def up(self) -> bool:
        return self.down_since is None

    def mark_down(self, error: str) -> None:
        self.failures += 1
        self.last_error = error
        if self.down_since is None:
            self.down_since = time.monotonic()

    def mark_up(self) -> None:
        self.down_since = None

    def learn(self, address: dict[str, Any]) -> None:
        """Record a side-channel address a prefill response carried (every response does:
        a restarted instance has a new epoch, maybe a new port)."""
        self.addresses[int(address.get("dp_rank", 0))] = address

    def next_dp_rank(self) -> int | None:
        """The DP rank the next push-flow request goes to, round robin over the probed
        ranks; None where requests are not routed by rank."""
        if not self.dp_size:
            return None
        rank = self._dp_turn % self.dp_size
        self._dp_turn += 1
        return rank

    def state(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "up": self.up,
            "inflight": self.inflight,
            "served": self.served,
            "failures": self.failures,
            "last_error": self.last_error,
            **(
                {"kvbridge": [self.addresses[r] for r in sorted(self.addresses)]}
                if self.role == "prefill"
                else {}
            ),
        }


class Pool:
    """Instances of one role."""

    def __init__(self, role: str, urls: list[str]) -> None:
        if not urls:
            raise ValueError(f"at least one {role} URL is required")
        self.role = role
        self.instances = [Instance(url=u.rstrip("/"), role=role) for u in urls]
        self._ticket = itertools.count()

    def pick(self, avoid: Instance | None = None) -> Instance | None:
        """Least loaded instance that is up, other than ``avoid`` (if none is: the one
        down the longest, ``avoid`` too, whose failure the caller then reports)."""
        candidates = [i for i in self.instances if i.up and i is not avoid] or sorted(
            self.instances, key=lambda i: i.down_since or 0.0
        )[:1]
        if not candidates:
            return None
        best = min(candidates, key=lambda i: (i.inflight, i._order))
        best._order = next(self._ticket)
        return best

    def states(self) -> list[dict[str, Any]]:
        return [i.state() for i in self.instances]


__all__ = ["Instance", "Pool"]
