"""SGLang's bootstrap server for the ``kvbridge`` backend (the prefill instance's main
process): SGLang's rank registry plus the instance's epochs at
:data:`~.lifecycle.EPOCH_PATH`, which decode ranks poll (:func:`.decode.fetch_epoch`)
to tell a restarted prefill from the one they bootstrapped with."""

from __future__ import annotations

import uuid

from kvbridge.adapters.sglang import compat
from kvbridge.adapters.sglang.lifecycle import EPOCH_PATH, InstanceEpoch, encode_epoch, rank_key

_c = compat.common()


class KVBridgeKVBootstrapServer(_c.BootstrapServer):
    """SGLang's bootstrap server (prefill main process) plus the instance's epochs at
    :data:`~.lifecycle.EPOCH_PATH`: a fresh id per start, and each rank's epoch from its
    registration; with ``transfer_block_size``, no page size in its route answers."""

    def __init__(self, host, port):
        # Set before SGLang's constructor: it adds the routes and starts serving.
        self.kvbridge_instance = uuid.uuid4().hex[:12]
        self.kvbridge_ranks: dict[str, str] = {}
        super().__init__(host, port)

    def _setup_routes(self):
        super()._setup_routes()
        self.app.router.add_get(EPOCH_PATH, self._handle_kvbridge_epoch)

    async def _handle_route_put(self, request):
        data = await request.json()  # aiohttp caches the body: SGLang's handler reads it again
        response = await super()._handle_route_put(request)
        if response.status == 200 and isinstance(data.get("kvbridge_epoch"), str):
            dp = (
                data["attn_dp_rank"]
                if data.get("system_dp_size", 1) == 1
                else data["system_dp_rank"]
            )
            key = rank_key(
                dp=dp, cp=data["attn_cp_rank"], tp=data["attn_tp_rank"], pp=data["pp_rank"]
            )
            self.kvbridge_ranks[key] = data["kvbridge_epoch"]
        if response.status == 200 and data.get("kvbridge_transfer_pages"):
            # Prefill ranks moving KV in transfer pages (transfer_block_size): SGLang's
            # decode refuses a prefill whose page_size differs from its own before any
            # backend sees a room, and skips that check for None. kvbridge checks pages
            # itself (a decode registers its pages in transfer pages, .prefill
            # refuses others). No await since SGLang's handler set it: no GET sees it.
            self.page_size = None
        return response

    async def _handle_kvbridge_epoch(self, request):
        from aiohttp import web

        doc = InstanceEpoch(
            instance=self.kvbridge_instance, ranks=dict(self.kvbridge_ranks), ready=self._is_ready()
        )
        return web.Response(body=encode_epoch(doc), content_type="application/json")


__all__ = ["KVBridgeKVBootstrapServer"]
