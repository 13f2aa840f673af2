"""Output sinks: where finished episodes go.

- `base`: the `Sink` interface (and `BackgroundSink` for writers on background threads) and
  `RunDirectory`, the one owner of a run's files (lock, error/overwrite/resume, manifest).
- `factory`: `build_sinks`, a recorder's sinks made from its options.
- `maniskill_h5`: ManiSkill's trajectory format, writer and reader (`ManiSkillH5Sink`).
- `mp4`: per-env or tiled MP4 videos (`Mp4Sink`); `video_names`: the rule that names them.
- `results`: ``NAME.results.jsonl``, one row per finished episode, kept or not (`ResultsSink`).
- `loggers`: TensorBoard and Weights & Biases (`TensorBoardSink`, `WandbSink`).

A sink receives every kept episode (`fastrecord.episode.EpisodeData`, ``submit``) and the outcome of
every finished episode, kept or not (`fastrecord.episode.EpisodeEnded`, ``episodes_ended``). A new output
format is a new module here with a `Sink` subclass; pass instances to the wrapper:
``RecordEpisode(env, "out", sinks=[MySink()])``.
"""

from fastrecord.episode import EpisodeData, EpisodeEnded
from fastrecord.sinks.base import BackgroundSink, OutputExistsError, RunDirectory, Sink
from fastrecord.sinks.factory import RecorderSinks, build_sinks

__all__ = [
    "BackgroundSink",
    "EpisodeData",
    "EpisodeEnded",
    "OutputExistsError",
    "RecorderSinks",
    "RunDirectory",
    "Sink",
    "build_sinks",
]
