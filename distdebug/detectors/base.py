"""The detector interface as a plugin sees it: ``from distdebug.detectors.base import Detector, Finding``.

The class lives in ``distdebug.runtime.detector`` (the session, which runs detectors, sits below this
package and imports nothing from above it); this module is its stable face for detectors, plugins and faults.
"""

from __future__ import annotations

from distdebug.runtime.detector import Detector, Finding, RankContext, Severity, StepEvent

__all__ = ["Detector", "Finding", "RankContext", "Severity", "StepEvent"]
