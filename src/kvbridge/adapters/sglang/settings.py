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
            raise ConfigError(f"{CONFIG_ENV}: cannot read {raw[1:]!r}: {exc}", key=CONFIG_ENV) from exc
    try:
        cfg = load_config(raw or None)
    except ConfigError as exc:
        raise ConfigError(f"{CONFIG_ENV}: {exc.message}", key=exc.key, fix=exc.fix) from exc
    return cfg


def check_page_size(config: KVBridgeConfig, page_size: int) -> None:
    """Refuse a ``transfer_block_size`` other than SGLang's page size: the backend moves
    whole pages (the manager calls it once, at start-up)."""
    if config.transfer_block_size not in (0, page_size):
        raise ConfigError(
            f"{CONFIG_ENV}: transfer_block_size {config.transfer_block_size}: the SGLang backend moves KV in SGLang's pages ({page_size} tokens)",
            key="transfer_block_size",
            fix="leave it 0 and give prefill and decode the same --page-size",
        )


__all__ = ["CONFIG_ENV", "check_page_size", "config_from_env"]
