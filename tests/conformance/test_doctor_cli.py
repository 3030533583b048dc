"""`kvbridge doctor` and `kvbridge config` as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge import doctor
from kvbridge.transports import registry
from kvbridge.transports.registry import TransportEntry, register_transport

KVBRIDGE = [sys.executable, "-m", "kvbridge.cli"]


def test_doctor_reports_both_real_transports_working() -> None:
    proc = subprocess.run(
        [*KVBRIDGE, "doctor", "--json"], check=False, capture_output=True, text=True, timeout=300
    )
    report = json.loads(proc.stdout)
    by_name = {c["transport"]: c for c in report["transports"]}
    for name in ("nixl", "mooncake"):
        check = by_name[name]
        assert check["imports"] and check["works"], check
        assert "verified" in " ".join(check["steps"]) and check["write_gbps"] > 0
    assert proc.returncode == 0
    assert report["environment"]["cpus"] >= 1


def test_doctor_names_the_fix_for_a_transport_that_does_not_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "kvb_doctor_broken.py").write_text(
        "raise ImportError('libibverbs.so.1: cannot open shared object file')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    # a registry of this test's own: "broken" must not outlive it
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    register_transport(
        TransportEntry(
            "broken",
            "kvb_doctor_broken:T",
            "test",
            "pip install x",
            hints=((r"libibverbs", "apt-get install -y libibverbs1"),),
        )
    )
    check = doctor.check_transport("broken")
    assert not check.imports and not check.works
    assert check.fix == "apt-get install -y libibverbs1"
    assert "libibverbs.so.1" in check.detail


def test_config_command_validates_and_prints(tmp_path: Path) -> None:
    ok = subprocess.run(
        [*KVBRIDGE, "config", '{"transport": "mooncake"}', "--json"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0 and json.loads(ok.stdout)["transport"] == "mooncake"
    cfg = tmp_path / "kv.json"
    cfg.write_text('{"timeouts": {"lease_s": "long"}}')
    bad = subprocess.run(
        [*KVBRIDGE, "config", f"@{cfg}"], check=False, capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2
    assert "timeouts.lease_s" in bad.stderr and "takes float > 0" in bad.stderr
