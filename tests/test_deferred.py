"""`fastrecord.deferred`: the modules ManiSkill imports but fastrecord's processes never use run at their first use.
Each case runs in a fresh interpreter (the finder is process-wide, and a module once run stays run)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import h5py
from conftest import checkout_env, fastrecord_cli, record_args


def run_python(code: str, cwd=None, **env: str) -> dict:
    """``code`` in a fresh interpreter of this checkout; it prints one JSON line last, returned."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                       cwd=cwd, env=checkout_env(**env))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


PACKAGE = {
    "pkg/__init__.py": "",
    # counts its runs in a file; fails its first run where told to; imports a module that reads it back meanwhile
    "pkg/heavy.py": """
        import os, time
        from pathlib import Path
        runs = Path(os.environ["RUNS"])
        runs.write_text(str(int(runs.read_text() or 0) + 1))
        if os.environ.get("FAIL_FIRST") and runs.read_text() == "1":
            raise RuntimeError("the first run fails")
        time.sleep(0.2)  # threads reading it meanwhile wait for the one run
        import pkg.cycle
        SEEN_BY_CYCLE = pkg.cycle.SEEN
        VALUE = 42
    """,
    "pkg/cycle.py": """
        from pkg import heavy
        SEEN = getattr(heavy, "VALUE", "partial")  # read before heavy's code is done: a partial module, as Python's
    """,
    "pkg/user.py": """
        import pkg.heavy as by_import
        from pkg import heavy as by_from
    """,
}


def write_package(tmp_path):
    for name, text in PACKAGE.items():
        path = tmp_path / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(textwrap.dedent(text))
    (tmp_path / "runs").write_text("")


def test_a_deferred_module_runs_once_at_its_first_use_whatever_the_thread(tmp_path):
    """Imports bind the module without running it (a second import neither); the first read of one of its names runs
    it once, while other threads reading it wait; a module it imports that reads it back meanwhile sees a partial
    module (as in Python's own import cycles); afterwards it is a plain module."""
    write_package(tmp_path)
    answer = run_python("""
        import json, sys, threading, types
        from fastrecord.deferred import DEFERRED, install, is_deferred
        assert install(["pkg.heavy"])
        import pkg.user
        import pkg.heavy
        from pathlib import Path
        runs_after_imports = Path("runs").read_text()
        deferred = is_deferred(sys.modules["pkg.heavy"]) and pkg.user.by_import is pkg.user.by_from is pkg.heavy
        values = []
        threads = [threading.Thread(target=lambda: values.append(pkg.user.by_from.VALUE)) for _ in range(8)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        print(json.dumps(dict(runs_after_imports=runs_after_imports, deferred=deferred, values=values,
                              runs=Path("runs").read_text(), seen_by_cycle=pkg.heavy.SEEN_BY_CYCLE,
                              plain=type(pkg.heavy) is types.ModuleType, file=pkg.heavy.__file__.endswith("heavy.py"),
                              listed=sorted(DEFERRED))))
    """, cwd=tmp_path, RUNS=str(tmp_path / "runs"), PYTHONPATH=f"{tmp_path}:{checkout_env()['PYTHONPATH']}")
    assert answer == dict(runs_after_imports="", deferred=True, values=[42] * 8, runs="1", seen_by_cycle="partial",
                          plain=True, file=True, listed=["matplotlib.animation", "matplotlib.pyplot", "requests"])


def test_a_deferred_module_that_fails_raises_its_error_at_first_use_and_runs_again_at_the_next(tmp_path):
    """A module whose code raises raises it where it is first used (as its import would have), and stays deferred: the
    next use runs it again, as a new import would."""
    write_package(tmp_path)
    answer = run_python("""
        import json
        from fastrecord.deferred import install, is_deferred
        install(["pkg.heavy"])
        import pkg.heavy
        try:
            pkg.heavy.VALUE
            first = "no error"
        except RuntimeError as e:
            first = str(e)
        still = is_deferred(pkg.heavy)
        print(json.dumps(dict(first=first, still_deferred=still, second=pkg.heavy.VALUE)))
    """, cwd=tmp_path, RUNS=str(tmp_path / "runs"), FAIL_FIRST="1",
        PYTHONPATH=f"{tmp_path}:{checkout_env()['PYTHONPATH']}")
    assert answer == dict(first="the first run fails", still_deferred=True, second=42)


def test_maniskills_unused_imports_are_deferred_and_work_when_used(tmp_path):
    """After ``import mani_skill.envs`` with deferral on, matplotlib's pyplot and requests are imported but not run;
    used, they are the real modules (a figure drawn and saved, a requests session made). ``FASTRECORD_DEFER_IMPORTS=0``
    turns `install` off. Importing and using fastrecord's API installs nothing in the caller's process."""
    code = """
        import io, json, sys
        from fastrecord.deferred import install, is_deferred
        on = install()
        import mani_skill.envs  # noqa: F401
        deferred = {m: is_deferred(sys.modules.get(m)) for m in ("matplotlib.pyplot", "requests")}
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots()
        ax.plot([0, 1], [1, 0])
        png = io.BytesIO()
        fig.savefig(png, format="png")
        import requests
        session = type(requests.Session()).__name__
        print(json.dumps(dict(on=on, deferred=deferred, png=png.getvalue()[:4].hex(), session=session,
                              after=is_deferred(plt) or is_deferred(requests))))
    """
    assert run_python(code) == dict(on=True, deferred={"matplotlib.pyplot": True, "requests": True}, png="89504e47",
                                    session="Session", after=False)
    off = run_python(code, FASTRECORD_DEFER_IMPORTS="0")
    assert off["on"] is False and off["deferred"] == {"matplotlib.pyplot": False, "requests": False}
    library = run_python("""
        import json, sys
        import gymnasium as gym
        from fastrecord import RecordEpisode, make_eval_envs  # noqa: F401
        from fastrecord.deferred import DeferringFinder, is_deferred
        env = RecordEpisode(gym.make("PickCube-v1", sim_backend="physx_cpu", render_mode="rgb_array",
                                     human_render_camera_configs=dict(width=32, height=32)), "out", save_video=False)
        env.reset(seed=0)
        env.close()
        print(json.dumps(dict(finder=any(isinstance(f, DeferringFinder) for f in sys.meta_path),
                              pyplot=is_deferred(sys.modules.get("matplotlib.pyplot")))))
    """, cwd=tmp_path)
    assert library == dict(finder=False, pyplot=False)


def test_the_command_never_runs_maniskills_unused_imports(tmp_path):
    """``fastrecord record`` (the README's job, small) imports ManiSkill without running matplotlib's pyplot or
    requests (``-X importtime`` lists no module they import, where Python's own import, ``FASTRECORD_DEFER_IMPORTS=0``,
    runs them), and records what it records either way."""
    listed = {}
    for way, extra in (("deferred", {}), ("python", {"FASTRECORD_DEFER_IMPORTS": "0"})):
        out = tmp_path / way
        r = fastrecord_cli(*record_args(out, episodes=1, max_steps=5), "--num-envs", "1",
                           env=dict(PYTHONPROFILEIMPORTTIME="1", **extra))
        assert r.returncode == 0, r.stderr[-3000:]
        imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
        listed[way] = sorted(m for m in ("matplotlib.figure", "urllib3", "mani_skill.envs") if m in imported)
        with h5py.File(out / "trajectory.h5") as f:
            assert f["traj_0/actions"].shape == (5, 8)
    assert listed == dict(deferred=["mani_skill.envs"], python=["mani_skill.envs", "matplotlib.figure", "urllib3"])
