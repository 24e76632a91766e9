"""Detectors: one module each, registered by name in ``registry``."""
