"""Artifact ids see the weights: a local checkpoint's files, a hub model's commit, the tiny kit's recorded hashes.

Before, a target's fingerprint was its name, revision and vocabulary: retraining a local target in place and
rerunning gave a cache hit on stale artifacts, and a damaged tiny kit published different data under the clean id.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from jobs import generate
from pipeline import hub
from pipeline.checksums import StatCache
from pipeline.errors import DrafterError
from pipeline.models import loading
from pipeline.orchestration.dag import plan
from tests.helpers import hub_cache, offline_hub, small_cfg

READS_TARGET = {"generate", "count", "train_drafter", "cluster", "train_router", "estimate_rdk", "evaluate"}


def _copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _perturb_in_place(directory: Path) -> None:
    """Retrain in place, as far as the files can tell: one weight moves, save_pretrained overwrites."""
    import torch

    model = loading.load_model(str(directory))
    with torch.no_grad():
        next(model.parameters())[0, 0] += 0.5
    model.save_pretrained(str(directory))


def test_retraining_a_local_target_in_place_changes_every_id_that_reads_it(tmp_path: Path, tiny_kit) -> None:
    target = _copy_model(tiny_kit.path("target"), tmp_path / "my-target")
    cfg = small_cfg(tmp_path, f"target.model={target}")
    before = {name: step.id for name, step in plan(cfg).stages.items()}
    assert plan(cfg).stages["generate"].fingerprint["weights"].startswith("sha256:")
    _perturb_in_place(target)
    after = {name: step.id for name, step in plan(cfg).stages.items()}
    # every stage's artifact is stamped with the target's fingerprint
    assert {name for name in before if before[name] != after[name]} == READS_TARGET


def test_retraining_the_other_tokenizer_drafter_in_place_changes_estimate_rdks_id(tmp_path: Path, tiny_kit) -> None:
    """estimate_rdk's held-out analysis, which picks τ and the prior weight, runs evaluate.drafter_other: its
    fingerprint is in the stage's id, so a drafter_other retrained in place (one weight moves) rebuilds estimate_rdk
    instead of reusing a τ chosen with the old weights."""
    other = _copy_model(tiny_kit.path("drafter_other"), tmp_path / "my-other")
    cfg = small_cfg(tmp_path, f"evaluate.drafter_other={other}")
    before = plan(cfg, ["estimate_rdk"])["estimate_rdk"]
    _perturb_in_place(other)
    after = plan(cfg, ["estimate_rdk"])["estimate_rdk"]
    assert after.id != before.id
    assert after.config["models"]["drafter_other"] == loading.fingerprint(str(other))


def test_the_stat_cache_hashes_a_checkpoint_once_until_a_file_changes(tmp_path: Path, tiny_kit) -> None:
    target = _copy_model(tiny_kit.path("target"), tmp_path / "ckpt")
    cache = StatCache(tmp_path / "stat.json")
    first = loading.local_weights_digest(target, cache)
    assert cache.hashed == 2  # model.safetensors and config.json
    again = StatCache(tmp_path / "stat.json")  # a new process: the cache is on disk
    assert loading.local_weights_digest(target, again) == first and again.hashed == 0
    weights = target / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # touched: hashed again
    assert loading.local_weights_digest(target, again) == first and again.hashed == 1
    _perturb_in_place(target)
    assert loading.local_weights_digest(target, again) != first


def test_a_local_directory_without_safetensors_is_refused(tmp_path: Path, tiny_kit) -> None:
    target = _copy_model(tiny_kit.path("target"), tmp_path / "bin-only")
    (target / "model.safetensors").rename(target / "pytorch_model.bin")
    with pytest.raises(DrafterError, match="holds no safetensors weights"):
        loading.local_weights_digest(target)


def test_a_hub_models_id_holds_the_commit_its_revision_resolves_to(tmp_path: Path, tiny_kit,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "hub"
    old, new = "a" * 40, "b" * 40
    hub_cache(cache, "org/tiny-target", {old: tiny_kit.path("target"), new: tiny_kit.path("target")})
    offline_hub(cache, monkeypatch)
    (cache / "models--org--tiny-target" / "refs" / "main").write_text(old)
    assert hub.hub_commit("org/tiny-target", None) == old
    (cache / "models--org--tiny-target" / "refs" / "main").write_text(new)
    assert hub.hub_commit("org/tiny-target", None) == new  # main moved on: another commit, another id
    assert hub.hub_commit("org/tiny-target", old) == old  # a pinned commit needs no lookup
    with pytest.raises(DrafterError, match="Pin target.revision") as err:
        hub.hub_commit("org/never-downloaded", "v1.0")
    # the message named "the drafter's" revision, a setting that does not exist (a drafter resolves main)
    assert "a drafter has no revision setting: download it or pass its path" in str(err.value)


def test_a_hub_model_loads_at_the_commit_its_ids_name_though_its_branch_moves_on(
        tmp_path: Path, tiny_kit, monkeypatch: pytest.MonkeyPatch) -> None:
    """The id named the commit main resolved to at planning, but the loaders asked for main again: a download
    between planning and loading put other weights under the planned id, exit 0."""
    import torch
    cache = tmp_path / "hub"
    old, new = "c" * 40, "d" * 40
    hub_cache(cache, "org/moving-target", {old: tiny_kit.path("target"), new: tiny_kit.path("target")})
    _perturb_in_place(cache / "models--org--moving-target" / "snapshots" / new)
    offline_hub(cache, monkeypatch)
    main = cache / "models--org--moving-target" / "refs" / "main"
    main.write_text(old)
    first = {name: tensor.clone() for name, tensor in loading.load_model(str(cache / "models--org--moving-target"
                                                                               / "snapshots" / old)).state_dict().items()}
    assert loading.fingerprint("org/moving-target")["weights"] == f"commit:{old}"
    main.write_text(new)  # a download elsewhere moves main on while this process runs
    loaded = loading.load_model("org/moving-target").state_dict()
    assert all(torch.equal(loaded[name], first[name]) for name in first)  # the planned commit's weights
    assert loading.fingerprint("org/moving-target")["weights"] == f"commit:{old}"
    hub.pinned_commit.cache_clear()  # a new process resolves main afresh, and loads what it names
    loading._fingerprint_cached.cache_clear()
    assert loading.fingerprint("org/moving-target")["weights"] == f"commit:{new}"
    moved = loading.load_model("org/moving-target").state_dict()
    assert not all(torch.equal(moved[name], first[name]) for name in first)


def test_a_hub_tokenizer_of_its_own_names_its_commit_in_the_ids(tmp_path: Path, tiny_kit,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """target.tokenizer=org/tok (a repository of its own) with revision main: a corrected chat template pushed there
    keeps the vocabulary, and the fingerprint held the model's commit and the vocabulary hash only, so generate was a
    cache hit with prompts in the old template. The tokenizer's commit is in the ids now."""
    cache = tmp_path / "hub"
    old, new = "e" * 40, "f" * 40
    hub_cache(cache, "org/tok", {old: tiny_kit.path("target"), new: tiny_kit.path("target")})
    offline_hub(cache, monkeypatch)
    target = _copy_model(tiny_kit.path("target"), tmp_path / "my-target")
    (cache / "models--org--tok" / "refs" / "main").write_text(old)
    before = loading.fingerprint(str(target), tokenizer="org/tok")
    (cache / "models--org--tok" / "refs" / "main").write_text(new)  # the template fix lands on main
    hub.pinned_commit.cache_clear()  # the next process resolves main afresh
    loading._fingerprint_cached.cache_clear()
    after = loading.fingerprint(str(target), tokenizer="org/tok")
    assert before["vocab_hash"] == after["vocab_hash"] and before["files"] != after["files"]


