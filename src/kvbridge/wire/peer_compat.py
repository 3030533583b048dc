"""Compatibility of two kvbridge instances: what must match before any KV moves.

Everything must match except the tensor-parallel split: a prefill and a decode
instance with different TP sizes share the model's KV heads, cut differently (the
handshake checks the two splits can be paired, see :mod:`kvbridge.core.tp`).

:class:`CompatInfo` lists the properties; :func:`compat_hash` condenses them into the
short string carried by every frame (checked before the frame body is even decoded);
:func:`compat_diff` explains a mismatch property by property.

>>> a = CompatInfo(model="m", dtype="bfloat16", layout="nhd", block_size=16,
...                num_layers=32, num_kv_heads=8, head_dim=128)
>>> b = msgspec.structs.replace(a, block_size=32)
>>> compat_hash(a) == compat_hash(b)
False
>>> compat_diff(a, b)
{'block_size': (16, 32)}
"""

from __future__ import annotations

import hashlib

import msgspec

from kvbridge.core.layout import TOKEN_ROW_LAYOUTS, CacheSpec
from kvbridge.errors import IncompatiblePeerError

#: Version of the kvbridge wire protocol. Bumped only for incompatible changes; new
#: optional fields (with defaults, at the end of a Struct) do not bump it.
PROTOCOL_VERSION = 1


class CompatInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Properties two peers must share for their KV caches to be exchanged."""

    model: str
    """Model identity as the engine names it (path or hub id)."""
    dtype: str
    layout: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    """KV heads per rank."""
    head_dim: int
    tp_size: int = 1
    wire_dtype: str = "exact"
    """What KV values travel (config ``wire_dtype``)."""
    total_kv_heads: int = 0
    """KV heads of the model (before the TP split); 0: ``num_kv_heads * tp_size``."""
    data_path: str = "direct"
    """How KV moves (config ``data_path``, resolved: ``direct`` or ``packed``): both
    sides must pack or neither."""
    layer_groups: tuple[int, ...] = ()
    """Per layer (model order), the KV cache group whose block ids it uses
    (:mod:`kvbridge.core.blocks`); empty: one group (every engine without vLLM's hybrid
    KV cache manager)."""
    group_windows: tuple[int, ...] = ()
    """Per KV cache group, its sliding window in tokens, 0 for full attention; empty
    with ``layer_groups``."""
    group_states: tuple[str, ...] = ()
    """Per KV cache group, what a state-space group keeps per request (its kind, the
    shapes, dtypes and order of its state tensors: the bytes a state block holds), ""
    for an attention group; empty when no group is a state-space one."""

    @property
    def num_groups(self) -> int:
        return max(self.layer_groups, default=0) + 1

    @property
    def model_kv_heads(self) -> int:
        return self.total_kv_heads or self.num_kv_heads * self.tp_size

    @property
    def layout_key(self) -> str:
        """What of the cache layout peers must share: the layout itself, except that on
        the packed path every layout of per-token rows (NHD, HND, K|V per token and
        head: :data:`~kvbridge.core.layout.TOKEN_ROW_LAYOUTS`) packs a block into the
        same rows (one per plane, token and head: ``csrc/PACKED_FORMAT.md``), so any
        pairs with any (e.g. a vLLM prefill that stores tokens first with a decode that
        stores heads first)."""
        return (
            "rows"
            if self.data_path == "packed" and self.layout in TOKEN_ROW_LAYOUTS
            else self.layout
        )

    @classmethod
    def from_spec(
        cls,
        spec: CacheSpec,
        *,
        model: str,
        tp_size: int = 1,
        wire_dtype: str = "exact",
        total_kv_heads: int = 0,
        data_path: str = "direct",
        layer_groups: tuple[int, ...] = (),
        group_windows: tuple[int, ...] = (),
        group_states: tuple[str, ...] = (),
    ) -> CompatInfo:
        """``data_path``: ``KVBridgeConfig.resolved_data_path``."""
        return cls(
            model=model,
            dtype=spec.dtype,
            layout=spec.layout,
            block_size=spec.block_size,
            num_layers=spec.num_layers,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            tp_size=tp_size,
            wire_dtype=wire_dtype,
            total_kv_heads=total_kv_heads,
            data_path=data_path,
            layer_groups=layer_groups,
            group_windows=group_windows,
            group_states=group_states,
        )


_TP_SPLIT = ("num_kv_heads", "tp_size", "total_kv_heads")
"""Fields that describe how a rank's TP split cuts the model's heads: they may differ
between peers (checked at the handshake, :mod:`kvbridge.core.tp`) and are left out of
the hash, which carries the model's head count instead."""


_SINCE_V1 = ("layer_groups", "group_windows", "group_states")
"""Fields added after the first release of the hash: hashed only when set, so that
peers that do not use them keep the hash they had."""


