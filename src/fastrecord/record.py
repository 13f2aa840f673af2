"""The recording wrappers: a drop-in for ManiSkill's ``RecordEpisode`` over batched device buffers.

`EpisodeRecorder` owns episode bookkeeping (which envs are mid-episode, their seeds and reset kwargs,
episode ids, the keep filter) and hands finished episodes to the writers. `RecordEpisode` (a
``gym.Wrapper`` for ManiSkill envs, ``num_envs >= 1``) and `RecordVectorEpisode` (a gymnasium
``VectorWrapper`` for vector envs of ManiSkill CPU envs) only translate step/reset calls into it.

Per parallel step the recorder renders once (all envs in one call), writes every recorded leaf into
`EpisodeBuffer` with one copy per leaf, and copies nothing to the host. When envs'
episodes end (reset, auto-reset, close) it decides which to keep from two small flags, copies the kept
ones to the host in one batch, and queues them for the background writers.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import gymnasium as gym
import numpy as np
import torch

from fastrecord.buffer import EpisodeBuffer, flatten_tree
from fastrecord.envs import IMAGE_RENDER_MODES, ManiSkillView, SubEnvAccess, VectorEnvView
from fastrecord.episode import EpisodeData
from fastrecord.sinks.maniskill_h5 import TrajectoryWriter
from fastrecord.video import VideoSettings, encode_mp4, resolve_codec
from fastrecord.workers import WorkerPool

KeepFilter = Literal["all", "success", "success_once", "failure"] | Callable[[dict[str, Any]], bool]
KEEP_CHOICES = ("all", "success", "success_once", "failure")
VIDEO_LAYOUTS = ("per_env", "tiled")


@dataclass(frozen=True)
class Field:
    """One recorded quantity. ``state`` fields have T+1 rows (reset + every step), ``transition`` T."""

    name: str  # top-level key in the trajectory group (leaves are name/...)
    kind: Literal["state", "transition"]
    dtype: type | None = None  # dtype on disk; None keeps the env's


# What is recorded, declared once: reset, step and flush all loop over this.
FIELDS = {
    f.name: f
    for f in (
        Field("obs", "state"),
        Field("env_states", "state", np.float32),
        Field("frames", "state"),  # video images, not written to HDF5
        Field("actions", "transition", np.float32),
        Field("terminated", "transition", np.bool_),
        Field("truncated", "transition", np.bool_),
        Field("success", "transition", np.bool_),
        Field("fail", "transition", np.bool_),
        Field("rewards", "transition", np.float32),
        Field("overlay", "transition"),  # scalars drawn on frames when info_on_video
    )
}
_NOT_IN_H5 = ("frames", "overlay")


def _field_of(leaf: str) -> Field:
    return FIELDS[leaf.split("/", 1)[0]]


def _np(x: Any) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


class EpisodeRecorder:
    """Owns: the `EpisodeBuffer`, the video workers, the `TrajectoryWriter`, episode ids, per-env
    episode metadata (seed, reset kwargs) and the keep filter.

    Env-agnostic: it sees envs only through a view (`ManiSkillView` / `VectorEnvView`).
    """

    def __init__(
        self,
        view: ManiSkillView | VectorEnvView,
        output_dir: str | Path,
        *,
        save_trajectory: bool,
        trajectory_name: str | None,
        save_video: bool,
        info_on_video: bool,
        save_video_trigger: Callable[[int], bool] | None,
        max_steps_per_video: int | None,
        record_reward: bool,
        record_env_state: bool,
        video_fps: int,
        avoid_overwriting_video: bool,
        source_type: str | None,
        source_desc: str | None,
        keep: KeepFilter,
        video_layout: str,
        video_source: str,
        video_codec: str,
        video_crf: int,
        video_preset: str,
        video_workers: int | None,
        buffer_capacity: int | None,
    ) -> None:
        if not (callable(keep) or keep in KEEP_CHOICES):
            raise ValueError(f"keep={keep!r} is not a filter; use one of {KEEP_CHOICES} or a callable(final_info) -> bool")
        if video_layout not in VIDEO_LAYOUTS:
            raise ValueError(f"video_layout={video_layout!r} is unknown; use one of {VIDEO_LAYOUTS}")
        if not (video_source == "render" or video_source.startswith("sensor:")):
            raise ValueError(f"video_source={video_source!r} is unknown; use 'render' (the human render camera) or 'sensor:<camera name>'")
        if save_video and video_source == "render" and view.render_mode not in IMAGE_RENDER_MODES:
            raise ValueError(
                f"Render mode is {view.render_mode!r}, which cannot make videos. Create the env with "
                f"render_mode='rgb_array' (or one of {IMAGE_RENDER_MODES}), pass video_source='sensor:<camera>', "
                f"or set save_video=False."
            )
        self.view = view
        self.num_envs = view.num_envs
        self.output_dir = Path(output_dir)
        if save_trajectory or save_video:
            try:
                self.output_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ValueError(f"output_dir={str(output_dir)!r} cannot be created ({e.strerror}); pass a writable directory") from e
            if not os.access(self.output_dir, os.W_OK):
                raise ValueError(f"output_dir={str(output_dir)!r} is not writable; pass a directory you can write to")
        self.save_trajectory = save_trajectory
        self.save_video = save_video
        self.info_on_video = info_on_video
        self.save_video_trigger = save_video_trigger
        self.max_steps_per_video = max_steps_per_video
        self.record_reward = record_reward
        self.record_env_state = record_env_state
        self.keep = keep
        self.video_layout = video_layout
        self.video_source = video_source
        self.avoid_overwriting_video = avoid_overwriting_video

        self.max_episode_steps = view.max_episode_steps()
        capacity = buffer_capacity or (self.max_episode_steps + 1 if self.max_episode_steps else 64)
        self.buffer: EpisodeBuffer | None = None
        self._capacity = capacity

        self._seeds = np.zeros(self.num_envs, dtype=np.int64)
        self._reset_kwargs: list[dict] = [{} for _ in range(self.num_envs)]
        self._frames_ok = np.ones(self.num_envs, dtype=bool)  # every frame of the episode was captured
        self._last_info: Any = None
        self._warned_state = False
        self.elapsed_record_steps = 0
        self.num_episodes = 0  # episodes kept (ids 0..n-1)
        self.num_finished = 0  # episodes ended, kept or not
        self._video_id = 0
        self._closed = False

        self.trajectory: TrajectoryWriter | None = None
        if save_trajectory:
            name = trajectory_name or time.strftime("%Y%m%d_%H%M%S")
            from mani_skill import get_commit_info

            header: dict[str, Any] = dict(env_info=view.env_info(), commit_info=get_commit_info())
            if source_type is not None:
                header["source_type"] = source_type
            if source_desc is not None:
                header["source_desc"] = source_desc
            self.trajectory = TrajectoryWriter(self.output_dir / f"{name}.h5", header)
        self.videos: WorkerPool | None = None
        if save_video:
            codec = resolve_codec(video_codec)
            workers = video_workers or max(1, min(os.cpu_count() or 1, 16))
            self.video_settings = VideoSettings(codec=codec, crf=video_crf, preset=video_preset, fps=video_fps)
            self.videos = WorkerPool(self._encode_job, num_workers=workers, max_pending=max(2 * workers, self.num_envs + workers), name="fastrecord-mp4")
        self.video_paths: list[Path] = []

    # ------------------------------------------------------------------ capture
    def _capturing(self) -> bool:
        if not self.save_video:
            return False
        return self.save_video_trigger is None or bool(self.save_video_trigger(self.elapsed_record_steps))

    def _frames(self, obs: Any) -> torch.Tensor:
        if self.video_source == "render":
            img = self.view.render()
        else:
            cam = self.video_source.split(":", 1)[1]
            try:
                img = obs["sensor_data"][cam]["rgb"]
            except (KeyError, TypeError, IndexError):
                cams = list(obs["sensor_data"]) if isinstance(obs, Mapping) and "sensor_data" in obs else []
                raise ValueError(
                    f"video_source={self.video_source!r}: the observation has no sensor_data/{cam}/rgb (cameras: {cams}); "
                    f"create the env with obs_mode='rgb' (or 'rgbd') and a camera of that name, or use video_source='render'"
                ) from None
        if isinstance(img, np.ndarray) and img.ndim == 3:
            img = img[None]
        img = torch.as_tensor(img)
        if img.ndim != 4 or img.shape[-1] != 3 or img.dtype != torch.uint8:
            raise TypeError(f"video frames must be [num_envs, H, W, 3] uint8, got {tuple(img.shape)} {img.dtype}")
        return img

    def _collect(self, obs: Any, *, with_frames: bool, check_state: bool = False, refresh: bool = False) -> dict[str, Any]:
        """The state-kind data of this instant: observation, env state, frame.

        ``check_state`` (at resets: the scene may have been reconfigured) verifies that every env has the
        same state layout, as ManiSkill does; otherwise env states are not recorded.
        """
        data: dict[str, Any] = {}
        if self.save_trajectory:
            data["obs"] = obs
            if self.record_env_state:
                state = self.view.state_dict(refresh=refresh)
                from mani_skill.utils import sapien_utils

                if not check_state or sapien_utils.is_state_dict_consistent(state):
                    data["env_states"] = state
                else:
                    self.record_env_state = False
                    if not self._warned_state:
                        self._warned_state = True
                        from mani_skill.utils.logging_utils import logger

                        logger.warning("State dictionary is not consistent, disabling recording of environment states")
        if with_frames:
            data["frames"] = self._frames(obs)
        return data

    def _leaves(self, data: dict[str, Any]) -> dict[str, torch.Tensor]:
        # every leaf stays on the device it comes from (CPU simulation + GPU rendering: flags and states
        # on the CPU, frames on the GPU): no per-step copies between devices
        out: dict[str, torch.Tensor] = {}
        for name, value in data.items():
            if name == "frames":
                out[name] = value
            else:
                out.update(flatten_tree(self.view.batch(value), name))
        return out

    def _ensure_buffer(self) -> EpisodeBuffer:
        if self.buffer is None:
            self.buffer = EpisodeBuffer(self.num_envs, self._capacity)
        return self.buffer

    # ------------------------------------------------------------------ events
    def on_reset(self, obs: Any, env_idx: np.ndarray, reset_kwargs: dict[str, Any]) -> None:
        """Episodes of ``env_idx`` begin: record their slot 0 (reset obs, state, frame)."""
        self._raise_if_failed()
        capture = self._capturing()
        self._frames_ok[env_idx] = capture
        data = self._collect(obs, with_frames=capture, check_state=True, refresh=len(env_idx) == self.num_envs)
        leaves = self._leaves(data)
        buf = self._ensure_buffer()
        if len(env_idx) == self.num_envs:  # a full reset may reconfigure the scene: drop stale fields
            buf.retain_only(set(leaves) | {n for n in buf.fields if _field_of(n).kind == "transition"})
        buf.start(env_idx, leaves)
        seeds = self.view.episode_seeds()
        self._seeds[env_idx] = seeds[env_idx] if len(seeds) == self.num_envs else seeds[0]
        for e in env_idx:
            kw = copy.deepcopy(reset_kwargs)
            if self.num_envs > 1 or isinstance(self.view, VectorEnvView):  # per-env episodes: the env's own seed
                kw = {k: v for k, v in kw.items() if k != "options"} | {"seed": int(self._seeds[e])}
            self._reset_kwargs[e] = kw

    def on_step(self, action: Any, obs: Any, rew: Any, terminated: Any, truncated: Any, info: Mapping,
                restart: np.ndarray | None = None) -> None:
        """Every env took one step (``restart`` envs were auto-reset instead: their data is a slot 0)."""
        self._raise_if_failed()
        capture = self._capturing()
        if not capture:
            self._frames_ok[:] = False
        elif restart is not None:
            self._frames_ok[restart] = True
        data = self._collect(obs, with_frames=capture)
        if self.num_envs == 1 and np.shape(action) == self.view.single_action_shape:
            action = action[None]  # ManiSkill's single env takes unbatched actions too
        data.update(actions=action, terminated=terminated, truncated=truncated)
        for key in ("success", "fail"):
            if key in info:
                data[key] = info[key]
        if self.save_trajectory and self.record_reward:
            data["rewards"] = rew
        if self.info_on_video and self.save_video:
            data["overlay"] = self._overlay_scalars(rew, info)
        self._last_info = info
        self.buffer.step(self._leaves(data), restart)
        if restart is not None and restart.any():
            idx = np.flatnonzero(restart)
            self._seeds[idx] = self.view.episode_seeds()[idx]
            for e in idx:
                self._reset_kwargs[e] = {"seed": int(self._seeds[e])}
        self.elapsed_record_steps += 1
        if self.max_steps_per_video is not None and self.video_layout == "tiled" and self.num_envs > 1:
            full = np.flatnonzero(self.buffer.cursor >= self.max_steps_per_video)
            if len(full):
                self.finalize(full, split=True)

    def _overlay_scalars(self, rew: Any, info: Mapping) -> dict[str, Any]:
        out: dict[str, Any] = {"reward": rew}
        for k, v in info.items():
            if k.startswith("_") or isinstance(v, Mapping):
                continue
            a = v if isinstance(v, torch.Tensor) else np.asarray(v)
            if a.ndim <= 1 and (a.ndim == 0 or a.shape[0] == self.num_envs or self.view.unbatched):
                out[k] = v
        return out

    # ------------------------------------------------------------------ finishing episodes
    def _keep_mask(self, rows: np.ndarray) -> np.ndarray:
        if self.keep == "all":
            return np.ones(len(rows), dtype=bool)
        buf = self.buffer
        if callable(self.keep):
            info = self._last_info or {}
            out = []
            for e in rows:
                final = {}
                for k, v in info.items():
                    a = _np(v) if not isinstance(v, Mapping) else v
                    if isinstance(a, np.ndarray) and a.ndim >= 1 and a.shape[0] == self.num_envs and not self.view.unbatched:
                        final[k] = a[e]
                    else:
                        final[k] = a
                out.append(bool(self.keep(final)))
            return np.asarray(out, dtype=bool)
        fields = buf.fields
        if "success" not in fields and not (self.keep == "failure" and "fail" in fields):
            raise ValueError(
                f"keep={self.keep!r} needs info['success'] from the env, which this env does not report; use keep='all' or a callable"
            )
        if self.keep == "success_once":
            flags = buf.gather(rows, names=["success"])["success"].reshape(len(rows), -1)
            steps = np.arange(flags.shape[1])
            valid = (steps[None] >= 1) & (steps[None] <= buf.cursor[rows][:, None])
            return (flags & valid).any(axis=1)
        last = {k: v.reshape(len(rows)).astype(bool) for k, v in buf.read_last(["success", "fail"], rows).items()}
        if self.keep == "success":
            return last["success"]
        # failure: the env reports fail at the end, or it did not succeed
        failed = last.get("fail", np.zeros(len(rows), dtype=bool))
        return failed | ~last["success"] if "success" in last else failed

    def finalize(self, env_idx: np.ndarray, split: bool = False) -> None:
        """End the episodes in progress of ``env_idx``: keep, copy and queue them, or drop them.

        With ``split`` the envs go on: a new episode starts at their current state (ManiSkill's
        ``flush_trajectory``/``max_steps_per_video`` behaviour); otherwise a reset must follow.
        """
        buf = self.buffer
        if buf is None or self._closed:
            return
        env_idx = np.asarray(env_idx, dtype=np.int64).reshape(-1)
        rows = env_idx[buf.cursor[env_idx] >= 1]  # episodes without a step are not saved (as ManiSkill)
        if len(rows):
            self.num_finished += len(rows)
            kept = rows[self._keep_mask(rows)]
            if len(kept):
                self._write(kept)
        if split:
            buf.restart_from_last(env_idx)
        else:
            buf.end(env_idx)  # ended: only a reset (or auto-reset) starts them again

    def _write(self, kept: np.ndarray) -> None:
        # the one device-to-host copy of these episodes; per-env videos without overlays take their frames
        # as yuv420p converted on the GPU (half the bytes; encode_mp4 waits for the asynchronous copy)
        yuv = self.videos is not None and self.video_layout == "per_env" and not self.info_on_video
        host = self.buffer.gather(kept, yuv420p=("frames",) if yuv else ())
        lengths = self.buffer.cursor[kept]
        control_mode = self.view.control_mode  # an IPC round trip for async vector envs: once a batch
        episodes: list[EpisodeData] = []
        for i, e in enumerate(kept):
            t = int(lengths[i])
            datasets: dict[str, np.ndarray] = {}
            overlay: dict[str, np.ndarray] = {}
            frames = None
            for name, arr in host.items():
                field = _field_of(name)
                a = arr[i, : t + 1] if field.kind == "state" else arr[i, 1 : t + 1]
                if field.name == "frames":
                    frames = a
                elif field.name == "overlay":
                    overlay[name.split("/", 1)[1]] = a
                else:
                    datasets[name] = a.astype(field.dtype, copy=False) if field.dtype else a
            meta: dict[str, Any] = dict(
                episode_id=self.num_episodes,
                episode_seed=int(self._seeds[e]),
                control_mode=control_mode,
                elapsed_steps=t,
                reset_kwargs=self._reset_kwargs[e],
            )
            for key in ("success", "fail"):
                if key in datasets:
                    meta[key] = bool(datasets[key][-1])
            lines = None
            if overlay and frames is not None:
                lines = [{}] + [{k: v[s].item() for k, v in overlay.items()} for s in range(t)]
            episodes.append(EpisodeData(self.num_episodes, int(e), t, datasets, meta, frames, lines))
            self.num_episodes += 1
        if self.trajectory is not None:
            self.trajectory.submit(episodes)
        if self.videos is not None:
            self._submit_videos(episodes)

    def _submit_videos(self, episodes: list[EpisodeData]) -> None:
        ready = [ep for ep in episodes if ep.frames is not None and self._frames_ok[ep.env_idx]]
        if not ready:
            return
        if self.video_layout == "per_env":
            for ep in ready:
                tag = "" if "success" not in ep.meta else ("_success" if ep.meta["success"] else "_failure")
                path = self._video_path(f"{ep.episode_id}_env{ep.env_idx}{tag}")
                self.video_paths.append(path)
                self.videos.submit((path, ep.frames, ep.overlay))
        else:
            from mani_skill.utils.visualization.misc import tile_images

            length = max(len(ep.frames) for ep in ready)
            padded = [np.concatenate([ep.frames, np.repeat(ep.frames[-1:], length - len(ep.frames), 0)]) for ep in ready]
            if any(ep.overlay for ep in ready):
                padded = [_draw_overlay(f, ep.overlay) for f, ep in zip(padded, ready)]
            tiled = tile_images(padded, nrows=int(np.sqrt(self.num_envs)))
            path = self._video_path(str(self._video_id))
            self._video_id += 1
            self.video_paths.append(path)
            self.videos.submit((path, np.ascontiguousarray(tiled), None))

    def _video_path(self, stem: str) -> Path:
        path = self.output_dir / f"{stem}.mp4"
        k = 1
        while self.avoid_overwriting_video and path.exists():
            path = self.output_dir / f"{stem}_{k}.mp4"
            k += 1
        return path

    def _encode_job(self, job: tuple[Path, np.ndarray, list | None]) -> None:
        path, frames, overlay = job
        if overlay:
            frames = _draw_overlay(frames, overlay)
        encode_mp4(path, frames, self.video_settings)

    # ------------------------------------------------------------------ lifecycle
    def check(self) -> None:
        """Before a step: raise a background writer's error, use after close, or a step before reset."""
        self._raise_if_failed()
        if self.buffer is None:
            raise RuntimeError(f"step() for envs {list(range(self.num_envs))} before any reset(): call env.reset() first")

    def _raise_if_failed(self) -> None:
        if self._closed:
            raise RuntimeError("the recorder is closed; create a new RecordEpisode to record more")
        for w in (self.trajectory, self.videos):
            if w is not None:
                w.raise_if_failed()

    def wait_until_done(self) -> None:
        """Block until every queued episode is on disk (re-raises writer errors)."""
        for w in (self.videos, self.trajectory):
            if w is not None:
                w.wait_until_done()

    def close(self, flush: bool) -> None:
        """Finish episodes in progress (if ``flush``), drain the writers, consolidate files. Idempotent."""
        if self._closed:
            return
        errors: list[BaseException] = []
        try:
            if flush and self.buffer is not None:
                self.finalize(np.arange(self.num_envs))
        except BaseException as e:  # noqa: BLE001 - still close the writers, then re-raise
            errors.append(e)
        self._closed = True
        for w in (self.videos, self.trajectory):
            if w is None:
                continue
            try:
                w.close()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
        if errors:
            raise errors[0]


