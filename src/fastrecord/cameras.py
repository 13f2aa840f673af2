"""Which cameras an env's observations hold: ``video_source="sensor:<camera>"`` checked when the wrapper
is made, before the run directory is, rather than at the first reset (which would leave an empty run);
`check_video_options`, every check of the video options against the env.

ManiSkill envs declare their observations in ``observation_space`` (``single_observation_space`` for a
vector env): ``sensor_data/<camera>/rgb`` for each RGB camera of an image ``obs_mode``. Envs that do not
declare a ``Dict`` observation space cannot tell, and are checked at the first reset instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def observed_cameras(env: Any) -> list[str] | None:
    """The cameras whose RGB images ``env``'s observations hold (``sensor_data/<camera>/rgb``); [] for a
    ManiSkill env observing no images (e.g. ``obs_mode="state"``); None when ``env`` cannot tell."""
    space = getattr(env, "single_observation_space", None) or getattr(env, "observation_space", None)
    spaces = getattr(space, "spaces", None)
    sensors = spaces.get("sensor_data") if isinstance(spaces, Mapping) else None
    if sensors is None:  # a ManiSkill env (it has sensors) observing no images; else the env cannot tell
        return [] if hasattr(getattr(env, "unwrapped", None), "_sensors") else None
    cameras = getattr(sensors, "spaces", None)
    if not isinstance(cameras, Mapping):
        return None
    return [name for name, cam in cameras.items() if "rgb" in (getattr(cam, "spaces", None) or {})]


def check_video_source(video_source: str, env: Any) -> None:
    """Raise ValueError when ``video_source="sensor:<camera>"`` names a camera whose RGB images ``env``'s
    observations do not hold, naming the cameras they do hold. "render", and envs that cannot tell, pass."""
    if not video_source.startswith("sensor:"):
        return
    camera = video_source.split(":", 1)[1]
    cameras = observed_cameras(env)
    if cameras is None or camera in cameras:
        return
    if cameras:
        raise ValueError(f"video_source={video_source!r}: the env has no RGB camera {camera!r}; its observations hold "
                         f"{', '.join(cameras)}: pass video_source='sensor:{cameras[0]}' (or another of them), or "
                         f"video_source='render'")
    obs_mode = getattr(getattr(env, "unwrapped", None), "obs_mode", None)
    raise ValueError(
        f"video_source={video_source!r}: the env's observations hold no camera images "
        f"(obs_mode={obs_mode!r}); create the env with obs_mode='rgb' (or 'rgbd'), or use video_source='render'"
    )


def check_frame_sides(video_source: str, env: Any) -> None:
    """Raise ValueError when a camera the videos come from makes frames wider or taller than H.264 encodes
    (`fastrecord.checks.MAX_FRAME_SIDE`), naming the camera and the fix, before anything renders: the
    encoder refused such frames only after the first episode had rendered, leaving a run behind. Envs that
    do not say their camera sizes (not ManiSkill's, a vector env's sub-envs) pass."""
    from fastrecord.checks import MAX_FRAME_SIDE

    if video_source == "render":
        configs = getattr(getattr(env, "unwrapped", None), "_human_render_camera_configs", None)
        sizes = {name: (getattr(c, "width", 0), getattr(c, "height", 0))
                 for name, c in configs.items()} if isinstance(configs, Mapping) else {}
        fix = "create the env with human_render_camera_configs=dict(width=..., height=...) of at most that"
    else:
        camera = video_source.split(":", 1)[1]
        space = getattr(env, "single_observation_space", None) or getattr(env, "observation_space", None)
        if space is None:  # as the TypeError below: no space, no size to check
            return
        try:
            shape = space["sensor_data"][camera]["rgb"].shape  # [(N,) H, W, 3]
        except (KeyError, TypeError, IndexError):
            return
        sizes = {camera: (shape[-2], shape[-3])}
        fix = "create the env with sensor_configs=dict(width=..., height=...) of at most that"
    for name, (width, height) in sizes.items():
        if max(int(width), int(height)) > MAX_FRAME_SIDE:
            raise ValueError(f"camera {name!r} makes {width}x{height} frames, larger than the {MAX_FRAME_SIDE} pixels "
                             f"a side H.264 (libx264) encodes; {fix}, or pass save_video=False")


def check_video_options(save_video: bool, video_source: str, render_mode: str | None, env: Any) -> None:
    """The video options against the env, before the run directory is made: a render mode that makes no
    image (`fastrecord.envs.IMAGE_RENDER_MODES`), a camera name the env lacks (`check_video_source`), frame
    sides H.264 cannot encode (`check_frame_sides`)."""
    from fastrecord.envs import IMAGE_RENDER_MODES

    if save_video and video_source == "render" and render_mode not in IMAGE_RENDER_MODES:
        raise ValueError(
            f"Render mode is {render_mode!r}, which cannot make videos. Create the env with "
            f"render_mode='rgb_array' (or one of {IMAGE_RENDER_MODES}), pass video_source='sensor:<camera>', "
            f"or set save_video=False."
        )
    check_video_source(video_source, env)
    if save_video:
        check_frame_sides(video_source, env)
