"""The MLflow Model Registry side of the pipeline: gated registration of bundles and verified pulls.

``register`` turns a bundle that passed its gates into a model version (tags carry the verdict, metrics,
component ids and fingerprint; the aliases ``candidate``/``champion`` are the commit point) and
``pull`` gives a serving engineer a bundle only after every file and fingerprint has been checked.
``bundle`` owns the on-disk format, ``store`` the connection and tag names.
"""

from pipeline.registry.bundle import (
    Bundle,
    bundle_sha256,
    read_bundle_json,
    registered_name,
    verify_bundle,
    write_bundle,
)
from pipeline.registry.pull import parse_ref, pull
from pipeline.registry.register import RegistrationResult, register

__all__ = [
    "Bundle",
    "RegistrationResult",
    "bundle_sha256",
    "parse_ref",
    "pull",
    "read_bundle_json",
    "register",
    "registered_name",
    "verify_bundle",
    "write_bundle",
]
