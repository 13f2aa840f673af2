"""fastrecord: record ManiSkill episodes (trajectories + per-env MP4s) at encoder speed.

    from fastrecord import RecordEpisode      # drop-in for mani_skill.utils.wrappers.RecordEpisode
    env = RecordEpisode(env, "videos", keep="success")
"""

from fastrecord.buffer import BufferTooLargeError, EpisodeBuffer
from fastrecord.make_env import make_eval_envs
from fastrecord.record import RecordEpisode, RecordVectorEpisode
from fastrecord.workers import WorkerError

__all__ = ["RecordEpisode", "RecordVectorEpisode", "make_eval_envs", "EpisodeBuffer", "BufferTooLargeError", "WorkerError"]
__version__ = "0.1.0"
