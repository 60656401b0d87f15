"""The vLLM plugin's settings (ple.integrations.vllm.settings): PLE_OFFLOAD,
PLE_GATHER_*, the tiers, PLE_LOOKAHEAD_MIB and the PLE_CONFIG file, and
their errors: each bad setting a ValueError that names where it was set and
what it accepts, raised when the plugin loads (and at an engine's first
step).  Needs no vLLM but for the first step; the entry point is in ple's
metadata."""

from __future__ import annotations

import importlib.metadata
import json
import re
from types import SimpleNamespace

import pytest
import torch

import ple
from ple.integrations.vllm import register
from ple.integrations.vllm.settings import Settings, settings


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
    ({"PLE_GATHER_WINDOW": "4"}, r"unknown variable PLE_GATHER_WINDOW \(did you mean "
                                 r"PLE_GATHER_PREFETCH_WINDOW_KIB\?\): the plugin reads "
                                 r"PLE_OFFLOAD, "
                                 r"PLE_CONFIG, PLE_GATHER_POLICY, "
                                 r"PLE_GATHER_PREFETCH_WINDOW_KIB, .* spelled exactly so"),
    ({"PLE_GATHER_THREADS": "many"}, r"^ple: PLE_GATHER_THREADS='many' is not an integer: "
                                     r"threads takes threads, an integer in \[1, 256\]$"),
    ({"PLE_GATHER_THREADS": "2.0"}, r"^ple: PLE_GATHER_THREADS='2.0' is not an integer"),
    ({"PLE_GATHER_THREADS": "0"}, r"^ple: PLE_GATHER_THREADS='0': threads must be at least 1, "
                                  r"got 0 \(the range is \[1, 256\]\)$"),
    ({"PLE_GATHER_IO_BLOCK_BYTES": "3"}, r"^ple: PLE_GATHER_IO_BLOCK_BYTES='3': io_block_bytes "
                                         r"must be 0 or a power of two, got 3$"),
    ({"PLE_GATHER_POLICY": "fast"}, r"^ple: PLE_GATHER_POLICY='fast': unknown prefetch policy "
                                    r"'fast'; expected one of \('window', 'distance', 'all', "
                                    r"'none'\)$"),
    ({"PLE_GATHER_POLICY": "WINDOW"}, r"PLE_GATHER_POLICY='WINDOW': unknown prefetch policy"),
    ({"PLE_GATHER_IO": "Direct"}, r"PLE_GATHER_IO='Direct': unknown io mode 'Direct'; expected "
                                  r"one of \('mmap', 'direct'\)"),
    ({"PLE_HOST_ROWS": "-1"}, r"PLE_HOST_ROWS must be a count of rows .* not '-1'"),
    ({"PLE_OFFLOAD": " , "}, r"^ple: PLE_OFFLOAD is ' , ', which names no module; it must be "
                             r"'auto', 'none', or module names as vLLM names them"),
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


# Every variable of the plugin, as it must be spelled.
VARIABLES = ("PLE_OFFLOAD, PLE_CONFIG, PLE_GATHER_POLICY, PLE_GATHER_PREFETCH_WINDOW_KIB, "
             "PLE_GATHER_THREADS, PLE_GATHER_ROW_CACHE_MIB, PLE_GATHER_IO_QUEUE_DEPTH, "
             "PLE_GATHER_IO_BLOCK_BYTES, PLE_GATHER_IO, PLE_HOST_ROWS, PLE_DEVICE_ROWS, "
             "PLE_LOOKAHEAD_MIB")
LIBRARY = "PLE_GRAPH_GATHER, PLE_IO_BACKEND, PLE_FORCE_JIT, PLE_BUILD_DIR"


@pytest.mark.parametrize("name, value", [
    ("PLE_GATHER_threads", "abc"), ("PLE_GATHER_threads", "4"),
    ("PLE_GATHER_Row_Cache_MiB", "512"), ("PLE_GATHER_io", "direct"),
    ("ple_gather_threads", "4"), ("Ple_Gather_Policy", "all"), ("PLE_GATHER_", "4"),
    ("PLE_Offload", "auto"), ("ple_offload", "auto"), ("PLE_host_rows", "3"),
    ("PLE_Device_Rows", "3"), ("PLE_LOOKAHEAD_mib", "1"), ("ple_config", "/nowhere.json")])
