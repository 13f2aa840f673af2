"""Output sinks: where finished episodes go (ManiSkill trajectory files, MP4 videos, your own)."""