@pytest.mark.parametrize("edit", [
    lambda d: (d / "chat_template.jinja").write_text((d / "chat_template.jinja").read_text().replace(
        "<|im_start|>", "<|im_start|> ", 1)),
    lambda d: (d / "generation_config.json").write_text('{"repetition_penalty": 1.3}'),
], ids=["chat-template-fixed-in-place", "generation-config-edited"])
def test_editing_a_local_targets_loading_files_in_place_changes_every_id_that_reads_it(
        tmp_path: Path, tiny_kit, edit) -> None:
    """The id held the weights and the vocabulary only: a chat template fixed in place kept every id, so the
    calibration set rendered with the old template was a cache hit and the drafters trained on it were registered."""
    target = _copy_model(tiny_kit.path("target"), tmp_path / "my-target")
    cfg = small_cfg(tmp_path, f"target.model={target}")
    before = plan(cfg)
    assert before.stages["generate"].fingerprint["files"].startswith("sha256:")
    moved = plan(small_cfg(tmp_path, f"target.model={_copy_model(target, tmp_path / 'elsewhere' / 'my-target')}"))
    assert moved.stages["generate"].fingerprint["files"] == before.stages["generate"].fingerprint["files"]  # not paths
    edit(target)
    after = plan(cfg)
    assert after.stages["generate"].fingerprint["weights"] == before.stages["generate"].fingerprint["weights"]
    assert {name for name in before.stages if before.stages[name].id != after.stages[name].id} == READS_TARGET


