"""Plan-time checks of settings against the models (pipeline/orchestration/limits.py): lengths beyond a
model's context and draft lengths beyond EAGLE-3's trained steps are refused by ``plan`` before any work,
naming the keys; only the planned stages are checked; every shipped YAML fits its models.

The tiny kit's ``test`` profile has a 128-token context (384 bytes for ``drafter_bytes``); its refs are
checked from the recipe, so most tests here need no built kit. Those that copy a kit model to give it a
shorter context use the ``tiny_kit`` fixture.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from jobs import generate
from pipeline.artifacts import ArtifactWriter, artifact_id
from pipeline.config.sections import load_config
from pipeline.errors import DrafterError
from pipeline.orchestration import limits
from pipeline.orchestration.dag import STAGE_NAMES, plan
from tests.helpers import hub_cache, offline_hub, small_cfg

ROOT = Path(__file__).resolve().parents[1]


def _short_context_copy(tiny_kit, role: str, dest: Path, positions: int) -> Path:
    """A copy of a kit model whose config.json claims only ``positions`` positions (weights untouched)."""
    shutil.copytree(tiny_kit.path(role), dest)
    config = json.loads((dest / "config.json").read_text())
    config["max_position_embeddings"] = positions
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def test_generate_longer_than_the_target_context_is_refused_before_any_work(tmp_path: Path) -> None:
    # 100 + 64 = 164 > 128: HF generate only warned, and the rows were kept.
    cfg = small_cfg(tmp_path, "generate.max_prompt_tokens=100", "generate.max_new_tokens=64")
    with pytest.raises(DrafterError, match=r"generate\.max_prompt_tokens \+ generate\.max_new_tokens") as err:
        generate.main(cfg)
    assert "128 tokens" in str(err.value) and "Lower generate.max_new_tokens to 28" in str(err.value)
    assert not (tmp_path / "artifacts").exists() and not (tmp_path / "mlflow.db").exists()
    plan(small_cfg(tmp_path, "generate.max_prompt_tokens=100", "generate.max_new_tokens=28"), ["generate"])


def test_raw_rows_are_held_to_the_target_context_too(tmp_path: Path) -> None:
    with pytest.raises(DrafterError, match=r"generate\.max_prompt_tokens \+ generate\.max_new_tokens"):
        plan(small_cfg(tmp_path, "generate.kind=raw", "generate.max_new_tokens=96"), ["count"])


def test_generate_by_a_drafter_is_held_to_its_context(tmp_path: Path, tiny_kit) -> None:
    drafter = _short_context_copy(tiny_kit, "drafter", tmp_path / "short-drafter", 40)
    cfg = small_cfg(tmp_path, "generate.kind=drafter", f"generate.drafter={drafter}")  # 48 + 12 = 60 > 40
    with pytest.raises(DrafterError, match=r"generate\.max_prompt_tokens \+ generate\.max_new_tokens") as err:
        plan(cfg, ["generate"])
    assert "the drafter" in str(err.value) and "40 tokens" in str(err.value)


def test_train_drafter_max_length_beyond_the_target_context_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DrafterError, match=r"Set train_drafter\.max_length to 128 or less"):
        plan(small_cfg(tmp_path, "train_drafter.max_length=256"), ["train_drafter"])
    plan(small_cfg(tmp_path, "train_drafter.max_length=128"), ["train_drafter"])


def test_tapping_the_targets_post_norm_state_is_refused_before_training(tmp_path: Path) -> None:
    """The last layer's output (HF hidden_states[L]) is taken after the final norm: no server hands it to a drafter.
    EAGLE-3's export refused it after training; DFlash's trained and exported it. Both are now refused by plan."""
    with pytest.raises(DrafterError, match=r"aux_layer_ids(.|\n)*\[0, 2\](.|\n)*3-layer target"):
        plan(small_cfg(tmp_path, "train_drafter.aux_layer_ids=[0,1,3]"), ["train_drafter"])
    plan(small_cfg(tmp_path, "train_drafter.aux_layer_ids=[0,1,2]"), ["train_drafter"])
    with pytest.raises(DrafterError, match=r"\[0, 1\](.|\n)*no server captures(.|\n)*\[0, 2\] for a 3-layer target"):
        plan(small_cfg(tmp_path, "train_dflash.target_layer_ids=[0,2]"), ["train_dflash"])
    plan(small_cfg(tmp_path, "train_dflash.target_layer_ids=[0,1]"), ["train_dflash"])


@pytest.mark.parametrize("stage", ["train_router", "estimate_rdk"])
def test_the_drafters_reading_calibration_rows_are_held_to_their_context(stage: str, tmp_path: Path,
                                                                        tiny_kit) -> None:
    """train_router runs cluster.drafter and estimate_rdk runs evaluate.drafter over calibration rows; nothing held
    those rows to the drafter's context (which can be shorter than the target's), so positions past it were
    extrapolated without a word. The rows are as long as generate makes them (48 + 12 = 60 here) or max_length."""
    short = _short_context_copy(tiny_kit, "drafter", tmp_path / "short-drafter", 40)
    key = "cluster.drafter" if stage == "train_router" else "evaluate.drafter"
    with pytest.raises(DrafterError, match=r"the calibration rows \(generate.max_prompt_tokens \+ generate.max_new_"
                                           rf"tokens\) \(60\) is longer than the context of the drafter .*\({key}\)"):
        plan(small_cfg(tmp_path, f"{key}={short}"), [stage])
    with pytest.raises(DrafterError, match=rf"{stage}.max_length \(32\) is longer(.|\n)*32 tokens"):
        plan(small_cfg(tmp_path, f"{key}={_short_context_copy(tiny_kit, 'drafter', tmp_path / 'd2', 30)}",
                       f"{stage}.max_length=32"), [stage])
    plan(small_cfg(tmp_path, f"{key}={short}", f"{stage}.max_length=40"), [stage])


def test_evaluate_needs_room_for_a_verify_forward(tmp_path: Path) -> None:
    base = ["evaluate.methods=[full]", "evaluate.max_new_tokens=24", "evaluate.gammas=[2,4]"]
    with pytest.raises(DrafterError, match=r"evaluate\.max_prompt_tokens \+ evaluate\.max_new_tokens \+ "
                                           r"max\(evaluate\.gammas\) \+ 1") as err:
        plan(small_cfg(tmp_path, *base, "evaluate.max_prompt_tokens=100"), ["evaluate"])  # 100 + 24 + 4 + 1 = 129
    assert "129 tokens" in str(err.value) and "the target" in str(err.value)
    plan(small_cfg(tmp_path, *base, "evaluate.max_prompt_tokens=99"), ["evaluate"])  # 128: fits exactly


@pytest.mark.parametrize("role", ["drafter", "drafter_other"])
def test_evaluate_is_held_to_each_drafters_context(role: str, tmp_path: Path, tiny_kit) -> None:
    short = _short_context_copy(tiny_kit, role, tmp_path / f"short-{role}", 64)
    method = "full" if role == "drafter" else "slem"
    cfg = small_cfg(tmp_path, f"evaluate.{role}={short}", f"evaluate.methods=[{method}]")  # 64 + 32 + 4 + 1 > 64
    with pytest.raises(DrafterError, match=rf"the {role} .*short-{role}") as err:
        plan(cfg, ["evaluate"])
    assert f"evaluate.{role} with a longer context" in str(err.value)


def test_evaluate_is_held_to_the_byte_drafters_context_in_bytes(tmp_path: Path) -> None:
    # At least 1 byte per target token plus gamma x lookahead drafted bytes: 64 + 32 + 4 x 80 = 416 > 384.
    byte_only = ["evaluate.methods=[slrs,slem_bytes]", "evaluate.slrs_byte_top_k=1"]
    with pytest.raises(DrafterError, match=r"drafter_bytes tiny:test/drafter_bytes") as err:
        plan(small_cfg(tmp_path, *byte_only, "evaluate.slrs_lookahead=80"), ["evaluate"])
    assert "64 + 32 + 320 = 416 bytes" in str(err.value) and "<= 384 bytes" in str(err.value) and "slrs, slem_bytes" in str(err.value)
    plan(small_cfg(tmp_path, *byte_only, "evaluate.slrs_lookahead=72"), ["evaluate"])  # 64 + 32 + 288 = 384


def test_gammas_beyond_eagle3s_trained_steps_are_refused(tmp_path: Path) -> None:
    eagle = ["evaluate.methods=[eagle3]", "evaluate.max_new_tokens=16", "train_drafter.ttt_steps=7"]
    with pytest.raises(DrafterError, match=r"every evaluate\.gammas entry <= 7 \(train_drafter\.ttt_steps") as err:
        plan(small_cfg(tmp_path, *eagle, "evaluate.gammas=[4,8]"), ["evaluate"])
    assert "train_drafter.ttt_steps=8" in str(err.value)
    plan(small_cfg(tmp_path, *eagle, "evaluate.gammas=[4,7]"), ["evaluate"])
    # Without method eagle3 the drafter is not used, so its steps do not bound gamma.
    plan(small_cfg(tmp_path, "evaluate.methods=[full]", "evaluate.max_new_tokens=16", "evaluate.gammas=[8]"),
         ["evaluate"])


def test_a_named_eagle3_artifacts_own_steps_bound_gamma(tmp_path: Path) -> None:
    config = {"train_drafter": {"ttt_steps": 3}}
    aid = artifact_id("train_drafter", config, [], None)
    writer = ArtifactWriter(tmp_path / "store", aid, kind="eagle3_drafter", stage="train_drafter", config=config,
                            inputs=[], fingerprint=None)
    (writer.tmp / "config.json").write_text("{}")  # an artifact holds at least one payload
    named = writer.commit().path
    cfg = small_cfg(tmp_path, "evaluate.methods=[eagle3]", f"evaluate.eagle3={named}", "evaluate.gammas=[4]",
                    "train_drafter.ttt_steps=7")
    with pytest.raises(DrafterError, match=r"<= 3 \(ttt_steps of the artifact"):
        plan(cfg, ["evaluate"])


def test_only_planned_stages_are_checked(tmp_path: Path) -> None:
    cfg = small_cfg(tmp_path, "evaluate.max_prompt_tokens=128", "train_drafter.max_length=4096",
                    "evaluate.methods=[full]")
    assert set(plan(cfg, ["count"]).stages) == {"generate", "count"}
    with pytest.raises(DrafterError, match=r"train_drafter\.max_length"):
        plan(cfg, ["train_drafter"])
    with pytest.raises(DrafterError, match=r"evaluate\.max_prompt_tokens"):
        plan(cfg, ["evaluate"])  # without eagle3, evaluate does not read train_drafter


@pytest.mark.parametrize("config", ["null", '{"model_type": "llama", "num_hidden_layers": "4"}'],
                         ids=["null", "a-string-field"])
def test_a_local_config_json_that_does_not_load_is_refused_at_plan_time_naming_it(tmp_path: Path, tiny_kit,
                                                                                  config: str) -> None:
    """A config.json that is `null` raised a raw TypeError, one whose num_hidden_layers is a string huggingface_hub's
    StrictDataclassFieldValidationError, from plan's reads of the context and depth and from the checkpoint's dtype."""
    from pipeline.config.sections import TargetConfig
    from pipeline.models.context import _text_config, context_length, depth
    from pipeline.models.target import Target

    target = tmp_path / "local"
    shutil.copytree(tiny_kit.path("target"), target)
    (target / "config.json").write_text(config)
    _text_config.cache_clear()
    for read in (lambda: context_length(str(target)), lambda: depth(str(target)),
                 lambda: Target(TargetConfig(model=str(target))).checkpoint_dtype()):
        with pytest.raises(DrafterError, match="its config.json does not load") as err:
            read()
        assert str(target / "config.json") in err.value.found and "copy or save the checkpoint again" in err.value.fix
    with pytest.raises(DrafterError, match=f"Could not (load|read the config of) '{target}'"):  # plan: one of these
        plan(small_cfg(tmp_path / "work", f"target.model={target}"), ["generate"])


def test_the_recipe_context_is_the_built_kits(tiny_kit) -> None:
    """Planning reads a tiny ref's context from the recipe; the built models say the same."""
    from transformers import AutoConfig

    from pipeline.models.context import context_length, depth

    for role in ("target", "drafter", "drafter_other", "drafter_bytes"):
        built = AutoConfig.from_pretrained(tiny_kit.path(role)).max_position_embeddings
        assert context_length(f"tiny:test/{role}") == built, role
        assert context_length(str(tiny_kit.path(role))) == built, role
        layers = AutoConfig.from_pretrained(tiny_kit.path(role)).num_hidden_layers
        assert depth(f"tiny:test/{role}") == layers == depth(str(tiny_kit.path(role))), role


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_every_shipped_yaml_fits_its_models(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            tiny_kit) -> None:
    """Every stage of every shipped YAML passes the plan-time checks. The hub models' configs come from a Hugging Face
    cache holding their published model_type and max_position_embeddings, read offline through the real loaders
    (the hub is not reachable from tests), beside the kit's tokenizer (its chat template's overhead is checked)."""
    published = {"meta-llama/Meta-Llama-3-8B-Instruct": ("llama", 8192),
                 "meta-llama/Llama-3.2-1B-Instruct": ("llama", 131072), "Qwen/Qwen2.5-0.5B-Instruct": ("qwen2", 32768)}
    for model, (model_type, positions) in published.items():
        files = tmp_path / "files" / model
        files.mkdir(parents=True)
        (files / "config.json").write_text(json.dumps({"model_type": model_type,
                                                       "max_position_embeddings": positions}))
        for tokenizer_file in tiny_kit.path("target").iterdir():
            if tokenizer_file.name not in ("config.json", "model.safetensors", "generation_config.json"):
                shutil.copy(tokenizer_file, files / tokenizer_file.name)
        hub_cache(tmp_path / "hub", model, {"c" * 40: files})
        (tmp_path / "hub" / f"models--{model.replace('/', '--')}" / "refs" / "main").write_text("c" * 40)
    offline_hub(tmp_path / "hub", monkeypatch)
    cfg = load_config(ROOT / "configs" / name)
    limits.check_settings(cfg, STAGE_NAMES, {})


