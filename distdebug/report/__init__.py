"""Presentation: the only place that imports rich."""
