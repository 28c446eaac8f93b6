"""The vLLM sections of README.md and docs/vllm.md against the code they document.

The command lines and settings run without vLLM; the metrics and layouts need it.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import re
from pathlib import Path
from typing import Any

import pytest

import kvtier.adapters.vllm.config as vllm_config
from kvtier.adapters.vllm.config import offload_config_from_vllm
from kvtier.core.policies import ADMISSION_POLICIES, EVICTION_POLICIES, PolicySpec
from kvtier.offload.config import OffloadConfig

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", "docs/vllm.md"]


def vllm_section(doc: str) -> str:
    text = (ROOT / doc).read_text(encoding="utf-8")
    start = text.index("## Using kvtier with vLLM")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def subsection(doc: str, title: str) -> str:
    section = vllm_section(doc)
    start = section.index(f"### {title}")
    end = section.find("\n### ", start + 1)
    return section[start:] if end < 0 else section[start:end]


def flags(doc: str, flag: str) -> list[dict[str, Any]]:
    """Return the JSON of every `flag '...'` in the section's bash blocks."""
    blocks = re.findall(r"```bash\n(.*?)```", vllm_section(doc), re.S)
    return [
        json.loads(arg) for block in blocks for arg in re.findall(f"{flag} '(.*?)'", block, re.S)
    ]


def settings_rows(doc: str) -> dict[str, list[str]]:
    rows = re.findall(r"^\| `(\w+)` \|(.*)\|$", subsection(doc, "Settings"), re.M)
    return {key: [cell.strip() for cell in cells.split("|")] for key, cells in rows}


@pytest.mark.parametrize("doc", DOCS)
def test_every_documented_command_line_is_accepted(doc: str) -> None:
    configs = flags(doc, "--kv-transfer-config")
    assert len(configs) == 4  # CPU tier, disk tier, the cascade, KV events
    for config in configs:
        assert config["kv_connector"] == "KVTierConnector"
        assert config["kv_connector_module_path"] == "kvtier.adapters.vllm"
        offload_config_from_vllm(config["kv_connector_extra_config"], 1, 2048, events=False)
    assert [c["enable_kv_cache_events"] for c in flags(doc, "--kv-events-config")] == [True]


def code_default(key: str) -> object:
    defaults = {f.name: f.default for f in dataclasses.fields(OffloadConfig)}
    if key == "policy":
        return PolicySpec(defaults["eviction_policy"], defaults["admission_policy"]).name
    if key == "disk_direct_io":  # another spelling of disk_io_mode: no default of its own
        return None
    value = defaults[key]
    return value.value if isinstance(value, enum.Enum) else value


def parse_default(cell: str) -> object:
    if cell in ("—", "from the budget"):  # unset
        return None
    if cell in ("false", "true"):
        return cell == "true"
    return json.loads(cell.strip("`"))


@pytest.mark.parametrize("doc", DOCS)
def test_documented_settings_defaults_are_the_configs(doc: str) -> None:
    rows = settings_rows(doc)
    assert {"cpu_bytes", "disk_bytes", "disk_path", "cascade", "store_mode", "policy"} <= set(rows)
    for key, (default, _) in rows.items():
        documented, code = parse_default(default), code_default(key)
        unset = code is None or (type(code) is int and code == 0)
        assert documented == code or (documented is None and unset), (key, default, code)


@pytest.mark.parametrize("doc", DOCS)
def test_documented_settings_are_the_keys_the_connector_takes(doc: str) -> None:
    keys = set(vllm_config._KEYS) - {"disk_persist"}  # refused unless false: in the prose
    own = keys - set(vllm_config._ALIASES)
    assert table_keys(doc) == own
    assert keys <= set(re.findall(r"`([a-z_]+)`", subsection(doc, "Settings")))


def test_the_config_docstring_names_every_key_of_kvtiers_spelling() -> None:
    # Regression: it listed kvtier's own keys without token_check.
    own = set(vllm_config._KEYS) - set(vllm_config._ALIASES) - {"disk_persist"}
    named = set(re.findall(r"`([a-z_]+)`", vllm_config.__doc__ or ""))
    assert sorted(own - named) == []


def table_keys(doc: str) -> set[str]:
    """The keys in the first column of the Settings table (a row may name two)."""
    lines = subsection(doc, "Settings").splitlines()
    rows = [line.split("|")[1] for line in lines if line.startswith("| `")]
    return {key for row in rows for key in re.findall(r"`([a-z_]+)`", row)}


def test_documented_policy_names_are_the_registered_ones() -> None:
    for doc in DOCS:  # README gives examples, docs/vllm.md the list
        for name in re.findall(r'`"?([a-z0-9+]+)"?`', settings_rows(doc)["policy"][1]):
            if name.startswith("+"):  # "optionally `+door`"
                assert name[1:] in ADMISSION_POLICIES
            else:
                PolicySpec.parse(name)
    listed = set(re.findall(r"`\+?([a-z0-9]+)`", settings_rows("docs/vllm.md")["policy"][1]))
    assert listed == {*EVICTION_POLICIES, *ADMISSION_POLICIES} - {"all"}


@pytest.mark.parametrize("doc", DOCS)
def test_documented_metrics_are_the_registered_ones(doc: str) -> None:
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvtier.adapters.vllm.stats import INFO_LABELS, KVTierPromMetrics

    registry = CollectorRegistry()
    kinds = {
        kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)
    }
    KVTierPromMetrics(SimpleNamespace(kv_transfer_config=None), kinds, ["engine"], {0: ["0"]})
    families = list(registry.collect())
    registered = {f.name + ("_total" if f.type == "counter" else "") for f in families}
    table = subsection(doc, "Metrics")
    assert set(re.findall(r"`(kvtier:[a-z_]+)", table)) == registered
    info = re.search(r"`kvtier:info\{([^}]*)\}`", table)
    assert info is not None
    assert tuple(info.group(1).split(", ")) == INFO_LABELS


@pytest.mark.parametrize("doc", DOCS)
def test_documented_layouts_are_the_accepted_ones(doc: str) -> None:
    pytest.importorskip("vllm")
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kvtier.adapters.vllm.regions import is_block_compact

    requirements = subsection(doc, "Requirements and limits").split("\n- ")[1]
    documented = set(re.findall(r"`([A-Z]{5})`", requirements))
    assert documented == {layout.name for layout in KVCacheLayout if is_block_compact(layout.name)}