def test_shortlist_methods_without_shortlists_are_refused_at_plan_time(tmp_path: Path) -> None:
    """The methods that draft over named shortlists (asked of the registry, not listed here) need at least one."""
    with pytest.raises(DrafterError, match="at least one shortlist name when method shortlist is on"):
        plan(small_cfg(tmp_path, "evaluate.methods=[full,shortlist]", "evaluate.shortlists=[]"), ["evaluate"])
    plan(small_cfg(tmp_path, "evaluate.methods=[full]", "evaluate.shortlists=[]"), ["evaluate"])


def test_shortlist_names_count_will_not_build_are_refused_at_plan_time(tmp_path: Path) -> None:
    """``evaluate.shortlists=top_k_16,top_k_64`` (one name holding a comma) or a typo planned, and evaluate found it
    only after every trainer. The helpers' count builds top_k_16, top_k_64, top_p_0.9 and min_count_2."""
    with pytest.raises(DrafterError, match=r"evaluate.shortlists names shortlists count will not build: "
                                           r"'top_k_16,top_k_64'\.\n.*'top_k_16', 'top_k_64', 'top_p_0.9', 'min_count_2'"):
        plan(small_cfg(tmp_path, "evaluate.methods=[shortlist]", "evaluate.shortlists=top_k_16,top_k_64"),
             ["evaluate"])
    with pytest.raises(DrafterError, match=r"evaluate.dynaspec_match names shortlists count will not build: 'top_k_6'"):
        plan(small_cfg(tmp_path, "evaluate.methods=[pa_fr]", "evaluate.dynaspec_match=top_k_6"), ["evaluate"])
    # read only by the methods that use them; a count artifact named in evaluate.counts is checked when read
    plan(small_cfg(tmp_path, "evaluate.methods=[full]", "evaluate.shortlists=[top_k_6]",
                   "evaluate.dynaspec_match=top_k_6"), ["evaluate"])
    plan(small_cfg(tmp_path, "evaluate.methods=[shortlist]", "evaluate.shortlists=[top_k_64,top_p_0.9]"),
         ["evaluate"])


