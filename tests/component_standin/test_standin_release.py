"""What the release itself decides about KVBridgeConnector, in its own environment (no
server): vLLM 0.33 and 0.34 ask a connector whether it supports sleep mode before an
instance starts (``VllmConfig._verify_kv_transfer_compat``); kvbridge says no, so
``--enable-sleep-mode`` with it is refused with the connector's name, where a yes
would let sleep unmap the KV cache that NIXL or Mooncake registered and peers write
into. (On a platform without sleep mode, such as this stand-in's, vLLM refuses the
flag earlier, for the platform: hence no server here.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.config import KVTransferConfig, VllmConfig

from kvbridge.adapters.vllm import CONNECTOR_NAME, register


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer", "kv_both"])
def test_the_release_refuses_sleep_mode_with_kvbridge(role: str) -> None:
    register()
    config = SimpleNamespace(
        kv_transfer_config=KVTransferConfig(kv_connector=CONNECTOR_NAME, kv_role=role),
        model_config=SimpleNamespace(enable_sleep_mode=True),
    )
    with pytest.raises(ValueError, match=f"{CONNECTOR_NAME} does not support sleep mode"):
        VllmConfig._verify_kv_transfer_compat(config)
    config.model_config.enable_sleep_mode = False
    VllmConfig._verify_kv_transfer_compat(config)  # without sleep mode: nothing to refuse