def _draw_overlay(frames: np.ndarray, overlay: list[dict[str, Any]]) -> np.ndarray:
    from mani_skill.utils.visualization.misc import put_info_on_image

    out = frames.copy()
    for s, info in enumerate(overlay[: len(out)]):
        if info:
            out[s] = put_info_on_image(out[s], info)
    return out


def _env_idx(options: Mapping | None, num_envs: int, key: str) -> np.ndarray:
    if options is None or options.get(key) is None:
        return np.arange(num_envs)
    v = _np(options[key])
    return np.flatnonzero(v) if v.dtype == np.bool_ else v.astype(np.int64).reshape(-1)


_RECORDER_DOC_ARGS = """
    ManiSkill's arguments (same meaning and defaults as ``mani_skill.utils.wrappers.RecordEpisode``):
        output_dir, save_trajectory, trajectory_name, save_video, info_on_video, save_on_reset,
        save_video_trigger, max_steps_per_video, clean_on_close, record_reward, record_env_state,
        video_fps, render_substeps, avoid_overwriting_video, source_type, source_desc.

    fastrecord's additions:
        keep: which finished episodes are written: "all" (default, as ManiSkill), "success" (success at
            the last step), "success_once", "failure", or a callable on the episode's final info.
        video_layout: "per_env" (one MP4 per env episode, default) or "tiled" (ManiSkill's layout).
        video_source: "render" (the human render camera, default) or "sensor:<camera>" (an RGB camera
            already in the observation: no extra render).
        video_codec / video_crf / video_preset: encoder settings ("auto": h264_nvenc where the GPU has an
            encoder, else libx264; crf 23; preset "ultrafast", the one that keeps up with GPU envs).
        video_workers: encoder threads (default: one per CPU core, at most 16).
        buffer_capacity: steps per env held on the device (default max_episode_steps + 1; longer
            episodes grow the buffer).
"""