def test_chat_with_nothing_held_out_is_refused_at_plan_and_a_short_held_out_share_is_said(tmp_path: Path,
                                                                                         tiny_kit) -> None:
    """generate.heldout_fraction=0 with the chat task planned, and failed only in evaluate, after every trainer. A
    held-out share with fewer chats than evaluate.prompts_per_task was cut silently: the gates were decided on
    those few, and the evaluation now says how many."""
    from pipeline.evaluation.matrix import eval_prompts
    from pipeline.models.target import Target

    with pytest.raises(DrafterError, match=r"evaluate.tasks has chat, but generate.heldout_fraction is 0"):
        plan(small_cfg(tmp_path, "generate.heldout_fraction=0"), ["evaluate"])
    plan(small_cfg(tmp_path, "generate.heldout_fraction=0", "evaluate.tasks=[code]"), ["evaluate"])
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [{"from": "human", "value": f"Question {i}?"}]})
                              + "\n" for i in range(40)))
    cfg = small_cfg(tmp_path, f"generate.source={source}", "generate.heldout_fraction=0.25", "evaluate.tasks=[chat]",
                    "evaluate.prompts_per_task=40")
    said: list[str] = []
    prompts = eval_prompts(cfg, Target(cfg.target).tokenizer(), said.append)
    assert 0 < len(prompts["chat"]) < 40
    assert said == [f"evaluate: {len(prompts['chat'])} chat prompts, not evaluate.prompts_per_task=40: the held-out "
                    "share holds no more (raise generate.heldout_fraction for more)"]


