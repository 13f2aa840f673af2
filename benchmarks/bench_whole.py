"""Whole commands, launch to exit, side by side in one run (issue 27): fastrecord against ManiSkill's ways.

Every job is a fresh interpreter launched as a user launches it (``python -m fastrecord record ...``, a script
calling ``make_eval_envs``, ``python -m mani_skill.trajectory.replay_trajectory``), timed from its launch to its
exit, with where its seconds went: the commands write their phase times to ``FASTRECORD_TIMELINE``
(`fastrecord.system.stamp`; ManiSkill's jobs are written in `benchmarks.whole_children` with the same stamps):

    import    launch -> imports done (interpreter, torch, ManiSkill, fastrecord)
    envs      env creation (sub-env processes, render scenes)
    reset     the first reset (and its first render, where the job records)
    step1     the first step
    loop      first step -> last step
    close     last step -> process exit (encoders draining, files closed, processes joined, interpreter exit)

`fastrecord replay` stamps the start and the end of its replay (workers, envs, loop and merge together: the
``replay`` column); its own timeline line (workers up, replaying, done) is printed under its row.

Jobs (``--only``): ``record`` (`fastrecord record` 16 envs x 64 episodes; ManiSkill's ``RecordEpisode`` in each
sub-env of an ``AsyncVectorEnv``, every env's video; the same loop with no video; and `fastrecord record` with
one env, whose time to its first step is the start-up to match), ``eval`` (`make_eval_envs`, the diffusion-policy
baseline's CPU branch, every video, against ManiSkill's baseline eval with env 0's video and with none), ``replay``
(state -> rgb, `fastrecord replay` against ``replay_trajectory``, as `benchmarks/bench_replay.py`).

    python benchmarks/bench_whole.py --size small                  # 2-core CPU machine: 2 envs, 128x128, lavapipe
    python benchmarks/bench_whole.py --size gpu --json whole.json  # the issue's sizes: 16 envs, 512x512, GPU render
    python benchmarks/bench_whole.py --size gpu --only record --src before=/path/to/older/checkout/src

``--src LABEL=PATH`` adds fastrecord's record and eval jobs run with another source tree (e.g. before a
change), measured in the same run. Whole-process times vary by +-30% between runs on shared machines:
compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CHECKOUT = Path(__file__).resolve().parents[1]
if str(CHECKOUT) not in sys.path:  # run as a script: `benchmarks.*` importable
    sys.path.insert(0, str(CHECKOUT))

from benchmarks.bench_replay import episodes_in, maniskill_replay_argv, record_input, replay_argv  # noqa: E402

PHASES = (("import", "launch", "imported"), ("envs", "imported", "env_ready"), ("reset", "env_ready", "reset"),
          ("step1", "reset", "first_step"), ("loop", "first_step", "loop_end"), ("close", "loop_end", "exit"))
REPLAY_PHASE = ("replay", "imported", "loop_end")  # fastrecord replay: envs + loop + merge, one span


@dataclasses.dataclass(frozen=True)
class Size:
    num_envs: int  # envs of every record and eval job
    size: int  # the human camera's width and height (videos)
    render: str  # render backend: cpu (lavapipe on a machine without a GPU) or gpu
    record_episodes: int  # episodes of the record jobs
    episode_steps: int  # steps of every recorded or evaluated episode
    eval_steps: int  # steps of the eval jobs (the envs reset themselves at truncation)
    replay_episodes: tuple[int, ...]  # episodes replayed, one comparison each (the input holds the largest)
    replay_envs: int  # envs of the replay jobs


SIZES = {
    "small": Size(num_envs=2, size=128, render="cpu", record_episodes=4, episode_steps=20, eval_steps=40,
                  replay_episodes=(8,), replay_envs=2),
    "gpu": Size(num_envs=16, size=512, render="gpu", record_episodes=64, episode_steps=50, eval_steps=200,
                replay_episodes=(96, 480), replay_envs=16),
}


@dataclasses.dataclass
class Result:
    job: str  # record, eval, replay
    label: str
    seconds: float  # launch to exit
    stamps: dict[str, float]  # phase name -> seconds since launch
    env_steps: int = 0

    def phase(self, name: str) -> float | None:
        for n, a, b in (*PHASES, REPLAY_PHASE):
            if (
                n == name
                and a in self.stamps
                and b in self.stamps
                and (n != "replay" or "env_ready" not in self.stamps)
            ):
                return self.stamps[b] - self.stamps[a]
        return None

    @property
    def first_step(self) -> float | None:
        """Launch to the end of the first step: the start-up a user waits."""
        return self.stamps.get("first_step")

    @property
    def loop_with_close(self) -> float | None:
        """The first reset to the end of close (the eval's "loop with close")."""
        if "env_ready" in self.stamps and "closed" in self.stamps:
            return self.stamps["closed"] - self.stamps["env_ready"]
        return None


def child_env(src: Path | None, timeline: Path) -> dict[str, str]:
    """The job's environment: ``src`` (this checkout's src by default) and the checkout first on the path."""
    path = [str(src or CHECKOUT / "src"), str(CHECKOUT)]
    if os.environ.get("PYTHONPATH"):
        path.append(os.environ["PYTHONPATH"])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "FASTRECORD_TIMELINE": str(timeline)}


