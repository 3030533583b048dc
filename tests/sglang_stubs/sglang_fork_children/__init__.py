"""Test-only SGLang plugin: SGLang's subprocesses (scheduler, detokenizer, DP
controller) start by ``fork`` instead of ``spawn`` where ``KVBRIDGE_TEST_SGLANG_FORK=1``.

Why: SGLang forces ``multiprocessing``'s ``spawn`` (``_set_envs_and_config``), for CUDA;
each spawned child is a fresh interpreter that imports torch and SGLang again, about 9
CPU-seconds for the scheduler and 8 for the detokenizer on the test machine, three
quarters of an SGLang test server's start. On CPU nothing forbids ``fork`` (vLLM's engine
core starts so on CPU by default), and a test server forked from a fork server that
imported those modules (``kvbridge.demo.forkserver``; the tests' conftest) starts its
children with nothing left to import. The process tree is SGLang's own: the children are
the server's, as with ``spawn``. The tests set the variable; the demo, the benchmarks and
users' servers never do.
"""

from __future__ import annotations

import os

SET_ENVS = "sglang.srt.entrypoints.engine._set_envs_and_config"
"""Where SGLang sets the start method (``mp.set_start_method("spawn", force=True)``)."""
ENABLE = "KVBRIDGE_TEST_SGLANG_FORK"


def register() -> None:
    """Entry point (group ``sglang.srt.plugins``), run in every SGLang process."""
    if os.environ.get(ENABLE) != "1":
        return
    import multiprocessing

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def around_set_envs(original, *args, **kwargs):
        result = original(*args, **kwargs)
        multiprocessing.set_start_method("fork", force=True)
        return result

    HookRegistry.register(SET_ENVS, around_set_envs, HookType.AROUND)