class _RecorderMixin:
    """Shared ManiSkill-compatible surface of both wrappers."""

    _rec: EpisodeRecorder

    def _make_recorder(self, view: Any, output_dir: str, kwargs: dict[str, Any]) -> None:
        if kwargs.pop("render_substeps", False):
            raise ValueError(
                "render_substeps=True is not supported by fastrecord yet (frames are captured once per env step); "
                "use mani_skill.utils.wrappers.RecordEpisode for substep videos, or raise video_fps"
            )
        self.save_on_reset = kwargs.pop("save_on_reset")
        self.clean_on_close = kwargs.pop("clean_on_close")
        self._rec = EpisodeRecorder(view, output_dir, **kwargs)
        self.output_dir = self._rec.output_dir

    # ManiSkill attribute names
    @property
    def save_video(self) -> bool:
        return self._rec._capturing()

    @property
    def recorder(self) -> EpisodeRecorder:
        return self._rec

    def flush_trajectory(self, verbose: bool = False, ignore_empty_transition: bool = True,
                         env_idxs_to_flush: Any = None, save: bool = True) -> None:
        """Finish the episodes in progress of ``env_idxs_to_flush`` now (they go on as new episodes).

        fastrecord records each env episode's trajectory and video together, so this also flushes the
        videos of those envs. ``save=False`` drops them.
        """
        idx = np.arange(self._rec.num_envs) if env_idxs_to_flush is None else _np(env_idxs_to_flush).reshape(-1)
        if save:
            self._rec.finalize(idx, split=True)
        else:
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

    def __new__(cls, env: Any, *args: Any, **kwargs: Any):
        if cls is RecordEpisode and isinstance(env, gym.vector.VectorEnv):
            return RecordVectorEpisode(env, *args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        env: gym.Env,
        output_dir: str,
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
        video_fps: int = 30,
        render_substeps: bool = False,
        avoid_overwriting_video: bool = False,
        source_type: str | None = None,
        source_desc: str | None = None,
        *,
        keep: KeepFilter = "all",
        video_layout: str = "per_env",
        video_source: str = "render",
        video_codec: str = "auto",
        video_crf: int = 23,
        video_preset: str = "ultrafast",
        video_workers: int | None = None,
        buffer_capacity: int | None = None,
    ) -> None:
        gym.Wrapper.__init__(self, env)
        kwargs = dict(locals())
        for k in ("self", "env", "output_dir", "__class__"):
            kwargs.pop(k, None)
        self._make_recorder(ManiSkillView(env), output_dir, kwargs)
        self._closed = False

    @property
    def num_envs(self) -> int:
        return self._rec.num_envs

    @property
    def base_env(self):
        return self.env.unwrapped

    def reset(self, *args: Any, seed: int | list[int] | None = None, options: dict | None = None, **kwargs: Any):
        env_idx = _env_idx(options, self.num_envs, "env_idx")
        if self.save_on_reset:
            self._rec.finalize(env_idx)
        elif self._rec.buffer is not None:
            self._rec.buffer.end(env_idx)  # not saved: ManiSkill's save_on_reset=False
        obs, info = self.env.reset(*args, seed=seed, options=options, **kwargs)
        reset_kwargs = copy.deepcopy(dict(options=_plain(options), **kwargs))
        if seed is not None:
            reset_kwargs["seed"] = seed
        self._rec.on_reset(obs, env_idx, reset_kwargs)
        return obs, info

    def step(self, action: Any):
        self._rec.check()
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
    return {k: (_np(v) if isinstance(v, torch.Tensor) else v) for k, v in options.items()}


