"""How SGLang users configure kvbridge: the ``KVBRIDGE_CONFIG`` environment variable.

SGLang 0.5.23 has no per-backend option for ``--disaggregation-transfer-backend``, so
the prefill and decode servers read kvbridge's config (the keys of
:class:`kvbridge.config.KVBridgeConfig`, checked strictly) from the environment: a JSON
object, or ``@path`` to a JSON file. Unset or empty: all defaults (NIXL).

>>> config_from_env({"KVBRIDGE_CONFIG": '{"transport": "mooncake"}'}).transport
'mooncake'
>>> config_from_env({}).transport
'nixl'
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from kvbridge.config import KVBridgeConfig, load_config
from kvbridge.errors import ConfigError

CONFIG_ENV = "KVBRIDGE_CONFIG"


def config_from_env(environ: Mapping[str, str] | None = None) -> KVBridgeConfig:
    """The kvbridge config of this SGLang server (raises :class:`ConfigError`)."""
    raw = (os.environ if environ is None else environ).get(CONFIG_ENV, "").strip()
    if raw.startswith("@"):
        try:
            with open(raw[1:], encoding="utf-8") as f:
                raw = f.read()
        except OSError as exc:
            raise ConfigError(
                f"{CONFIG_ENV}: cannot read {raw[1:]!r}: {exc}", key=CONFIG_ENV
            ) from exc
    try:
        cfg = load_config(raw or None)
    except ConfigError as exc:
        raise ConfigError(f"{CONFIG_ENV}: {exc.message}", key=exc.key, fix=exc.fix) from exc
    return cfg


def transfer_page_size(config: KVBridgeConfig, page_size: int) -> int:
    """Tokens per page as the backend moves KV (config ``transfer_block_size``; 0: the
    server's ``--page-size``). A server with larger pages addresses each of its pages as
    several transfer pages, so prefill and decode pair when the value divides both page
    sizes (the manager calls this once, at start-up; a prefill with larger pages than
    its decode's also needs a decode without a prefix cache of its own, checked when the
    decode registers).

    Raises:
        ConfigError: naming the key, when the value does not divide ``page_size``.
    """
    unit = config.transfer_block_size or page_size
    if page_size % unit:
        raise ConfigError(
            f"{CONFIG_ENV}: transfer_block_size {unit} must divide this server's --page-size "
            f"({page_size} tokens)",
            key="transfer_block_size",
            fix=(
                "set it to the smaller --page-size of prefill and decode, the same on both "
                "instances (each page size a multiple of it)"
            ),
        )
    return unit


__all__ = ["CONFIG_ENV", "config_from_env", "transfer_page_size"]
