"""A user detector (plugin) that raises at a step (2 unless told): the harness must switch it off, not the
training. Its option comes from the command line: --detector-option Boom.at_step=N."""

from dataclasses import dataclass

from distdebug.detectors.base import Detector


@dataclass(kw_only=True)
class BoomConfig:
    at_step: int = 2
    """The step whose boundary raises."""


class Boom(Detector):
    name = "boom"
    description = "raises on purpose"
    Config = BoomConfig

    def __init__(self, config=None):
        self.config = config or BoomConfig()

    def on_step(self, event):
        if event.step == self.config.at_step:
            raise RuntimeError("detector bug")
        return ()