def _shared(info: CompatInfo) -> dict[str, object]:
    """What peers must share, property by property (what :func:`compat_hash` hashes)."""
    out: dict[str, object] = {
        f: info.layout_key if f == "layout" else getattr(info, f)
        for f in info.__struct_fields__
        if f not in _TP_SPLIT
    }
    out["model_kv_heads"] = info.model_kv_heads
    return out


def shared_value(info: CompatInfo, field: str) -> object:
    """The value of a property peers must share, as :func:`compat_digests` digests it."""
    return _shared(info)[field]


def compat_digests(info: CompatInfo, salt: bytes) -> dict[str, str]:
    """Per property peers must share, a digest of its value under ``salt``: what a
    prefill answers a peer whose compatibility hash differs, so that the peer can name
    the properties that differ (:func:`digest_diff`) without learning our values. A
    value from a short list (a dtype, a block size; a model name someone can guess) can
    still be found by trying candidates against its digest: the salt only makes each
    answer need its own tries.

    >>> a = CompatInfo(model="m", dtype="bfloat16", layout="nhd", block_size=16,
    ...                num_layers=32, num_kv_heads=8, head_dim=128)
    >>> digest_diff(a, compat_digests(msgspec.structs.replace(a, model="n"), b"s"), b"s")
    ['model']
    """
    return {
        f: hashlib.sha256(
            b"kvbridge-compat-field\0" + salt + msgspec.msgpack.encode([f, value])
        ).hexdigest()[:16]
        for f, value in _shared(info).items()
    }


def digest_diff(ours: CompatInfo, digests: dict[str, str], salt: bytes) -> list[str]:
    """The properties whose digest (:func:`compat_digests`) differs from ours; those the
    peer did not send (another version) are not compared."""
    mine = compat_digests(ours, salt)
    return [f for f, d in digests.items() if f in mine and mine[f] != d]


def compat_hash(info: CompatInfo) -> str:
    """16 hex characters identifying what every pair of peers must share (stable
    across processes and versions of msgspec: values are encoded in field order)."""
    shared = [
        info.layout_key if f == "layout" else getattr(info, f)
        for f in info.__struct_fields__
        if f not in _TP_SPLIT and not (f in _SINCE_V1 and not getattr(info, f))
    ] + [info.model_kv_heads]
    payload = msgspec.msgpack.encode(shared)
    return hashlib.sha256(b"kvbridge-compat-v3\0" + payload).hexdigest()[:16]


def hashed_diff(ours: CompatInfo, theirs: CompatInfo) -> dict[str, tuple[object, object]]:
    """``{property: (ours, theirs)}`` for every property of :func:`compat_hash` that
    differs (the TP split's fields are not among them: the model's head count is)."""
    a, b = _shared(ours), _shared(theirs)
    return {f: (a[f], b[f]) for f in a if a[f] != b[f]}


def compat_diff(ours: CompatInfo, theirs: CompatInfo) -> dict[str, tuple[object, object]]:
    """``{field: (ours, theirs)}`` for every property that differs."""
    return {
        f: (getattr(ours, f), getattr(theirs, f))
        for f in ours.__struct_fields__
        if getattr(ours, f) != getattr(theirs, f)
        and not (f == "layout" and ours.layout_key == theirs.layout_key)
    }


def settings_mismatch(
    peer: str, ours: dict[str, object], theirs: dict[str, object]
) -> IncompatiblePeerError | None:
    """The kvbridge settings two peers must share (``transport``, ``wire_dtype``,
    ``data_path``: name -> value, the same names on both sides) that differ, as one
    error naming each value and the fix; None when they match. Called when a peer
    introduces itself: by :class:`kvbridge.runtime.node.Node` at a handshake, by the
    SGLang prefill at a decode's registration.

    >>> err = settings_mismatch("d", {"transport": "nixl"}, {"transport": "mooncake"})
    >>> err.message, err.differences
    ("peer d uses transport 'mooncake', this instance 'nixl'", {'transport': ('nixl', 'mooncake')})
    >>> err.fix
    "set the same 'transport' in the kvbridge config (KVBRIDGE_CONFIG) of prefill and decode"
    """
    differences = {k: (v, theirs[k]) for k, v in ours.items() if theirs[k] != v}
    if not differences:
        return None
    said = ", ".join(f"{k} {b!r}" for k, (_, b) in differences.items())
    mine = ", ".join(f"{a!r}" for a, _ in differences.values())
    return IncompatiblePeerError(
        f"peer {peer} uses {said}, this instance {mine}",
        differences=differences,
        fix=(
            "set the same "
            + ", ".join(f"'{k}'" for k in differences)
            + " in the kvbridge config (KVBRIDGE_CONFIG) of prefill and decode"
        ),
    )


__all__ = [
    "PROTOCOL_VERSION",
    "CompatInfo",
    "compat_diff",
    "compat_digests",
    "compat_hash",
    "digest_diff",
    "hashed_diff",
    "settings_mismatch",
    "shared_value",
]
