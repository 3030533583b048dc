"""Every SGLang-version shim of the kvbridge backend, in one place.

Supported: SGLang 0.5.23 (tested; ``pip install 'kvbridge[sglang]'`` pins
``sglang>=0.5.23,<0.6``). When the pin moves, re-check what this module touches:

- ``sglang.srt.disaggregation.utils.TransferBackend``: an ``Enum`` with no registration
  API; every scheduler converts ``--disaggregation-transfer-backend`` with
  ``TransferBackend(value)``, so we add a member (:func:`add_transfer_backend`).
- ``sglang.srt.disaggregation.utils.get_kv_class``: raises for unknown backends; wrapped
  with an AROUND hook of ``sglang.srt.plugins.hook_registry.HookRegistry``, which also
  rewrites the ``from ... import get_kv_class`` bindings of already-loaded modules.
- ``sglang.srt.arg_groups.choices.add_disagg_transfer_backend_choices``: argparse choices.
- ``sglang.srt.disaggregation.common.conn``: ``CommonKVManager/Sender/Receiver/
  BootstrapServer`` and the ``ABORT`` / ``ABORT_ACK`` frames, subclassed and reused by
  :mod:`.manager`; ``base.conn.KVPoll``; ``utils.DisaggregationMode``.
- Per-layer streaming (:func:`hook_layerwise`): an AROUND hook on
  ``model_executor.forward_batch_info.ForwardBatch.init_new`` (a classmethod; 0.5.23
  passes the ``ScheduleBatch`` itself) attaches a plan to the ``ForwardBatch`` it
  returns; an AROUND hook on ``model_executor.model_runner.ModelRunner.forward``
  makes that plan the thread's active one for the duration of the model forward (the
  eager runner hands the layers a *copy* of the ``ForwardBatch``, built field by field
  into static buffers, so an attribute on the original does not reach them); an AROUND
  hook on ``layers.radix_attention.RadixAttention.forward`` (``self.layer_id``)
  reports each finished layer of the active plan. :func:`extend_requests` and :func:`page_ids` read
  ``ScheduleBatch.reqs / forward_mode / prefix_lens / extend_lens / req_to_token_pool`` and
  ``Req.disagg_kv_sender (its bootstrap_room) / origin_input_ids / disagg_decode_prefix_len /
  kv.req_pool_idx``; ``KVArgs.prefill_start_layer`` offsets layer ids (pipeline parallelism).
- The compatibility info (:func:`kv_cache_identity`, :func:`model_identity`)
  and the packed path (:func:`kv_dtype_and_head_dim`): ``configs.model_config.ModelConfig
  .from_server_args`` (``.dtype``, ``.head_dim``, ``.get_total_num_kv_heads()``),
  ``KVArgs.kv_cache_dtype_str``
  (``"auto"`` or a dtype name; ``fp8*`` for an 8-bit cache), ``ServerArgs.model_path``.
  A room waiting for staging (``decode.KVBridgeKVReceiver``) holds
  ``CommonKVReceiver.send_metadata(kv_indices, aux_index, ...)`` (the decode scheduler's
  only call, made once a room's pages are allocated, then ``poll`` each step;
  ``init_time`` unset until it runs, so SGLang's waiting timeout does not start) and
  reads ``bootstrap_infos`` and ``conclude_state``.
- The packed path's pairing of ranks between TP sizes mirrors the rank mapping of
  ``CommonKVReceiver`` (``target_tp_rank(s)``, ``required_prefill_response_num``; for
  MLA the first target real and the rest dummy): :func:`.packed.latent_sources` for
  MLA pools, :mod:`kvbridge.core.tp`'s split for MHA. ``tests/unit/test_sglang_packed.py``
  holds SGLang's targets for several sizes, written from that code: re-derive them.
- ``ServerArgs.disaggregation_decode_enable_radix_cache`` (:func:`decode_prefix_cache`):
  a decode that keeps its own prefix cache (a prefill with larger pages refuses it).
- States between TP sizes (:func:`state_split_info`): ``KVArgs.state_dim_per_tensor``,
  ``state_slice_outer_counts``, ``state_conv_shard_groups`` and ``state_layer_ids``
  (from ``MambaPool.get_state_dim_per_tensor`` and siblings), listed as
  ``state_item_lens``: field by field (conv, then temporal), each once per layer.
- Data-parallel replicas (:func:`serve_replica_dp_rank`): ``CommonKVManager.attn_dp_rank /
  attn_dp_size / system_dp_rank / system_dp_size`` and the DP-rank check and
  registration in ``CommonKVSender.__init__``; a rank's seat (:func:`server_seat`):
  those, ``local_ip``, ``attn_tp_rank``, ``pp_rank`` and ``ServerArgs.port``;
  ``runtime_context.get_parallel().load_balance_method`` (:func:`load_balance_method`).
- The prefill's bootstrap row (:class:`TopologyRowHook`): ``CommonKVManager
  ._register_topology_row(url, payload)``, private, called from its constructor.
- One request per room (:mod:`.rooms`): ``CommonKVManager.request_status``,
  ``record_failure``, ``conclude_failure``,
  ``KVTransferError(room, reason)``, and the endpoints' ``_owns_bootstrap_room`` flag,
  which SGLang's ``CommonKVReceiver.clear/abort`` honour under any allocation policy
  and ``CommonKVSender.clear/abort`` only under ``prefill_complete`` (kvbridge's sender
  checks it itself).

Nothing here is imported before SGLang loads the plugin.
"""