class RecordVectorEpisode(_RecorderMixin, SubEnvAccess, gym.vector.VectorWrapper):
    """`RecordEpisode` for a gymnasium vector env (Sync/Async) of ManiSkill CPU envs.

    Each sub-env's episodes are recorded separately (its own trajectory group and MP4). Supports the
    vector env's auto-reset modes NEXT_STEP (gymnasium's default: the episode ends at the done step,
    the next step restarts it) and DISABLED (``reset(options={"reset_mask": ...})``).
    """ + _RECORDER_DOC_ARGS

    def __init__(self, env: gym.vector.VectorEnv, output_dir: str, save_trajectory: bool = True,
                 trajectory_name: str | None = None, save_video: bool = True, info_on_video: bool = False,
                 save_on_reset: bool = True, save_video_trigger: Callable[[int], bool] | None = None,
                 max_steps_per_video: int | None = None, clean_on_close: bool = True, record_reward: bool = True,
                 record_env_state: bool = True, video_fps: int = 30, render_substeps: bool = False,
                 avoid_overwriting_video: bool = False, source_type: str | None = None,
                 source_desc: str | None = None, *, keep: KeepFilter = "all", video_layout: str = "per_env",
                 video_source: str = "render", video_codec: str = "auto", video_crf: int = 23,
                 video_preset: str = "ultrafast", video_workers: int | None = None,
                 buffer_capacity: int | None = None) -> None:
        gym.vector.VectorWrapper.__init__(self, env)
        mode = env.metadata.get("autoreset_mode", gym.vector.AutoresetMode.NEXT_STEP)
        if mode == gym.vector.AutoresetMode.SAME_STEP:
            raise ValueError(
                "autoreset_mode=SAME_STEP resets sub-envs before their last frame can be rendered; create the "
                "vector env with autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP (the default) or DISABLED"
            )
        self._autoreset = mode == gym.vector.AutoresetMode.NEXT_STEP
        kwargs = dict(locals())
        for k in ("self", "env", "output_dir", "__class__", "mode"):
            kwargs.pop(k, None)
        self._make_recorder(VectorEnvView(env), output_dir, kwargs)
        self._pending_restart = np.zeros(env.num_envs, dtype=bool)
        self._closed = False

    def reset(self, *, seed: int | list[int] | None = None, options: dict | None = None):
        env_idx = _env_idx(options, self.num_envs, "reset_mask")
        if self.save_on_reset:
            self._rec.finalize(env_idx)
        obs, info = self.env.reset(seed=seed, options=options)
        self._pending_restart[env_idx] = False
        kw: dict[str, Any] = {"options": {k: v for k, v in (options or {}).items() if k != "reset_mask"}}
        self._rec.on_reset(obs, env_idx, kw)
        return obs, info

    def step(self, actions: Any):
        self._rec.check()
        obs, rew, terminated, truncated, info = self.env.step(actions)
        restart = self._pending_restart.copy() if self._autoreset else None
        self._rec.on_step(actions, obs, rew, terminated, truncated, info, restart=restart)
        done = np.logical_or(_np(terminated), _np(truncated))
        if self._autoreset:
            self._pending_restart = done
            if done.any():
                self._rec.finalize(np.flatnonzero(done))
        return obs, rew, terminated, truncated, info

    def close(self, **kwargs: Any) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._rec.close(flush=self.save_on_reset)
        finally:
            self.env.close(**kwargs)
