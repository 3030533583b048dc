"""``kv_transfer_params``: decoded once, at the boundary, into a typed :class:`Handoff`.

vLLM hands connectors an untyped dict per request. kvbridge reads two dialects:

- its own block, ``{"kvbridge": {...}}`` (:class:`KVBridgeParams`), which the
  ``kvbridge proxy`` sends for the layer-wise push flow and which the prefill side
  returns for the P-first flow;
- vLLM's P-first fields, so existing routers work: ``{"do_remote_decode": true}`` on a
  prefill request; on a decode request ``{"do_remote_prefill": true, ...}`` with the
  ``kvbridge`` block the prefill side put next to vLLM's own ``remote_*`` fields.

A malformed block is logged and the request is served without a handoff (computed
locally): a client's typo costs compute, never correctness.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

import msgspec

from kvbridge.core.blocks import BlockTable
from kvbridge.core.tp import check_pairing, idle_prefill_ranks, prefill_ranks
from kvbridge.errors import IncompatiblePeerError
from kvbridge.wire.auth import new_ticket

log = logging.getLogger(__name__)


class RankAddress(msgspec.Struct, frozen=True):
    """One tensor-parallel rank's side channel and its process epoch."""

    address: str
    epoch: str = ""


class PrefillAddress(msgspec.Struct, frozen=True):
    """Where the decode side reaches the prefill instance's side channel.

    ``address`` / ``epoch`` are TP rank 0's; ``ranks`` lists every TP rank's, in rank
    order (a prefill instance with TP 1 may leave it empty). Each decode worker talks
    to the prefill workers holding its KV heads (:meth:`sources`).

    ``dp_rank``: on an instance with data parallelism each DP rank is an engine of its
    own with its own side channel; this is that rank's, and a push-flow prefill request
    for this address must reach that rank (vLLM routes a request by its
    ``X-data-parallel-rank`` header; ``kvbridge proxy`` sets it). Optional on the wire
    (a peer that predates it reads 0).
    """

    address: str
    engine_id: str = ""
    epoch: str = ""
    ranks: list[RankAddress] = []
    dp_rank: int = 0

    def sources(self, rank: int, tp_size: int, total_kv_heads: int) -> list[RankAddress]:
        """The prefill workers that decode worker ``rank`` of ``tp_size`` reads its KV
        heads from (the model has ``total_kv_heads``): the one of the same rank when
        both instances run the same TP size; else the one holding its heads (decode TP
        a multiple of the prefill's) or the several that do (the other way round).

        Raises:
            IncompatiblePeerError: the two TP sizes cannot be paired
                (:func:`~kvbridge.core.tp.check_pairing`).
        """
        ranks = self._ranks(tp_size, total_kv_heads)
        if len(ranks) == tp_size:
            return [ranks[rank]]
        return [ranks[r] for r in prefill_ranks(total_kv_heads, len(ranks), tp_size, rank)]

    def idle(self, rank: int, tp_size: int, total_kv_heads: int) -> list[RankAddress]:
        """The prefill workers that feed no decode worker and that decode worker ``rank``
        tells to let go of each request: replicas nobody reads, as when an MLA model
        (one latent "head", on every rank) runs on more prefill ranks than decode
        ranks (:func:`~kvbridge.core.tp.idle_prefill_ranks`). Raises as :meth:`sources`."""
        ranks = self._ranks(tp_size, total_kv_heads)
        if len(ranks) == tp_size:
            return []
        return [ranks[r] for r in idle_prefill_ranks(total_kv_heads, len(ranks), tp_size, rank)]

    def _ranks(self, tp_size: int, total_kv_heads: int) -> list[RankAddress]:
        """Every prefill rank's address, once their TP size is known to pair with ours."""
        ranks = self.ranks or [RankAddress(self.address, self.epoch)]
        if len(ranks) == tp_size:
            return ranks
        try:
            check_pairing(total_kv_heads, len(ranks), tp_size, idle=True)
        except IncompatiblePeerError as exc:
            raise IncompatiblePeerError(
                f"the prefill instance at {self.address} runs tensor parallel size {len(ranks)}, "
                f"this decode instance {tp_size}: {exc.message}",
                differences={"tp_size": (tp_size, len(ranks))},
                fix=exc.fix,
            ) from None
        return ranks


Flow = Literal["push", "pull", "discover"]


class KVBridgeParams(msgspec.Struct, frozen=True):
    """The ``kvbridge`` block of ``kv_transfer_params``.

    ``flow: discover`` (prefill role, any tiny prompt): nothing is held or sent; the
    response's ``kv_transfer_params.kvbridge.prefill`` says where this prefill
    instance's side channel is (how ``kvbridge proxy`` learns it).
    """

    transfer_id: str
    role: Literal["prefill", "decode"]
    flow: Flow = "push"
    prefill: PrefillAddress | None = None
    """Decode side: the prefill instance to ask (push) or read from (pull)."""
    remote_blocks: list[int] | None = None
    """P-first decode side: the prefill's blocks holding the prompt, in order (with
    vLLM's hybrid manager, KV cache group 0's, -1 where it holds none)."""
    remote_group_blocks: list[list[int]] | None = None
    """P-first decode side, hybrid manager: the other KV cache groups' blocks for the
    same positions (:mod:`kvbridge.core.blocks`)."""
    remote_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None
    """P-first decode side: the prompt tokens the prefill's blocks hold. A decode whose
    prompt is longer (the prefill's with its first token appended) loads these and
    computes the rest; None (an older prefill): the decode's prompt is the prefill's."""
    first_token: bool = False
    """P-first prefill side: the decode continues from this request's first token (the
    ``kvbridge proxy`` streamed it to the client), so a request that its first token
    ended (an EOS or stop token) has nothing to hand over: its blocks are not held."""
    ticket: str = ""
    """The transfer's ticket (:func:`new_ticket`): the proxy gives both sides the same one
    in the push flow, the prefill draws one for a P-first request and returns it to the
    decode side here. The prefill acts only on messages that carry it
    (:class:`kvbridge.wire.messages.Abort`)."""


