"""`PackedVectorEnv`: a gymnasium vector env whose sub-envs live several to a process.

gymnasium's ``AsyncVectorEnv`` gives every sub-env a process of its own. For CPU-simulated ManiSkill envs
that render on a GPU (the batched render's sub-envs: they render nothing themselves, but each process opens
its own Vulkan device), 16 processes starting together wait for the GPU driver: on the H200 machine a
process's render device takes 0.66 s alone and 4.7-6.0 s when 16 make theirs at once, and 16 PickCube envs
took 8.4-10.5 s to make in 16 processes against 2.95 s in 4 processes of 4 (`benchmarks/probe_make_contention.py`,
docs/performance.md). The physics of several envs in one process then runs in turn, and a reconfiguring reset
(make_eval_envs: every episode) rebuilds their scenes in turn: the default of 2 envs a process is what whole commands
measured best (H100, 16 envs at 512x512: record 19.1 s against 21.8 s with 4 a process and 22.4-23.3 s with 1; the
eval 23.9 s against 25.5 s with 4; 8 a process 26.3-26.4 s).

Semantics are ``AsyncVectorEnv``'s (gymnasium 1.x): the three autoreset modes, ``options["reset_mask"]``,
``call`` / ``get_attr`` / ``set_attr`` through the wrappers (``get_wrapper_attr``), infos gathered with
``VectorEnv._add_info``, ``close(terminate=True)``. What differs: no dummy env is built in the caller (the first
process reports the spaces after making its envs), the processes can be launched before the caller needs them
(`PackedLaunch`: the CLI starts its sub-envs before its own imports), and an error in a sub-env is raised in the
caller as the sub-env's own exception, its traceback and sub-env index attached (after an error of a reset or a
step the vector env is closed: a half-stepped batch cannot go on; ``call``, ``get_attr`` and ``set_attr`` change
nothing where they fail, so the vector env stays open, where gymnasium's worker would shut down).
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import threading
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import (
    CloudpickleWrapper,
    batch_space,
    clear_mpi_env_vars,
    concatenate,
    create_empty_array,
    iterate,
)

from fastrecord.packed_process import AheadFailed, process_main
from fastrecord.system import stamp

__all__ = ["AheadFailed", "PackedLaunch", "PackedVectorEnv", "RemoteTraceback", "SubEnvDied", "process_sizes"]

ENVS_PER_PROCESS = 2  # the default packing (16 envs: 8 processes of 2; H100 sweep of 1, 2, 4, 8 in docs/performance.md)
MIN_PROCESSES = 4  # below 16 envs the processes stay 4 (or one an env), so the physics of few envs is not serialised
START_NOTICE_S = 120.0  # a process still making its sub-envs after this long is named once (a warning), then awaited
log = logging.getLogger("fastrecord")


def process_sizes(num_envs: int, envs_per_process: int | None = None, cores: int | None = None) -> list[int]:
    """How many envs each process hosts: ``envs_per_process`` each (the last fewer), or by default
    ``ceil(num_envs / 2)`` processes but at least ``min(num_envs, 4)`` and at most ``cores`` (the usable cores),
    the envs spread evenly (sizes differ by at most one)."""
    if not isinstance(num_envs, int) or isinstance(num_envs, bool) or num_envs < 1:
        raise ValueError(f"num_envs={num_envs!r}: pass a positive int")
    if envs_per_process is not None:
        if not isinstance(envs_per_process, int) or isinstance(envs_per_process, bool) or envs_per_process < 1:
            raise ValueError(f"envs_per_process={envs_per_process!r}: pass a positive int (1: a process per env, "
                             f"as gymnasium's AsyncVectorEnv), or None for the default")
        full, rest = divmod(num_envs, envs_per_process)
        return [envs_per_process] * full + ([rest] if rest else [])
    if cores is None:
        from fastrecord.workers import affinity_cores

        cores = affinity_cores()
    procs = max(1, min(num_envs, max(math.ceil(num_envs / ENVS_PER_PROCESS), MIN_PROCESSES), cores))
    base, extra = divmod(num_envs, procs)
    return [base + 1] * extra + [base] * (procs - extra)


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a sub-env's process (the ``__cause__`` of the re-raised error)."""

    def __str__(self) -> str:
        return "\n" + str(self.args[0])


