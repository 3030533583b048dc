"""``kvbridge proxy``: OpenAI-compatible front dispatching to prefill/decode instances
(see :mod:`.app`). Imports aiohttp, so import it only where the proxy runs."""
