"""The vLLM stand-in tier: ``make test`` runs it for vLLM 0.33 and 0.34 (scripts/test.sh).

Runs in a release's own environment (``scripts/setup-vllm-standin.sh 0.34.0``), with
``KVBRIDGE_VLLM_STANDIN=1`` in the test process's environment so that every vLLM server
it starts inherits it and runs the stand-in forward (``tests/vllm_standin``):

    KVBRIDGE_VLLM_STANDIN=1 .venv-vllm-0.34/bin/python -m pytest tests/integration_standin

The engine modules of ``tests/integration`` run the same way (``test_vllm_pd.py``: all
but the prompt-logprobs test pass on 0.33.0 and 0.34.0, the stand-in computes no
logits). Anywhere else this directory collects nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import standin_gate

_ACTIVE = standin_gate.active()

collect_ignore_glob = [] if _ACTIVE else ["test_*.py"]

# the engine tests' helpers (engine_helpers)
sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))

if _ACTIVE:
    from kvbridge.demo.servers import ServerProcess, VllmServer

    ServerProcess.omp_threads = 1  # as in tests/integration/conftest.py
    ServerProcess.preload = True  # likewise

    # the stand-in's cache is plain host memory, allocated whole: 64 MiB holds the
    # tier's longest prompts many times over, and keeps six instances small
    VllmServer.kv_cache_mb = 64