def test_a_prompt_budget_the_chat_template_fills_is_refused_at_plan_time(tmp_path: Path, tiny_kit) -> None:
    """evaluate.max_prompt_tokens at or below the chat template's own tokens (12 around a user turn for the kit's
    ChatML) was refused only when evaluate encoded its prompts, after every trainer had run. plan now refuses it
    where it loads the tokenizer already (a local or hub one; a tiny-kit ref is never loaded to plan: its stages
    check), for generate's prompts too, but not for generate.kind=raw, which templates none."""
    target = tiny_kit.path("target")  # the kit's target as a local checkpoint
    base = (f"target.model={target}", "evaluate.methods=[full]")
    for key, stage in (("evaluate.max_prompt_tokens", "evaluate"), ("generate.max_prompt_tokens", "generate")):
        with pytest.raises(DrafterError, match=rf"{key}=12 leaves no room for the user's text under .*chat template"):
            plan(small_cfg(tmp_path, *base, f"{key}=12"), [stage])
    with pytest.raises(DrafterError, match="leaves no room") as err:
        plan(small_cfg(tmp_path, *base, "evaluate.max_prompt_tokens=4"), ["evaluate"])
    assert "of at least 13" in err.value.expected
    plan(small_cfg(tmp_path, *base, "evaluate.max_prompt_tokens=13", "generate.max_prompt_tokens=13"), ["evaluate"])
    plan(small_cfg(tmp_path, *base, "generate.kind=raw", "generate.max_prompt_tokens=12"), ["generate"])
    plan(small_cfg(tmp_path, *base, "evaluate.max_prompt_tokens=12"), ["count"])  # evaluate not planned