from __future__ import annotations

import logging
import threading
from typing import NamedTuple

import numpy as np

log = logging.getLogger(__name__)

SUPPORTED = ">=0.5.23,<0.6"
TESTED = ("0.5.23",)


def sglang_version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # noqa: BLE001 - best effort, only for a warning
        return "unknown"


def warn_if_untested() -> None:
    v = sglang_version()
    if v not in TESTED:
        log.warning(
            "kvbridge's SGLang backend is tested with SGLang %s; found %s", ", ".join(TESTED), v
        )


def add_transfer_backend(name: str) -> None:
    """Make ``--disaggregation-transfer-backend name`` parse and resolve."""
    from sglang.srt.arg_groups.choices import add_disagg_transfer_backend_choices
    from sglang.srt.disaggregation.utils import TransferBackend

    if name in TransferBackend._value2member_map_:
        return
    add_disagg_transfer_backend_choices([name])
    member = object.__new__(TransferBackend)
    member._name_, member._value_ = name.upper(), name
    type.__setattr__(TransferBackend, name.upper(), member)
    TransferBackend._member_map_[name.upper()] = member
    TransferBackend._value2member_map_[name] = member
    TransferBackend._member_names_.append(name.upper())


def hook_get_kv_class(name: str, classes) -> None:
    """Route ``get_kv_class(TransferBackend(name), kind)`` to ``classes()``, a callable
    returning ``(manager, sender, receiver, bootstrap_server)`` classes (imported lazily)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def around(original, transfer_backend, class_type):
        from sglang.srt.disaggregation.utils import KVClassType

        if getattr(transfer_backend, "value", None) != name or class_type == KVClassType.KVARGS:
            return original(transfer_backend, class_type)
        manager, sender, receiver, bootstrap = classes()
        return {
            KVClassType.MANAGER: manager,
            KVClassType.SENDER: sender,
            KVClassType.RECEIVER: receiver,
            KVClassType.BOOTSTRAP_SERVER: bootstrap,
        }[class_type]

    HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", around, HookType.AROUND)


def common():
    """SGLang's shared backend machinery, as a namespace."""
    from types import SimpleNamespace

    from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
    from sglang.srt.disaggregation.common import conn
    from sglang.srt.disaggregation.utils import DisaggregationMode

    return SimpleNamespace(
        KVArgs=KVArgs,
        KVPoll=KVPoll,
        DisaggregationMode=DisaggregationMode,
        Manager=conn.CommonKVManager,
        Sender=conn.CommonKVSender,
        Receiver=conn.CommonKVReceiver,
        BootstrapServer=conn.CommonKVBootstrapServer,
        AbortNotification=conn.AbortNotification,
        KVTransferError=conn.KVTransferError,
        ABORT_TAG=conn.ABORT_TAG,
        ABORT_ACK_TAG=conn.ABORT_ACK_TAG,
        NetworkAddress=conn.NetworkAddress,
    )


