"""Component tests of the vLLM stand-in tier: the stand-in forward's contract and what a
release itself decides about kvbridge's connector, in a release's own environment, with
no server started (``tests/integration_standin``, beside them, starts real servers).

Run like the stand-in tier (scripts/test.sh runs both folders for 0.33 and 0.34):

    KVBRIDGE_VLLM_STANDIN=1 .venv-vllm-0.34/bin/python -m pytest tests/component_standin

Anywhere else this directory collects nothing.
"""

from __future__ import annotations

import standin_gate

collect_ignore_glob = [] if standin_gate.active() else ["test_*.py"]
