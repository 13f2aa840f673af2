"""`EpisodeRecorder`: episode bookkeeping over the device buffer, handing finished episodes to sinks.

Per parallel step the recorder renders once (all envs in one call), writes every recorded leaf into
`EpisodeBuffer` with one copy per leaf, and copies nothing to the host. When envs' episodes end (reset,
auto-reset, close) it decides which to keep from two small flags, copies the kept ones to the host in
one batch, and hands them to its sinks (`fastrecord.sinks`: ManiSkill's trajectory files, MP4 videos,
yours), built from the options by `fastrecord.sinks.build_sinks`. Every finished episode, kept or not,
also reaches every sink as an `EpisodeEnded` (its length, flags, return and seed). It sees envs only
through a view (`fastrecord.envs.EnvView`), so one code path serves any number and kind of envs.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastrecord.buffer import EpisodeBuffer, flatten_tree
from fastrecord.cameras import check_video_options
from fastrecord.envs import EnvView, unbatchable
from fastrecord.episode import EpisodeData, field_of
from fastrecord.episode_end import ended_events, keep_mask, read_ended
from fastrecord.exits import close_at_exit, forget_at_exit, stopped_by_signal
from fastrecord.options import RecordOptions
from fastrecord.sinks.base import EpisodeHandoff, RunDirectory, Sink, close_sinks
from fastrecord.sinks.factory import build_sinks
from fastrecord.sinks.reconcile import refuse_damage
from fastrecord.staging import default_staging_pool, shared_memory_supported
from fastrecord.system import stamp
from fastrecord.video.overlay import Overlay, maniskill_font
from fastrecord.video.yuv import YUV420P


def _with_env_dim(action: Any, space: Any) -> Any:
    """``action`` with a leading env dim of 1 on each leaf that has its space's unbatched shape."""
    if isinstance(action, Mapping):
        sub = getattr(space, "spaces", {})
        return {k: _with_env_dim(v, sub.get(k)) for k, v in action.items()}
    shape = getattr(space, "shape", None)
    return action[None] if shape is not None and tuple(np.shape(action)) == tuple(shape) else action


# reset options that say which env slots reset: where an episode ran, not what it is (not in its reset_kwargs)
ENV_SLOT_KEYS = ("env_idx", "reset_mask")