def test_a_variable_in_another_case_is_refused(name, value):
    """Names are exact (upper case): a variable of the plugin spelled in
    another case, or any other PLE_GATHER_*, is refused, with or without the
    correct one beside it and whether or not the plugin is asked for."""
    message = (rf"^ple: unknown variable {name} \(did you mean PLE_\w+\?\): the plugin reads "
               rf"{VARIABLES}, and ple {LIBRARY}, spelled exactly so")
    for environ in ({name: value}, {name: value, "PLE_OFFLOAD": "auto"},
                    {name: value, "PLE_GATHER_THREADS": "2", "PLE_HOST_ROWS": "1"}):
        with pytest.raises(ValueError, match=message):
            settings(environ)


def test_other_variables_of_ple_are_not_the_plugins():
    assert settings({"PLE_IO_BACKEND": "pread", "PLE_GRAPH_GATHER": "1", "PLE_FORCE_JIT": "1",
                     "PLE_BUILD_DIR": "/tmp", "GATHER_THREADS": "x"}) == Settings()


@pytest.mark.parametrize("name, value, nearest", [
    ("PLE_LOOKAHEAD_MB", "0", "PLE_LOOKAHEAD_MIB"), ("PLE_OFFLOADS", "auto", "PLE_OFFLOAD"),
    ("PLE_HOST_ROW", "12", "PLE_HOST_ROWS"), ("PLE_CONFIG_FILE", "x.json", "PLE_CONFIG"),
    ("PLE_TEST_WHATEVER", "x", None), ("ple_device_row", "3", "PLE_DEVICE_ROWS")])
def test_any_variable_of_ples_prefix_the_plugin_does_not_know_is_refused(name, value, nearest):
    """A misspelled variable beside the others would leave its setting at
    its default (lookahead at 64 MiB, the plugin off and the table in
    memory): it is refused, naming the nearest variable ple knows."""
    nearest = nearest or r"PLE_\w+"
    with pytest.raises(ValueError, match=rf"^ple: unknown variable {name} \(did you mean "
                                         rf"{nearest}\?\)"):
        settings({name: value, "PLE_OFFLOAD": "auto"})


def test_whole_numbers_of_the_environment():
    got = settings({"PLE_OFFLOAD": "auto", "PLE_HOST_ROWS": " 12 ", "PLE_DEVICE_ROWS": "+0",
                    "PLE_GATHER_THREADS": "3", "PLE_LOOKAHEAD_MIB": "007"})
    assert got == Settings("auto", ple.GatherConfig(threads=3), host_rows=12, lookahead_mib=7)


@pytest.mark.parametrize("key", ["host_rows", "device_rows"])
@pytest.mark.parametrize("text", ["Infinity", "-Infinity", "NaN", "1.7", "0.9", "2.0", "1e3",
                                  "true", "-3", "[1]", '"1.5"', '"many"', '"12"', "{}"])
def test_a_row_count_of_the_file_is_a_whole_number(tmp_path, key, text):
    path = tmp_path / "ple.json"
    path.write_text(f'{{"offload": "auto", "{key}": {text}}}')
    with pytest.raises(ValueError, match=rf"^ple: '{key}' of PLE_CONFIG={path} must be a count "
                                         r"of rows \(a whole number >= 0\), not "):
        settings({"PLE_CONFIG": str(path)})


@pytest.mark.parametrize("variable", ["PLE_HOST_ROWS", "PLE_DEVICE_ROWS"])
@pytest.mark.parametrize("value", ["1.7", "0.9", "inf", "1e3", "1_000", "+-5", "٣", "-1"])
def test_a_row_count_of_the_environment_is_a_whole_number(variable, value):
    with pytest.raises(ValueError, match=rf"^ple: {variable} must be a count of rows \(a whole "
                                         rf"number >= 0\), not {re.escape(repr(value))}$"):
        settings({variable: value})


