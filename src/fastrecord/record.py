"""The recording wrappers: a drop-in for ManiSkill's ``RecordEpisode``.

`RecordEpisode` (a ``gym.Wrapper`` for ManiSkill envs, ``num_envs >= 1``) and `RecordVectorEpisode` (a
gymnasium ``VectorWrapper`` for vector envs of ManiSkill CPU envs) only translate step/reset calls into
an `EpisodeRecorder` (`fastrecord.recorder`), which owns the buffer and hands finished episodes to the
sinks. Their parameters after ``env`` and ``output_dir`` are `RecordOptions`' fields (`fastrecord.options`,
the one declaration of their defaults, meaning and checks), written out with their types so that an IDE
and a type checker see them: ManiSkill 3.0.1's in its positional order, then fastrecord's keyword-only
ones, then ``sinks`` (tests/test_api.py holds the two declarations equal).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import inspect
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import gymnasium as gym
import numpy as np
import torch

from fastrecord.envs import ManiSkillView, SubEnvAccess, VectorEnvView, to_numpy
from fastrecord.episode import KeepFilter
from fastrecord.exits import stopped_by_signal
from fastrecord.options import IfExists, RecordOptions, VideoLayout, check_output_dir, options_help
from fastrecord.recorder import EpisodeRecorder
from fastrecord.sinks.base import Sink
from fastrecord.system import stamp

if TYPE_CHECKING:
    from fastrecord.sinks.maniskill_h5 import TrajectoryWriter


def _env_idx(options: Mapping | None, num_envs: int, key: str) -> np.ndarray:
    if options is None or options.get(key) is None:
        return np.arange(num_envs)
    v = to_numpy(options[key])
    return np.flatnonzero(v) if v.dtype == np.bool_ else v.astype(np.int64).reshape(-1)


_RECORDER_DOC_ARGS = """
    Arguments after ``env`` and ``output_dir`` (`fastrecord.options.RecordOptions`; ManiSkill's first,
    in its positional order, fastrecord's additions keyword-only):
""" + options_help() + """
        sinks (default ()): more outputs, `fastrecord.sinks.Sink` instances that receive every kept episode.
"""


class _H5FileHandle:
    """What ManiSkill's scripts read from ``env._h5_file``: ``filename``; ``close()`` writes everything
    queued (the file stays consistent; fastrecord's writer keeps recording into it)."""

    def __init__(self, writer: TrajectoryWriter, rec: EpisodeRecorder) -> None:
        self._writer, self._rec = writer, rec

    @property
    def filename(self) -> str:
        return str(self._writer.h5_path)

    def close(self) -> None:
        if not self._rec.closed:
            self._rec.wait_until_done()


class _RecorderMixin:
    """Shared ManiSkill-compatible surface of both wrappers: `RecordOptions` in, ManiSkill's attribute
    names out (``save_trajectory``, ``video_fps``, ``_h5_file``, ``_json_path``, ...)."""

    _rec: EpisodeRecorder

    def __new__(cls, env: Any, *args: Any, **kwargs: Any) -> Any:
        if cls is RecordEpisode and isinstance(env, gym.vector.VectorEnv):
            return RecordVectorEpisode(env, *args, **kwargs)  # a different class: Python skips __init__ here
        _check_arguments(cls, env, args, kwargs)
        return super().__new__(cls)

    def _make_recorder(self, view: Any, output_dir: str | Path, options: RecordOptions, sinks: Sequence[Sink]) -> None:
        check_output_dir(output_dir, type(self).__name__)
        self.options = options
        self._rec = EpisodeRecorder(view, output_dir, options, sinks)
        self.output_dir = self._rec.output_dir

    # ManiSkill's attribute names, same meaning
    save_on_reset = property(lambda self: self.options.save_on_reset)
    save_trajectory = property(lambda self: self.options.save_trajectory)
    clean_on_close = property(lambda self: self.options.clean_on_close)
    info_on_video = property(lambda self: self.options.info_on_video)
    video_fps = property(lambda self: self.options.video_fps)
    max_steps_per_video = property(lambda self: self.options.max_steps_per_video)
    save_video_trigger = property(lambda self: self.options.save_video_trigger)
    record_reward = property(lambda self: self.options.record_reward)
    max_episode_steps = property(lambda self: self._rec.max_episode_steps)

    @property
    def record_env_state(self) -> bool:
        return self._rec.record_env_state  # turned off when the env's state layout is inconsistent

    @property
    def save_video(self) -> bool:
        return self._rec.capturing()

    @property
    def _elapsed_record_steps(self) -> int:
        return self._rec.elapsed_record_steps

    @property
    def _episode_id(self) -> int:
        """The id of the last episode saved (-1 before the first), as ManiSkill counts."""
        return self._rec.next_episode_id - 1

    def _trajectory_writer(self, name: str) -> TrajectoryWriter:
        """The trajectory's writer, for ManiSkill's attribute ``name``."""
        sink = self._rec.trajectory
        if sink is None or sink.writer is None:  # the recorder opens the writer when it is built
            raise AttributeError(f"{name} exists only with save_trajectory=True (ManiSkill's wrapper has none either)")
        return sink.writer

    @property
    def _h5_file(self) -> _H5FileHandle:
        return _H5FileHandle(self._trajectory_writer("_h5_file"), self._rec)

    @property
    def _json_path(self) -> str:
        return str(self._trajectory_writer("_json_path").json_path)

    @property
    def _json_data(self) -> dict[str, Any]:
        """The JSON of the trajectory: header and the episodes committed so far."""
        return self._trajectory_writer("_json_data").json_data

    @property
    def recorder(self) -> EpisodeRecorder:
        return self._rec

    def flush_trajectory(self, verbose: bool = False, ignore_empty_transition: bool = True,
                         env_idxs_to_flush: Any = None, save: bool = True) -> None:
        """Finish the episodes in progress of ``env_idxs_to_flush`` now (they go on as new episodes).

        fastrecord records each env episode's trajectory and video together, so this also flushes the
        videos of those envs. ``save=False`` drops them.
        """
        idx = np.arange(self._rec.num_envs) if env_idxs_to_flush is None else to_numpy(env_idxs_to_flush).reshape(-1)
        if save:
            self._rec.finalize(idx, split=True)
        elif self._rec.buffer is not None:  # None: nothing recorded yet, nothing to drop
            self._rec.buffer.restart_from_last(idx)

    def flush_video(self, name: str | None = None, suffix: str = "", verbose: bool = False,
                    ignore_empty_transition: bool = True, save: bool = True) -> None:
        """Finish every env's episode in progress now (see `flush_trajectory`)."""
        self.flush_trajectory(save=save)

    def wait_until_done(self) -> None:
        self._rec.wait_until_done()


class RecordEpisode(_RecorderMixin, gym.Wrapper):
    """Record trajectories (ManiSkill's HDF5/JSON format) and MP4 videos of a ManiSkill env.

    A drop-in for ``mani_skill.utils.wrappers.RecordEpisode``: replace the import. Works for
    GPU-parallel envs (``num_envs > 1``, also under ``ManiSkillVectorEnv``), single CPU envs, and, through
    `RecordVectorEpisode` (returned automatically when ``env`` is a gymnasium vector env), vector envs
    of ManiSkill CPU envs. Episodes end at reset (full, partial via ``options["env_idx"]``, or
    auto-reset) and at close.
    """ + _RECORDER_DOC_ARGS

    def __init__(
        self,
        env: gym.Env | gym.vector.VectorEnv,  # a vector env gets a RecordVectorEpisode (__new__)
        output_dir: str | Path,
        # ManiSkill 3.0.1's parameters, in its order (RecordOptions: the same fields, defaults and types)
        save_trajectory: bool = True,
        trajectory_name: str | None = None,
        save_video: bool = True,
        info_on_video: bool = False,
        save_on_reset: bool = True,
        save_video_trigger: Callable[[int], bool] | None = None,
        max_steps_per_video: int | None = None,
        clean_on_close: bool = True,
        record_reward: bool = True,
        record_env_state: bool = True,
        video_fps: float = 30,
        render_substeps: bool = False,
        avoid_overwriting_video: bool = False,
        source_type: str | None = None,
        source_desc: str | None = None,
        *,
        keep: KeepFilter = "all",
        if_exists: IfExists = "error",
        video_layout: VideoLayout = "per_env",
        video_source: str = "render",
        video_codec: str = "auto",
        video_crf: int = 23,
        video_preset: str = "ultrafast",
        video_gop: int | None = None,
        video_workers: int | None = None,
        trajectory_writers: int | None = None,
        trajectory_compression: str = "gzip:1",
        buffer_capacity: int | None = None,
        lerobot: bool = False,
        lerobot_video_codec: str | None = None,
        lerobot_gop: int = 2,
        lerobot_crf: int | None = None,
        lerobot_state_keys: str | tuple[str, ...] | None = None,
        sinks: Sequence[Sink] = (),
    ) -> None:
        options = _options(locals())  # first: locals() holds the parameters only
        env = cast("gym.Env", env)  # __new__ sent a vector env to RecordVectorEpisode
        gym.Wrapper.__init__(self, env)
        self._make_recorder(ManiSkillView(env), output_dir, options, sinks)
        self._closed = False

    @property
    def num_envs(self) -> int:
        return self._rec.num_envs

    @property
    def base_env(self) -> Any:
        return self.env.unwrapped

    def reset(self, *args: Any, seed: int | list[int] | None = None, options: dict | None = None,
              **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        env_idx = _env_idx(options, self.num_envs, "env_idx")
        if self.save_on_reset:
            self._rec.finalize(env_idx)
        elif self._rec.buffer is not None:
            self._rec.buffer.end(env_idx)  # not saved: ManiSkill's save_on_reset=False
        # ManiSkill's reset takes a seed per env (a list) where gymnasium's type says int
        obs, info = self.env.reset(*args, seed=seed, options=options, **kwargs)  # type: ignore[arg-type]
        reset_kwargs = copy.deepcopy(dict(options=_plain(options), **kwargs))
        if seed is not None:
            reset_kwargs["seed"] = seed
        self._rec.on_reset(obs, env_idx, reset_kwargs)
        return obs, info

    def step(self, action: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        self._rec.before_step()
        obs, rew, terminated, truncated, info = self.env.step(action)
        self._rec.on_step(action, obs, rew, terminated, truncated, info)
        return obs, rew, terminated, truncated, info

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._rec.close(flush=self.save_on_reset)
        finally:
            self.env.close()


def _plain(options: Mapping | None) -> dict | None:
    if options is None:
        return None
    return {k: (to_numpy(v) if isinstance(v, torch.Tensor) else v) for k, v in options.items()}


class RecordVectorEpisode(_RecorderMixin, SubEnvAccess, gym.vector.VectorWrapper):
    """`RecordEpisode` for a gymnasium vector env (Sync/Async) of ManiSkill CPU envs.

    Each sub-env's episodes are recorded separately (its own trajectory group and MP4). Supports the
    vector env's auto-reset modes NEXT_STEP (gymnasium's default: the episode ends at the done step,
    the next step restarts it) and DISABLED (``reset(options={"reset_mask": ...})``).
    """ + _RECORDER_DOC_ARGS

    def __init__(
        self,
        env: gym.vector.VectorEnv,
        output_dir: str | Path,
        # ManiSkill 3.0.1's parameters, in its order (RecordOptions: the same fields, defaults and types)
        save_trajectory: bool = True,
        trajectory_name: str | None = None,
        save_video: bool = True,
        info_on_video: bool = False,
        save_on_reset: bool = True,
        save_video_trigger: Callable[[int], bool] | None = None,
        max_steps_per_video: int | None = None,
        clean_on_close: bool = True,
        record_reward: bool = True,
        record_env_state: bool = True,
        video_fps: float = 30,
        render_substeps: bool = False,
        avoid_overwriting_video: bool = False,
        source_type: str | None = None,
        source_desc: str | None = None,
        *,
        keep: KeepFilter = "all",
        if_exists: IfExists = "error",
        video_layout: VideoLayout = "per_env",
        video_source: str = "render",
        video_codec: str = "auto",
        video_crf: int = 23,
        video_preset: str = "ultrafast",
        video_gop: int | None = None,
        video_workers: int | None = None,
        trajectory_writers: int | None = None,
        trajectory_compression: str = "gzip:1",
        buffer_capacity: int | None = None,
        lerobot: bool = False,
        lerobot_video_codec: str | None = None,
        lerobot_gop: int = 2,
        lerobot_crf: int | None = None,
        lerobot_state_keys: str | tuple[str, ...] | None = None,
        sinks: Sequence[Sink] = (),
    ) -> None:
        options = _options(locals())  # first: locals() holds the parameters only
        gym.vector.VectorWrapper.__init__(self, env)
        mode = env.metadata.get("autoreset_mode", gym.vector.AutoresetMode.NEXT_STEP)
        if mode == gym.vector.AutoresetMode.SAME_STEP:
            raise ValueError(
                "autoreset_mode=SAME_STEP resets sub-envs before their last frame can be rendered; create the "
                "vector env with autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP (the default) or DISABLED"
            )
        self._autoreset = mode == gym.vector.AutoresetMode.NEXT_STEP
        self._make_recorder(VectorEnvView(env), output_dir, options, sinks)
        self._pending_restart = np.zeros(env.num_envs, dtype=bool)
        self._closed = False

    def reset(self, *, seed: int | list[int | None] | None = None,  # gymnasium's vector reset: None, an env unseeded
              options: dict | None = None) -> tuple[Any, dict[str, Any]]:
        env_idx = _env_idx(options, self.num_envs, "reset_mask")
        # the sub-envs reset while the ended episodes are taken (where the vector env resets in two halves: its class
        # says so, not an attribute a wrapper forwards); their events reach the sinks once the reset is done (their
        # videos are queued at once: `Mp4Sink` limits the encodes beside the sub-envs)
        split = getattr(type(self.env), "resets_async", False)
        with self._rec.handoffs_held():
            if split:
                self._rec.view.control_mode  # noqa: B018 - read once now: the episode end asks for it, mid-reset
                self.env.reset_async(seed=seed, options=options)
            if self.save_on_reset:
                self._rec.finalize(env_idx)
            elif self._rec.buffer is not None:
                self._rec.buffer.end(env_idx)  # not saved: ManiSkill's save_on_reset=False, as RecordEpisode
            obs, info = self.env.reset_wait() if split else self.env.reset(seed=seed, options=options)
        self._pending_restart[env_idx] = False
        rest = {k: v for k, v in (options or {}).items() if k != "reset_mask"}  # what each sub-env's reset got
        kw: dict[str, Any] = {"options": _plain(rest) or None}  # None as RecordEpisode records a reset without options
        self._rec.on_reset(obs, env_idx, kw)
        return obs, info

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        self._rec.before_step()
        obs, rew, terminated, truncated, info = self.env.step(actions)
        restart = self._pending_restart.copy() if self._autoreset else None
        self._rec.on_step(actions, obs, rew, terminated, truncated, info, restart=restart)
        done = np.logical_or(to_numpy(terminated), to_numpy(truncated))
        if self._autoreset:
            self._pending_restart = done
            if done.any() and self.save_on_reset:  # else flush_trajectory() before the next step saves it
                self._rec.finalize(np.flatnonzero(done))
        return obs, rew, terminated, truncated, info

    def close(self, **kwargs: Any) -> None:
        """Finish the episodes in progress, then close the vector env (sub-env processes, a batched render's
        mirrors) while the writers do their remaining work: the close costs the longer of the two, not the sum.
        The recorder's error, if any, is raised first; the env's after both are done."""
        if self._closed:
            return
        self._closed = True
        closing = _Closing(self.env, kwargs)
        error: BaseException | None = None
        try:
            if self.save_on_reset and not stopped_by_signal():
                self._rec.finalize(np.arange(self.num_envs))  # what the writers need of the env, read now
        except BaseException as e:  # noqa: BLE001 - the recorder still closes; raised below, first
            error = e
        if self._rec.frames_per_step == 1:  # substep frames: the recorder's close still stops them
            closing.start()
        try:
            self._rec.close(flush=self.save_on_reset)
        except BaseException as e:  # noqa: BLE001
            error = error or e
        stamp("recorder_closed")
        closing.join(reraise=error is None)
        if error is not None:
            raise error


class _Closing:
    """Owns: a thread closing ``env`` (started by `start`) and its error, re-raised by `join`."""

    def __init__(self, env: Any, kwargs: dict[str, Any]) -> None:
        self.env, self.kwargs = env, kwargs
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def _run(self) -> None:
        try:
            self.env.close(**self.kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised by join() in the caller
            self.error = e

    def start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="fastrecord-close-env", daemon=True)
            self.thread.start()

    def join(self, reraise: bool = True) -> None:
        """Wait for the close (starting it where `start` was not reached); re-raise its error (``reraise``)."""
        self.start()
        assert self.thread is not None
        self.thread.join()
        if self.error is not None and reraise:
            raise self.error


def _options(values: Mapping[str, Any]) -> RecordOptions:
    """`RecordOptions` from a wrapper's parameters (``locals()`` of its ``__init__``: its parameters are the
    fields, by name)."""
    return RecordOptions(**{f.name: values[f.name] for f in dataclasses.fields(RecordOptions)})


def _check_arguments(cls: type, env: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise a TypeError naming the valid parameters when ``cls(env, *args, **kwargs)`` cannot bind (an
    unknown, misspelt or doubled argument): Python's own message names only the bad one."""
    signature = inspect.signature(cls)  # its __init__'s, without self (below)
    try:
        signature.bind(env, *args, **kwargs)
    except TypeError as e:
        names = list(signature.parameters)
        close = [m for k in kwargs if k not in names for m in difflib.get_close_matches(k, names, n=1)]
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise TypeError(f"{cls.__name__}: {e}; {hint}its parameters are {names}") from None


# What help() and inspect.signature(RecordEpisode) show: the explicit __init__ (without it, __new__'s
# (env, *args, **kwargs) would hide it; type checkers read __init__ itself).
for _cls in (RecordEpisode, RecordVectorEpisode):
    _sig = inspect.signature(_cls.__init__)
    setattr(_cls, "__signature__", _sig.replace(parameters=list(_sig.parameters.values())[1:]))  # noqa: B010
