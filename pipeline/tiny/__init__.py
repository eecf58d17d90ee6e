"""Tiny-model kit (docstring to be completed)."""

from pipeline.tiny.build import TinyKit, build_kit, resolve_tiny_ref
from pipeline.tiny.spec import PROFILES, ROLES, default_cache_dir, kit_hash

__all__ = ["PROFILES", "ROLES", "TinyKit", "build_kit", "default_cache_dir", "kit_hash", "resolve_tiny_ref"]