def launch(job: str, label: str, argv: list[str], work: Path, src: Path | None = None, env_steps: int = 0,
           timeout: float = 900) -> Result:
    """Run ``argv`` in a fresh interpreter; its wall time and phase stamps (seconds since launch)."""
    timeline = work / f"timeline_{len(list(work.glob('timeline_*')))}.json"
    t0 = time.time()
    r = subprocess.run(argv, env=child_env(src, timeline), capture_output=True, text=True, timeout=timeout, cwd=work)
    t1 = time.time()
    if r.returncode != 0:
        raise RuntimeError(f"{label} failed (exit {r.returncode}): {' '.join(argv)}\n{r.stderr[-3000:]}")
    raw = json.loads(timeline.read_text()) if timeline.exists() else {}
    stamps = {"launch": 0.0, **{k: v - t0 for k, v in raw.items()}, "exit": t1 - t0}
    res = Result(job, label, t1 - t0, stamps, env_steps)
    print(f"  {label}: {res.seconds:.1f} s  " + "  ".join(
        f"{n} {res.phase(n):.1f}" for n, _, _ in (*PHASES, REPLAY_PHASE) if res.phase(n) is not None), flush=True)
    for line in detail(res):
        print(f"    {line}", flush=True)
    for line in r.stdout.splitlines():
        if line.startswith(("workers (", "start-up")):
            print(f"    {line}", flush=True)
    return res


def detail(res: Result) -> list[str]:
    """Where env creation and close went: the finer stamps between ``imported`` and ``env_ready`` (the batched
    render's mirrors and sub-envs) and after ``loop_end`` (recorder, sub-envs, mirrors, exit handlers), each as
    seconds since the phase began."""
    out = []
    for a, b, name in (("imported", "env_ready", "envs"), ("loop_end", "exit", "close")):
        if a not in res.stamps or b not in res.stamps:
            continue
        t0, t1 = res.stamps[a], res.stamps[b]
        inner = sorted((t, k) for k, t in res.stamps.items() if t0 < t < t1 and k not in (a, b))
        if inner:
            out.append(f"{name} {t1 - t0:.2f} s: " + ", ".join(f"{k} +{t - t0:.2f}" for t, k in inner))
    server = sorted((t, k) for k, t in res.stamps.items() if k.startswith("forkserver_"))
    if server:  # how the forkserver started (workers.start_forkserver: a zygote, or a fresh interpreter and why)
        out.append("forkserver: " + ", ".join(f"{k.split('_', 1)[1]} at {t:.2f} s" for t, k in server))
    device = sorted((t, k) for k, t in res.stamps.items() if k.startswith("render_device_"))
    if device:  # the render engine opened early, while the imports ran (fastrecord.render.device)
        out.append("render device: " + ", ".join(f"{k.rsplit('_', 1)[1]} at {t:.2f} s" for t, k in device))
    return out


def _child(job: str, args: dict[str, Any]) -> list[str]:
    return [sys.executable, "-m", "benchmarks.whole_children", job, json.dumps(args)]