class EpisodeRecorder:
    """Owns: the `EpisodeBuffer`, the sinks (made by `build_sinks`), the `RunDirectory`, episode ids,
    per-env episode metadata (seed, reset kwargs, running return) and the keep filter.

    Env-agnostic: it sees envs only through an `EnvView`.
    """

    def __init__(
        self, view: EnvView, output_dir: str | Path, options: RecordOptions, sinks: Sequence[Sink] = ()
    ) -> None:
        opts = options
        check_video_options(opts.save_video, opts.video_source, view.render_mode, view.env)  # before the run directory
        self.options = opts
        self.view = view
        self.num_envs = view.num_envs
        self.output_dir = Path(output_dir)
        self.save_trajectory = opts.save_trajectory
        self.save_video = opts.save_video
        self.info_on_video = opts.info_on_video
        self._font = maniskill_font() if opts.info_on_video else ""
        self.save_video_trigger = opts.save_video_trigger
        self.record_reward = opts.record_reward
        self.record_env_state = opts.record_env_state
        self.keep = opts.keep
        self.video_source = opts.video_source

        self.max_episode_steps = view.max_episode_steps()
        self._capacity = opts.buffer_capacity or (self.max_episode_steps + 1 if self.max_episode_steps else 64)
        self.buffer: EpisodeBuffer | None = None

        # every check that can fail runs before the first file is touched
        built = build_sinks(opts, view, sinks)
        self.sinks: list[Sink] = built.all
        self.trajectory, self.videos, self.lerobot, self.results = (
            built.trajectory,
            built.videos,
            built.lerobot,
            built.results,
        )
        # what the sinks need recorded
        self._record_data = any(s.wants_datasets for s in self.sinks)
        frame_sinks = [s for s in self.sinks if s.wants_frames]
        self._record_frames = bool(frame_sinks)
        self._yuv = bool(frame_sinks) and all(s.accepts_yuv420p for s in frame_sinks)
        # render_substeps: each buffer slot holds the step's substep frames and its own frame (the reset slot
        # its frame repeated), so an episode's video is one contiguous run of the gathered frames
        self.frames_per_step = view.start_substeps() + 1 if opts.render_substeps and self._record_frames else 1
        self._substeps_on = False

        self._seeds = np.zeros(self.num_envs, dtype=np.int64)
        self._returns: torch.Tensor | None = None  # each env's running return (float64, where rewards come from)
        self._returns_zero = np.ones(self.num_envs, dtype=bool)  # zeroed, and no step added since
        self._reset_kwargs: list[dict] = [{} for _ in range(self.num_envs)]
        # extra JSON entry fields of each env's next written episode, set by the caller (a replay's
        # source_episode_id): in the part files from the start, so a crashed run's episodes keep them
        # None (set_episode_meta): the env's episode in progress is a spare one, neither written nor counted
        self.episode_meta: list[dict[str, Any] | None] = [{} for _ in range(self.num_envs)]
        self._frames_ok = np.ones(self.num_envs, dtype=bool)  # every frame of the episode was captured
        self._last_info: Any = None
        self._staging_reserved = False
        self._handoff = EpisodeHandoff(self.sinks)  # every sink hears of every ended episode (held during resets)
        self._warned_state = False
        self.elapsed_record_steps = 0
        self.num_finished = 0  # episodes ended, kept or not
        self._closed = False

        self.run = RunDirectory(output_dir, opts.trajectory_name, opts.if_exists,
                                options={**opts.as_dict(), **built.chosen}, check_resume=self._inspect_resumed).open()
        self._open_sinks()
        self.trajectory_name = self.run.name
        # episode ids continue where a resumed run stopped
        self.first_episode_id = self.run.committed
        self.next_episode_id = self.first_episode_id
        close_at_exit(self)
        stamp("recorder_made")

    def _open_sinks(self) -> None:
        """Open every sink on the run directory, a resumed run's outputs first made to agree (`sinks.reconcile`:
        each holds exactly the episodes the run committed); a failure closes what was opened and abandons the
        run directory (`RunDirectory.abandon`) before it is raised."""
        opened: list[Sink] = []
        try:
            if self.run.resuming:
                from fastrecord.sinks.reconcile import reconcile

                self._check_resumed_outputs(self._resumed)
                reconcile(self.run, self._resumed)
            for s in self.sinks:
                s.open(self.run)
                opened.append(s)
        except BaseException:
            for s in reversed(opened):
                try:
                    s.close()
                except BaseException:  # noqa: BLE001 - the construction error is the one to report
                    pass
            self.run.abandon()
            raise

    def _inspect_resumed(self, manifest: dict[str, Any]) -> None:
        """Under the run's lock, before anything is written: a damaged run is refused (`refuse_damage`)."""
        name = self.options.trajectory_name
        assert name is not None  # only a name given resumes: a default (timestamp) name is always a free one
        self._resumed = refuse_damage(Path(self.output_dir), name)

    def _check_resumed_outputs(self, state: Any) -> None:
        """A resumed run writes the outputs the earlier one wrote (its `sinks.reconcile.RunState`): an output
        it did not write would number its episodes from 0, one it wrote would stop at the resume."""
        from fastrecord.sinks.lerobot import LeRobotSink

        n = state.committed
        lerobot = any(isinstance(s, LeRobotSink) for s in self.sinks)
        for option, ours, theirs in (("save_trajectory", self.trajectory is not None, state.h5 is not None),
                                     ("lerobot", lerobot, state.lerobot is not None)):
            if ours != theirs and (n > 0 or theirs):
                raise ValueError(f"if_exists='resume': run {self.run.name!r} holds {n} episodes recorded with "
                                 f"{option}={theirs}; resume it with {option}={theirs} (the same outputs), or record "
                                 f"into another trajectory_name")

    # ------------------------------------------------------------------ capture
    def capturing(self) -> bool:
        """Whether this step's frames are captured (a frame sink exists and ``save_video_trigger`` agrees)."""
        if not self._record_frames:
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
                    f"video_source={self.video_source!r}: the observation has no sensor_data/{cam}/rgb "
                    f"(cameras: {cams}); create the env with obs_mode='rgb' (or 'rgbd') and a camera of that name, "
                    "or use video_source='render'"
                ) from None
        if isinstance(img, np.ndarray) and img.ndim == 3:
            img = img[None]
        img = torch.as_tensor(img)
        if img.ndim != 4 or img.shape[-1] != 3 or img.dtype != torch.uint8:
            raise TypeError(f"video frames must be [num_envs, H, W, 3] uint8, got {tuple(img.shape)} {img.dtype}")
        return img

    def _collect(self, obs: Any, *, with_frames: bool, check_state: bool = False, refresh: bool = False,
                 reset: bool = False) -> dict[str, Any]:
        """The state-kind data of this instant: observation, env state, frame.

        ``check_state`` (at resets: the scene may have been reconfigured) verifies that every env has the same state
        layout, as ManiSkill does; otherwise env states are not recorded."""
        data: dict[str, Any] = {}
        if self._record_data:
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
            frames = self._frames(obs)
            k = self.frames_per_step
            if k > 1:  # [N, k, H, W, 3]: a reset's frame repeated, a step's substep frames and its own
                frames = frames[:, None].expand(-1, k, *frames.shape[1:]) if reset else self.view.step_frames(frames)
            data["frames"] = frames
        return data

    def _leaves(self, data: dict[str, Any]) -> dict[str, torch.Tensor]:
        # every leaf stays on the device it comes from (CPU simulation + GPU rendering: flags and states
        # on the CPU, frames on the GPU): no per-step copies between devices
        out: dict[str, torch.Tensor] = {}
        for name, value in data.items():
            if name == "frames":
                out[name] = value
            else:
                try:
                    batched = self.view.batch(value)
                except TypeError as e:  # torch refuses an array of objects: name the leaf and the fix
                    raise unbatchable(value, name) from e
                out.update(flatten_tree(batched, name))
        return out

    def _size_writers(self, leaves: Mapping[str, Any]) -> None:
        """``trajectory_writers=None``: at the first reset, size the HDF5 writers from the observations the env
        returned (it may declare a flat Box and return camera images): image leaves get more writers."""
        if self.trajectory is None or self.options.trajectory_writers is not None:
            return
        from fastrecord.options import default_trajectory_writers, usable_cores
        from fastrecord.sinks.maniskill_h5.layout import IMAGE_KEYS

        images = any(n.startswith("obs") and n.rsplit("/", 1)[-1] in IMAGE_KEYS for n in leaves)
        wanted = default_trajectory_writers(usable_cores(), images)
        if wanted > self.trajectory.writers:
            self.trajectory.add_writers(wanted)
            self.run.options["trajectory_writers"] = wanted  # the manifest records the count used

    def _reserve_staging(self, buf: EpisodeBuffer) -> None:
        """At the first reset: have the staging pool make (and pin) the two arenas that batches of finished
        episodes' frames go through (one being filled while the encoders read the other), on background
        threads at once, so that the first episodes out do not wait for them (each is leased while its pieces
        are still being pinned: `fastrecord.staging.Arena.pin_pieces`)."""
        self._staging_reserved = True
        frames = buf.fields.get("frames")
        if frames is None or not shared_memory_supported():
            return
        yuv = self._yuv and frames.is_cuda
        per_frame = frames[0, 0].numel() // 2 if yuv else frames[0, 0].numel()
        default_staging_pool().reserve(self.num_envs * buf.capacity * per_frame, pin=frames.is_cuda, count=2)

    def _ensure_buffer(self) -> EpisodeBuffer:
        if self.buffer is None:
            self.buffer = EpisodeBuffer(self.num_envs, self._capacity)
        return self.buffer

    # ------------------------------------------------------------------ events
    def on_reset(self, obs: Any, env_idx: np.ndarray, reset_kwargs: dict[str, Any]) -> None:
        """Episodes of ``env_idx`` begin: record their slot 0 (reset obs, state, frame)."""
        self._raise_if_failed()
        capture = self.capturing()
        self._frames_ok[env_idx] = capture
        data = self._collect(
            obs, with_frames=capture, check_state=True, refresh=len(env_idx) == self.num_envs, reset=True
        )
        leaves = self._leaves(data)
        buf = self._ensure_buffer()
        if len(env_idx) == self.num_envs:  # a full reset may reconfigure the scene: drop stale fields
            buf.retain_only(set(leaves) | {n for n in buf.fields if field_of(n).kind == "transition"})
        buf.start(env_idx, leaves)
        if not self._staging_reserved:
            self._reserve_staging(buf)
            self._size_writers(leaves)
        self._zero_returns(env_idx)
        seeds = self.view.episode_seeds()
        self._seeds[env_idx] = seeds[env_idx] if len(seeds) == self.num_envs else seeds[0]
        if self.view.per_env_seeds:  # per-env episodes: the env's own seed (where the caller's was, else last)
            rest = dict(reset_kwargs)
            if "options" in rest:  # as RecordEpisode records them, less the env slots (which depend on the layout)
                rest["options"] = {k: v for k, v in (rest["options"] or {}).items() if k not in ENV_SLOT_KEYS} or None
            rest.setdefault("seed", None)
            for e, seed in zip(np.asarray(env_idx).tolist(), self._seeds[env_idx].tolist(), strict=True):
                self._reset_kwargs[e] = {k: seed if k == "seed" else copy.deepcopy(v) for k, v in rest.items()}
        else:
            for e in env_idx:
                self._reset_kwargs[e] = copy.deepcopy(reset_kwargs)

    def on_step(self, action: Any, obs: Any, rew: Any, terminated: Any, truncated: Any, info: Mapping,
                restart: np.ndarray | None = None) -> None:
        """Every env took one step (``restart`` envs were auto-reset instead: their data is a slot 0)."""
        self._raise_if_failed()
        capture = self.capturing()
        if not capture:
            self._frames_ok[:] = False
        elif restart is not None:
            self._frames_ok[restart] = True
        data = self._collect(obs, with_frames=capture)
        if self.num_envs == 1:  # ManiSkill's single env takes unbatched actions too (per agent for multi-agent envs)
            action = _with_env_dim(action, self.view.single_action_space)
        data.update(actions=action, terminated=terminated, truncated=truncated)
        for key in ("success", "fail"):
            if key in info:
                data[key] = info[key]
        if self._record_data and self.record_reward:
            data["rewards"] = rew
        if self.info_on_video and self._record_frames:
            data["overlay"] = self._overlay_scalars(rew, info)
        self._last_info = info
        buf = self.buffer
        assert buf is not None, "on_reset records each episode's first slot before on_step"
        buf.step(self._leaves(data), restart)
        self._add_rewards(self.view.batch(rew), restart)
        if restart is not None and restart.any():
            idx = np.flatnonzero(restart)
            self._seeds[idx] = self.view.episode_seeds()[idx]
            for e in idx:
                self._reset_kwargs[e] = {"seed": int(self._seeds[e])}
        self.elapsed_record_steps += 1

    def _overlay_scalars(self, rew: Any, info: Mapping) -> dict[str, Any]:
        out: dict[str, Any] = {"reward": rew}
        for k, v in info.items():
            if k.startswith("_") or isinstance(v, Mapping):
                continue
            a = v if isinstance(v, torch.Tensor) else np.asarray(v)
            if a.ndim <= 1 and (a.ndim == 0 or a.shape[0] == self.num_envs or self.view.unbatched):
                out[k] = v
        return out

    def _zero_returns(self, env_idx: np.ndarray) -> None:
        if self._returns is None:
            return
        idx = np.asarray(env_idx, dtype=np.int64).reshape(-1)
        idx = idx[~self._returns_zero[idx]]  # already 0 (a finalize, then the reset): no device work
        if not len(idx):
            return
        self._returns_zero[idx] = True
        if self._returns_zero.all():  # every env's return is to be 0: no index copied to the device
            self._returns.zero_()
        else:
            self._returns[torch.as_tensor(idx, device=self._returns.device)] = 0

    def _add_rewards(self, rew: Any, restart: np.ndarray | None) -> None:
        """Add a step's rewards ``[N]`` (``restart`` envs were auto-reset instead: theirs start at 0)."""
        rew = torch.as_tensor(rew).reshape(-1)
        if self._returns is None:
            self._returns = torch.zeros(rew.shape[0], dtype=torch.float64, device=rew.device)
        self._returns += rew.to(self._returns.device)  # summed in float64: one kernel, no float64 copy first
        self._returns_zero[:] = False
        if restart is not None and restart.any():
            self._zero_returns(np.flatnonzero(restart))

    def set_episode_meta(self, env_idx: Sequence[int] | np.ndarray, metas: Sequence[Mapping[str, Any] | None]) -> None:
        """Set `episode_meta` of ``env_idx``, checked: extra JSON fields (one mapping per env, e.g.
        `fastrecord.shards.episode_meta`: ``global_index``, ``source_rank``) for the episodes those envs
        write next, in their ``NAME.json`` entries and results rows. ``None`` for an env marks its episode
        in progress as not to be recorded at all (neither written, nor counted, nor in the results: a
        spare env slot of a sharded run). The values stay until set again (a reset does not clear them):
        set them at each reset that starts a new episode."""
        env_idx = np.asarray(env_idx, dtype=np.int64).reshape(-1)
        if len(env_idx) != len(metas):
            raise ValueError(
                f"set_episode_meta: {len(env_idx)} envs but {len(metas)} metas; give one mapping (or None) per env"
            )
        reserved = {"episode_id", "episode_seed", "control_mode", "elapsed_steps", "reset_kwargs", "success", "fail"}
        for e, m in zip(env_idx.tolist(), metas, strict=True):
            if not 0 <= e < self.num_envs:
                raise ValueError(f"set_episode_meta: env index {e} is outside 0..{self.num_envs - 1}")
            if m is not None and reserved & set(m):
                raise ValueError(
                    f"set_episode_meta: keys {sorted(reserved & set(m))} are the recorder's own JSON fields; "
                    f"use other names (e.g. global_index)"
                )
            self.episode_meta[e] = None if m is None else dict(m)

    # ------------------------------------------------------------------ finishing episodes
    def finalize(self, env_idx: np.ndarray, split: bool = False) -> None:
        """End the episodes in progress of ``env_idx``: keep, copy and queue them, or drop them.

        With ``split`` the envs go on: a new episode starts at their current state (ManiSkill's
        ``flush_trajectory``/``max_steps_per_video`` behaviour); otherwise a reset must follow."""
        buf = self.buffer
        if buf is None or self._closed:
            return
        env_idx = np.asarray(env_idx, dtype=np.int64).reshape(-1)
        rows = env_idx[buf.cursor[env_idx] >= 1]  # episodes without a step are not saved (as ManiSkill)
        rows = rows[
            np.array([self.episode_meta[e] is not None for e in rows], dtype=bool).reshape(-1)
        ]  # spare slots: dropped
        try:
            if len(rows):
                self.num_finished += len(rows)
                # host reads first: after _write they would wait for its gather
                ended = read_ended(buf, rows, self._returns)
                keep = keep_mask(self.keep, rows, ended, buf.fields, self._last_info, self.num_envs,
                                 self.view.unbatched)
                first_id = self.next_episode_id
                kept = rows[keep]
                if len(kept):
                    self._write(kept)
                self._handoff(ended_events(rows, keep, first_id, ended, self._seeds, self._frames_ok,
                                           self.episode_meta))
        finally:  # handed off (or failed): these episodes are over and are never finalized again
            self._zero_returns(env_idx)
            if split:
                buf.restart_from_last(env_idx)
            else:
                buf.end(env_idx)  # ended: only a reset (or auto-reset) starts them again

    def handoffs_held(self) -> contextlib.AbstractContextManager[None]:
        """Inside, the episodes `finalize` ends reach the sinks on leaving (`EpisodeHandoff.held`)."""
        return self._handoff.held()

    def _write(self, kept: np.ndarray) -> None:
        # the one device-to-host copy of these episodes; per-env videos without overlays take their frames
        # as yuv420p converted on the GPU (half the bytes; the encoder waits for the asynchronous copy)
        buf = self.buffer
        assert buf is not None  # called by finalize, which has one
        host = buf.gather(kept, transforms={"frames": YUV420P} if self._yuv else None)
        lengths = buf.cursor[kept]
        control_mode = self.view.control_mode  # an IPC round trip for async vector envs: once a batch
        episodes: list[EpisodeData] = []
        fields = {name: field_of(name) for name in host}
        for i, e in enumerate(kept):
            t = int(lengths[i])
            datasets: dict[str, np.ndarray] = {}
            overlay: dict[str, np.ndarray] = {}
            frames = None
            for name, arr in host.items():
                f = fields[name]
                a = arr[i, : t + 1] if f.kind == "state" else arr[i, 1 : t + 1]
                if f.name == "frames":
                    if self.frames_per_step > 1:  # [t + 1, k, ...] -> the reset's frame and k frames a step
                        a = a.reshape(-1, *a.shape[2:])[self.frames_per_step - 1:]
                    frames = a if self._frames_ok[e] else None
                elif f.name == "overlay":
                    overlay[name.split("/", 1)[1]] = a
                else:
                    datasets[name] = a.astype(f.dtype, copy=False) if f.dtype else a
            meta: dict[str, Any] = dict(
                episode_id=self.next_episode_id,
                episode_seed=int(self._seeds[e]),
                control_mode=control_mode,
                elapsed_steps=t,
                reset_kwargs=self._reset_kwargs[e],
            )
            meta.update(self.episode_meta[e] or {})
            for key in ("success", "fail"):
                if key in datasets:
                    meta[key] = bool(datasets[key][-1])
            lines = None
            if overlay and frames is not None:  # columns, formatted and drawn where the video is encoded
                lines = Overlay.of_episode(
                    {k: np.array(v) for k, v in overlay.items()}, self._font, self.frames_per_step
                )
            episodes.append(
                EpisodeData(self.next_episode_id, int(e), t, datasets, meta, frames, lines, self.frames_per_step)
            )
            self.next_episode_id += 1
        _submit_to_all(self.sinks, episodes)

    # ------------------------------------------------------------------ lifecycle
    @property
    def num_episodes(self) -> int:
        """Episodes this recorder kept (ids ``first_episode_id .. next_episode_id - 1``)."""
        return self.next_episode_id - self.first_episode_id

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def video_paths(self) -> list[Path]:
        return self.videos.files if self.videos is not None else []

    def check(self) -> None:
        """Before a step: raise a background writer's error, use after close, or a step before reset."""
        self._raise_if_failed()
        if self.buffer is None:
            raise RuntimeError(
                f"step() for envs {list(range(self.num_envs))} before any reset(): call env.reset() first"
            )

    def before_step(self) -> None:
        """Right before the env steps: `check`, and with render_substeps switch the substep frames on for a
        step whose frames are captured (off otherwise: ManiSkill's hook asks ``save_video`` too)."""
        self.check()
        if self.frames_per_step > 1:
            on = self.capturing()
            if on != self._substeps_on:
                self.view.substep_capture(on)
                self._substeps_on = on

    def _raise_if_failed(self) -> None:
        if self._closed:
            raise RuntimeError("the recorder is closed; create a new RecordEpisode to record more")
        for s in self.sinks:
            s.raise_if_failed()

    def wait_until_done(self) -> None:
        """Block until every queued episode is on disk (re-raises writer errors)."""
        # the results sink is the last: its rows of what every output holds (the commit log) then reach a sink
        # that joins only committed episodes into files (LeRobot's `limit`) through `Sink.after_commit`
        for s in self.sinks:
            s.wait_until_done()

    def close(self, flush: bool) -> None:
        """Finish episodes in progress (if ``flush``), drain and close every sink, release the run
        directory. Idempotent; the first error is re-raised after everything was closed."""
        if self._closed:
            return
        errors: list[BaseException] = []
        flush = flush and not stopped_by_signal()  # Ctrl-C, SIGTERM: what is in progress is cut, not finished
        try:
            if flush and self.buffer is not None:
                self.finalize(np.arange(self.num_envs))
        except BaseException as e:  # noqa: BLE001 - still close the sinks, then re-raise
            errors.append(e)
        self._closed = True
        forget_at_exit(self)
        if self.frames_per_step > 1:
            try:
                self.view.stop_substeps()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
        # every output done first, then the results rows of what all of them hold (the commits), and only then
        # the closes: a sink that joins episodes into files (LeRobot) takes the committed ones only
        for s in self.sinks:
            try:
                if s is self.results:  # the last: the outputs finish their files in their close, below
                    self.results.commit_before_close()
                else:
                    s.wait_until_done()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
        own = [s for s in (self.trajectory, self.videos, self.lerobot) if s is not None]
        errors.extend(close_sinks(self.sinks, side_by_side=own, last=self.results))
        try:
            self.run.close(status="failed" if errors else "closed")
        except BaseException as e:  # noqa: BLE001 - a full disk: the sinks' error, if any, says more
            errors.append(e)
        if errors:
            raise errors[0]


def _submit_to_all(sinks: Sequence[Any], episodes: list[EpisodeData]) -> None:
    """Hand ``episodes`` to every sink. A Ctrl-C (``KeyboardInterrupt``) or a SIGTERM (``SystemExit`` from
    `fastrecord.install_signal_handlers`' handler), raised at whatever line the main thread is at, during one sink's
    hand-off still lets the sinks after it take the episodes, then is raised: otherwise one output (the HDF5 file)
    would hold an episode that another (its video) never got. The window left is a signal inside a sink's own
    ``submit``, before it queued the episodes."""
    interrupted: KeyboardInterrupt | SystemExit | None = None
    for sink in sinks:
        try:
            sink.submit(episodes)
        except (KeyboardInterrupt, SystemExit) as e:
            interrupted = interrupted or e
    if interrupted is not None:
        raise interrupted
