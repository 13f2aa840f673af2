"""Modules that ManiSkill's and SAPIEN's imports pull in but fastrecord's processes never use, run at their first use
instead of at import (`install`).

Importing ``mani_skill.envs`` imports ``matplotlib.pyplot`` (``pytorch_kinematics.ik`` plots its IK on demand;
ManiSkill's notebook helpers and ``PlaceSphere`` import it too) and ``requests`` (``sapien.physx`` downloads the PhysX
GPU library with it, ``sapien.asset`` assets): deferred, the import of torch, SAPIEN, ManiSkill and PyAV took 0.5 s
less on the 2-core CPU machine (median 2.83 against 3.35 s), and the same on the H100 machine, whose matplotlib costs
its import only 0.2 s (7.75 against 7.73 s; `benchmarks/probe_deferred.py`, docs/performance.md). With `install`, an
``import`` of one of `DEFERRED` binds a module object at once and runs the module's code the first time something reads
an attribute it lacks (``plt.subplots``, ``requests.get``): the same module then, the same behaviour, only later. What
the import system itself reads (``__spec__``, ``__name__``, ``__file__``) is there without running it, so a second
``import`` of it does not run it either (the standard library's ``importlib.util.LazyLoader`` runs a module at that
second import: ``__spec__`` is one of the attributes that load it).

Only in processes fastrecord owns, before their heavy imports: the ``fastrecord`` command (`commands.cli.entry`) and
the forkserver its env processes come from (`workers._zygote`; its children inherit it). A user's process is left as
it is: the library API never installs it. ``FASTRECORD_DEFER_IMPORTS=0`` turns it off.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import threading
import types
from collections.abc import Sequence
from typing import Any

# module -> who imports it at import time, and when it is used: never on a path of fastrecord's
DEFERRED = {
    "matplotlib.pyplot": "pytorch_kinematics.ik (an IK plot on demand), mani_skill's jupyter_utils, renderer and "
                         "place_sphere: figures, none drawn while recording or replaying",
    "matplotlib.animation": "mani_skill.utils.visualization.jupyter_utils: a notebook's animation",
    "requests": "sapien.physx (the PhysX GPU library's first download), sapien.asset (asset downloads)",
}
ENV = "FASTRECORD_DEFER_IMPORTS"  # "0": every module imported as Python does


class DeferredModule(types.ModuleType):
    """A module of `DEFERRED` imported but not yet run: the first read of an attribute it lacks runs its code in it
    (once, whatever the thread), after which it is a plain module."""

    def __getattr__(self, name: str) -> Any:
        return _run(self, name)


_running: set[str] = set()  # modules whose code runs now (an import cycle reads them as Python's partial modules)
_locks: dict[str, threading.RLock] = {}
_locks_lock = threading.Lock()


def _run(module: Any, name: str) -> Any:
    spec = module.__dict__["__spec__"]
    if name == "__path__" and spec.submodule_search_locations is None:
        raise AttributeError(name)  # "is it a package?": the import system asks this of a plain module too
    with _locks_lock:
        lock = _locks.setdefault(spec.name, threading.RLock())
    with lock:
        if type(module) is DeferredModule:
            if spec.name in _running:  # read by its own code, or an import it makes, before it is whole
                raise AttributeError(f"partially initialized module {spec.name!r} has no attribute {name!r}")
            _running.add(spec.name)
            try:
                spec.loader.exec_module(module)
            finally:
                _running.discard(spec.name)
            setattr(module, "__class__", types.ModuleType)  # a plain module from now on  # noqa: B010
    return getattr(module, name)


# The finder and loader below are plain classes: the import system asks only for their methods, and
# ``importlib.abc`` costs a fresh Python 3.12 process 0.1 s (it imports ``importlib.resources``).
class _DeferringLoader:
    """Makes the module (as its own loader would), hands it the real loader, and runs nothing."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None  # Python's default module, as a source file's loader makes

    def exec_module(self, module: types.ModuleType) -> None:
        spec = module.__spec__
        assert spec is not None
        spec.loader = self.loader
        module.__loader__ = self.loader
        module.__class__ = DeferredModule


class DeferringFinder:
    """Finds a module of ``names`` where Python would (``PathFinder``: a source or bytecode file) and defers its run."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = frozenset(names)

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not isinstance(spec.loader, (importlib.machinery.SourceFileLoader,
                                                        importlib.machinery.SourcelessFileLoader)):
            return None  # not found, or not a Python file (an extension module runs when made): imported as usual
        deferring: Any = _DeferringLoader(spec.loader)  # a loader by its methods (see above)
        spec.loader = deferring
        return spec


def install(names: Sequence[str] = tuple(DEFERRED)) -> bool:
    """Defer the modules ``names`` in this process from now on (those already imported stay as they are); once a
    process. Returns whether deferral is on (off: ``FASTRECORD_DEFER_IMPORTS=0``)."""
    if os.environ.get(ENV, "") == "0":
        return False
    if not any(isinstance(f, DeferringFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, DeferringFinder(names))
    return True


def is_deferred(module: object) -> bool:
    """Whether ``module`` is imported but its code has not run yet."""
    return type(module) is DeferredModule
