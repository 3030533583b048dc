"""The shipped example works on both real transports; transports refuse what they
cannot do instead of silently doing something else."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge.config import load_config
from kvbridge.errors import TransportUnavailableError
from kvbridge.transports import create_transport
from kvbridge.transports.common import rdma_devices

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "stream_layers.py"


@pytest.mark.parametrize("transport", ["nixl", "mooncake"])
def test_stream_layers_example(transport: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), transport],
        check=False,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "decode: layers [0, 1, 2, 3] arrived; 5 blocks in every layer verified" in proc.stdout
    assert proc.stdout.strip().endswith("verified")


def test_mooncake_refuses_rdma_without_a_device() -> None:
    cfg = load_config({"transport": "mooncake", "mooncake": {"protocol": "rdma"}})
    if rdma_devices():
        pytest.skip("this machine has RDMA devices; the refusal only applies without them")
    with pytest.raises(TransportUnavailableError, match="no RDMA device") as info:
        create_transport("mooncake", cfg, agent_name="rdma-probe")
    assert "mooncake.protocol to 'tcp'" in str(info.value)


def test_nixl_refuses_backends_it_does_not_have() -> None:
    cfg = load_config({"nixl": {"backends": ["NO_SUCH_BACKEND"]}})
    with pytest.raises(TransportUnavailableError, match="NO_SUCH_BACKEND") as info:
        create_transport("nixl", cfg, agent_name="nixl-probe")
    assert "UCX" in (info.value.fix or ""), "the fix lists the plugins that exist"
