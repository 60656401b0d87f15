"""The vLLM plugin's settings: ``PLE_*`` environment variables and the JSON
file ``PLE_CONFIG`` names (docs/vllm.md).  :func:`settings` reads and checks
them; a bad setting is a ValueError that names the variable, or the key and
the file, and what it accepts."""


from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ple.config import FIELDS, GatherConfig
from ple.layers.lookahead import DEFAULT_MAX_BYTES as DEFAULT_LOOKAHEAD_BYTES
from ple.layers.lookahead import lookahead_mib

__all__ = ["Settings", "settings"]

OFFLOAD_ENV = "PLE_OFFLOAD"
CONFIG_ENV = "PLE_CONFIG"
GATHER_ENV_PREFIX = "PLE_GATHER_"
# Each GatherConfig field's variable: the prefix and the field's name in upper case.
GATHER_ENVS = {f"{GATHER_ENV_PREFIX}{name.upper()}": name for name in FIELDS}
TIER_ENVS = {"host_rows": "PLE_HOST_ROWS", "device_rows": "PLE_DEVICE_ROWS"}
LOOKAHEAD_ENV = "PLE_LOOKAHEAD_MIB"
VARIABLES = (OFFLOAD_ENV, CONFIG_ENV, *GATHER_ENVS, *TIER_ENVS.values(), LOOKAHEAD_ENV)
# ple's variables outside the plugin: the graph gather's mechanism, the
# direct-I/O backend, and the native module's build (docs/vllm.md).
LIBRARY_VARIABLES = ("PLE_GRAPH_GATHER", "PLE_IO_BACKEND", "PLE_FORCE_JIT", "PLE_BUILD_DIR")
CONFIG_KEYS = ("offload", "gather", *TIER_ENVS, "lookahead_mib")
OFFLOAD_KEYWORDS = ("auto", "none")
# A whole number as a variable spells it.
DECIMAL = re.compile(r"[+-]?[0-9]+")
# A module name of PLE_OFFLOAD: vLLM's dotted path of attribute names and indices.
MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.\w+)*")


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
    its ``PLE_CONFIG`` names; a ValueError that names the variable, or the
    key and the file, at fault and what it accepts otherwise.  Names are
    exact: the variables in upper case, the file's keys and the keywords
    ``auto`` and ``none`` in lower case; a variable of the plugin spelled in
    another case, or any other ``PLE_GATHER_*``, is refused."""
    environ = os.environ if environ is None else environ
    _refuse_unknown_variables(environ)
    path = environ.get(CONFIG_ENV)
    values = _read_config_file(Path(path)) if path else {}

    def setting(variable: str, key: str):
        """(the value, where it was set) of a setting: its variable's text,
        else its key's JSON value in the file; (None, None) where neither
        sets it."""
        if environ.get(variable):
            return Text(environ[variable]), variable
        if values.get(key) is not None:
            return values[key], f"{key!r} of {CONFIG_ENV}={path}"
        return None, None

    gather = {name: (value, f"{name!r} of 'gather' of {CONFIG_ENV}={path}")
              for name, value in values.get("gather", {}).items()}
    for variable, name in GATHER_ENVS.items():
        if environ.get(variable):
            gather[name] = (_field_value(name, environ[variable], variable),
                            f"{variable}={environ[variable]!r}")
    tiers = {}
    for key, variable in TIER_ENVS.items():
        raw, where = setting(variable, key)
        tiers[key] = 0 if raw is None else _row_count(raw, where)
    raw, where = setting(LOOKAHEAD_ENV, "lookahead_mib")
    mib = (DEFAULT_LOOKAHEAD_BYTES >> 20 if raw is None
           else lookahead_mib(_whole_number(raw), where, given=raw))
    offload, where = setting(OFFLOAD_ENV, "offload")
    offload = str(offload) if isinstance(offload, Text) else offload
    return Settings(_offload(offload, where), _gather_config(gather), **tiers, lookahead_mib=mib)


class Text(str):
    """A setting's value as its variable spells it (a file's values are JSON values)."""


def _refuse_unknown_variables(environ) -> None:
    """A ValueError for a variable whose name begins with ``PLE_`` (in any
    case) and is neither one of the plugin's nor one of ple's own
    (``LIBRARY_VARIABLES``), naming the known variable nearest to it."""
    known = (*VARIABLES, *LIBRARY_VARIABLES)
    wrong = sorted(name for name in environ
                   if name.upper().startswith("PLE_") and name not in known)
    if wrong:
        raise ValueError(f"ple: unknown variable {', '.join(wrong)} (did you mean "
                         f"{_nearest(wrong[0], known)}?): "
                         f"the plugin reads {', '.join(VARIABLES)}, and ple "
                         f"{', '.join(LIBRARY_VARIABLES)}, spelled exactly so (upper case)")


def _nearest(name: str, known: tuple[str, ...]) -> str:
    """The known variable ``name`` most likely misspells: the shortest that
    has each of its words, else the closest by spelling."""
    words = name.upper().removeprefix("PLE_").split("_")
    having = [k for k in known if all(word and word in k for word in words)]
    return min(having, key=len) if having else difflib.get_close_matches(
        name.upper(), known, n=1, cutoff=0)[0]


def _read_config_file(path: Path) -> dict:
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ValueError(f"ple: {CONFIG_ENV}={path}: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"ple: {CONFIG_ENV}={path} is not UTF-8 text, as a JSON file of the "
                         f"plugin's settings must be: {error}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"ple: {CONFIG_ENV}={path} is not JSON: {error}") from None
    if not isinstance(values, dict):
        raise ValueError(f"ple: {CONFIG_ENV}={path} holds a {type(values).__name__}, not a JSON "
                         f"object with keys among {CONFIG_KEYS}")
    unknown = sorted(set(values) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(f"ple: {CONFIG_ENV}={path} has unknown keys {unknown}; expected keys "
                         f"among {CONFIG_KEYS}")
    values["gather"] = gather = {} if values.get("gather") is None else values["gather"]
    if not isinstance(gather, dict):
        raise ValueError(f"ple: 'gather' of {CONFIG_ENV}={path} must be an object of "
                         f"GatherConfig fields {tuple(FIELDS)}, not {gather!r}")
    unknown = sorted(set(gather) - set(FIELDS))
    if unknown:
        raise ValueError(f"ple: 'gather' of {CONFIG_ENV}={path} has unknown fields {unknown}; "
                         f"the GatherConfig fields are {tuple(FIELDS)}")
    return values


def _field_value(name: str, raw: str, variable: str):
    """The value of GatherConfig field ``name`` that its variable's text
    ``raw`` spells: the text itself for a choice, else an integer."""
    field = FIELDS[name]
    if "choices" in field:
        return raw
    value = _whole_number(Text(raw))
    if value is None:
        power = " (0 or a power of two)" if field["power_of_two"] else ""
        raise ValueError(f"ple: {variable}={raw!r} is not an integer: {name} takes "
                         f"{field['unit']}, an integer in [{field['least']}, {field['most']}]{power}")
    return value


def _gather_config(fields: dict[str, tuple]) -> GatherConfig | None:
    """The GatherConfig of ``{field: (value, where it was set)}``; a
    ValueError that names where a bad value was set otherwise."""
    if not fields:
        return None
    for name, (value, where) in fields.items():
        try:
            GatherConfig(**{name: value})
        except ValueError as error:
            raise ValueError(f"ple: {where}: {error}") from None
    return GatherConfig(**{name: value for name, (value, _) in fields.items()})


def _whole_number(raw) -> int | None:
    """``raw`` as an int: an int (not a bool) of the file, or the decimal
    text of a variable; None for anything else (a float, however whole; a
    JSON string)."""
    if isinstance(raw, Text):
        text = raw.strip()
        return int(text) if DECIMAL.fullmatch(text) else None
    return raw if isinstance(raw, int) and not isinstance(raw, bool) else None


def _row_count(raw, where: str) -> int:
    rows = _whole_number(raw)
    if rows is None or rows < 0:
        raise ValueError(f"ple: {where} must be a count of rows (a whole number >= 0), not {raw!r}")
    return rows


def _offload(value, where: str | None) -> str | tuple[str, ...] | None:
    """``value`` of PLE_OFFLOAD (a text) or of the file's "offload" (a text
    or a list of names), set at ``where``."""
    if value is None or value == "":
        return None
    given = value
    accepted = ("'auto', 'none', or module names as vLLM names them (a comma-separated text, "
                "or a list in the file)")
    if isinstance(value, str):
        if value.strip() in OFFLOAD_KEYWORDS:
            return "auto" if value.strip() == "auto" else ()
        value = value.split(",")
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"ple: {where} must be {accepted}, not {given!r}")
    names = tuple(dict.fromkeys(v.strip() for v in value if v.strip()))
    if not names:
        raise ValueError(f"ple: {where} is {given!r}, which names no module; it must be "
                         f"{accepted}")
    bad = [name for name in names
           if name.lower() in OFFLOAD_KEYWORDS or not MODULE_NAME.fullmatch(name)]
    if bad:
        raise ValueError(f"ple: {where} is {given!r}: not module names {bad} (the keywords "
                         f"'auto' and 'none' are lower case and stand alone); it must be "
                         f"{accepted}")
    return names