class RoomStatus:
    """A manager's per-room status in SGLang's tables (``CommonKVManager.request_status``,
    ``check_status``, ``update_status``, ``record_failure`` and ``failure_records`` under
    ``failure_lock``): kvbridge reads and changes a room's status only through this.

    Who calls: the prefill's and decode's threads and the endpoints (:mod:`.rooms`) of
    one manager, any thread; SGLang's scheduler reads the same tables. SGLang owns them;
    ``record_failure`` stays the manager's own (SGLang calls it too, and kvbridge's
    prefill keeps a tombstone there)."""

    def __init__(self, mgr) -> None:
        self._mgr = mgr
        self._poll = common().KVPoll
        self._concluded = (self._poll.Success, self._poll.Failed)

    def any(self) -> bool:
        """Whether SGLang keeps a status for some room (in flight, or concluded and not
        yet cleared). Any thread; constant time (the transport's pump asks it)."""
        return bool(self._mgr.request_status)

    def known(self, room: int) -> bool:
        """Whether SGLang keeps a status for ``room``."""
        return room in self._mgr.request_status

    def live(self, room: int) -> bool:
        """Known and not failed: the room may still move KV."""
        return self.known(room) and self._mgr.check_status(room) != self._poll.Failed

    def failed(self, room: int) -> bool:
        """Whether a failure was recorded for ``room`` (even if its status was cleared)."""
        with self._mgr.failure_lock:
            return room in self._mgr.failure_records

    def fail(self, room: int, reason: str, *, unless: tuple | None = None) -> bool:
        """Record ``reason`` and mark ``room`` failed (SGLang's scheduler then aborts its
        request with it), unless it has no status or its status is in ``unless``
        (``KVPoll`` values; default: succeeded or failed). Whether it failed it."""
        done = self._concluded if unless is None else unless
        if not self.known(room) or self._mgr.check_status(room) in done:
            return False
        self.mark_failed(room, reason)
        return True

    def mark_failed(self, room: int, reason: str) -> None:
        """Record ``reason`` and mark ``room`` failed, whatever its status (SGLang keeps
        the reason of a room it has no status for, for its endpoints' errors)."""
        self._mgr.record_failure(room, reason)
        self._mgr.update_status(room, self._poll.Failed)

    def concluded(self, room: int) -> bool:
        """Whether ``room`` succeeded or failed."""
        return self._mgr.request_status.get(room) in self._concluded

    def waiting_for_input(self, room: int) -> None:
        """Every destination of ``room`` arrived: the prefill may send it."""
        self._mgr.update_status(room, self._poll.WaitingForInput)

    def succeeded(self, room: int) -> None:
        """Every write of ``room`` landed."""
        self._mgr.update_status(room, self._poll.Success)

    def forget_waiting(self, room: int) -> None:
        """Drop ``room``'s status if it only waits for input (destinations that no
        request took)."""
        if self._mgr.request_status.get(room) == self._poll.WaitingForInput:
            self._mgr.request_status.pop(room, None)


class TopologyRowHook:
    """A base of the manager (before SGLang's ``CommonKVManager``): lets the manager add
    to the row a prefill rank registers with SGLang's bootstrap server, which decodes
    read (:meth:`topology_row`, kvbridge's: the rank's epoch and agent). SGLang 0.5.23
    registers the row from ``CommonKVManager.__init__`` through the private
    ``_register_topology_row(url, payload)``, with no hook; overriding it, here and
    nowhere else, is the only way in."""

    def topology_row(self, payload: dict) -> dict:
        return payload

    def _register_topology_row(self, url, payload):
        return super()._register_topology_row(url, self.topology_row(payload))


