"""User configuration: msgspec Structs, strict.

Who calls: the engine adapters, once per process, with the user's
``kv_connector_extra_config`` (vLLM) or the SGLang backend options; the CLI and tests.
The result is frozen and shared read-only by every component of that process.

Strictness: an unknown key, a wrong type or an out-of-range value raises
:class:`~kvbridge.errors.ConfigError` naming the dotted key, the valid keys or choices,
and (for a likely typo) the closest valid key.

Example::

    >>> cfg = load_config({"transport": "mooncake", "timeouts": {"lease_s": 30}})
    >>> cfg.transport, cfg.timeouts.lease_s
    ('mooncake', 30.0)
    >>> try:
    ...     load_config({"transprot": "nixl"})
    ... except ConfigError as err:
    ...     print(err)  # doctest: +ELLIPSIS
    unknown config key 'transprot' (fix: did you mean 'transport'? valid keys: ...)
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import re
import typing
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Union

import msgspec

from kvbridge.errors import ConfigError

PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveInt = Annotated[int, msgspec.Meta(gt=0)]
MooncakeQueueLimit = Annotated[int, msgspec.Meta(ge=1, le=65535)]

TransportName = Literal["nixl", "mooncake"]


class _Section(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Base of every config section: strict, immutable, keyword-only."""


class Timeouts(_Section):
    """Deadlines, in seconds. Every wait in kvbridge is bounded by one of these."""

    handshake_s: PositiveFloat = 10.0
    """Exchanging agent metadata with a new peer."""

    transfer_s: PositiveFloat = 30.0
    """One posted transfer (a layer, or a whole request) from post to completion."""

    receive_s: PositiveFloat = 120.0
    """How long the decode side waits, twice: for its destination to go out (room in
    the FP8 staging buffer, the handshake, the prefill's acknowledgement), then for the
    first KV data (the prefill side's queueing and compute). On expiry the load fails
    and the engine's load-failure policy (recompute or fail) applies."""

    lease_s: PositiveFloat = 60.0
    """How long a prefill instance holds a finished request's blocks waiting for the
    decode side (its destination, or its pull in the P-first flow) before freeing them."""

    abort_ack_s: PositiveFloat = 5.0
    """How long an aborted request waits for in-flight transfers to drain before its
    blocks are released anyway."""

    heartbeat_s: PositiveFloat = 1.0
    """The decode side checks every prefill instance it waits on this often. A new
    epoch (the instance restarted), or three missed beats with its side-channel port
    closed (the process is gone), fail its transfers at once instead of at
    ``receive_s``; a prefill that misses beats but still accepts connections is busy,
    not dead, and its transfers keep their own deadlines."""


class NixlOptions(_Section):
    """Options of the NIXL transport."""

    backends: tuple[str, ...] = ("UCX",)
    """NIXL backend plugins to instantiate, in preference order."""

    progress_thread: bool | None = None
    """NIXL's own progress thread. ``None`` (default): off for host memory (on a few
    cores it spins a core and costs throughput), on for device memory. kvbridge's
    notification pump drives progress either way."""

    num_threads: NonNegativeInt = 0
    """Worker threads of multi-threaded backends (UCX); 0 keeps the backend default."""


class MooncakeOptions(_Section):
    """Options of the Mooncake transfer-engine transport."""

    protocol: Literal["tcp", "rdma"] = "tcp"
    """Wire protocol. Mooncake silently falls back to TCP for an unknown protocol or a
    missing RDMA device; kvbridge refuses instead."""

    device_name: str = ""
    """RDMA device(s) for ``protocol: rdma`` (e.g. ``"mlx5_0"``); empty: auto-detect."""

    workers: PositiveInt = 4
    """Threads per peer submitting batches (the engine releases the GIL while it
    transfers). Per peer, so a frozen peer's stuck batches cannot starve the others."""

    max_queued_transfers_per_peer: MooncakeQueueLimit = 65535
    """Sets ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` unless already set; Mooncake's
    default (1024) makes batches of thousands of descriptors fail with "queue-full";
    the engine accepts at most 65535."""

    max_pending_admissions_per_peer: MooncakeQueueLimit = 65535
    """Sets ``MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER`` unless already set."""

    waiter_nice: Annotated[int, msgspec.Meta(ge=0, le=19)] = 10
    """Nice value of the threads that submit transfers to the engine and wait for them
    (Linux, per thread; 0: leave them at the process's priority). They no longer
    busy-wait as the engine's own ``batch_transfer_sync`` does (a whole core per batch
    in flight, also while a peer is slow or frozen); they look at pending transfers
    with pauses, so this matters little now (``benchmarks/run.py transport-costs``
    compares both ways at several values)."""

    progress_timeout_s: PositiveInt | None = None
    """Sets ``MC_TCP_PROGRESS_TIMEOUT_SEC`` unless already set: how long a TCP lane may
    move no byte before Mooncake drops it and the batch fails, to be retried while the
    peer answers a probe. None: a third of ``timeouts.transfer_s`` (at least 2 s), so
    a retry fits in the transfer's deadline; Mooncake's own default, 30 s, is the
    whole default ``transfer_s``."""


