"""Video encoding: PyAV settings and encode/decode (`encode`), encoder processes (`pool`).

A new encoder backend is a module here. This package imports only numpy, PyAV and
`fastrecord.staging`: encoder processes import it without torch or ManiSkill.
"""

from fastrecord.video.encode import (
    EncoderError,
    VideoSettings,
    check_video_settings,
    codec_available,
    decode_mp4,
    encode_mp4,
    resolve_codec,
)
from fastrecord.video.pool import EncoderProcessPool, EncoderStats, default_encoder_pool

__all__ = [
    "EncoderError", "EncoderProcessPool", "EncoderStats", "VideoSettings", "check_video_settings", "codec_available", "decode_mp4",
    "default_encoder_pool", "encode_mp4", "resolve_codec",
]
