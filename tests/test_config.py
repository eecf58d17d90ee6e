"""Configs: every shipped YAML loads, overrides apply, and bad keys/values give errors that name them."""

import math
import re
import shlex
from pathlib import Path

import pytest

from jobs.cli import build_parser
from pipeline.config.schema import describe, field_docs, to_dict
from pipeline.config.sections import PipelineConfig, load_config
from pipeline.config.stages import CountConfig, EvaluateConfig, GenerateConfig
from pipeline.errors import DrafterError

CONFIGS = sorted(Path(__file__).resolve().parents[1].joinpath("configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_yaml_loads_and_says_how_to_run_it(path: Path) -> None:
    cfg = load_config(path)
    assert isinstance(cfg, PipelineConfig)
    lines = path.read_text().splitlines()
    header = lines[: next(i for i, x in enumerate(lines) if not x.startswith("#"))]
    assert header, f"{path.name} must begin with a comment"
    commands = [shlex.split(m.group(0)) for line in header
                for m in re.finditer(r"drafter \S+ --config \S+", line)]
    assert commands, f"{path.name} must say in its header which drafter command runs it"
    subcommands = build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001
    for argv in commands:
        assert argv[1] in subcommands and argv[3] == f"configs/{path.name}", argv


def test_defaults_are_the_tiny_setup() -> None:
    assert load_config(None).target.model.startswith("tiny:")
    assert len(CONFIGS) >= 2


def test_dotted_overrides_with_yaml_values() -> None:
    cfg = load_config(None, ["generate.max_new_tokens=64", "count.top_k=[8, 16]", "target.revision=abc",
                             "generate.limit=null", "mlflow.timeout_s=2"])
    assert cfg.generate.max_new_tokens == 64
    assert cfg.count.top_k == [8, 16]
    assert cfg.target.revision == "abc"
    assert cfg.generate.limit is None
    assert cfg.mlflow.timeout_s == 2.0 and isinstance(cfg.mlflow.timeout_s, float)


def test_unknown_key_names_the_key_and_the_valid_ones(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("generate:\n  max_new_tokenz: 5\n")
    with pytest.raises(DrafterError) as err:
        load_config(path)
    msg = str(err.value)
    assert "generate.max_new_tokenz" in msg and "max_new_tokens" in msg
    with pytest.raises(DrafterError, match="wrokdir"):
        load_config(None, ["wrokdir=x"])


def test_wrong_types_and_values_are_rejected() -> None:
    with pytest.raises(DrafterError, match="generate.max_new_tokens"):
        load_config(None, ["generate.max_new_tokens=lots"])
    with pytest.raises(DrafterError, match="generate.kind"):
        load_config(None, ["generate.kind=magic"])
    with pytest.raises(DrafterError, match="generate.drafter"):
        load_config(None, ["generate.kind=drafter"])
    with pytest.raises(DrafterError, match="count.top_p"):
        load_config(None, ["count.top_p=[1.5]"])
    with pytest.raises(DrafterError, match="not valid YAML|mapping"):
        load_config(None, ["target=5"])


@pytest.mark.parametrize("override", [
    "generate.temperature=.inf", "evaluate.temperature=nan", "evaluate.top_p=.nan", "generate.top_p=-.inf",
    "train_drafter.train.lr=inf", "train_drafter.train.betas=[0.9, .nan]", "estimate_rdk.taus=[1e-2, .inf]",
    "evaluate.gate_tau_min=.nan", "evaluate.gate_speed_min=-.inf", "mlflow.timeout_s=.inf",
    "train_drafter.features_disk_limit_gb=1e400",
])
def test_non_finite_numbers_are_refused_naming_the_key(override: str) -> None:
    """nan fails every comparison and inf passes `> 0`: range checks alone let them through (an infinite
    temperature turns logits into nan)."""
    key = override.split("=")[0]
    with pytest.raises(DrafterError, match=rf"Invalid value for {re.escape(key)}(\[\d\])?\.\n  expected: a finite number"):
        load_config(None, [override])


def test_sampling_and_draft_length_ranges() -> None:
    with pytest.raises(DrafterError, match="evaluate.top_p"):
        load_config(None, ["evaluate.top_p=0"])
    with pytest.raises(DrafterError, match="evaluate.top_p"):
        load_config(None, ["evaluate.top_p=1.5"])
    with pytest.raises(DrafterError, match=r"evaluate.gammas.*to 64"):
        load_config(None, ["evaluate.gammas=[4, 65]"])
    assert load_config(None, ["evaluate.gammas=[1, 64]"]).evaluate.gammas == [1, 64]
    with pytest.raises(DrafterError, match="evaluate.temperature"):
        EvaluateConfig(temperature=math.inf)  # built directly, not through YAML
    with pytest.raises(DrafterError, match="generate.temperature"):
        GenerateConfig(temperature=math.inf)


def test_missing_config_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DrafterError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_every_field_is_documented() -> None:
    for cls in (PipelineConfig, GenerateConfig, CountConfig):
        docs = field_docs(cls)
        undocumented = [f for f in cls.__dataclass_fields__ if not docs.get(f)]
        assert not undocumented, f"{cls.__name__}: {undocumented}"
    keys = [row[0] for row in describe(PipelineConfig)]
    assert "generate.max_new_tokens" in keys and "target.model" in keys


def test_round_trip_through_plain_data() -> None:
    cfg = load_config(None, ["count.top_k=[3]"])
    again = load_config(None, [f"{k}={v}" for k, v in _flat(to_dict(cfg)).items()])
    assert to_dict(again) == to_dict(cfg)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = "null" if v is None else v
    return out


def test_malformed_yaml_file_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("generate:\n  limit: 5\n count: [1, 2\n")
    with pytest.raises(DrafterError) as err:
        load_config(path)
    assert "broken.yaml" in str(err.value) and "line 3" in str(err.value)
