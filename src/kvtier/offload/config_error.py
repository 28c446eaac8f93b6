"""The error every invalid offload configuration value raises."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key and the value."""
