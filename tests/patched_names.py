"""Which names of other libraries ple changes: a snapshot of every loaded
module's names and of its classes' own members, and the callables that
differ from it later.  Imported by the test scripts that run a library's
whole path (load, generate, save) in a process of their own."""

from __future__ import annotations

import sys
import types


def snapshot() -> dict[tuple[str, str], object]:
    """{(owner, name): value} of every module but ple's and of its classes'
    own members (owner ``module.Class``)."""
    seen = {}
    for name, module in list(sys.modules.items()):
        if not isinstance(module, types.ModuleType) or name.split(".")[0] == "ple":
            continue
        for attr, value in list(vars(module).items()):
            seen[(name, attr)] = value
            if isinstance(value, type) and value.__module__ == name:
                for key, member in list(vars(value).items()):
                    seen[(f"{name}.{value.__qualname__}", key)] = member
    return seen


def changed_since(before: dict[tuple[str, str], object]) -> list[str]:
    """The callables that differ from ``before``, sorted: a name that was
    there, or a member added to a class that was (a module's new names do
    not count: imports add them)."""
    classes = {owner for owner, _ in before if owner not in sys.modules}
    return sorted(f"{owner}.{attr}" for (owner, attr), value in snapshot().items()
                  if callable(value) and before.get((owner, attr)) is not value
                  and ((owner, attr) in before or owner in classes))
