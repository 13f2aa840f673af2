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

import math
import multiprocessing
import threading
import traceback
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

from fastrecord.system import stamp

__all__ = ["AheadFailed", "PackedLaunch", "PackedVectorEnv", "RemoteTraceback", "SubEnvDied", "process_sizes"]

ENVS_PER_PROCESS = 2  # the default packing (16 envs: 8 processes of 2; H100 sweep of 1, 2, 4, 8 in docs/performance.md)
MIN_PROCESSES = 4  # below 16 envs the processes stay 4 (or one an env), so the physics of few envs is not serialised


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


class AheadFailed(RuntimeError):
    """A sub-env failed at the work `PackedVectorEnv.step_ahead` had it run after answering a step (its cause is the
    sub-env's own error); raised at the command after."""


class PackedLaunch:
    """Owns the processes of a `PackedVectorEnv` while they start.

    ``background=True`` starts them on a thread (``Process.start`` on the forkserver context waits for the
    server's preload): the caller goes on with its own imports while the sub-envs are made, then
    ``PackedVectorEnv(launch=...)`` takes them over. ``close()`` ends processes that were never taken over."""

    def __init__(self, env_fns: Sequence[Callable[[], gym.Env]], envs_per_process: int | None = None, *,
                 context: str | None = None, autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
                 background: bool = False, daemon: bool = True) -> None:
        self.num_envs = len(env_fns)
        self.sizes = process_sizes(self.num_envs, envs_per_process)
        self.autoreset_mode = autoreset_mode if isinstance(autoreset_mode, AutoresetMode) else AutoresetMode(
            autoreset_mode)
        self._fns = list(env_fns)
        self._ctx: Any = multiprocessing.get_context(context)
        self._daemon = daemon
        self.processes: list[Any] = []
        self.pipes: list[Any] = []
        self._failed: BaseException | None = None
        self._taken = False
        self._thread: threading.Thread | None = None
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
                    parent, child = self._ctx.Pipe()
                    proc = self._ctx.Process(
                        target=_worker, name=f"fastrecord-subenvs-{first}-{first + size - 1}", daemon=self._daemon,
                        args=(child, CloudpickleWrapper(self._fns[first:first + size]),  # type: ignore[arg-type]  # a list
                              first, self.autoreset_mode))
                    proc.start()
                    child.close()
                    self.processes.append(proc)
                    self.pipes.append(parent)
                    first += size
        except BaseException as e:  # noqa: BLE001 - raised where the launch is taken over
            self._failed = e

    def take(self) -> tuple[list[Any], list[Any]]:
        """The started processes and their pipes (waits for the launch; raises what it raised)."""
        if self._thread is not None:
            self._thread.join()
        if self._failed is not None:
            self.close()
            raise self._failed
        self._taken = True
        return self.processes, self.pipes

    def close(self) -> None:
        """End the processes at once, unless a `PackedVectorEnv` took them over."""
        if self._taken:
            return
        if self._thread is not None:
            self._thread.join()
        _end(self.processes, self.pipes)
        self._taken = True


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


