"""Video: PyAV settings and encode/decode in this process (`encode`), encoder processes and `encode_mp4`
(`pool`), frame transforms such as RGB to yuv420p on the GPU (`yuv`), the info overlay (`overlay`).

A new encoder backend or frame transform is a module here. This package imports only numpy, PyAV,
`fastrecord.staging` and `fastrecord.processes` (torch lazily): encoder processes import it without
torch or ManiSkill.
"""

from fastrecord.video.encode import (
    EncoderError,
    VideoSettings,
    check_video_settings,
    codec_available,
    decode_mp4,
    resolve_codec,
)
from fastrecord.video.pool import EncoderProcessPool, EncoderStats, default_encoder_pool, encode_mp4
from fastrecord.video.yuv import YUV420P, Yuv420Frames, rgb_to_yuv420p

__all__ = [
    "EncoderError",
    "EncoderProcessPool",
    "EncoderStats",
    "VideoSettings",
    "YUV420P",
    "Yuv420Frames",
    "check_video_settings",
    "codec_available",
    "decode_mp4",
    "default_encoder_pool",
    "encode_mp4",
    "resolve_codec",
    "rgb_to_yuv420p",
]