def test_running_a_checkpoints_own_code_changes_every_id_that_reads_the_target(tmp_path: Path, tiny_kit) -> None:
    """``target.trust_remote_code`` is a run setting, but it chooses the implementation of a checkpoint that has
    both a known model_type and an ``auto_map``: the answers of the two are cache hits of each other under one id.
    With it on, the target's fingerprint says so (and with it off nothing changes, so no id of a run without remote
    code moved)."""
    target = _copy_model(tiny_kit.path("target"), tmp_path / "my-target")
    off, on = (plan(small_cfg(tmp_path, f"target.model={target}", f"target.trust_remote_code={flag}"))
               for flag in ("false", "true"))
    assert "remote_code" not in off.stages["generate"].fingerprint
    assert on.stages["generate"].fingerprint["remote_code"] is True
    assert {name for name in off.stages if off.stages[name].id != on.stages[name].id} == READS_TARGET


def test_the_targets_remote_code_setting_never_runs_a_drafters_code(tmp_path: Path, tiny_kit,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``target.trust_remote_code`` reached every drafter the config names: planning read each one's config with it
    on, so a drafter checkpoint's ``auto_map`` code ran, unread and unpinned. Here a drafter whose config class writes
    a marker when imported is named beside a target run with its own code: planning leaves no marker, while reading
    that config with remote code allowed does write it (so the marker would show a run)."""
    from pipeline.models.context import context_length

    marker = tmp_path / "ran"
    monkeypatch.setenv("DRAFTER_TEST_MARKER", str(marker))
    drafter = _copy_model(tiny_kit.path("drafter"), tmp_path / "my-drafter")
    config = json.loads((drafter / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_marked.MarkedConfig"}
    (drafter / "config.json").write_text(json.dumps(config))
    (drafter / "configuration_marked.py").write_text(
        "import os\nimport pathlib\n\nfrom transformers import LlamaConfig\n\n"
        "pathlib.Path(os.environ['DRAFTER_TEST_MARKER']).write_text('ran')\n\n\n"
        "class MarkedConfig(LlamaConfig):\n    pass\n")
    target = _copy_model(tiny_kit.path("target"), tmp_path / "my-target")
    plan(small_cfg(tmp_path, f"target.model={target}", "target.trust_remote_code=true",
                   f"evaluate.drafter={drafter}", f"cluster.drafter={drafter}"))
    assert not marker.exists(), "a drafter's own code ran"
    context_length(str(drafter), None, True)
    assert marker.read_text() == "ran"


def test_a_target_tokenizer_with_more_ids_than_the_models_embedding_is_refused_at_plan(tmp_path: Path,
                                                                                     tiny_kit) -> None:
    """target.tokenizer was never compared with the model: one with more ids than the embedding has rows planned and
    then failed inside generate (an IndexError on a CPU, a device assert on a GPU). Planning now refuses it, naming
    both sizes; a tokenizer with fewer ids (a padded embedding) plans."""
    small = _copy_model(tiny_kit.path("drafter_other"), tmp_path / "small-model")  # 768 embedding rows
    large = _copy_model(tiny_kit.path("target"), tmp_path / "large-tokenizer")  # 1,024 ids
    with pytest.raises(DrafterError, match=r"more token ids than the target model has embeddings(.|\n)*at most 768 "
                                           r"ids(.|\n)*found:    1024 ids"):
        plan(small_cfg(tmp_path, f"target.model={small}", f"target.tokenizer={large}"))
    plan(small_cfg(tmp_path, f"target.model={large}", f"target.tokenizer={small}"))
    # tiny-kit refs (their fingerprint holds no vocabulary size, so plan cannot tell): refused where the target loads,
    # before any work, where generate died on an IndexError
    cfg = small_cfg(tmp_path, "target.model=tiny:test/drafter_other", "target.tokenizer=tiny:test/target")
    with pytest.raises(DrafterError, match=r"more token ids than the target model has embeddings(.|\n)*at most 768 "
                                           r"ids(.|\n)*found:    1024 ids"):
        generate.main(cfg)
    assert not list((tmp_path / "artifacts").glob("generate-*"))


def test_a_tiny_target_with_a_tokenizer_of_its_own_keeps_the_kits_weights_in_its_ids(tmp_path: Path,
                                                                                   tiny_kit) -> None:
    """Only a target whose tokenizer was a tiny ref too got the kit's weights digest: with a tokenizer directory the
    ids held the recipe alone, so kits built into other bytes shared them."""
    from pipeline.tiny import kit_weights

    tokenizer = _copy_model(tiny_kit.path("target"), tmp_path / "tokenizer")
    (tokenizer / "model.safetensors").unlink()
    found = loading.fingerprint("tiny:test/target", tokenizer=str(tokenizer))
    assert found["weights"] == "kit:" + kit_weights("tiny:test/target")
    assert found["files"].startswith("sha256:")  # the tokenizer directory's files


def test_a_tiny_kit_tokenizer_beside_a_local_model_names_the_kits_chat_template(
        tmp_path: Path, tiny_kit, monkeypatch: pytest.MonkeyPatch) -> None:
    """A local target with target.tokenizer=tiny:...: the kit tokenizer's files (chat template, tokenizer config) never
    reached the fingerprint, so a kit rebuilt with another chat template kept every id. The digests its build recorded
    now do; a local model with its own tokenizer holds no tokenizer entry, its id as before."""
    from pipeline.checksums import sha256_file

    target = _copy_model(tiny_kit.path("target"), tmp_path / "local")
    first = loading.fingerprint(str(target), tokenizer="tiny:test/target")
    own = loading.fingerprint(str(target))
    root = tmp_path / "cache" / "tiny" / tiny_kit.root.name
    shutil.copytree(tiny_kit.root, root)
    template = root / "target" / "chat_template.jinja"
    template.write_text("Answer in French.\n" + template.read_text())
    report = json.loads((root / "report.json").read_text())
    report["sha256"]["target/chat_template.jinja"] = sha256_file(template)  # as a rebuild records it
    (root / "report.json").write_text(json.dumps(report))
    monkeypatch.setenv("DRAFTER_CACHE", str(tmp_path / "cache"))
    loading._fingerprint_cached.cache_clear()  # a new process
    rebuilt = loading.fingerprint(str(target), tokenizer="tiny:test/target")
    assert loading.load_tokenizer("tiny:test/target").chat_template.startswith("Answer in French.")
    assert (rebuilt["vocab_hash"], rebuilt["weights"]) == (first["vocab_hash"], first["weights"])
    assert rebuilt["files"] != first["files"]
    assert loading.fingerprint(str(target)) == own


def test_a_damaged_tiny_kit_is_refused_when_loaded(tmp_path: Path, tiny_kit, monkeypatch: pytest.MonkeyPatch) -> None:
    from jobs import generate
    from pipeline.tiny import build_kit

    cache = tmp_path / "cache"
    shutil.copytree(tiny_kit.root, cache / "tiny" / tiny_kit.root.name)
    monkeypatch.setenv("DRAFTER_CACHE", str(cache))
    assert build_kit("test", cache).root == cache / "tiny" / tiny_kit.root.name  # the clean copy loads
    weights = cache / "tiny" / tiny_kit.root.name / "target" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(DrafterError, match=r"not the one that was built: 1 file\(s\) changed \(target/model.safetensors\)"):
        build_kit("test", cache)
    cfg = small_cfg(tmp_path / "work")
    with pytest.raises(DrafterError, match="drafter tiny --profile test --force"):
        generate.main(cfg)
    assert not (tmp_path / "work" / "artifacts").exists() or not any((tmp_path / "work" / "artifacts").glob("generate-*"))


def _built_elsewhere(kit_root: Path, cache: Path) -> Path:
    """The kit as another machine can build it from the same recipe: the same directory name (the recipe hash),
    other bytes in the target's weights, each file's digest recorded in its report as the build records them. (The
    kit trains under bf16 autocast where the CPU multiplies bf16 natively, in float32 elsewhere, with kernels chosen
    per CPU.)"""

    from pipeline.checksums import sha256_file

    root = cache / "tiny" / kit_root.name
    shutil.copytree(kit_root, root)
    _perturb_in_place(root / "target")
    report = json.loads((root / "report.json").read_text())
    report["sha256"] = {name: sha256_file(root / name) for name in report["sha256"]}
    (root / "report.json").write_text(json.dumps(report))
    return root


def test_a_tiny_kit_built_into_other_bytes_gets_other_ids_and_none_of_the_first_kits_artifacts(
        tmp_path: Path, tiny_kit, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ids used to hold the kit's recipe hash alone: a kit built into other weights (another CPU, a new torch)
    found the first kit's calibration set cached under the same id and trained on it, exit 0."""
    from jobs import generate
    from pipeline.artifacts import load_artifact
    from pipeline.tiny import build_kit

    cfg = small_cfg(tmp_path / "work")
    first = plan(cfg)
    assert first.stages["generate"].fingerprint["weights"].startswith("kit:")
    calibration = generate.main(cfg)
    assert plan(cfg).stages["generate"].cached
    cache = tmp_path / "elsewhere"
    _built_elsewhere(tiny_kit.root, cache)
    monkeypatch.setenv("DRAFTER_CACHE", str(cache))
    assert build_kit("test", cache).root == cache / "tiny" / tiny_kit.root.name  # a sound kit: it loads
    other = plan(cfg)
    assert not other.provisional
    assert {name for name in first.stages if first.stages[name].id != other.stages[name].id} == READS_TARGET
    assert not other.stages["generate"].cached
    with pytest.raises(DrafterError, match="built for a different target") as err:
        load_artifact(calibration.path, fingerprint=other.stages["generate"].fingerprint)
    assert "weights=kit:" in err.value.expected and "weights=kit:" in err.value.found


# --- damaged cached models (issue 21): a library's own exception never reaches the user ----------------

def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize(("damage", "load"), [
    (lambda d: (d / "config.json").write_text("[1, 2]"), "fingerprint"),  # used to raise TypeError
    (lambda d: (d / "tokenizer.json").write_text('{"version": "1.0", "model": 3}'), "fingerprint"),  # KeyError
    (lambda d: _cut(d / "model.safetensors"), "load_model"),  # SafetensorError: incomplete metadata
    (lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 64), "load_model"),  # SafetensorError: header
], ids=["config-a-list", "tokenizer-json-fields-missing", "safetensors-cut", "safetensors-garbage"])
def test_a_damaged_local_checkpoint_is_refused_naming_it(tmp_path: Path, tiny_kit, damage, load: str) -> None:
    target = _copy_model(tiny_kit.path("target"), tmp_path / "damaged")
    damage(target)
    with pytest.raises(DrafterError, match=f"Could not load '{target}'") as err:
        getattr(loading, load)(str(target))
    assert "damaged or incomplete" in err.value.found and "again" in err.value.fix


