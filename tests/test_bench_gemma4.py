"""tools/bench_gemma4.py: the checkpoint it writes is the layout transformers
saves for Gemma 4 (names, shapes, dtypes, the vectors' values) and loads
with nothing missing; a --tiny run on the CPU reports every phase of every
arm, its arms generate the same tokens and ple's counters count the
prompt's and the steps' rows; a run on a GPU adds the GPU's memory and the
goals; bad options and foreign directories are refused before anything is
written; token groups and goals are judged as the report says."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers.models.gemma4", reason="transformers has no Gemma 4")

from safetensors import safe_open  # noqa: E402
from transformers import AutoModelForCausalLM, Gemma4ForConditionalGeneration  # noqa: E402

from helpers import directory_bytes, foreign_files_message, save_a_model  # noqa: E402
from helpers import quiet_transformers  # noqa: E402, F401 (an autouse fixture)
from ple_tools import bench_gemma4  # noqa: E402

PHASES = ("load", "prefill", "decode")
GPU_FIELDS = {"gpu_peak", "gpu_end", "gpu_reserved_peak", "device_used"}
HOST_FIELDS = {"rss_end", "rss_peak", "rss_anon_end", "read_bytes"}


def tensors_of(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    return tensors


def test_the_checkpoint_is_the_layout_transformers_saves(tmp_path):
    record = bench_gemma4.write_checkpoint(tmp_path / "ckpt", bench_gemma4.TINY, seed=0)
    config = bench_gemma4.gemma4_config(bench_gemma4.TINY)
    Gemma4ForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(tmp_path / "saved")
    ours, saved = tensors_of(tmp_path / "ckpt"), tensors_of(tmp_path / "saved")
    assert {n: (t.shape, t.dtype) for n, t in ours.items()} == {
        n: (t.shape, t.dtype) for n, t in saved.items()}
    for name, tensor in saved.items():
        if tensor.dim() < 2:  # the model's own init, which no random number enters
            assert torch.equal(ours[name], tensor), name
    table = ours[bench_gemma4.TABLE]
    assert table.shape == (record["table_rows"], record["table_cols"]) == (512, 256)
    assert len(torch.unique(table, dim=0)) == len(table)  # no row of the block's tiling repeats
    assert record["shards"] == len(list((tmp_path / "ckpt").glob("*.safetensors"))) > 1
    assert record["bytes"] == sum(t.nbytes for t in ours.values())
    model, loading = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt",
                                                          output_loading_info=True)
    assert type(model) is Gemma4ForConditionalGeneration
    assert {key: list(value) for key, value in loading.items() if value} == {}
    assert bench_gemma4.reusable_checkpoint(tmp_path / "ckpt", bench_gemma4.TINY, 0) == record
    assert bench_gemma4.reusable_checkpoint(tmp_path / "ckpt", bench_gemma4.TINY, 1) is None
    marker = tmp_path / "ckpt" / bench_gemma4.INFO
    marker.write_text(marker.read_text().replace(record["config"], "0" * 64))
    assert bench_gemma4.reusable_checkpoint(tmp_path / "ckpt", bench_gemma4.TINY, 0) is None


def test_e4b_has_the_published_sizes():
    """The sizes issue 40 and the docs give: a 262,144 x 10,752 table of
    5.6 GB in a checkpoint of about 16 GB."""
    config, shards, names = bench_gemma4.plan_checkpoint(bench_gemma4.E4B)
    info = bench_gemma4.checkpoint_info(config, shards, names, bench_gemma4.E4B, 0)
    assert (info["table_rows"], info["table_cols"]) == (262_144, 42 * 256)
    assert info["table_bytes"] == 5_637_144_576
    assert 15e9 < info["bytes"] < 17e9
    assert all(sum(2 * torch.Size(shape).numel() for _, shape, _ in shard)
               <= bench_gemma4.E4B.shard_bytes or len(shard) == 1 for shard in shards)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One --tiny run on the CPU: the process, its results (the JSON
    document's) and its directory."""
    directory = tmp_path_factory.mktemp("bench_gemma4")
    document = directory / "run.json"
    run = subprocess.run(
        [sys.executable, "-m", "ple_tools.bench_gemma4", "--tiny", "--device", "cpu",
         "--dir", str(directory / "ckpt"), "--arms", "transformers,ple,ple-cache:1,ple-q5_k",
         "--json", str(document)],
        capture_output=True, text=True, timeout=600)
    results = json.loads(document.read_text())["results"] if document.exists() else None
    return run, results, directory


