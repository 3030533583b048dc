"""Lanes of a bootstrap room: the room id under which kvbridge's SGLang sender or
receiver works, when several requests come on one room (the primer and samples of a
request with ``n > 1``; :mod:`.rooms` says why). Pure; no SGLang imports.

Who calls: :class:`~.manager.KVBridgeKVManager` keeps one :class:`RoomLanes`; the
sender's and the receiver's constructors take their room id from it (SGLang's
scheduler thread).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

log = logging.getLogger(__name__)

_LANE_STRIDE = 720720 << 20
"""Between the room ids of a room's lanes: a multiple of every number up to 16, so
that a lane's room id leaves the room's residue modulo a data-parallel size (SGLang
may pick a prefill DP rank as ``room % dp_size``) as it was."""
_ROOM_LIMIT = 1 << 63


def lane_room(room: int, lane: int) -> int:
    """The room id of the ``lane``-th endpoint of bootstrap room ``room`` on a server
    (lane 0: ``room`` itself). Both servers compute it alike.

    >>> lane_room(5, 0), lane_room(5, 2) - 5 == 2 * _LANE_STRIDE
    (5, True)
    """
    if lane == 0:
        return room
    offset = lane * _LANE_STRIDE
    return room + offset if room + offset < _ROOM_LIMIT else room - offset


class RoomLanes:
    """How many endpoints this server rank has made for each bootstrap room, the
    recent ``capacity`` rooms (a room's samples follow its primer within moments).
    One per manager; thread-safe (SGLang's scheduler thread calls it)."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self._made: OrderedDict[int, int] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, room: int | None) -> int | None:
        """The room id of the next endpoint of ``room`` (None: no room)."""
        if room is None:
            return None
        room = int(room)
        with self._lock:
            lane = self._made.pop(room, 0)
            self._made[room] = lane + 1
            while len(self._made) > self.capacity:
                self._made.popitem(last=False)
        if lane:
            log.debug("kvbridge: bootstrap room %s, request %d on it", room, lane + 1)
        return lane_room(room, lane)


__all__ = ["RoomLanes", "lane_room"]
