"""The drafter pipeline library: artifacts, configs, data, models, counting, tracking and the
speculative-decoding engine. Stage recipes live in ``jobs/`` and may import this package; this package
never imports ``jobs/``."""

__version__ = "0.1.0"