@pytest.mark.slow
def test_a_tiny_run_on_the_cpu_reports_every_phase_and_the_same_tokens(tiny_run):
    run, document, directory = tiny_run
    assert run.returncode == 0, run.stdout + run.stderr
    results = {r["arm"]: r for r in document["results"]}
    assert document["checkpoint"]["model"] == "gemma-4-tiny"
    assert list(results) == ["transformers", "ple", "ple-cache:1", "ple-q5_k"]
    prompt, new = bench_gemma4.TINY_DEFAULTS["prompt_tokens"], bench_gemma4.TINY_DEFAULTS[
        "new_tokens"]
    for arm, r in results.items():
        assert r["round"] == 1 and r["device"] == "cpu (CPU)"
        assert len(r["tokens"]) == 1 + new and len(r["decode_ms"]) == new
        assert r["ttft_s"] > 0 and r["decode_tok_s"] > 0 and r["load_s"] > 0
        for phase in PHASES:
            fields = set(r["phases"][phase])
            assert HOST_FIELDS <= fields and not GPU_FIELDS & fields, (arm, phase)
            assert ("ple" in fields) == arm.startswith("ple")
    exact = {results[arm]["sha256"] for arm in ("transformers", "ple", "ple-cache:1")}
    assert len(exact) == 1
    for arm in ("ple", "ple-cache:1", "ple-q5_k"):
        counters = {phase: results[arm]["phases"][phase]["ple"] for phase in ("prefill", "decode")}
        assert counters["prefill"]["rows"] == prompt  # the prompt in one forward
        assert counters["decode"]["rows"] == new  # a row a step
    q5_k = results["ple-q5_k"]["phases"]["prefill"]["ple"]
    assert q5_k["bytes_copied"] == prompt * 176  # packed Q5_K rows of 256 values
    assert document["goals"] == []
    assert "tokens:\n  transformers, ple, ple-cache:1: sha256 " in run.stdout
    assert ("  ple-q5_k: sha256 " in run.stdout
            and "a q5_k copy of the table: compared with its own runs only" in run.stdout)
    assert "goals: on a GPU only (--device cuda)" in run.stdout
    marker = json.loads((directory / "ckpt" / bench_gemma4.INFO).read_text())
    assert marker["copies"] == {"q5_k": "per-layer-table-q5_k.gguf"}
    assert "per-layer-table-q5_k.gguf" in marker["files"]


