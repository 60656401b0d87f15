"""The vLLM plugin's settings (ple.integrations.vllm.settings): PLE_OFFLOAD,
PLE_GATHER_*, the tiers, PLE_LOOKAHEAD_MIB and the PLE_CONFIG file, and
their errors.  Needs no
vLLM; the entry point is in ple's metadata."""

from __future__ import annotations

import importlib.metadata
import json

import pytest

import ple
from ple.integrations.vllm import Settings, settings


def test_unset_the_plugin_does_nothing():
    assert settings({}) == Settings()
    assert not settings({"PLE_OFFLOAD": ""}).active


@pytest.mark.parametrize("value, offload", [
    ("auto", "auto"), ("none", ()),
    ("model.self_decoder.embed_tokens_per_layer, language_model.model.x",
     ("model.self_decoder.embed_tokens_per_layer", "language_model.model.x")),
    ("model.layers.1.ple.ple_embedding.ngram_embedding",
     ("model.layers.1.ple.ple_embedding.ngram_embedding",))])
def test_offload(value, offload):
    assert settings({"PLE_OFFLOAD": value}).offload == offload


def test_gather_and_tiers_from_the_environment():
    got = settings({"PLE_OFFLOAD": "auto", "PLE_GATHER_POLICY": "all",
                    "PLE_GATHER_ROW_CACHE_MIB": "64", "PLE_GATHER_IO": "direct",
                    "PLE_HOST_ROWS": "1000"})
    assert got == Settings("auto", ple.GatherConfig(policy="all", row_cache_mib=64, io="direct"),
                           host_rows=1000)


def test_the_environment_wins_over_the_file(tmp_path):
    path = tmp_path / "ple.json"
    path.write_text(json.dumps({"offload": "auto", "gather": {"threads": 2, "policy": "none"},
                                "device_rows": 5}))
    got = settings({"PLE_CONFIG": str(path), "PLE_GATHER_POLICY": "window"})
    assert got == Settings("auto", ple.GatherConfig(threads=2, policy="window"), device_rows=5)


@pytest.mark.parametrize("environ, message", [
    ({"PLE_GATHER_WINDOW": "4"}, r"unknown PLE_GATHER_WINDOW: the GatherConfig fields are "
                                 r"PLE_GATHER_POLICY, PLE_GATHER_PREFETCH_WINDOW_KIB"),
    ({"PLE_GATHER_THREADS": "many"}, r"PLE_GATHER_THREADS='many' is not an integer \(threads\)"),
    ({"PLE_GATHER_THREADS": "0"}, r"bad gather setting .*threads must be at least 1"),
    ({"PLE_GATHER_POLICY": "fast"}, r"unknown prefetch policy 'fast'"),
    ({"PLE_HOST_ROWS": "-1"}, r"PLE_HOST_ROWS must be a count of rows .* not '-1'"),
    ({"PLE_OFFLOAD": " , "}, r"PLE_OFFLOAD=\[' ', ' '\] names no module"),
    ({"PLE_LOOKAHEAD_MIB": "lots"}, r"PLE_LOOKAHEAD_MIB must be MiB of rows read ahead, an "
                                    r"integer in \[0, 256\] \(0: no lookahead\), not 'lots'"),
    ({"PLE_LOOKAHEAD_MIB": "257"}, r"PLE_LOOKAHEAD_MIB must be .* not '257'"),
    ({"PLE_LOOKAHEAD_MIB": "-1"}, r"PLE_LOOKAHEAD_MIB must be .* not '-1'"),
])
def test_bad_settings_name_what_is_wrong(environ, message):
    with pytest.raises(ValueError, match=message):
        settings(environ)


def test_lookahead_is_64_mib_unless_set():
    assert settings({}).lookahead_mib == 64
    assert settings({"PLE_LOOKAHEAD_MIB": "0"}).lookahead_mib == 0
    assert settings({"PLE_LOOKAHEAD_MIB": "256"}).lookahead_mib == 256


def test_lookahead_from_the_file_and_the_environment(tmp_path):
    path = tmp_path / "ple.json"
    path.write_text(json.dumps({"offload": "auto", "lookahead_mib": 0}))
    assert settings({"PLE_CONFIG": str(path)}).lookahead_mib == 0
    assert settings({"PLE_CONFIG": str(path), "PLE_LOOKAHEAD_MIB": "8"}).lookahead_mib == 8


@pytest.mark.parametrize("value", [1.5, True, -1, 300])
def test_a_bad_lookahead_in_the_file_is_named(tmp_path, value):
    path = tmp_path / "ple.json"
    path.write_text(json.dumps({"lookahead_mib": value}))
    with pytest.raises(ValueError, match=r"'lookahead_mib' of .*ple.json must be MiB of rows "
                                         r"read ahead, an integer in \[0, 256\]"):
        settings({"PLE_CONFIG": str(path)})


@pytest.mark.parametrize("content, message", [
    ("{", r"is not JSON"), ("[1]", r"holds a list, not a JSON object"),
    ('{"offload": "auto", "tiers": 3}', r"has unknown keys \['tiers'\]"),
    ('{"gather": 3}', r"'gather' of .* must be an object of GatherConfig fields"),
])
def test_a_bad_config_file_is_named(tmp_path, content, message):
    path = tmp_path / "ple.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        settings({"PLE_CONFIG": str(path)})
    with pytest.raises(ValueError, match=r"PLE_CONFIG=.*missing.json: No such file"):
        settings({"PLE_CONFIG": str(tmp_path / "missing.json")})


def test_the_entry_point_is_in_ples_metadata():
    (entry,) = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins")
                if e.dist is not None and e.dist.name == "ple"]
    assert entry.value == "ple.integrations.vllm:register"
