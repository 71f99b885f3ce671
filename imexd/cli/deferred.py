"""Modules a command loads at their first use instead of at its start.

No argparse here: `imexd run` imports this without building a parser.
"""

from __future__ import annotations

import sys


def import_lazily(name: str) -> None:
    """Let module `name` load at its first use instead of at its import: a stand-in that
    loads the real module, and hands its attributes out, the first time one is asked for.

    (importlib.util.LazyLoader cannot do this on Python 3.11: the import statement itself
    reads the module's `__spec__`, which loads it.)
    """
    if name in sys.modules:
        return
    import types  # noqa: PLC0415 - the commands that defer a module only

    class Deferred(types.ModuleType):
        def __getattr__(self, attr: str) -> object:
            import importlib  # noqa: PLC0415 - at the first use only

            if sys.modules.get(name) is self:
                del sys.modules[name]  # the import below loads the real module
            return getattr(importlib.import_module(name), attr)

    stand_in = Deferred(name)
    sys.modules[name] = stand_in
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(__import__(parent), child, stand_in)


def defer_unused_imports() -> None:
    """Load on first use what the agent and the control commands import but seldom use.

    paho imports urllib.request (and with it http.client and email) for a proxy lookup
    that runs only where PySocks is installed: a part of every such command's start.
    """
    import_lazily("urllib.request")
