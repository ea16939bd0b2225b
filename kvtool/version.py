"""The package version, at the base layer so any module (benchmark records, skill block metadata) can read it."""

__version__ = "0.1.0"