class SubEnvDied(RuntimeError):
    """A sub-env process ended without answering (killed, crashed in native code, or out of memory)."""


class PackedLaunch:
    """Owns the processes of a `PackedVectorEnv` while they start.

    ``background=True`` starts them on a thread (``Process.start`` on the forkserver context waits for the
    server's preload): the caller goes on with its own imports while the sub-envs are made, then
    ``PackedVectorEnv(launch=...)`` takes them over. ``close()`` ends processes that were never taken over;
    ``close(wait=False)`` returns at once where the thread is still starting them (a refusal of the options, whose
    one-line error should not wait for the server's preload): the thread then ends each process it starts.

    ``context``: multiprocessing's start method (its default where None). A background launch never forks from its
    thread (`_launch_context`): it starts on the forkserver unless ``context`` names another method that is not
    "fork", and ``context="fork"`` is refused."""

    def __init__(self, env_fns: Sequence[Callable[[], gym.Env]], envs_per_process: int | None = None, *,
                 context: str | None = None, autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
                 background: bool = False, daemon: bool = True) -> None:
        self.num_envs = len(env_fns)
        self.sizes = process_sizes(self.num_envs, envs_per_process)
        self.autoreset_mode = autoreset_mode if isinstance(autoreset_mode, AutoresetMode) else AutoresetMode(
            autoreset_mode)
        self._fns = list(env_fns)
        self._ctx: Any = _launch_context(context, background)
        self._daemon = daemon
        self.processes: list[Any] = []
        self.pipes: list[Any] = []
        self._failed: BaseException | None = None
        self._taken = False
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # the launch's thread and close(wait=False) agree on who ends the processes
        self._abandoned = False  # closed without waiting: the thread ends what it starts
        self._thread_done = False
        if background:
            self._thread = threading.Thread(target=self._start, name="fastrecord-packed-launch", daemon=True)
            self._thread.start()
        else:
            self._start()
            if self._failed is not None:
                raise self._failed

    def _start(self) -> None:
        try:
            first = 0
            with clear_mpi_env_vars():
                for size in self.sizes:
                    if self._abandoned:
                        break
                    parent, child = self._ctx.Pipe()
                    proc = self._ctx.Process(
                        target=process_main, name=f"fastrecord-subenvs-{first}-{first + size - 1}", daemon=self._daemon,
                        args=(child, CloudpickleWrapper(self._fns[first:first + size]),  # type: ignore[arg-type]  # a list
                              first, self.autoreset_mode))
                    proc.start()
                    child.close()
                    with self._lock:
                        self.processes.append(proc)
                        self.pipes.append(parent)
                    first += size
        except BaseException as e:  # noqa: BLE001 - raised where the launch is taken over
            self._failed = e
        finally:
            with self._lock:
                abandoned = self._abandoned
                self._thread_done = True
            if abandoned:
                _end(self.processes, self.pipes)

    def made_for(self, env_fns: Sequence[Callable[[], gym.Env]], autoreset_mode: AutoresetMode) -> bool:
        """Whether these processes make the envs of ``env_fns`` (functions that compare equal, in the same order)
        with ``autoreset_mode``: what a vector env checks before it takes over a launch started early."""
        return not self._taken and self.autoreset_mode == autoreset_mode and self._fns == list(env_fns)

    def take(self) -> tuple[list[Any], list[Any]]:
        """The started processes and their pipes (waits for the launch; raises what it raised)."""
        if self._thread is not None:
            self._thread.join()
        if self._failed is not None:
            self.close()
            raise self._failed
        self._taken = True
        return self.processes, self.pipes

    def close(self, wait: bool = True) -> None:
        """End the processes at once, unless a `PackedVectorEnv` took them over. ``wait=False``: where the launch's
        thread is still starting them, leave them to it (it ends each as its start returns) and return now."""
        if self._taken:
            return
        self._taken = True
        if self._thread is not None:
            if not wait:
                with self._lock:
                    if not self._thread_done:
                        self._abandoned = True
                        return
            self._thread.join()
        _end(self.processes, self.pipes)


