"""Component tests of the SGLang backend: kvbridge's SGLang classes on SGLang's own
modules, with no server started (run in ``.venv-sglang``, beside
``tests/integration_sglang``, whose tests start real SGLang servers)."""