class RoomDestinations:
    """A prefill manager's decode destinations per room in SGLang's tables
    (``CommonKVManager.transfer_infos``: room -> {decode agent: destination}, and
    ``req_to_decode_prefix_len``), which SGLang's own code reads too (its status
    targets, its MLA replica factor, the sender's decode prefix length): kvbridge reads
    and changes them only through this. A destination is kvbridge's record with the
    attributes SGLang's helpers read (``endpoint``, ``dst_port``, ``is_dummy``,
    ``required_dst_info_num``, ``decode_prefix_len``).

    Who calls: the prefill's control thread adds and forgets; its transfer thread, the
    scheduler thread (senders, the per-layer plan) and the endpoints read. SGLang owns
    the tables; a room's entry goes when SGLang's sender clears it or kvbridge forgets
    an early room no request took."""

    def __init__(self, mgr) -> None:
        self._mgr = mgr

    def has(self, room: int) -> bool:
        """Whether any destination of ``room`` is kept."""
        return room in self._mgr.transfer_infos

    def of(self, room: int) -> dict | None:
        """``room``'s destinations by decode agent (a copy), None when none is kept."""
        infos = self._mgr.transfer_infos.get(room)
        return None if infos is None else dict(infos)

    def get(self, room: int, agent: str):
        """The destination ``agent`` sent for ``room``, or None."""
        return self._mgr.transfer_infos.get(room, {}).get(agent)

    def add(self, room: int, agent: str, dest, expected: int) -> bool:
        """Keep ``agent``'s destination for ``room`` (replacing its earlier one). Once
        ``expected`` are kept (the decode's ``required_dst_info_num``), settle what
        SGLang derives from them (the MLA replica factor, the decode's prefix length) and
        return True: the room may then wait for input."""
        infos = self._mgr.transfer_infos.setdefault(room, {})
        infos[agent] = dest
        if len(infos) != expected:
            return False
        self._mgr.resolve_kv_replica_factor(infos)
        self._mgr.req_to_decode_prefix_len[room] = next(
            (d.decode_prefix_len for d in infos.values() if d.decode_prefix_len is not None), 0
        )
        return True

    def forget(self, room: int) -> None:
        """Drop ``room``'s destinations (an early room no request took)."""
        self._mgr.transfer_infos.pop(room, None)

    def status_targets(self, room: int) -> list[tuple[str, int]]:
        """The control sockets SGLang sends ``room``'s statuses to (its decode ranks);
        none when no destination is kept."""
        return self._mgr._room_notify_targets(room) if self.has(room) else []


def control_endpoint(ip: str, port: int) -> str:
    """The ZeroMQ endpoint of a rank's control socket as SGLang addresses it
    (``tcp://ip:port``, IPv6 bracketed): what kvbridge binds a control message's MAC to
    (:func:`.messages.sign`), computed alike by its sender and its receiver."""
    return common().NetworkAddress(ip, int(port)).to_tcp()


def serve_replica_dp_rank(mgr) -> None:
    """Make a prefill sender of SGLang's data-parallel *replicas* (``--dp-size N``
    without DP attention) name its replica as the request's prefill DP rank. Called once
    by the manager, after SGLang's constructor.

    SGLang 0.5.23 counts a prefill's DP ranks as ``system_dp_rank`` for replicas and
    ``attn_dp_rank`` for DP attention (its bootstrap server's ``dp_group``, which the
    decode resolves a room to: ``room % dp_size`` under ``follow_bootstrap_room``, the
    prefill's default, or by asking the bootstrap server). But ``CommonKVSender.__init__``
    checks (``follow_bootstrap_room``) or registers (other balancing methods)
    ``kv_mgr.attn_dp_rank``, which is 0 on every replica: each room the controller
    dispatches to replica ``r > 0`` fails there with "follow_bootstrap_room conflict"
    (and, with SGLang's own backends, the decode then waits for it until its timeouts).
    A replica's manager therefore carries its ``system_dp_rank`` as ``attn_dp_rank``
    (the registration row SGLang's constructor has sent already keeps the real one;
    the bootstrap server ignores it for replicas)."""
    if mgr.system_dp_size > 1 and mgr.attn_dp_size == 1:
        mgr.attn_dp_rank = mgr.system_dp_rank


def load_balance_method() -> str:
    """How this server's DP controller assigns requests to its DP ranks, as SGLang
    resolved ``--load-balance-method`` (``auto``: ``follow_bootstrap_room`` on a
    prefill, ``round_robin`` on a decode; ``ServerArgs`` keeps ``auto``)."""
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().load_balance_method