@pytest.mark.parametrize("damage", [lambda f: _cut(f), lambda f: f.write_text("[1, 2]"), lambda f: f.write_bytes(b"\xff")],
                         ids=["cut", "a-list", "not-utf8"])
def test_a_damaged_generation_config_is_refused_not_taken_for_a_missing_one(tmp_path: Path, tiny_kit,
                                                                            damage) -> None:
    """transformers reads a damaged generation_config.json as an absent one (the config reader raises OSError, the
    model loader logs at info level and uses defaults): the end-of-turn ids it names would stop ending answers and
    drop out of every shortlist, exit 0. Both loaders refuse it; without the file, both load as before."""
    target = _copy_model(tiny_kit.path("target"), tmp_path / "damaged")
    sound = loading.load_generation_config(str(target))
    assert sound is not None and sound.eos_token_id is not None
    damage(target / "generation_config.json")
    for load in (loading.load_generation_config, loading.load_model):
        with pytest.raises(DrafterError, match="its generation_config.json (is not valid JSON|holds JSON that is not)"
                           ) as err:
            load(str(target))
        assert str(target / "generation_config.json") in err.value.found and "again" in err.value.fix
    (target / "generation_config.json").unlink()
    assert loading.load_generation_config(str(target)) is None
    assert loading.load_model(str(target)).generation_config is not None


