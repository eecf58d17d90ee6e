"""Registry test fixtures shared by tests/test_registry.py, tests/test_registry_refs.py and
tests/test_registry_pull.py: a target fingerprint, passing gates, a tracking config, small real component
artifacts, a bundle of them, and where a server stores a version's bundle."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from pipeline.artifacts import Artifact, ArtifactStore, artifact_id
from pipeline.config.sections import MlflowConfig
from pipeline.registry import Bundle

FP = {"model": "org/target", "revision": "r1", "vocab_hash": "v" * 64, "vocab_size": 320}
PASSED = {"passed": True, "checks": {"lossless": {"passed": True}, "speedup": {"passed": True, "min": 1.0}}}


def registry_cfg(uri: str | None) -> MlflowConfig:
    return MlflowConfig(tracking_uri=uri, experiment="registry-tests", retries=2, timeout_s=2.0)


def make_components(root: Path, fp: dict = FP, seed: int = 0) -> list[Artifact]:
    """A count artifact (safetensors + JSON) and a drafter artifact (safetensors) for target ``fp``."""
    store = ArtifactStore(root / "artifacts")
    rng = np.random.default_rng(seed)
    out = []
    for stage, kind in (("count", "token_counts"), ("train_drafter", "drafter")):
        config = {"seed": seed}
        writer = store.writer(
            artifact_id(stage, config, [], fp),
            kind=kind,
            stage=stage,
            config=config,
            inputs=[],
            fingerprint=fp,
        )
        save_file(
            {"weight": rng.standard_normal((16, 8)).astype(np.float32)},
            str(writer.tmp / "weights.safetensors"),
        )
        (writer.tmp / "info.json").write_text(json.dumps({"kind": kind, "rows": 16}))
        out.append(writer.commit())
    return out


def make_bundle(name: str, components: list[Artifact], tau: float, **extra) -> Bundle:
    fields = {
        "metrics": {"tau": tau, "speedup": tau / 2, "acceptance_rate": 0.5},
        "primary_metric": "tau",
        "gates": PASSED,
        "fingerprint": FP,
        **extra,
    }
    return Bundle(name=name, artifacts=components, **fields)


def stored_copy(server: object, source: str) -> Path:
    """Where the test server keeps a version's bundle: mlflow-artifacts:/<path> lives under its root/artifacts."""
    assert source.startswith("mlflow-artifacts:/")
    return server.root / "artifacts" / source.removeprefix("mlflow-artifacts:/")