def _launch_context(context: str | None, background: bool) -> Any:
    """multiprocessing's context for a `PackedLaunch`. A fork copies the whole process but only the thread that
    forks: a lock another thread holds at that moment (an import's, a stream's, a C library's) stays held in the copy
    for good, and the copy waits on it forever. The CLI forks nothing from a thread, but a launch in the background
    starts its processes from one while the caller goes on, so it takes the forkserver (a server that forks from its
    single thread) where the start method would be "fork" (Linux's default before Python 3.14). What led here: a
    background launch of three CartPole processes on the fork default, in a pytest process with ten or more other
    threads, waited 600 s for a sub-env's first message in CI on 2026-12-07, the first such hang in the CI runs since
    the launch was written (not reproduced in more than 1,600 launches beside three chattering threads on the 2-core
    machine)."""
    if not background:
        return multiprocessing.get_context(context)
    if context == "fork":
        raise ValueError("PackedLaunch(background=True, context='fork') would fork from the launch's thread, and a "
                         "forked copy of a threaded process can hang for good on a lock another thread held; pass "
                         "context='forkserver' (or None, which gives it) or 'spawn', or background=False to fork "
                         "from the calling thread")
    ctx = multiprocessing.get_context(context)
    return multiprocessing.get_context("forkserver") if ctx.get_start_method() == "fork" else ctx


def _end(processes: list[Any], pipes: list[Any], grace: float = 10.0) -> None:
    """End ``processes``: SIGTERM, then SIGKILL for any still there after ``grace`` seconds."""
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
    for proc in processes:
        proc.join(grace)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for pipe in pipes:
        pipe.close()


def _reap(processes: list[Any], pipes: list[Any], timeout: float | None, grace: float = 10.0) -> None:
    """The processes that answered ``close``, awaited as they exit (ended after ``timeout`` seconds each). Waits on
    their sentinels without reaping them: a process is reaped (``waitpid``) by one thread only, the caller's (its
    ``is_alive``, ``join``, multiprocessing's ``active_children``); two threads reaping one child race, and the loser
    reads a live process."""
    from multiprocessing.connection import wait

    for proc in processes:
        if not wait([proc.sentinel], timeout):
            proc.terminate()
            if not wait([proc.sentinel], grace):
                proc.kill()
    for pipe in pipes:
        pipe.close()
    stamp("subenv_processes_joined")


