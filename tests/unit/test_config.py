from __future__ import annotations

import json

import pytest

from kvbridge.config import KVBridgeConfig, config_keys, load_config
from kvbridge.errors import ConfigError


def test_defaults_and_overrides() -> None:
    assert load_config(None) == KVBridgeConfig() == load_config({}) == load_config("{}")
    cfg = load_config(
        {"transport": "mooncake", "timeouts": {"lease_s": 7}, "nixl": {"backends": ["UCX", "GDS"]}}
    )
    assert cfg.transport == "mooncake"
    assert (
        cfg.timeouts.lease_s == 7.0
        and cfg.timeouts.transfer_s == KVBridgeConfig().timeouts.transfer_s
    )
    assert cfg.nixl.backends == ("UCX", "GDS")


@pytest.mark.parametrize(
    ("doc", "key", "in_message"),
    [
        ({"transprot": "nixl"}, "transprot", "did you mean 'transport'"),
        ({"timeouts": {"lease": 3}}, "timeouts.lease", "did you mean 'timeouts.lease_s'"),
        (
            {"nixl": {"bogus": 1}},
            "nixl.bogus",
            "valid keys: backends, num_threads, progress_thread",
        ),
        ({"transport": "tcp"}, "transport", "valid choices: 'nixl', 'mooncake'"),
        ({"mooncake": {"protocol": "ib"}}, "mooncake.protocol", "valid choices: 'tcp', 'rdma'"),
        ({"timeouts": {"lease_s": -1}}, "timeouts.lease_s", "takes float > 0"),
        ({"timeouts": {"lease_s": "30"}}, "timeouts.lease_s", "expected `float`, got `str`"),
        (
            {"mooncake": {"max_queued_transfers_per_peer": 70000}},
            "mooncake.max_queued_transfers_per_peer",
            "<= 65535",
        ),
        ({"nixl": {"backends": "UCX"}}, "nixl.backends", "takes a list of str"),
        ({"timeouts": 5}, "timeouts", "an object with keys handshake_s"),
        ({"wire_dtype": "fp8", "data_path": "direct"}, "data_path", "set it to 'packed'"),
        ({"data_path": "staged"}, "data_path", "valid choices: 'auto', 'direct', 'packed'"),
    ],
)
def test_bad_keys_name_the_key_and_the_fix(doc: dict, key: str, in_message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(doc)
    assert info.value.key == key
    assert key in str(info.value)
    assert in_message in str(info.value)


@pytest.mark.parametrize("doc", ["[1, 2]", "{not json", 42])
def test_documents_that_are_not_objects(doc: object) -> None:
    with pytest.raises(ConfigError, match="fix: pass a"):
        load_config(doc)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("doc", "packed"),
    [
        ({}, False),
        ({"wire_dtype": "fp8"}, True),
        ({"data_path": "packed"}, True),
        ({"wire_dtype": "fp8", "data_path": "packed"}, True),
        ({"data_path": "direct"}, False),
    ],
)
def test_data_path_resolves_auto_by_wire_dtype(doc: dict, packed: bool) -> None:
    assert load_config(doc).packed is packed
    assert load_config(doc).resolved_data_path == ("packed" if packed else "direct")


def test_config_is_frozen() -> None:
    cfg = load_config({})
    with pytest.raises(AttributeError):
        cfg.transport = "mooncake"  # type: ignore[misc]


def test_config_keys_lists_every_leaf() -> None:
    keys = config_keys()
    assert "transport" in keys and "timeouts.lease_s" in keys and "mooncake.workers" in keys
    assert not any(k in ("timeouts", "nixl", "mooncake") for k in keys)


def test_a_hand_built_config_is_checked_like_a_loaded_one() -> None:
    """Adapters and tests build configs without load_config too: fp8 through the direct
    path is refused there, with the same key and fix."""
    with pytest.raises(ConfigError, match="set it to 'packed'") as info:
        KVBridgeConfig(wire_dtype="fp8", data_path="direct")
    assert info.value.key == "data_path"
    assert KVBridgeConfig(wire_dtype="fp8").resolved_data_path == "packed"


@pytest.mark.parametrize(
    ("cfg", "exposed"),
    [
        ({}, False),
        ({"host": "::1"}, False),
        ({"host": "localhost"}, False),
        ({"host": "10.0.0.5"}, True),
        ({"host": "0.0.0.0"}, True),
        ({"host": "prefill-0.internal"}, True),
        ({"host": "10.0.0.5", "secret": "s"}, False),
    ],
)
def test_a_side_channel_on_the_network_without_a_secret_is_warned_of(
    cfg: dict, exposed: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvbridge import cli
    from kvbridge.config import exposure_warning

    warning = exposure_warning(load_config(cfg))
    assert (warning is not None) == exposed
    assert cli.main(["config", json.dumps(cfg)]) == 0
    err = capsys.readouterr().err
    assert ("without a 'secret'" in err) == exposed and ("isolated network" in err) == exposed


def test_doctor_warns_of_a_config_that_exposes_the_side_channel(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvbridge import cli

    args = ["doctor", "--json", "--transport", "loopback", "--config"]
    assert cli.main([*args, '{"host": "192.168.1.7"}']) == 0
    assert "without a 'secret'" in json.loads(capsys.readouterr().out)["warnings"][0]
    assert cli.main([*args, '{"host": "192.168.1.7", "secret": "s"}']) == 0
    assert json.loads(capsys.readouterr().out)["warnings"] == []
