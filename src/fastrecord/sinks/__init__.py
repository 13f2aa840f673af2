"""Output sinks: where finished episodes go.

- `base`: the `Sink` interface (and `BackgroundSink` for writers on background threads) and
  `RunDirectory`, the one owner of a run's files (lock, error/overwrite/resume, manifest).
- `maniskill_h5`: ManiSkill's trajectory format, writer and reader (`ManiSkillH5Sink`).
- `mp4`: per-env or tiled MP4 videos (`Mp4Sink`).
- `results`: ``NAME.results.jsonl``, one row per finished episode, kept or not (`ResultsSink`).
- `loggers`: TensorBoard and Weights & Biases (`TensorBoardSink`, `WandbSink`).

A new output format is a new module here with a `Sink` subclass; pass instances to the wrapper:
``RecordEpisode(env, "out", sinks=[MySink()])``.
"""

from fastrecord.sinks.base import BackgroundSink, OutputExistsError, RunDirectory, Sink

__all__ = ["BackgroundSink", "OutputExistsError", "RunDirectory", "Sink"]