class Handoff(msgspec.Struct, frozen=True):
    """What this instance does for one request."""

    role: Literal["prefill", "decode"]
    flow: Flow
    transfer_id: str
    prefill: PrefillAddress | None = None
    remote_blocks: list[int] | None = None
    remote_group_blocks: list[list[int]] | None = None
    remote_tokens: int | None = None
    first_token: bool = False
    ticket: str = ""

    def remote_table(self) -> BlockTable | None:
        """P-first decode side: the prefill's blocks as a table (every KV cache group)."""
        if self.remote_blocks is None:
            return None
        return BlockTable.from_wire(self.remote_blocks, self.remote_group_blocks or ())


def parse(params: dict[str, Any] | None, request_id: str) -> Handoff | None:
    """The handoff a request asks for, or None (no kvbridge transfer)."""
    if not params:
        return None
    block = params.get("kvbridge")
    if block is not None:
        try:
            kb = msgspec.convert(block, KVBridgeParams)
        except msgspec.ValidationError as exc:
            log.warning(
                "kvbridge: request %s has malformed kv_transfer_params.kvbridge (%s); computing it "
                "locally",
                request_id,
                exc,
            )
            return None
        if kb.role == "decode" and (kb.prefill is None or kb.flow == "discover"):
            log.warning(
                "kvbridge: request %s: decode params without a prefill address; computing it "
                "locally",
                request_id,
            )
            return None
        if kb.flow == "pull" and kb.role == "decode" and not params.get("do_remote_prefill", True):
            return None  # vLLM cleared the flag: the transfer was already handled
        return Handoff(
            role=kb.role,
            flow=kb.flow,
            transfer_id=kb.transfer_id,
            prefill=kb.prefill,
            remote_blocks=kb.remote_blocks,
            remote_group_blocks=kb.remote_group_blocks,
            remote_tokens=kb.remote_tokens,
            first_token=kb.first_token,
            # a P-first prefill draws the ticket it returns (pull_response); a pushed
            # request given none (an older proxy) is bound to its first decode instance
            ticket=kb.ticket
            or (new_ticket() if kb.role == "prefill" and kb.flow == "pull" else ""),
        )
    if params.get("do_remote_decode"):
        # vLLM's P-first protocol, request to the prefill instance
        return Handoff(role="prefill", flow="pull", transfer_id=request_id, ticket=new_ticket())
    if params.get("do_remote_prefill"):
        log.warning(
            "kvbridge: request %s carries do_remote_prefill without kvbridge's block (params from "
            "another connector?); computing it locally",
            request_id,
        )
    return None


def pull_response(
    transfer_id: str,
    prefill: PrefillAddress,
    engine_id: str,
    blocks: BlockTable | list[int],
    num_tokens: int,
    host: str,
    port: int,
    ticket: str,
) -> dict[str, Any]:
    """``kv_transfer_params`` the prefill side returns in the P-first flow: vLLM's own
    fields (so generic routers pass it on) plus kvbridge's block for the decode side.
    ``blocks``: the prompt's, in every KV cache group (vLLM's ``remote_block_ids`` gets
    group 0's)."""
    blocks, groups = BlockTable.of(blocks).to_wire()
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_request_id": transfer_id,
        "remote_block_ids": blocks,
        "remote_host": host,
        "remote_port": port,
        "remote_num_tokens": num_tokens,
        "kvbridge": msgspec.to_builtins(
            KVBridgeParams(
                transfer_id=transfer_id,
                role="decode",
                flow="pull",
                prefill=prefill,
                remote_blocks=blocks,
                remote_group_blocks=groups or None,
                remote_tokens=num_tokens,
                ticket=ticket,
            )
        ),
    }


def local_response() -> dict[str, Any]:
    """``kv_transfer_params`` the prefill side returns for a P-first request it did not
    hand off (the decode computes the prompt itself): vLLM's flags, both off, so a
    router passes them on and the decode side serves the request as a plain one."""
    return {"do_remote_prefill": False, "do_remote_decode": False}


def discover_response(prefill: PrefillAddress) -> dict[str, Any]:
    """``kv_transfer_params`` answering a ``discover`` request."""
    return {"kvbridge": {"prefill": msgspec.to_builtins(prefill)}}


__all__ = [
    "Handoff",
    "KVBridgeParams",
    "PrefillAddress",
    "RankAddress",
    "discover_response",
    "local_response",
    "parse",
    "pull_response",
]