def record_jobs(s: Size, work: Path, srcs: dict[str, Path | None], out: list[Result], maniskill: bool = True,
                sweep: tuple[int, ...] = ()) -> None:
    n, steps = s.num_envs, s.num_envs * s.episode_steps * -(-s.record_episodes // s.num_envs)
    common = ["--width", str(s.size), "--height", str(s.size), "--render-backend", s.render, "--max-episode-steps",
              str(s.episode_steps), "--if-exists", "overwrite"]
    for tag, src in srcs.items():
        name = f"fastrecord record{tag}"
        argv = [sys.executable, "-m", "fastrecord", "record", "PickCube-v1", "--num-envs", str(n), "--episodes",
                str(s.record_episodes), "--output-dir", str(work / f"fr_record{tag.strip()}"), *common]
        out.append(launch("record", name, argv, work, src, steps))
        if src is not None:  # one env's start: the checkout's only (the forkserver is not used by one env)
            continue
        one = [sys.executable, "-m", "fastrecord", "record", "PickCube-v1", "--num-envs", "1", "--episodes", "1",
               "--output-dir", str(work / f"fr_record1{tag.strip()}"), *common]
        out.append(launch("record", f"{name}, 1 env", one, work, src, s.episode_steps))
    for k in sweep:  # a labelled sweep beside the default (this checkout's fastrecord)
        argv = [sys.executable, "-m", "fastrecord", "record", "PickCube-v1", "--num-envs", str(n), "--episodes",
                str(s.record_episodes), "--output-dir", str(work / f"fr_record_epp{k}"), "--envs-per-process", str(k),
                *common]
        out.append(launch("record", f"fastrecord record, sweep: --envs-per-process {k}", argv, work, None, steps))
    if not maniskill:
        return
    a = dict(env_id="PickCube-v1", num_envs=n, size=s.size, render=s.render, episode_steps=s.episode_steps,
             episodes=s.record_episodes)
    out.append(launch("record", "ManiSkill, every video", _child("record_maniskill", {
        **a, "video": True, "out": str(work / "ms_record")}), work, env_steps=steps))
    out.append(launch("record", "ManiSkill, no video", _child("record_maniskill", {
        **a, "video": False, "out": str(work / "ms_record_none")}), work, env_steps=steps))


def eval_jobs(s: Size, work: Path, srcs: dict[str, Path | None], out: list[Result], maniskill: bool = True,
              prestart: bool = False, sweep: tuple[int, ...] = ()) -> None:
    a = dict(env_id="PickCube-v1", num_envs=s.num_envs, size=s.size, render=s.render, episode_steps=s.episode_steps,
             steps=s.eval_steps, obs_horizon=2)
    steps = s.num_envs * s.eval_steps
    for tag, src in srcs.items():
        out.append(launch("eval", f"fastrecord make_eval_envs{tag}", _child("eval_fastrecord", {
            **a, "video": True, "out": str(work / f"fr_eval{tag.strip()}")}), work, src, steps))
    for k in sweep:  # a labelled sweep beside the default (this checkout's fastrecord)
        out.append(launch("eval", f"fastrecord make_eval_envs, sweep: envs_per_process={k}", _child("eval_fastrecord", {
            **a, "video": True, "envs_per_process": k, "out": str(work / f"fr_eval_epp{k}")}), work, None, steps))
    if prestart:
        out.append(launch("eval", "fastrecord make_eval_envs, forkserver started first", _child("eval_fastrecord", {
            **a, "video": True, "prestart": True, "out": str(work / "fr_eval_prestart")}), work, env_steps=steps))
    if not maniskill:
        return
    out.append(launch("eval", "ManiSkill eval, env 0's video", _child("eval_maniskill", {
        **a, "video": True, "out": str(work / "ms_eval")}), work, env_steps=steps))
    out.append(launch("eval", "ManiSkill eval, no video", _child("eval_maniskill", {
        **a, "video": False, "out": str(work / "ms_eval_none")}), work, env_steps=steps))


def replay_jobs(s: Size, work: Path, srcs: dict[str, Path | None], out: list[Result]) -> None:
    del srcs  # the checkout's fastrecord only
    total = max(s.replay_episodes)
    t0 = time.perf_counter()
    ranks = max(1, min(4, (os.cpu_count() or 1) // 4))  # 16 cores: 4 ranks of 4 envs (device time: 92 s -> ~30 s)
    src_h5 = record_input(work / "replay_input", total, s.episode_steps, None, num_envs=s.replay_envs, ranks=ranks)
    print(f"  (replay input: {total} episodes recorded in {time.perf_counter() - t0:.1f} s by {ranks} process(es), "
          f"not timed)", flush=True)
    ms_dir = work / "maniskill_replay"
    ms_dir.mkdir(exist_ok=True)
    ms_src = ms_dir / src_h5.name
    shutil.copy(src_h5, ms_src)
    shutil.copy(src_h5.with_suffix(".json"), ms_src.with_suffix(".json"))
    for count in s.replay_episodes:
        folder = work / f"fr_replay_{count}"
        argv = replay_argv(src_h5, s.replay_envs, count, "states") + ["--output-dir", str(folder)]
        out.append(launch("replay", f"fastrecord replay, {count} episodes", argv, work,
                          env_steps=count * s.episode_steps))
        if episodes_in(folder / "replayed.json") != count:
            raise RuntimeError(f"fastrecord replay wrote {episodes_in(folder / 'replayed.json')} episodes, not {count}")
        out.append(launch("replay", f"ManiSkill replay_trajectory, {count} episodes",
                          maniskill_replay_argv(ms_src, s.replay_envs, count, "states"), work,
                          env_steps=count * s.episode_steps))
        for q in ms_dir.glob("*.json"):  # the tool writes NAME.rgb...json beside its input: start each count alike
            if q.name != ms_src.with_suffix(".json").name:
                q.unlink()
                q.with_suffix(".h5").unlink(missing_ok=True)


def _find(results: list[Result], label: str) -> Result | None:
    return next((r for r in results if r.label == label), None)


def ratios(results: list[Result], s: Size, srcs: dict[str, Path | None]) -> list[str]:
    """The issue's targets, each as a ratio of this run's figures."""
    lines = []

    def ratio(text: str, a: Result | None, b: Result | None, target: str, value: Any = None) -> None:
        if a is not None and b is not None:
            v = value(a, b) if value else a.seconds / b.seconds
            lines.append(f"{text}: {v:.2f}x (target {target})")

    for tag in srcs:
        fr = _find(results, f"fastrecord record{tag}")
        ratio(f"record{tag}: ManiSkill every video / fastrecord", _find(results, "ManiSkill, every video"), fr, ">= 2")
        ratio(f"record{tag}: ManiSkill no video / fastrecord", _find(results, "ManiSkill, no video"), fr, ">= 1")
        ratio(f"record{tag}: time to first step, {s.num_envs} envs / 1 env", fr,
              _find(results, f"fastrecord record{tag}, 1 env"), "<= 1.3", lambda a, b: a.first_step / b.first_step)
        ev = _find(results, f"fastrecord make_eval_envs{tag}")
        ratio(f"eval{tag}: fastrecord / ManiSkill env 0's video", ev, _find(results, "ManiSkill eval, env 0's video"),
              "<= 0.7")
        if ev is not None and ev.loop_with_close:
            rate = ev.env_steps / ev.loop_with_close
            lines.append(f"eval{tag}: loop with close {rate:.0f} env-steps/s (target >= 800)")
    for count in s.replay_episodes:
        ratio(f"replay {count}: ManiSkill / fastrecord",
              _find(results, f"ManiSkill replay_trajectory, {count} episodes"),
              _find(results, f"fastrecord replay, {count} episodes"), ">= 2")
    return lines


def table(results: list[Result]) -> list[str]:
    head = ("| job | seconds | " + " | ".join(n for n, _, _ in PHASES) + " | to first step | env-steps/s (loop) | "
            + REPLAY_PHASE[0] + " |")
    rows = [head, "|" + " --- |" * (len(PHASES) + 5)]
    for r in results:
        loop = r.phase("loop")
        rate = f"{r.env_steps / loop:.0f}" if loop and r.env_steps else ""
        cells = [f"{r.phase(n):.1f}" if r.phase(n) is not None else "" for n, _, _ in PHASES]
        first = f"{r.first_step:.1f}" if r.first_step is not None else ""
        span = r.phase(REPLAY_PHASE[0])
        rows.append(f"| {r.label} | {r.seconds:.1f} | " + " | ".join(cells) + f" | {first} | {rate} | "
                    + (f"{span:.1f}" if span is not None else "") + " |")
    return rows


def counts(p: argparse.ArgumentParser, flag: str, text: str, example: str) -> tuple[int, ...]:
    """``text``'s comma-separated positive integers, else ``p``'s usage error naming the flag and the value."""
    items = [k.strip() for k in text.split(",") if k.strip()]
    if not items or not all(k.isdigit() and int(k) >= 1 for k in items):
        p.error(f"{flag} {text!r}: give positive integers separated by commas, e.g. {flag} {example}")
    return tuple(int(k) for k in items)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--only", default="record,eval,replay", help="jobs to run, separated by commas")
    p.add_argument("--src", action="append", default=[], metavar="LABEL=PATH",
                   help="also run fastrecord's record and eval jobs with the fastrecord of PATH (a src folder), "
                        "labelled LABEL")
    p.add_argument("--src-first", action="store_true",
                   help="run the --src trees' record and eval jobs before this checkout's (a job's place in the run "
                        "moves its time: run once each way to compare two trees)")
    p.add_argument("--replay-episodes",
                   help="episode counts of the replay jobs, separated by commas (default: the size's)")
    p.add_argument("--eval-prestart", action="store_true",
                   help="also the eval with fastrecord's forkserver started first thing in the script")
    p.add_argument("--skip-maniskill", action="store_true", help="record and eval: fastrecord's jobs only")
    p.add_argument("--envs-per-process", default="",
                   help="a sweep beside the default: record and eval also with these sub-envs a process (e.g. 1,2)")
    p.add_argument("--json", help="write every result here")
    p.add_argument("--work-dir", help="where the jobs write (default: a temporary folder, removed)")
    args = p.parse_args(argv)
    s = SIZES[args.size]
    if args.replay_episodes:
        s = dataclasses.replace(s, replay_episodes=counts(p, "--replay-episodes", args.replay_episodes, "96,480"))
    srcs: dict[str, Path | None] = {"": None}
    for item in args.src:
        label, sep, path = item.partition("=")
        if not sep or not Path(path, "fastrecord").is_dir():
            p.error(f"--src {item!r} must be LABEL=PATH with PATH a src folder holding fastrecord/")
        srcs[f" ({label})"] = Path(path).resolve()
    if args.src_first:
        if len(srcs) == 1:
            p.error("--src-first runs the --src trees' jobs first: give at least one --src LABEL=PATH")
        srcs = {**{tag: src for tag, src in srcs.items() if tag}, "": None}
    ms = not args.skip_maniskill
    sweep = counts(p, "--envs-per-process", args.envs_per_process, "1,2") if args.envs_per_process.strip() else ()
    jobs = {"record": lambda *x: record_jobs(*x, maniskill=ms, sweep=sweep),
            "eval": lambda *x: eval_jobs(*x, maniskill=ms, prestart=args.eval_prestart, sweep=sweep),
            "replay": replay_jobs}
    warm = [sys.executable, "-c", "import torch, sapien, gymnasium, mani_skill.envs, av, h5py"]
    only = [j.strip() for j in args.only.split(",") if j.strip()]
    if bad := [j for j in only if j not in jobs]:
        p.error(f"--only {','.join(bad)}: not a job; use any of {', '.join(jobs)}")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_whole_"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"{args.size}: {s}; {os.cpu_count()} cores; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    results: list[Result] = []
    failed: list[str] = []
    # a `timeout` around this script (benchmarks/gpu_pending.sh) still gets the table of the jobs that finished
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.perf_counter()  # the first job would read the libraries from disk and the others from memory
    subprocess.run(warm, env=child_env(None, work / "warm.json"), capture_output=True, check=True)
    print(f"page cache warmed: the imports once, not timed ({time.perf_counter() - t0:.1f} s)", flush=True)
    try:
        for j in only:
            print(f"{j}:", flush=True)
            try:
                jobs[j](s, work, srcs, results)
            except (RuntimeError, subprocess.TimeoutExpired) as e:  # the other jobs still run; the exit says it
                print(f"  {j} stopped: {e}", flush=True)
                failed.append(j)
    finally:
        lines = table(results) + [""] + ratios(results, s, srcs)
        print("\n".join(lines), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(dict(size=args.size, config=dataclasses.asdict(s), lines=lines,
                                                       results=[dataclasses.asdict(r) for r in results]), indent=1))
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