def warn_unless_balanced_by_room(mgr, method: str) -> None:
    """Warn when this server has several DP ranks (replicas or attention DP) that its
    DP controller does not assign by room (``method``: :func:`load_balance_method`).
    Called once by each rank's manager, at start.

    SGLang sends a request with ``n > 1`` (parallel sampling) as its prefix primer and
    each sample on the request's one bootstrap room, and kvbridge pairs a room's
    requests in the order each server makes them (:mod:`.lanes`): that holds only if
    every server hands all requests of a room to one DP rank, as
    ``--load-balance-method follow_bootstrap_room`` does (a prefill's default; a
    decode's is ``round_robin``, which deals a request's samples out to its DP ranks:
    measured, such requests then went unanswered until the client's timeout)."""
    ranks = mgr.system_dp_size * mgr.attn_dp_size
    if ranks > 1 and method != "follow_bootstrap_room":
        log.warning(
            "kvbridge: this server's %d DP ranks are balanced by %s: requests with n > 1 "
            "(parallel sampling) then fail or wait until their timeouts; start both servers "
            "with --load-balance-method follow_bootstrap_room (a prefill's default) to keep "
            "a request's samples on one DP rank",
            ranks,
            method,
        )


def server_seat(server_args, mgr) -> str:
    """Which rank of which SGLang server ``mgr`` (after SGLang's constructor) serves,
    as ``"ip:port dpD.A tpT ppP"``: the rank's ``local_ip``, the server's HTTP port
    (``ServerArgs.port``), its DP replica and attention DP rank, attention TP rank and
    PP rank. Unique among the servers of a deployment, and unchanged when the server
    restarts on its address (unlike transport agent names, which carry an epoch)."""
    return (
        f"{mgr.local_ip}:{server_args.port} dp{mgr.system_dp_rank}.{mgr.attn_dp_rank} "
        f"tp{mgr.attn_tp_rank} pp{mgr.pp_rank}"
    )


# --- per-layer streaming -------------------------------------------------------------------

RADIX_ATTENTION_FORWARD = "sglang.srt.layers.radix_attention.RadixAttention.forward"
FORWARD_BATCH_INIT = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
MODEL_RUNNER_FORWARD = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
PLAN_ATTR = "_kvbridge_layer_plan"
"""Attribute of a ``ForwardBatch`` holding its :class:`~.streaming.ForwardPlan` (absent:
no per-layer posts for that forward)."""

_active = threading.local()
"""``_active.plan``: the plan of the model forward running on this thread, if any."""

_STREAMED_MODES = ("EXTEND", "MIXED")


class ExtendReq(NamedTuple):
    """One request of a prefill forward, as the per-layer path needs it."""

    room: int
    sender: object
    prompt_len: int
    decode_prefix_len: int
    prefix_len: int
    """Tokens in the cache before this forward (earlier chunks, radix-cache hits)."""
    extend_len: int
    """Tokens this forward computes."""
    req_pool_idx: int


def extend_requests(batch, model_runner) -> list[ExtendReq]:
    """The requests of a ``ScheduleBatch`` about to run an EXTEND (prefill) forward of
    the target model; empty for any other forward (decode, idle, draft, verify)."""
    mode = getattr(batch, "forward_mode", None)
    if mode is None or getattr(mode, "name", None) not in _STREAMED_MODES:
        return []
    if getattr(model_runner, "is_draft_worker", False):
        return []
    reqs = getattr(batch, "reqs", None) or ()
    prefix_lens, extend_lens = batch.prefix_lens, batch.extend_lens
    out = []
    for i, req in enumerate(reqs):
        sender = getattr(req, "disagg_kv_sender", None)
        # the sender's room: kvbridge's senders work under their lane's (adapters/sglang/lanes.py)
        room = getattr(sender, "bootstrap_room", None)  # None without a sender
        if room is None:
            continue
        out.append(
            ExtendReq(
                room=int(room),
                sender=sender,
                prompt_len=len(req.origin_input_ids),
                decode_prefix_len=int(getattr(req, "disagg_decode_prefix_len", 0) or 0),
                prefix_len=int(prefix_lens[i]),
                extend_len=int(extend_lens[i]),
                req_pool_idx=int(req.kv.req_pool_idx),
            )
        )
    return out


_KV_DTYPE_NAMES = {
    "auto": None,
    "": None,
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
}


def decode_prefix_cache(server_args) -> bool:
    """``--disaggregation-decode-enable-radix-cache`` (a ``ServerArgs`` field in 0.5.23,
    off by default; SGLang reads it through ``runtime_context.get_disagg()``)."""
    return bool(getattr(server_args, "disaggregation_decode_enable_radix_cache", False))