class PackedVectorEnv(gym.vector.VectorEnv):
    """A vector env of ``len(env_fns)`` sub-envs in processes of several envs each (`process_sizes`).

    Owns: the processes (each makes its envs with their functions, in order, and steps them in turn), the
    pipes to them, and the spaces the first process reported. Stepping sends each process its envs' actions,
    then gathers every answer: all processes step at once.
    """

    def __init__(self, env_fns: Sequence[Callable[[], gym.Env]] | None = None, envs_per_process: int | None = None,
                 *, context: str | None = None, autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
                 launch: PackedLaunch | None = None) -> None:
        self.closed = True  # until every process answered
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

    def _flat(self, answers: list[list[Any]]) -> list[Any]:
        return [item for answer in answers for item in answer]

    # ------------------------------------------------------------------------------------------ gymnasium's API
    def reset(self, *, seed: int | list[int | None] | None = None,
              options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
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
        results = self._flat(self._gather("reset"))
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
        that does not answer within ``timeout`` seconds is ended."""
        if terminate:
            self._terminate()
            return
        failure: BaseException | None = None
        try:
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
            stamp("subenvs_answered_close")
            for proc in self.processes:
                proc.join(timeout)
            stamp("subenv_processes_joined")
        except (BrokenPipeError, OSError):
            pass
        finally:
            _end(self.processes, self.pipes)
        if failure is not None:
            raise failure

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


def _error(index: int, e: BaseException) -> tuple[int, BaseException | None, str, str]:
    import pickle

    tb = "".join(traceback.format_exception(e))
    try:
        pickle.loads(pickle.dumps(e))
        exc: BaseException | None = e
    except Exception:  # noqa: BLE001 - an exception that does not pickle travels as its text
        exc = None
    return index, exc, f"{type(e).__name__}: {e}", tb


def _worker(conn: Any, fns: CloudpickleWrapper, first: int, mode: AutoresetMode) -> None:
    """A process of sub-envs ``first ...``: makes them, reports the spaces, then serves the vector env's commands
    until ``close`` or until the caller is gone (its pipe closed)."""
    import signal

    # SIGTERM ends this process (`PackedVectorEnv.close(terminate=True)`), whatever handler a forked caller had
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    envs: list[gym.Env] = []
    current = first
    try:
        for fn in fns.fn:  # type: ignore[attr-defined]  # a list of functions
            envs.append(fn())
            current += 1
        env = envs[0]
        spec = dict(metadata=dict(env.metadata), render_mode=env.render_mode, observation_space=env.observation_space,
                    action_space=env.action_space)
        for i, other in enumerate(envs[1:], 1):
            if other.observation_space != env.observation_space or other.action_space != env.action_space:
                raise RuntimeError(f"sub-env {first + i}'s spaces differ from sub-env {first}'s")
        conn.send((True, [spec]))
    except BaseException as e:  # noqa: BLE001 - sent to the caller, which raises it
        _send_error(conn, current, e)
        _close_all(envs)
        return
    _serve(conn, envs, first, mode)


def _serve(conn: Any, envs: list[gym.Env], first: int, mode: AutoresetMode) -> None:
    """Answer the vector env's commands (`_SubEnvs`) until ``close``, a reset's or step's error, or the caller's end."""
    served = _SubEnvs(envs, first, mode)
    while True:
        try:
            command, data = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):  # the caller is gone
            break
        try:
            out = served.run(command, data)
        except BaseException as e:  # noqa: BLE001 - sent to the caller, which raises it
            _send_error(conn, served.current, e)
            fatal = isinstance(e, (KeyboardInterrupt, SystemExit, OSError, AheadFailed))
            if command in ("call", "setattr") and not fatal:
                continue  # nothing changed (an attribute an env lacks): the envs serve on, as the caller's vector env
            _close_all(envs)  # a half-done reset or step: the caller closes the vector env
            return
        conn.send((True, out))
        if command == "close":
            return
        served.run_ahead()


class _SubEnvs:
    """A process's sub-envs ``first, first + 1, ...``: one method a command of the protocol; ``current`` is the
    sub-env a failed command was at."""

    def __init__(self, envs: list[gym.Env], first: int, mode: AutoresetMode) -> None:
        self.envs, self.first, self.mode = envs, first, mode
        self.autoreset = [False] * len(envs)
        self.last_obs: list[Any] = [None] * len(envs)
        self.current = first
        self.ahead: list[tuple[int, Any]] = []  # `step_ahead`: (env, next action) to run once the answer is sent
        self.ahead_failed: tuple[int, BaseException] | None = None

    def run(self, command: str, data: Any) -> list[Any]:
        handlers: dict[str, Callable[[Any], list[Any]]] = {
            "reset": self.reset, "step": self.step, "step_ahead": self.step_ahead, "call": self.call,
            "setattr": self.setattr, "close": self.close}
        handler = handlers.get(command)
        if handler is None:
            raise ValueError(f"unknown command {command!r}")
        if self.ahead_failed is not None and command != "close":  # the envs' state is unknown: no command goes on
            self.current, e = self.ahead_failed
            raise AheadFailed(f"sub-env {self.current} failed running its next step ahead ({type(e).__name__}: {e})"
                              ) from e
        self.current = self.first
        return handler(data)

    def step_ahead(self, data: list[tuple[Any, Any]]) -> list[Any]:
        out = self.step([action for action, _ in data])
        self.ahead = [(i, nxt) for i, (_, nxt) in enumerate(data) if nxt is not None]
        return out

    def run_ahead(self) -> None:
        """The envs' ``run_ahead`` of the last `step_ahead`, after its answer was sent; an error is kept for the next
        command (`run`)."""
        ahead, self.ahead = self.ahead, []
        for i, nxt in ahead:
            try:
                self.envs[i].get_wrapper_attr("run_ahead")(nxt)
            except BaseException as e:  # noqa: BLE001 - raised at the next command
                self.ahead_failed = (self.first + i, e)
                return

    def reset(self, data: list[dict[str, Any] | None]) -> list[Any]:
        out: list[Any] = []
        for i, (env, kw) in enumerate(zip(self.envs, data, strict=True)):
            self.current = self.first + i
            if kw is None:  # not in the reset mask: its last observation, no info
                if self.last_obs[i] is None:
                    raise ValueError(f"sub-env {self.current} was left out of a masked reset before its first "
                                     f"reset: reset every env once (options without reset_mask) first")
                out.append((self.last_obs[i], {}))
                continue
            obs, info = env.reset(**kw)
            self.last_obs[i], self.autoreset[i] = obs, False
            out.append((obs, info))
        return out

    def step(self, actions: list[Any]) -> list[Any]:
        out: list[Any] = []
        for i, (env, action) in enumerate(zip(self.envs, actions, strict=True)):
            self.current = self.first + i
            out.append(_step_one(env, action, self.mode, self.autoreset, i))
            self.last_obs[i] = out[-1][0]
        return out

    def call(self, data: tuple[str, tuple, dict]) -> list[Any]:
        name, args, kwargs = data
        out: list[Any] = []
        for i, env in enumerate(self.envs):
            self.current = self.first + i
            attr = env.get_wrapper_attr(name)
            out.append(attr(*args, **kwargs) if callable(attr) else attr)
        return out

    def setattr(self, data: list[tuple[str, Any]]) -> list[Any]:
        for i, (env, (name, value)) in enumerate(zip(self.envs, data, strict=True)):
            self.current = self.first + i
            env.set_wrapper_attr(name, value)
        return [None] * len(self.envs)

    def close(self, data: Any) -> list[Any]:
        """Every env closed; the first error raised after all."""
        failed: BaseException | None = None
        for i, env in enumerate(self.envs):
            try:
                env.close()
            except BaseException as e:  # noqa: BLE001 - every env closes; the first error is sent
                if failed is None:
                    failed, self.current = e, self.first + i
        if failed is not None:
            raise failed
        return [None] * len(self.envs)


def _step_one(env: gym.Env, action: Any, mode: AutoresetMode, autoreset: list[bool], i: int) -> tuple:
    """One sub-env's step under ``mode``, as gymnasium's ``AsyncVectorEnv`` worker does it."""
    if mode == AutoresetMode.NEXT_STEP:
        if autoreset[i]:
            obs, info = env.reset()
            rew, term, trunc = 0.0, False, False
        else:
            obs, rew, term, trunc, info = env.step(action)  # type: ignore[assignment]  # a float, as gymnasium's own
        autoreset[i] = bool(term or trunc)
        return obs, rew, term, trunc, info
    obs, rew, term, trunc, info = env.step(action)  # type: ignore[assignment]  # a float, as gymnasium's own
    if mode == AutoresetMode.SAME_STEP and (term or trunc):
        reset_obs, reset_info = env.reset()
        info = {"final_info": info, "final_obs": obs, **reset_info}
        obs = reset_obs
    return obs, rew, term, trunc, info


def _send_error(conn: Any, index: int, e: BaseException) -> None:
    try:
        conn.send((False, _error(index, e)))
    except (OSError, EOFError):  # the caller is gone
        pass


def _close_all(envs: list[gym.Env]) -> None:
    for env in envs:
        try:
            env.close()
        except BaseException:  # noqa: BLE001 - closing after an error that is being reported
            pass