class PackedVectorEnv(gym.vector.VectorEnv):
    """A vector env of ``len(env_fns)`` sub-envs in processes of several envs each (`process_sizes`).

    Owns: the processes (each makes its envs with their functions, in order, and steps them in turn), the
    pipes to them, and the spaces the first process reported. Stepping sends each process its envs' actions,
    then gathers every answer: all processes step at once.
    """

    resets_async = True  # reset_async / reset_wait (RecordVectorEpisode's reset takes the ended episodes between)

    def __init__(self, env_fns: Sequence[Callable[[], gym.Env]] | None = None, envs_per_process: int | None = None,
                 *, context: str | None = None, autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
                 launch: PackedLaunch | None = None) -> None:
        self.closed = True  # until every process answered
        self._reaper: threading.Thread | None = None  # awaits the processes' exits after close
        self._resetting = False  # a reset_async's answers not gathered yet
        self._reset_answers: list[Any] | None = None  # gathered, not yet taken by reset_wait
        self.processes: list[Any] = []
        self.pipes: list[Any] = []
        if launch is None:
            if env_fns is None:
                raise ValueError("PackedVectorEnv needs env_fns (the sub-envs' functions) or a PackedLaunch")
            launch = PackedLaunch(env_fns, envs_per_process, context=context, autoreset_mode=autoreset_mode)
        self.processes, self.pipes = launch.take()
        self.sizes, self.num_envs, self.autoreset_mode = launch.sizes, launch.num_envs, launch.autoreset_mode
        self.slices: list[tuple[int, int]] = []
        first = 0
        for size in self.sizes:
            self.slices.append((first, first + size))
            first += size
        self.closed = False
        try:
            ready = self._gather(None)
        except BaseException:
            self._terminate()
            raise
        spec = ready[0][0]
        for p, answer in enumerate(ready):
            if answer[0]["observation_space"] != spec["observation_space"] or answer[0]["action_space"] != spec[
                    "action_space"]:
                self._terminate()
                lo = self.slices[p][0]
                raise RuntimeError(f"sub-env {lo}'s spaces differ from sub-env 0's (observation "
                                   f"{answer[0]['observation_space']} vs {spec['observation_space']}): every "
                                   f"sub-env of a vector env needs the same spaces")
        self.metadata = dict(spec["metadata"])
        self.metadata["autoreset_mode"] = self.autoreset_mode
        self.render_mode = spec["render_mode"]
        self.single_observation_space = spec["observation_space"]
        self.single_action_space = spec["action_space"]
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)

    # ------------------------------------------------------------------------------------------ the protocol
    def _send(self, command: str, per_env: list[Any] | None = None, data: Any = None) -> None:
        if self.closed:
            raise gym.error.ClosedEnvironmentError(f"this PackedVectorEnv is closed; {command} needs an open one")
        self._settle_reset()
        for p, pipe in enumerate(self.pipes):
            lo, hi = self.slices[p]
            try:
                pipe.send((command, per_env[lo:hi] if per_env is not None else data))
            except (BrokenPipeError, ConnectionResetError, EOFError):  # the process is gone
                self._terminate()
                raise self._died(p, command) from None

    def _died(self, p: int, command: str | None) -> SubEnvDied:
        proc = self.processes[p]
        proc.join(5)
        lo, hi = self.slices[p]
        return SubEnvDied(f"the process of sub-envs {lo}-{hi - 1} ended without answering {command or 'its start'} "
                          f"(exit code {proc.exitcode}: killed, a crash in native code, or out of memory); the vector "
                          f"env is closed")

    def _gather(self, command: str | None, fatal: bool = True) -> list[list[Any]]:
        """Every process's answer (a list, one item an env), in process order; raises the first error, after which
        the vector env is closed unless the command changed nothing (``fatal=False``: ``call``, ``set_attr``) and
        every process is still there."""
        answers: list[list[Any]] = []
        failure: BaseException | None = None
        for p, pipe in enumerate(self.pipes):
            try:
                if command is None and not pipe.poll(START_NOTICE_S):  # the start: a make that takes minutes is said
                    self._slow_start(p)
                ok, payload = pipe.recv()
            except (EOFError, OSError):
                failure = failure or self._died(p, command)
                continue
            if ok:
                answers.append(payload)
            elif failure is None:
                failure = _raised(payload, command, closed=fatal)
        if failure is not None:
            if fatal or isinstance(failure, SubEnvDied):
                self._terminate()
            raise failure
        return answers

    def _slow_start(self, p: int) -> None:
        """Say once that process ``p`` is still making its sub-envs: a wait without end would otherwise say nothing
        (gymnasium's AsyncVectorEnv says nothing either)."""
        lo, hi = self.slices[p]
        log.warning("fastrecord: the process of sub-envs %d-%d (pid %s) has been making its envs for over %.0f s; "
                    "still waiting for it (a first download of the task's assets takes that long, a hang forever: "
                    "Ctrl-C stops)", lo, hi - 1, self.processes[p].pid, START_NOTICE_S)

    def _flat(self, answers: list[list[Any]]) -> list[Any]:
        return [item for answer in answers for item in answer]

    # ------------------------------------------------------------------------------------------ gymnasium's API
    def reset(self, *, seed: int | list[int | None] | None = None,
              options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        self.reset_async(seed=seed, options=options)
        return self.reset_wait()

    def reset_async(self, *, seed: int | list[int | None] | None = None,
                    options: dict[str, Any] | None = None) -> None:
        """Send `reset`'s command and return at once: the processes reset while the caller goes on (the recorder
        takes the ended episodes meanwhile); `reset_wait` takes their answers. Any other command sent before it
        first waits for them (kept for `reset_wait`)."""
        if self._resetting or self._reset_answers is not None:
            raise RuntimeError("reset_async() while a reset is pending: call reset_wait() first")
        if seed is None:
            seeds: list[int | None] = [None] * self.num_envs
        elif isinstance(seed, (int, np.integer)):
            seeds = [int(seed) + i for i in range(self.num_envs)]
        else:
            seeds = list(seed)
        if len(seeds) != self.num_envs:
            raise ValueError(f"{len(seeds)} seeds for {self.num_envs} envs: pass one seed an env, an int or None")
        options = dict(options) if options is not None else None
        mask = np.ones(self.num_envs, dtype=np.bool_)
        if options is not None and "reset_mask" in options:
            mask = options.pop("reset_mask")
            if not isinstance(mask, np.ndarray) or mask.dtype != np.bool_:
                raise TypeError(f"options['reset_mask'] must be a numpy bool array, got {mask!r}")
            if mask.shape != (self.num_envs,):
                raise ValueError(f"options['reset_mask'] must have shape ({self.num_envs},), got {mask.shape}")
            if not mask.any():
                raise ValueError("options['reset_mask'] resets no env: set at least one True")
        self._send("reset", [dict(seed=s, options=options) if m else None for s, m in zip(seeds, mask, strict=True)])
        self._resetting = True

    def _settle_reset(self) -> None:
        """The answers of a reset in flight, gathered and kept for `reset_wait` (before any other command)."""
        if self._resetting:
            self._resetting = False
            self._reset_answers = self._flat(self._gather("reset"))

    def reset_wait(self) -> tuple[Any, dict[str, Any]]:
        """The answers of `reset_async`'s reset: observations and infos, as `reset` returns them."""
        self._settle_reset()
        results, self._reset_answers = self._reset_answers, None
        if results is None:
            raise RuntimeError("reset_wait() without a reset in flight: call reset_async() first")
        infos: dict[str, Any] = {}
        for i, (_, info) in enumerate(results):
            infos = self._add_info(infos, info, i)
        return self._batched([r[0] for r in results]), infos

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        self._send("step", list(iterate(self.action_space, actions)))
        return self._stepped("step")

    def step_ahead(self, actions: Any, ahead: Sequence[Any | None]
                   ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """``step(actions)``, then, once a process has sent its answer, each of its envs whose ``ahead`` is not None
        runs ``env.get_wrapper_attr("run_ahead")(ahead)`` (the next step's work that needs only its action, e.g. the
        replay's physics, `fastrecord.replay.mirrored`) while the caller works on this step's answer. An error there
        is raised at the next command, the vector env then closed."""
        if len(ahead) != self.num_envs:
            raise ValueError(f"step_ahead: {len(ahead)} next actions for {self.num_envs} envs; pass one an env (None: "
                             f"nothing to run ahead)")
        acts = list(iterate(self.action_space, actions))
        self._send("step_ahead", list(zip(acts, ahead, strict=True)))
        return self._stepped("step_ahead")

    def _stepped(self, command: str) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        results = self._flat(self._gather(command))
        infos: dict[str, Any] = {}
        for i, r in enumerate(results):
            infos = self._add_info(infos, r[4], i)
        return (self._batched([r[0] for r in results]), np.array([r[1] for r in results], dtype=np.float64),
                np.array([r[2] for r in results], dtype=np.bool_), np.array([r[3] for r in results], dtype=np.bool_),
                infos)

    def _batched(self, observations: list[Any]) -> Any:
        out: Any = create_empty_array(self.single_observation_space, self.num_envs, fn=np.zeros)
        return concatenate(self.single_observation_space, observations, out)

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Each sub-env's ``name`` (through its wrappers): called with the arguments where it is callable."""
        if name in ("reset", "step", "close"):
            raise ValueError(f"call({name!r}): use the vector env's own {name}()")
        self._send("call", data=(name, args, kwargs))
        return tuple(self._flat(self._gather(f"call({name!r})", fatal=False)))

    def get_attr(self, name: str) -> tuple[Any, ...]:
        return self.call(name)

    def set_attr(self, name: str, values: Any) -> None:
        if not isinstance(values, (list, tuple)):
            values = [values] * self.num_envs
        if len(values) != self.num_envs:
            raise ValueError(f"set_attr({name!r}): {len(values)} values for {self.num_envs} envs; pass one value an "
                             f"env, or one value for all")
        self._send("setattr", [(name, v) for v in values])
        self._gather(f"set_attr({name!r})", fatal=False)

    def render(self) -> tuple[Any, ...] | None:  # gymnasium's AsyncVectorEnv's: a frame an env
        return self.call("render")

    def close_extras(self, timeout: float | None = None, terminate: bool = False, **kwargs: Any) -> None:
        """Ask every process to close its envs (``terminate``: end the processes at once instead); a process
        that does not answer within ``timeout`` seconds is ended. Returns once every process answered: their
        exits (a process with a GPU render device took 0.35-0.45 s to exit on the H100 machine, after its envs
        had closed in 0.06 s) are awaited on a thread of their own (`exited` waits for them)."""
        if terminate:
            self._terminate()
            return
        failure: BaseException | None = None
        answered = False
        try:
            self._settle_reset()  # a reset in flight answers first
            for pipe in self.pipes:
                pipe.send(("close", None))
            for pipe in self.pipes:
                if timeout is not None and not pipe.poll(timeout):
                    continue
                try:
                    ok, payload = pipe.recv()
                except (EOFError, OSError):
                    continue
                if not ok and failure is None:
                    failure = _raised(payload, "close")
            answered = True
            stamp("subenvs_answered_close")
        except (BrokenPipeError, OSError):
            pass
        finally:
            if answered:
                self._reaper = threading.Thread(target=_reap, args=(self.processes, self.pipes, timeout),
                                                name="fastrecord-subenvs-exit", daemon=True)
                self._reaper.start()
            else:
                _end(self.processes, self.pipes)
        if failure is not None:
            raise failure

    def exited(self, timeout: float | None = None) -> bool:
        """Wait (at most ``timeout`` seconds) for the processes of a closed vector env to exit; True once all have
        (and reaped, here)."""
        if self._reaper is not None:
            self._reaper.join(timeout)
        for proc in self.processes:  # reaped here (a sentinel reads as ended a moment before the process is reapable)
            proc.join(timeout)
        return all(not p.is_alive() for p in self.processes)

    def _terminate(self) -> None:
        self.closed = True
        _end(self.processes, self.pipes)

    def __del__(self) -> None:
        if not self.__dict__.get("closed", True):  # not the class's default: a constructor that failed
            self.close(terminate=True)


def _raised(payload: tuple[int, BaseException | None, str, str], command: str | None,
            closed: bool = True) -> BaseException:
    """The caller's exception for a sub-env's error: the sub-env's own exception where it pickled (else a
    RuntimeError with its text), its traceback attached as the cause."""
    index, exc, text, tb = payload
    if exc is None:
        exc = RuntimeError(text)
    where = command or "its start (making its env)"
    note = f"raised in sub-env {index}'s process, at {where}" + ("; the vector env is closed" if closed else "")
    notes = [*getattr(exc, "__notes__", []), note]
    setattr(exc, "__notes__", notes)  # noqa: B010 - BaseException.add_note, also before Python 3.11
    exc.__cause__ = RemoteTraceback(tb)
    return exc