def test_row_counts_of_the_file(tmp_path):
    path = tmp_path / "ple.json"
    path.write_text('{"offload": "auto", "host_rows": 12, "device_rows": null}')
    assert settings({"PLE_CONFIG": str(path)}) == Settings("auto", host_rows=12)


@pytest.mark.parametrize("text", ["Infinity", "NaN", "2.0", '"lots"', '"8"'])
def test_a_lookahead_of_the_file_is_a_whole_number(tmp_path, text):
    path = tmp_path / "ple.json"
    path.write_text(f'{{"lookahead_mib": {text}}}')
    with pytest.raises(ValueError, match=rf"^ple: 'lookahead_mib' of PLE_CONFIG={path} must be "
                                         r"MiB of rows read ahead, an integer in \[0, 256\]"):
        settings({"PLE_CONFIG": str(path)})


@pytest.mark.parametrize("gather, message", [
    ({"threads": 2.0}, r"'threads' of 'gather' of PLE_CONFIG=.*: threads must be an int in "
                       r"\[1, 256\], got 2.0$"),
    ({"threads": float("inf")}, r"'threads' of 'gather' of .*: threads must be an int in "
                                r"\[1, 256\], got inf$"),
    ({"row_cache_mib": "512"}, r"'row_cache_mib' of 'gather' of .*: row_cache_mib must be an "
                               r"int in \[0, 1099511627776\], got '512'$"),
    ({"threads": True}, r"'threads' of 'gather' of .*: threads must be an int"),
    ({"policy": "WINDOW"}, r"'policy' of 'gather' of .*: unknown prefetch policy 'WINDOW'; "
                           r"expected one of \('window', 'distance', 'all', 'none'\)$"),
    ({"io": "Direct"}, r"'io' of 'gather' of .*: unknown io mode 'Direct'"),
    ({"Threads": 2}, r"'gather' of PLE_CONFIG=.* has unknown fields \['Threads'\]; the "
                     r"GatherConfig fields are \('policy', 'prefetch_window_kib', 'threads', "),
    ({"row_cache_MiB": 2, "threads": 2}, r"'gather' of .* has unknown fields "
                                         r"\['row_cache_MiB'\]"),
])
def test_a_bad_gather_field_of_the_file_is_named(tmp_path, gather, message):
    path = tmp_path / "ple.json"
    path.write_text(json.dumps({"offload": "auto", "gather": gather}))
    with pytest.raises(ValueError, match=f"^ple: {message}"):
        settings({"PLE_CONFIG": str(path)})


@pytest.mark.parametrize("gather", ["[]", "0", "false", '"threads=2"'])
def test_gather_of_the_file_is_an_object(tmp_path, gather):
    path = tmp_path / "ple.json"
    path.write_text(f'{{"gather": {gather}}}')
    with pytest.raises(ValueError, match=r"'gather' of PLE_CONFIG=.* must be an object of "
                                         r"GatherConfig fields"):
        settings({"PLE_CONFIG": str(path)})


@pytest.mark.parametrize("content", [
    b'{"offload": "auto", "host_rows": 1, "x": "\xff"}',       # not UTF-8 at all
    '{"offload": "auto"}'.encode("utf-16"),                      # another encoding
    '{"offload": "caf\u00e9"}'.encode("latin-1")])
def test_a_config_file_that_is_not_utf8_is_named(tmp_path, content):
    path = tmp_path / "ple.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=rf"^ple: PLE_CONFIG={path} is not UTF-8 text, as a JSON "
                                         r"file of the plugin's settings must be: 'utf-8' codec "
                                         r"can't decode byte"):
        settings({"PLE_CONFIG": str(path)})


def test_a_config_file_that_is_a_directory_is_named(tmp_path):
    with pytest.raises(ValueError, match=rf"^ple: PLE_CONFIG={tmp_path}: Is a directory$"):
        settings({"PLE_CONFIG": str(tmp_path)})


