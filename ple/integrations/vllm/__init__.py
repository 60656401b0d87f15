"""ple inside vLLM: a general plugin that serves a model's large embedding
tables from the checkpoint's files.

Installed (``pip install --no-build-isolation '.[vllm]'``), the plugin is
loaded by vLLM in each of its processes (the entry point ``ple`` of the group
``vllm.general_plugins``; ``VLLM_PLUGINS`` filters it as any other) and
changes nothing until asked:

    PLE_OFFLOAD=auto vllm serve google/gemma-3n-E4B-it

``PLE_OFFLOAD`` (or ``"offload"`` of the file ``PLE_CONFIG`` names):

- unset or empty: the plugin does nothing, vLLM's own classes serve;
- ``auto``: the tables ple is made for are served from the checkpoint's
  files, as the transformers integration's ``offload="auto"`` does: Gemma 3n's
  ``embed_tokens_per_layer`` (the text-only and the multimodal class) and
  Qwen4Exp's n-gram tables (``ple.integrations.vllm.qwen4_exp``);
- a comma-separated list of module names of the served model, as vLLM names
  them (``model.self_decoder.embed_tokens_per_layer``,
  ``model.layers.1.ple.ple_embedding.ngram_embedding``; with
  ``language_model.`` in front in the multimodal classes): those modules only;
- ``none``: ple's classes serve with every table in memory (the text-only
  Gemma 3n's per-layer inputs mended, see ``ple.integrations.vllm.gemma3n``):
  the baseline to compare an offloaded model with.

The tables' gather and tiers (each offloaded table the same):

- ``PLE_GATHER_<FIELD>``: a field of :class:`ple.GatherConfig`
  (``PLE_GATHER_POLICY=window``, ``PLE_GATHER_ROW_CACHE_MIB=512``,
  ``PLE_GATHER_IO=direct``, ...);
- ``PLE_HOST_ROWS``, ``PLE_DEVICE_ROWS``: rows kept in host and device
  memory (``Table.place``: the first ``PLE_DEVICE_ROWS`` rows on the model's
  GPU, the next ``PLE_HOST_ROWS`` in host memory);
- ``PLE_LOOKAHEAD_MIB``: in a chunked prefill, the rows of a request's
  next chunks are read while its current chunk computes, at most this many
  MiB of rows ahead per table (default 64, 0: off;
  ``ple.integrations.vllm.lookahead``);
- ``PLE_CONFIG``: a JSON file with the same settings, ``{"offload": "auto" or
  [names], "gather": {field: value}, "host_rows": n, "device_rows": n,
  "lookahead_mib": n}``; the environment variables win over it.

A bad setting raises ``ValueError`` when vLLM loads its plugins, before any
model is built: vLLM does not start, rather than serve the tables from
memory.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from ple.config import FIELDS, GatherConfig
from ple.layers.lookahead import DEFAULT_MAX_BYTES as DEFAULT_LOOKAHEAD_BYTES
from ple.layers.lookahead import MOST_BYTES as MOST_LOOKAHEAD_BYTES

logger = logging.getLogger(__name__)

__all__ = ["Settings", "register", "settings"]

OFFLOAD_ENV = "PLE_OFFLOAD"
CONFIG_ENV = "PLE_CONFIG"
GATHER_ENV_PREFIX = "PLE_GATHER_"
TIER_ENVS = {"host_rows": "PLE_HOST_ROWS", "device_rows": "PLE_DEVICE_ROWS"}
LOOKAHEAD_ENV = "PLE_LOOKAHEAD_MIB"
CONFIG_KEYS = ("offload", "gather", *TIER_ENVS, "lookahead_mib")
# The architectures whose vLLM classes ple's replace, and where ple's live.
ARCHITECTURES = {
    "Gemma3nForCausalLM": "ple.integrations.vllm.gemma3n:Gemma3nForCausalLM",
    "Qwen4ExpForCausalLM": "ple.integrations.vllm.qwen4_exp_models:Qwen4ExpForCausalLM",
    "Qwen4ExpForConditionalGeneration":
        "ple.integrations.vllm.qwen4_exp_models:Qwen4ExpForConditionalGeneration",
}


@dataclass(frozen=True)
class Settings:
    """What the plugin was asked to do.  ``offload``: None (nothing),
    ``"auto"``, or module names (an empty tuple: ple's classes, every table
    in memory).  ``lookahead_mib``: the rows read ahead of a chunked
    prefill, per table (0: none)."""
    offload: str | tuple[str, ...] | None = None
    gather: GatherConfig | None = None
    host_rows: int = 0
    device_rows: int = 0
    lookahead_mib: int = DEFAULT_LOOKAHEAD_BYTES >> 20

    @property
    def active(self) -> bool:
        return self.offload is not None


def settings(environ: dict[str, str] | None = None) -> Settings:
    """The settings of ``environ`` (default ``os.environ``) and of the file
    its ``PLE_CONFIG`` names; a ValueError that names the variable or key at
    fault otherwise."""
    environ = os.environ if environ is None else environ
    values: dict = {}
    path = environ.get(CONFIG_ENV)
    if path:
        values = _read_config_file(Path(path))
    gather = dict(values.get("gather") or {})
    for name in FIELDS:
        variable = f"{GATHER_ENV_PREFIX}{name.upper()}"
        if environ.get(variable):
            gather[name] = _field_value(name, environ[variable], variable)
    unknown = sorted(key for key in environ if key.startswith(GATHER_ENV_PREFIX)
                     and key.removeprefix(GATHER_ENV_PREFIX).lower() not in FIELDS)
    if unknown:
        raise ValueError(f"ple: unknown {', '.join(unknown)}: the GatherConfig fields are "
                         f"{', '.join(GATHER_ENV_PREFIX + n.upper() for n in FIELDS)}")
    tiers = {}
    for key, variable in TIER_ENVS.items():
        raw = environ.get(variable) or values.get(key)
        tiers[key] = 0 if raw is None else _row_count(raw, variable if environ.get(variable)
                                                      else f"{key!r} of {path}")
    raw = environ.get(LOOKAHEAD_ENV) or values.get("lookahead_mib")
    lookahead_mib = (DEFAULT_LOOKAHEAD_BYTES >> 20 if raw is None else _lookahead_mib(
        raw, LOOKAHEAD_ENV if environ.get(LOOKAHEAD_ENV) else f"'lookahead_mib' of {path}"))
    offload = environ.get(OFFLOAD_ENV) or values.get("offload")
    try:
        config = GatherConfig(**gather) if gather else None
    except (TypeError, ValueError) as error:
        raise ValueError(f"ple: bad gather setting ({GATHER_ENV_PREFIX}* or 'gather' of "
                         f"{CONFIG_ENV}): {error}") from None
    return Settings(_offload(offload), config, **tiers, lookahead_mib=lookahead_mib)


def _read_config_file(path: Path) -> dict:
    try:
        values = json.loads(path.read_text())
    except OSError as error:
        raise ValueError(f"ple: {CONFIG_ENV}={path}: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"ple: {CONFIG_ENV}={path} is not JSON: {error}") from None
    if not isinstance(values, dict):
        raise ValueError(f"ple: {CONFIG_ENV}={path} holds a {type(values).__name__}, not a JSON "
                         f"object with keys among {CONFIG_KEYS}")
    unknown = sorted(set(values) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(f"ple: {CONFIG_ENV}={path} has unknown keys {unknown}; expected keys "
                         f"among {CONFIG_KEYS}")
    if not isinstance(values.get("gather", {}), dict):
        raise ValueError(f"ple: 'gather' of {path} must be an object of GatherConfig fields")
    return values


def _field_value(name: str, raw: str, variable: str):
    if "choices" in FIELDS[name]:
        return raw
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"ple: {variable}={raw!r} is not an integer "
                         f"({FIELDS[name]['unit']})") from None


def _row_count(raw, where: str) -> int:
    try:
        rows = int(raw)
    except (TypeError, ValueError):
        rows = -1
    if rows < 0 or isinstance(raw, bool):
        raise ValueError(f"ple: {where} must be a count of rows (an integer >= 0), not {raw!r}")
    return rows


def _lookahead_mib(raw, where: str) -> int:
    most = MOST_LOOKAHEAD_BYTES >> 20  # what a table's prefetches hold at most
    try:
        mib = int(raw)
    except (TypeError, ValueError):
        mib = -1
    if not 0 <= mib <= most or isinstance(raw, bool) or isinstance(raw, float):
        raise ValueError(f"ple: {where} must be MiB of rows read ahead, an integer in "
                         f"[0, {most}] (0: no lookahead), not {raw!r}")
    return mib


def _offload(value) -> str | tuple[str, ...] | None:
    if value is None or value == "":
        return None
    if isinstance(value, str):
        if value.strip() == "auto":
            return "auto"
        if value.strip() == "none":
            return ()
        value = value.split(",")
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"ple: offload must be 'auto', 'none' or module names, not {value!r}")
    names = tuple(dict.fromkeys(v.strip() for v in value if v.strip()))
    if not names:
        raise ValueError(f"ple: {OFFLOAD_ENV}={value!r} names no module")
    return names


def register() -> None:
    """The plugin's entry point (``vllm.general_plugins``): vLLM calls it in
    each of its processes.  With the plugin asked for, replaces vLLM's
    classes of the architectures ple serves with ple's (the multimodal Gemma
    3n builds its text model through the same registry entry; Qwen4Exp's
    multimodal class does not, so ple registers its own), and wraps the
    workers' ``execute_model`` for lookahead (``ple.integrations.vllm.lookahead``)."""
    asked = settings()
    if not asked.active:
        return
    from vllm import ModelRegistry

    for architecture, target in ARCHITECTURES.items():
        ModelRegistry.register_model(architecture, target)
    # Each engine's workers read PLE_LOOKAHEAD_MIB at their first step: the
    # hook is in place whatever this first reading says.
    from .lookahead import install

    install()
    logger.debug("ple: serving %s through ple (%s=%s)", ", ".join(ARCHITECTURES), OFFLOAD_ENV,
                 asked.offload)
