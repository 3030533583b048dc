"""kvbridge's vLLM integration: ``KVBridgeConnector`` (see :mod:`.connector`).

:func:`register` is kvbridge's ``vllm.general_plugins`` entry point: vLLM calls it in
every process it starts, and it registers the connector name lazily, so
``--kv-transfer-config '{"kv_connector": "KVBridgeConnector", ...}'`` works without a
module path (``kv_connector_module_path: "kvbridge.adapters.vllm.connector"`` works too).
Importing this package imports nothing from vLLM.
"""

CONNECTOR_NAME = "KVBridgeConnector"


def register() -> None:
    """Register ``KVBridgeConnector`` with vLLM's connector factory (idempotent)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "kvbridge.adapters.vllm.connector", "KVBridgeConnector")


__all__ = ["CONNECTOR_NAME", "register"]
