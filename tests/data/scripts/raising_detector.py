"""A user detector (plugin) that raises at step 2: the harness must switch it off, not the training."""

from distdebug.detectors.base import Detector


class Boom(Detector):
    name = "boom"
    description = "raises on purpose"

    def on_step(self, event):
        if event.step == 2:
            raise RuntimeError("detector bug")
        return ()