@pytest.mark.slow
def test_a_second_run_reuses_the_checkpoint_and_its_copy(tiny_run):
    _, _, directory = tiny_run
    before = {p.name: p.stat().st_mtime_ns for p in (directory / "ckpt").iterdir()}
    run = subprocess.run(
        [sys.executable, "-m", "ple_tools.bench_gemma4", "--tiny", "--device", "cpu",
         "--dir", str(directory / "ckpt"), "--arms", "ple-q5_k", "--new-tokens", "2"],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(r"\(reused\)\n  per-layer-table-q5_k.gguf: [\d.]+ MiB \(reused\)\n",
                     run.stdout), run.stdout
    assert {p.name: p.stat().st_mtime_ns for p in (directory / "ckpt").iterdir()} == before


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_tiny_run_on_a_gpu_reports_its_memory_and_the_goals(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "ple_tools.bench_gemma4", "--tiny", "--dir", str(tmp_path / "c"),
         "--arms", "transformers,cpu-table,ple,ple-q5_k", "--json", str(tmp_path / "run.json")],
        capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    document = json.loads((tmp_path / "run.json").read_text())["results"]
    for r in document["results"]:
        for phase in PHASES:
            assert GPU_FIELDS | HOST_FIELDS <= set(r["phases"][phase]), (r["arm"], phase)
    assert len({r["sha256"] for r in document["results"] if r["arm"] != "ple-q5_k"}) == 1
    goals = {(g["arm"], g["goal"]) for g in document["goals"]}
    assert {arm for arm, _ in goals} == {"ple", "ple-q5_k"} and len(goals) == 8


@pytest.mark.parametrize("arguments, line", [
    (["--device", "cpu"], "argument --device: cpu runs only the tiny model (--tiny): E4B on the "
                          "CPU measures nothing this tool is for"),
    (["--tiny", "--device", "cpu", "--arms", "ple,fast"],
     "argument --arms: unknown 'fast'; arms: transformers, cpu-table, ple, ple-cache:MIB, "
     "ple-TYPE (TYPE: f32, f16, bf16, q8_0, q5_1, q5_0, q4_1, q4_0, q6_k, q5_k, q4_k, mxfp4, "
     "tq2_0, tq1_0)"),
    (["--tiny", "--arms", "ple-cache:0"],
     "argument --arms: 'ple-cache:0': ple-cache:MIB takes an integer above 0 (MiB of row cache)"),
    (["--tiny", "--arms", "ple,transformers,ple"], "argument --arms: 'ple' is named twice"),
    (["--tiny", "--device", "cpu", "--arms", "transformers,cpu-table"],
     "argument --arms: cpu-table moves the table from the GPU to the CPU; on the CPU "
     "(--device cpu) the transformers arm is that already"),
    (["--tiny", "--prompt-tokens", "4090", "--new-tokens", "8"],
     "argument --prompt-tokens: 4090 prompt tokens and 9 new ones pass the model's 4,096 "
     "positions"),
    (["--tiny", "--prefill-chunk", "65"],
     "argument --prefill-chunk: 65 is longer than the prompt (64 tokens)"),
])
def test_bad_options_are_refused_before_anything_is_written(arguments, line, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        bench_gemma4.main(["--dir", str(tmp_path / "ckpt"), *arguments])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ") and err.splitlines()[-1].endswith(f"error: {line}"), err
    assert list(tmp_path.iterdir()) == []


def test_a_directory_holding_a_model_is_refused_and_left_as_it_was(tmp_path, capsys):
    save_a_model(tmp_path)
    before = directory_bytes(tmp_path)
    assert bench_gemma4.main(["--tiny", "--device", "cpu", "--dir", str(tmp_path)]) == 2
    message = foreign_files_message(tmp_path, ["model.safetensors", "notes.txt"],
                                    bench_gemma4.INFO)
    assert capsys.readouterr().err == f"error: {message}\n"
    assert directory_bytes(tmp_path) == before


def test_a_disk_without_room_is_refused_before_anything_is_written(tmp_path, monkeypatch,
                                                                   capsys):
    monkeypatch.setattr(bench_gemma4.shutil, "disk_usage",
                        lambda path: SimpleNamespace(total=2**40, used=2**40, free=2**20))
    assert bench_gemma4.main(["--tiny", "--device", "cpu", "--dir", str(tmp_path / "ckpt")]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path / 'ckpt'}: the gemma-4-tiny checkpoint "
                                       "takes 1.81 MiB, and its filesystem has 1.00 MiB free\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="has a CUDA GPU")
def test_without_a_gpu_the_default_device_is_refused(tmp_path, capsys):
    assert bench_gemma4.main(["--dir", str(tmp_path / "ckpt")]) == 2
    assert capsys.readouterr().err == ("error: no CUDA device: ple-bench-gemma4 measures a GPU "
                                       "(--tiny --device cpu runs the tiny model on the CPU)\n")
    assert list(tmp_path.iterdir()) == []


def run_record(arm: str, tokens: list[int], round: int = 1, **figures) -> dict:
    phases = {phase: {key.removeprefix(f"{phase}_"): value for key, value in figures.items()
                      if key.startswith(f"{phase}_")} for phase in PHASES}
    return {"arm": arm, "round": round, "tokens": tokens,
            "sha256": hashlib.sha256(json.dumps(tokens).encode()).hexdigest(),
            "ttft_s": figures.get("ttft_s", 1.0), "decode_tok_s": figures.get("decode_tok_s", 10.0),
            "phases": phases}


def test_tokens_that_differ_fail_the_run_and_a_quantized_copy_is_judged_apart():
    arms = bench_gemma4.parse_arms("transformers,ple,ple-q5_k", "cuda")
    agree = [run_record("transformers", [5, 6, 7]), run_record("ple", [5, 6, 7]),
             run_record("ple-q5_k", [5, 9, 7]), run_record("ple-q5_k", [5, 9, 7], round=2)]
    ok, lines = bench_gemma4.token_groups(agree, arms)
    assert ok and lines[0].startswith("  transformers, ple: sha256 ")
    assert lines[1].endswith("a q5_k copy of the table: compared with its own runs only "
                             "(2 of 3 tokens equal the bf16 arms')")
    ok, lines = bench_gemma4.token_groups([*agree[:3], run_record("ple-q5_k", [5, 6, 7], 2)], arms)
    assert not ok and "ple-q5_k: TOKENS DIFFER: ple-q5_k round 1 " in lines[1]
    ok, _ = bench_gemma4.token_groups([agree[0], run_record("ple", [5, 6, 8])], arms)
    assert not ok


def test_the_goals_compare_ple_with_the_workaround_and_transformers_alone():
    gib = 2**30
    memory = {f"{phase}_{key}": 0 for phase in PHASES
              for key in ("gpu_peak", "gpu_end", "device_used", "rss_end", "rss_peak")}

    def figures(gpu: float, rss: float, **speed) -> dict:
        return {**memory, **{k: gpu * gib for k in memory if "gpu" in k or "device" in k},
                **{k: rss * gib for k in memory if "rss" in k}, "ttft_s": 1.0,
                "decode_tok_s": 30.0, **speed}

    arms = bench_gemma4.parse_arms("transformers,cpu-table,ple", "cuda")
    medians = {"transformers": figures(15, 2), "cpu-table": figures(9, 8),
               "ple": figures(9, 2.5, ttft_s=1.06, decode_tok_s=29.0)}
    checks = {c["goal"]: c["met"] for c in bench_gemma4.goals(medians, 5 * gib, arms)}
    assert checks == {"GPU memory <= cpu-table's": True, "RSS <= cpu-table's less the table": True,
                      "TTFT <= 1.05x transformers'": False,
                      "decode within 1.05x of transformers'": True}
    medians["ple"] = figures(9.5, 3.5)
    checks = {c["goal"]: c["met"] for c in bench_gemma4.goals(medians, 5 * gib, arms)}
    assert not checks["GPU memory <= cpu-table's"]
    assert not checks["RSS <= cpu-table's less the table"]
