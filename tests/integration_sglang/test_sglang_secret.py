"""The shared ``secret`` on SGLang, kvbridge backend, on CPU (test_sglang_pd.py serves
requests with a secret on both sides). Here the prefill has a secret and the decode
none, the misconfiguration of setting it on one side only: the prefill refuses the
decode's unauthenticated messages, and the request fails on both sides at once (the
router answers within seconds, not at SGLang's 300 s timeouts) naming the fix. Starts
its own prefill + decode + router.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sglang_helpers import expect_refused, server_env, start_pd

pytestmark = pytest.mark.timeout(600)  # starts its servers (a minute or two on 2 cores)


@pytest.mark.extended  # `make test-all` only: the secret's check is unit-tested
def test_a_decode_without_the_prefills_secret_is_refused_naming_the_fix(
    model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    config = {"transport": "nixl", "layerwise": False}
    pairs = start_pd(
        model, tmp_path_factory.mktemp("secret"), server_env(config), False,
        prefill_env=server_env({**config, "secret": "set on the prefill only"}),
    )  # fmt: skip
    pd = next(pairs)
    try:
        text = expect_refused(pd, "a decode without the prefill's secret")
        logs = pd.prefill.log_path.read_text(errors="replace")
        assert "failed authentication: it carries no MAC" in logs, pd.prefill.log_tail()
        assert (
            "refused a decode's Registration" in logs and "refused a decode's Destination" in logs
        ), pd.prefill.log_tail()
        assert "set the same 'secret'" in text, (
            f"the failed request does not name the fix: {text[-2000:]}"
        )
    finally:
        pairs.close()