@pytest.mark.parametrize("value", ["AUTO", "Auto", "NONE", "None", "auto,model.x",
                                   "model.x, none", "model.a b", "model..x", "model.x;"])
def test_offload_keywords_are_lower_case_and_names_are_names(tmp_path, value):
    with pytest.raises(ValueError, match=rf"^ple: PLE_OFFLOAD is {re.escape(repr(value))}: "
                                         r"not module names "
                                         r"\[.*\] \(the keywords 'auto' and 'none' are lower "
                                         r"case and stand alone\)"):
        settings({"PLE_OFFLOAD": value})
    path = tmp_path / "ple.json"
    for offload in (value, value.split(",")):
        path.write_text(json.dumps({"offload": offload}))
        with pytest.raises(ValueError, match=rf"^ple: 'offload' of PLE_CONFIG={path} is "):
            settings({"PLE_CONFIG": str(path)})


@pytest.mark.parametrize("offload", [3, True, {"auto": 1}, ["model.x", 1]])
def test_offload_of_the_file_is_a_text_or_names(tmp_path, offload):
    path = tmp_path / "ple.json"
    path.write_text(json.dumps({"offload": offload}))
    with pytest.raises(ValueError, match=rf"^ple: 'offload' of PLE_CONFIG={path} must be 'auto', "
                                         r"'none', or module names"):
        settings({"PLE_CONFIG": str(path)})


def test_offload_keywords_and_names(tmp_path):
    assert settings({"PLE_OFFLOAD": " auto "}).offload == "auto"
    assert settings({"PLE_OFFLOAD": "none"}).offload == ()
    path = tmp_path / "ple.json"
    path.write_text(json.dumps({"offload": ["model.layers.1.ple.ple_embedding.ngram_embedding"]}))
    assert settings({"PLE_CONFIG": str(path)}).offload == (
        "model.layers.1.ple.ple_embedding.ngram_embedding",)


@pytest.mark.parametrize("environ", [
    {"PLE_OFFLOAD": "auto", "PLE_GATHER_threads": "abc"}, {"PLE_OFFLOAD": "AUTO"},
    {"PLE_GATHER_io": "direct"}, {"PLE_OFFLOAD": "auto", "PLE_HOST_ROWS": "1.7"}])
def test_the_plugins_entry_point_refuses_a_bad_setting(monkeypatch, environ):
    """vLLM loads the plugin (register) before it builds anything: a bad
    setting stops it there."""
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="^ple: "):
        register()


@pytest.mark.parametrize("environ, message", [
    ({"PLE_LOOKAHEAD_MIB": "lots"}, r"^ple: PLE_LOOKAHEAD_MIB must be MiB of rows read ahead"),
    ({"PLE_LOOKAHEAD_MIB": "8", "PLE_GATHER_threads": "2"}, r"^ple: unknown variable "
                                                             r"PLE_GATHER_threads"),
    ({"PLE_LOOKAHEAD_MIB": "8", "PLE_OFFLOAD": "AUTO"}, r"^ple: PLE_OFFLOAD is 'AUTO'")])
def test_a_bad_setting_at_an_engines_first_step_stops_it(monkeypatch, environ, message):
    """An engine's workers read the settings again at their first step (the
    lookahead's): a setting made bad since the model was built stops the
    step, as at load, instead of being logged while the engine runs on.
    Once the setting is good, the worker's next step runs."""
    pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm)")
    from ple.integrations.vllm import lookahead

    class Worker:  # the lookahead keeps a weak reference to its worker
        vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(
            max_num_scheduled_tokens=None, max_num_batched_tokens=4))
        model_runner = SimpleNamespace(get_model=lambda: torch.nn.Linear(1, 1))

    worker, steps = Worker(), []
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        lookahead.run_step(worker, None, steps.append)
    assert steps == []
    for name in environ:
        monkeypatch.delenv(name)
    assert lookahead.run_step(worker, "step", steps.append) is None
    assert steps == ["step"]