class KVBridgeConfig(_Section):
    """Top-level configuration. Every key has a default; ``{}`` is a valid config."""

    transport: TransportName = "nixl"
    """Which transport moves the KV cache: ``nixl`` or ``mooncake``."""

    host: str = "127.0.0.1"
    """Address this instance advertises to peers (transport endpoints, side channel)."""

    side_channel_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    """Port of this instance's side channel (worker rank r uses port + r); 0 picks free
    ports. Peers learn it from ``kv_transfer_params``, so 0 suits most deployments."""

    secret: str | None = None
    """Shared secret: when set (identically on prefill and decode), kvbridge's messages
    between the two (the side channel and the transport's notifications; on SGLang its
    registrations, destinations and ``Done`` notifications) are authenticated with
    HMAC-SHA256 and others are refused."""

    layerwise: bool = True
    """Stream each layer as soon as the prefill computed it (the transfer hides behind
    the remaining layers). Off: send everything once the prefill is done."""

    layerwise_min_tokens: NonNegativeInt = 128
    """Prompts shorter than this are sent once after the prefill, not per layer: for
    short prompts per-layer transfers cost more than they hide."""

    wire_dtype: Literal["exact", "fp8"] = "exact"
    """What KV values travel. ``exact``: the cache's own values. ``fp8``: float8 e4m3
    with one scale per (token, head), packed on the prefill side and unpacked into the
    decode cache (float16/bfloat16/float32 caches of CPU engines for now; 2-4x fewer
    bytes, about 3% relative error in the KV). Prefill and decode must agree."""

    data_path: Literal["auto", "direct", "packed"] = "auto"
    """How KV moves. ``direct``: the transport writes cache blocks (or their head
    ranges) straight into the peer's cache blocks, zero copy. ``packed``: each layer's
    blocks are packed into a registered staging buffer, written into the peer's, and
    unpacked there: needed by ``wire_dtype: fp8``, and with ``exact`` it moves any head
    range of any cache layout (different TP sizes on an NHD cache, which the direct
    path cannot cut; an NHD cache on one side and an HND one on the other). ``auto``:
    packed for ``fp8``, direct for ``exact``. In the P-first flow the decode side sends
    its destination and the prefill writes (nothing reads its cache). Prefill and
    decode must agree."""

    transfer_block_size: NonNegativeInt = 0
    """Tokens per block as kvbridge moves and addresses KV (0: the engine's own block
    size). Set it to a common divisor of both sides' block sizes, identically on
    prefill and decode, to pair instances whose engines use different block sizes
    (e.g. 16 and 64): each engine block is then addressed as several blocks of this
    many tokens. Needs a cache that stores each block token by token, blocks back to
    back (vLLM's GPU caches in LBNHC / NHD order, MLA caches; not vLLM's CPU cache,
    a heads-first or a block-outermost one). Smaller blocks mean more descriptors on
    the direct path, none more bytes."""

    staging_mb: PositiveInt = 256
    """Size of the registered staging buffer of the packed path, per worker. The
    decode side holds a request's packed KV in it until the request has arrived, so it
    bounds the packed KV of requests in flight (a request that can never fit fails
    naming this key)."""

    timeouts: Timeouts = msgspec.field(default_factory=Timeouts)
    nixl: NixlOptions = msgspec.field(default_factory=NixlOptions)
    mooncake: MooncakeOptions = msgspec.field(default_factory=MooncakeOptions)

    def __post_init__(self) -> None:
        # load_config checks the document first (same error); this catches hand-built configs
        _check_data_path(self.wire_dtype, self.data_path)

    @property
    def packed(self) -> bool:
        """True when KV moves through the staging buffers (``data_path``, resolved)."""
        return self.data_path == "packed" or (self.data_path == "auto" and self.wire_dtype == "fp8")

    @property
    def resolved_data_path(self) -> Literal["direct", "packed"]:
        """``data_path`` with ``auto`` resolved: what peers must agree on."""
        return "packed" if self.packed else "direct"


def load_config(source: Mapping[str, Any] | str | bytes | None = None) -> KVBridgeConfig:
    """Build a :class:`KVBridgeConfig` from a mapping or a JSON document.

    Args:
        source: a mapping (e.g. vLLM's ``kv_connector_extra_config``), a JSON object as
            text, or ``None`` for all defaults.

    Raises:
        ConfigError: the document is not a JSON object, or a key is unknown, mistyped or
            out of range. The message names the dotted key and the valid keys or choices.
    """
    if source is None:
        return KVBridgeConfig()
    if isinstance(source, (str, bytes)):
        try:
            source = json.loads(source)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"kvbridge config is not valid JSON: {exc}",
                fix='pass a JSON object such as \'{"transport": "nixl"}\'',
            ) from exc
    if not isinstance(source, Mapping):
        raise ConfigError(
            f"kvbridge config must be a JSON object / mapping, got {type(source).__name__}",
            fix='pass a mapping of config keys, e.g. {"transport": "nixl"}',
        )
    _check_keys(KVBridgeConfig, source, prefix="")
    _check_data_path(source.get("wire_dtype"), source.get("data_path"))  # before msgspec rewords it
    try:
        return msgspec.convert(dict(source), KVBridgeConfig, strict=True)
    except msgspec.ValidationError as exc:
        raise _explain(exc) from exc


