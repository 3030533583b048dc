"""The README stays true to the code it documents."""

from __future__ import annotations

from pathlib import Path

import msgspec

from kvbridge.config import KVBridgeConfig, config_keys

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_readme_documents_every_config_key_with_its_default() -> None:
    defaults = msgspec.json.decode(msgspec.json.encode(KVBridgeConfig()))
    for key in config_keys():
        value = defaults
        for part in key.split("."):
            value = value[part]
        row = next((line for line in README.splitlines() if line.startswith(f"| `{key}` |")), None)
        assert row is not None, f"README's config table lacks {key}"
        shown = row.split("|")[2].strip().strip("`")
        assert msgspec.json.decode(shown) == value, (
            f"README shows {key} = {shown}, code default is {value!r}"
        )