@pytest.mark.parametrize("report", [b"{not json", b"[1, 2]", b"\xff\xfe",
                                    b'{"profile": "test", "sha256": [["target/config.json", "00"]]}',
                                    b'{"profile": "test", "sha256": {"target/config.json": 0}}'])
def test_a_tiny_kit_whose_report_is_damaged_is_refused_at_plan_time(tmp_path: Path, tiny_kit,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   report: bytes) -> None:
    from pipeline.tiny import build_kit, kit_status, kit_weights

    cache = tmp_path / "cache"
    shutil.copytree(tiny_kit.root, cache / "tiny" / tiny_kit.root.name)
    (cache / "tiny" / tiny_kit.root.name / "report.json").write_bytes(report)
    monkeypatch.setenv("DRAFTER_CACHE", str(cache))
    with pytest.raises(DrafterError, match="report.json cannot be read") as err:
        kit_status("test", cache)
    assert "drafter tiny --profile test --force" in err.value.fix
    with pytest.raises(DrafterError, match="report.json cannot be read"):
        plan(small_cfg(tmp_path / "work"), ["generate"])
    with pytest.raises(DrafterError, match="report.json cannot be read"):  # a sha256 list: AttributeError here
        kit_weights("tiny:test/target", cache_dir=cache)
    with pytest.raises(DrafterError, match="report.json cannot be read"):
        build_kit("test", cache)


def test_a_stat_cache_of_another_shape_is_ignored(tmp_path: Path) -> None:
    (tmp_path / "stat.json").write_text("[1, 2]")
    file = tmp_path / "f.bin"
    file.write_bytes(b"x")
    assert StatCache(tmp_path / "stat.json").sha256(file) == StatCache(tmp_path / "none.json").sha256(file)