class KVCacheIdentity(NamedTuple):
    """What a prefill and a decode must share of their KV caches beyond the pool's
    geometry (their compatibility info, :mod:`.manager`)."""

    dtype: str
    """The cache's element type: a torch name, an 8-bit cache by SGLang's name for it
    (``fp8_e4m3``)."""
    head_dim: int
    kv_heads: int
    """The model's KV heads before the TP split."""


def kv_cache_identity(server_args, kv_args) -> KVCacheIdentity:
    """This server's :class:`KVCacheIdentity`, from the model's config (SGLang's
    ``KVArgs`` carries none of it on the decode)."""
    from sglang.srt.configs.model_config import ModelConfig

    name = str(getattr(kv_args, "kv_cache_dtype_str", None) or "auto").lower()
    model_config = ModelConfig.from_server_args(server_args)
    dtype = _KV_DTYPE_NAMES.get(name, name) or str(model_config.dtype).removeprefix("torch.")
    return KVCacheIdentity(
        dtype, int(model_config.head_dim), int(model_config.get_total_num_kv_heads())
    )


def kv_dtype_and_head_dim(kv_args, cache: KVCacheIdentity) -> tuple[str, int]:
    """The element type and head dim of ``cache`` (:func:`kv_cache_identity`), for
    packing the pool (the packed path). Raises :class:`~kvbridge.errors.ConfigError` for
    an 8-bit or unknown KV cache dtype."""
    from kvbridge.errors import ConfigError

    name = str(getattr(kv_args, "kv_cache_dtype_str", None) or "auto").lower()
    if name not in _KV_DTYPE_NAMES:
        raise ConfigError(
            "wire_dtype 'fp8' packs float16, bfloat16 or float32 KV caches; this server's is "
            f"{name!r}",
            key="wire_dtype",
            fix="use wire_dtype 'exact' (an 8-bit KV cache is already as small)",
        )
    return cache.dtype, cache.head_dim


def model_identity(server_args) -> str:
    """The model as the server names it (``--model-path``: a local directory or a hub
    id), as vLLM's adapter names it (``model_config.model``): a prefill and a decode
    must name the same."""
    return str(server_args.model_path)


def page_ids(batch, req_pool_idx: int, start: int, stop: int, page_size: int) -> np.ndarray:
    """Prefill page ids of the pages starting at token ``start``, ``start + page_size``,
    ... below ``stop`` of one request (``req_to_token`` holds token slots; page = slot //
    page_size). On a GPU this copies a few integers to the host (synchronizing)."""
    row = batch.req_to_token_pool.req_to_token[req_pool_idx, start:stop:page_size]
    return row.to("cpu").numpy().astype(np.int64) // page_size


def start_layer(kv_args) -> int:
    """The first layer of this rank's KV pool (pipeline parallelism; 0 otherwise)."""
    try:
        return int(getattr(kv_args, "prefill_start_layer", 0) or 0)
    except (TypeError, ValueError):
        return 0


class StateSplitInfo(NamedTuple):
    """What SGLang publishes of each state tensor of ``state_data_ptrs[0]`` for moving
    states between TP sizes (:func:`.states.state_split` reads it)."""

    dims: list[int]
    outer_counts: list[int]
    shard_groups: list[list[int] | None]
    layer_ids: list[int]


def state_split_info(kv_args) -> StateSplitInfo | None:
    """The first state type's per-tensor split metadata from ``KVArgs`` (0.5.23:
    ``state_dim_per_tensor``, the sliced axis' size on this rank, 0 for a state every
    rank holds whole; ``state_slice_outer_counts``, the rows before it;
    ``state_conv_shard_groups``, a conv state's sub-block sizes at TP 1 or None;
    ``state_layer_ids``), or None where this SGLang does not publish them."""
    try:
        dims = kv_args.state_dim_per_tensor[0]
        outer = kv_args.state_slice_outer_counts[0]
        groups = kv_args.state_conv_shard_groups[0]
        layers = kv_args.state_layer_ids[0]
        return StateSplitInfo(
            [int(d) for d in dims],
            [int(c) for c in outer],
            [None if g is None else [int(x) for x in g] for g in groups],
            [int(x) for x in layers],
        )
    except (AttributeError, IndexError, TypeError, ValueError):
        return None