def _check_data_path(wire_dtype: object, data_path: object) -> None:
    if wire_dtype == "fp8" and data_path == "direct":
        raise ConfigError(
            "wire_dtype 'fp8' quantizes KV while packing it, so it cannot use data_path 'direct' "
            "(cache to cache)",
            key="data_path",
            fix="drop data_path (auto) or set it to 'packed'",
        )


def config_keys(cls: type[msgspec.Struct] = KVBridgeConfig, prefix: str = "") -> list[str]:
    """All dotted leaf keys of a config Struct, in declaration order (for docs and errors)."""
    keys: list[str] = []
    for field in msgspec.structs.fields(cls):
        sub = _struct_type(field.type)
        if sub is not None:
            keys.extend(config_keys(sub, f"{prefix}{field.name}."))
        else:
            keys.append(f"{prefix}{field.name}")
    return keys


# --- error reporting ---------------------------------------------------------------------


def _struct_type(tp: Any) -> type[msgspec.Struct] | None:
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return tp
    return None


def _fields(cls: type[msgspec.Struct]) -> dict[str, Any]:
    hints = typing.get_type_hints(cls, include_extras=True)
    return {f.name: hints[f.name] for f in msgspec.structs.fields(cls)}


def _check_keys(cls: type[msgspec.Struct], data: Mapping[str, Any], prefix: str) -> None:
    fields = _fields(cls)
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            valid = sorted(fields)
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f"did you mean '{prefix}{close[0]}'? " if close else ""
            raise ConfigError(
                f"unknown config key '{dotted}'",
                key=dotted,
                fix=f"{hint}valid keys: {', '.join(valid)}",
            )
        sub = _struct_type(fields[key])
        if sub is not None and isinstance(value, Mapping):
            _check_keys(sub, value, prefix=f"{dotted}.")


_PATH_RE = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)


def _explain(exc: msgspec.ValidationError) -> ConfigError:
    """Turn msgspec's ``... - at `$.a.b``` message into one naming the key and choices."""
    m = _PATH_RE.match(str(exc))
    assert m is not None  # the pattern matches any string
    msg = m.group("msg")
    path = (m.group("path") or "").lstrip(".")
    path = re.sub(r"\[\d+\]", "", path)
    choices = _choices_at(path)
    fix = f"valid choices: {', '.join(map(repr, choices))}" if choices else None
    if fix is None:
        tp = _type_at(path)
        fix = f"'{path}' takes {_describe(tp)}" if tp is not None else None
    where = f"config key '{path}'" if path else "kvbridge config"
    return ConfigError(f"{where}: {msg[0].lower()}{msg[1:]}", key=path or None, fix=fix)


def _type_at(path: str) -> Any:
    cls: Any = KVBridgeConfig
    tp: Any = None
    for part in path.split(".") if path else []:
        if _struct_type(cls) is None:
            return None
        tp = _fields(cls).get(part)
        cls = tp
    return tp


def _choices_at(path: str) -> tuple[Any, ...]:
    tp = _type_at(path)
    while typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    return ()


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Annotated:
        base, *meta = typing.get_args(tp)
        bounds = []
        for m in meta:
            if isinstance(m, msgspec.Meta):
                if m.gt is not None:
                    bounds.append(f"> {m.gt}")
                if m.ge is not None:
                    bounds.append(f">= {m.ge}")
        return f"{_describe(base)} {' and '.join(bounds)}".strip()
    if origin is Union:
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    sub = _struct_type(tp)
    if sub is not None:
        return f"an object with keys {', '.join(_fields(sub))}"
    return getattr(tp, "__name__", str(tp))


def exposure_warning(cfg: KVBridgeConfig) -> str | None:
    """What a prefill with ``cfg`` exposes, or None: its side channel binds ``host``, so a
    non-loopback ``host`` without a ``secret`` lets anyone who reaches the port shake
    hands (and, P-first on the direct path, read the prefill's KV).

    >>> exposure_warning(KVBridgeConfig()) is None
    True
    >>> exposure_warning(KVBridgeConfig(host="10.0.0.5")).split(":")[0]
    "kvbridge's side channel binds 10.0.0.5 without a 'secret'"
    """
    if cfg.secret is not None or cfg.host == "localhost":
        return None
    try:
        if ipaddress.ip_address(cfg.host.strip("[]")).is_loopback:
            return None
    except ValueError:
        pass  # a host name: it may resolve to anything
    return (
        f"kvbridge's side channel binds {cfg.host} without a 'secret': anyone who reaches that "
        "port can shake hands with this instance (and, in the P-first flow on the direct data "
        "path, read its KV cache). Set the same 'secret' on prefill and decode, and keep KV "
        "traffic on an isolated network (it moves unencrypted)"
    )


__all__ = [
    "KVBridgeConfig",
    "MooncakeOptions",
    "NixlOptions",
    "Timeouts",
    "TransportName",
    "config_keys",
    "exposure_warning",
    "load_config",
]
