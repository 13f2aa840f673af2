"""The sub-env processes' side of `fastrecord.packed.PackedVectorEnv`: each process makes its envs, then answers the
vector env's commands (reset, step, a step run ahead, call, setattr, close) until ``close`` or the caller's end; an
error travels back as the sub-env's own exception with its traceback (`fastrecord.packed` raises it in the caller)."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import gymnasium as gym
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import CloudpickleWrapper


class AheadFailed(RuntimeError):
    """A sub-env failed at the work `PackedVectorEnv.step_ahead` had it run after answering a step (its cause is the
    sub-env's own error); raised at the command after."""


def _error(index: int, e: BaseException) -> tuple[int, BaseException | None, str, str]:
    import pickle

    tb = "".join(traceback.format_exception(e))
    try:
        pickle.loads(pickle.dumps(e))
        exc: BaseException | None = e
    except Exception:  # noqa: BLE001 - an exception that does not pickle travels as its text
        exc = None
    return index, exc, f"{type(e).__name__}: {e}", tb


def process_main(conn: Any, fns: CloudpickleWrapper, first: int, mode: AutoresetMode) -> None:
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
