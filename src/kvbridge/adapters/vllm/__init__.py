"""kvbridge's vLLM integration: ``KVBridgeConnector`` (see :mod:`.connector`).

:func:`register` is kvbridge's ``vllm.general_plugins`` entry point: vLLM calls it in
every process it starts, and it registers the connector name lazily, so
``--kv-transfer-config '{"kv_connector": "KVBridgeConnector", ...}'`` works without a
module path (``kv_connector_module_path: "kvbridge.adapters.vllm.connector"`` works too),
and routes kvbridge's log records to vLLM's handlers. Importing this package imports
nothing from vLLM.
"""

CONNECTOR_NAME = "KVBridgeConnector"


def register() -> None:
    """Register ``KVBridgeConnector`` with vLLM's connector factory and send kvbridge's
    log records where vLLM's go (idempotent)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "kvbridge.adapters.vllm.connector", "KVBridgeConnector"
        )
    share_vllm_log_handlers()


def share_vllm_log_handlers() -> None:
    """Give the ``kvbridge`` logger the handlers and level of vLLM's ``vllm`` logger,
    so kvbridge's INFO lines (handshakes, start-up) appear in the server's log in vLLM's
    format (vLLM configures only its own logger; without this they would reach Python's
    last-resort handler, WARNING and above). Leaves a ``kvbridge`` logger that already
    has handlers alone, and does nothing when vLLM configured none
    (``VLLM_CONFIGURE_LOGGING=0``: the application's logging config applies)."""
    import logging

    ours, vllm = logging.getLogger("kvbridge"), logging.getLogger("vllm")
    if ours.handlers or not vllm.handlers:
        return
    for handler in vllm.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(vllm.level)
    ours.propagate = False


__all__ = ["CONNECTOR_NAME", "register", "share_vllm_log_handlers"]