def full_attention_layers(model_runner) -> dict[int, int] | None:
    """A hybrid pool's layers that its KV pages hold: model layer id -> index among
    them, the order of ``KVArgs.kv_data_ptrs``. In 0.5.23 a sliding-window pool
    (``SWAKVPool.layers_mapping``: layer id -> (index in its sub-pool, is a window
    layer)) holds its full-attention layers, a pool with state-space layers
    (``HybridLinearKVPool.full_attention_layer_id_mapping``: layer id -> index) its
    attention layers. None when the runner's pool has neither mapping."""
    pool = getattr(model_runner, "token_to_kv_pool", None)
    mapping = getattr(pool, "layers_mapping", None)
    if isinstance(mapping, dict):
        return {int(layer): int(index) for layer, (index, window) in mapping.items() if not window}
    mapping = getattr(pool, "full_attention_layer_id_mapping", None)
    if isinstance(mapping, dict):
        return {int(layer): int(index) for layer, index in mapping.items()}
    return None


def hook_layerwise(plan_forward) -> None:
    """Wrap SGLang's forward so that per-layer streaming can see its layers.

    ``plan_forward(batch, model_runner)`` runs on the scheduler thread for every
    ``ForwardBatch`` built from a ``ScheduleBatch`` and returns a
    :class:`~.streaming.ForwardPlan` or None. A plan rides on its ``ForwardBatch`` and
    is active on the thread only while ``ModelRunner.forward`` runs that batch (so
    overlap scheduling, which prepares the next batch while this one runs, cannot mix
    them up); after every attention layer of that forward the hook calls
    ``plan.on_layer(plan, layer_id)``. Without a plan (decode, colocated servers, other
    backends) the hooks cost an attribute and a thread-local lookup per call. Errors in
    kvbridge's code are logged and never reach the forward: the chunk send covers it.
    """
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def around_init(original, cls, batch, *args, **kwargs):
        forward_batch = original(cls, batch, *args, **kwargs)
        try:
            model_runner = args[0] if args else kwargs.get("model_runner")
            plan = plan_forward(batch, model_runner)
            if plan is not None:
                setattr(forward_batch, PLAN_ATTR, plan)
        except Exception:  # streaming is an optimization; the chunk send covers
            log.exception("kvbridge: per-layer planning failed; this forward is sent per chunk")
        return forward_batch

    def around_model_forward(original, runner, *args, **kwargs):
        forward_batch = args[0] if args else kwargs.get("forward_batch")
        plan = getattr(forward_batch, PLAN_ATTR, None)
        if plan is None:
            return original(runner, *args, **kwargs)
        previous = getattr(_active, "plan", None)
        _active.plan = plan
        try:
            return original(runner, *args, **kwargs)
        finally:
            _active.plan = previous

    def around_attention(original, layer, *args, **kwargs):
        out = original(layer, *args, **kwargs)
        plan = getattr(_active, "plan", None)
        if plan is not None:
            try:
                plan.on_layer(plan, layer.layer_id)
            except Exception:  # never break the forward
                log.exception(
                    "kvbridge: per-layer hook failed for layer %s", getattr(layer, "layer_id", "?")
                )
        return out

    HookRegistry.register(FORWARD_BATCH_INIT, around_init, HookType.AROUND)
    HookRegistry.register(MODEL_RUNNER_FORWARD, around_model_forward, HookType.AROUND)
    HookRegistry.register(RADIX_ATTENTION_FORWARD, around_attention, HookType.AROUND)


__all__ = [
    "FORWARD_BATCH_INIT",
    "MODEL_RUNNER_FORWARD",
    "PLAN_ATTR",
    "RADIX_ATTENTION_FORWARD",
    "SUPPORTED",
    "TESTED",
    "ExtendReq",
    "KVCacheIdentity",
    "RoomDestinations",
    "RoomStatus",
    "StateSplitInfo",
    "TopologyRowHook",
    "add_transfer_backend",
    "common",
    "control_endpoint",
    "extend_requests",
    "full_attention_layers",
    "hook_get_kv_class",
    "hook_layerwise",
    "kv_cache_identity",
    "kv_dtype_and_head_dim",
    "model_identity",
    "page_ids",
    "sglang_version",
    "start_layer",
    "state_split_info",
    "warn_if_untested",
]
