"""fastrecord: record ManiSkill episodes (trajectories + per-env MP4s) at encoder speed.

    from fastrecord import RecordEpisode      # drop-in for mani_skill.utils.wrappers.RecordEpisode
    env = RecordEpisode(env, "videos", keep="success")
"""

from fastrecord.buffer import BufferTooLargeError, EpisodeBuffer
from fastrecord.make_env import make_eval_envs
from fastrecord.options import RecordOptions
from fastrecord.record import RecordEpisode, RecordVectorEpisode
from fastrecord.sinks import BackgroundSink, OutputExistsError, Sink
from fastrecord.workers import WorkerError

__all__ = ["RecordEpisode", "RecordVectorEpisode", "RecordOptions", "make_eval_envs", "Sink", "BackgroundSink",
           "EpisodeBuffer", "BufferTooLargeError", "OutputExistsError", "WorkerError"]
__version__ = "0.1.0"
