"""Whether this pytest run is a vLLM stand-in run: ``KVBRIDGE_VLLM_STANDIN=1`` and the
stand-in plugin installed (a release's own environment, scripts/setup-vllm-standin.sh).
Who calls: the conftests of tests/component_standin and tests/integration_standin, once
at collection; anywhere else their folders collect nothing."""

from __future__ import annotations

import importlib.util
import os


def active() -> bool:
    return (
        os.environ.get("KVBRIDGE_VLLM_STANDIN") == "1"
        and importlib.util.find_spec("vllm_standin") is not None
    )
