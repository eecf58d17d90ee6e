"""Our exports read by the ``speculators`` package itself (vLLM's EAGLE-3 training/packaging library), in
its own virtualenv: speculators 0.9.0 pins transformers <= 5.19 and datasets <= 5.1, which conflict with
ours (see ../shared/FACTS.md).

The venv (``torch==2.13.0 speculators==0.9.0``, then torchvision/torchaudio removed: the versions pip
pulls in do not match that torch and break ``import transformers``) is built once under
``$DRAFTER_TOOLS/speculators-0.9.0/`` (default ``~/.cache/drafter-pipeline-tools``, never inside the artifact
cache: see tests/tool_envs.py); a stamp written after the last step marks it complete, so an
interrupted build is redone. It is built with the uv ``make setup`` installs where present (measured here,
2 busy cores: 68 s), else pip (pip cache warm: 116-174 s); the tests then take ~30 s together. If it cannot be
built the tests fail, saying why: they are never skipped.

The EAGLE-3 tests write a small random-weight drafter and its target (``save_pretrained``: speculators reads the
verifier's config, lm_head and final norm from ``speculators_config.verifier.name_or_path``), feed fixed token ids
and 3H features through speculators' own ``Eagle3DraftModel.forward`` (3 unrolled steps, its default attention: flex
attention with a block mask, which needs the sequence length to be a multiple of 128 once extended for later steps),
and compare what its ``lm_head`` and final ``norm`` see, step by step, with :class:`Eagle3Drafter` over a
:class:`TTTCache` on the same inputs. speculators' forward returns only argmax ids, so the per-step logits and
pre-norm hidden states are taken with forward hooks. Every test's export is read by one interpreter in the venv
(:data:`DRIVER`; importing speculators costs ~13 CPU-seconds a process here), and what speculators raises on one
export fails that export's test alone, with its traceback.

Tolerance: float32, ``atol = rtol = 1e-5`` on logits of size ~2. Both sides compute the same float32 graph
with different kernels (flex attention vs our explicit softmax over the unrolled steps), so they differ by
rounding only: measured, step 0 identical and steps 1-2 within 6e-7. A wrong key, norm, mask or residual
gives differences of order 1 (``norm_before_residual: true`` in the config: 0.5 at step 0).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.cache import default_cache_dir
from pipeline.drafters.eagle3 import Eagle3Config, Eagle3Drafter, TTTCache
from pipeline.drafters.export import SPECULATORS_KEYS, export_eagle3, export_speculators
from pipeline.vocab.counting import eagle3_offset_maps
from tests.tool_envs import clean_env, ensure_tool_venv, tool_env_dir

pytestmark = pytest.mark.interop

PINS = ("torch==2.13.0", "speculators==0.9.0")
VENV_NAME = "speculators-0.9.0"
INSTALL_TIMEOUT_S = 1800
H, V, VD, T, STEPS = 32, 1000, 40, 128, 3
ATOL = RTOL = 1e-5

# Runs inside the speculators venv. argv: mode ("load" a speculators dir, or "convert" an EAGLE-3 dir with
# speculators' Eagle3Converter first), model dir, verifier dir, inputs, outputs, scratch dir.
SCRIPT = r'''
import json, sys
import torch
from importlib.metadata import version
from safetensors.torch import load_file, save_file
from speculators.models.eagle3 import Eagle3DraftModel

mode, model_dir, verifier_dir, inputs_path, out_path, scratch = sys.argv[1:7]
if mode == "convert":
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter
    aux = json.load(open(model_dir + "/config.json"))["drafter_pipeline"]["aux_layer_ids"]
    Eagle3Converter().convert(model_dir, scratch, base_model=verifier_dir, validate=False,
                              eagle_aux_hidden_state_layer_ids=aux)
    model_dir = scratch
model = Eagle3DraftModel.from_pretrained(model_dir).eval()
if mode == "convert":
    # The converted checkpoint has no embedding (an EAGLE-3 export has none). speculators 0.9.0 then
    # means to take the verifier's but under transformers 5.19 finds uninitialised memory instead of its
    # NaN sentinel and keeps it; its own loader, told to overwrite, does the intended thing.
    model._load_verifier_weights(overwrite_embed_tokens=True)
x = load_file(inputs_path)
logits, pre_norm = [], []
model.lm_head.register_forward_hook(lambda mod, args, out: logits.append(out.detach().clone()))
model.norm.register_forward_pre_hook(lambda mod, args: pre_norm.append(args[0].detach().clone()))
with torch.no_grad():
    tokens = model(hidden_states=x["hidden"], input_ids=x["input_ids"],
                   document_ids=torch.zeros_like(x["input_ids"]), position_ids=x["position_ids"],
                   ttt_steps=int(x["steps"]))
out = {f"logits_{s}": t for s, t in enumerate(logits)}
out.update({f"hidden_{s}": t for s, t in enumerate(pre_norm)})
out.update({f"tokens_{s}": t for s, t in enumerate(tokens)})
out.update({"state." + k: v.contiguous() for k, v in model.state_dict().items()})
save_file(out, out_path)
print(json.dumps({"attn_implementation": model._attn_impl,
                  "aux_layer_ids": list(model.config.eagle_aux_hidden_state_layer_ids),
                  "norm_before_residual": model.config.norm_before_residual,
                  "torch": version("torch"), "transformers": version("transformers"),
                  "speculators": version("speculators")}))
'''

# Runs inside the speculators venv: every job of the JSON list argv[1] ({name, script, args}) in this one interpreter
# as its own ``__main__`` with its own argv, its stdout captured; argv[2] gets, by name, the stdout or the traceback.
DRIVER = r'''
import contextlib, io, json, runpy, sys, traceback
jobs_path, report_path = sys.argv[1:3]
jobs, report = json.load(open(jobs_path)), {}
for job in jobs:
    sys.argv, out = [job["script"], *job["args"]], io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(job["script"], run_name="__main__")
        report[job["name"]] = {"stdout": out.getvalue()}
    except BaseException:
        report[job["name"]] = {"error": traceback.format_exc()[-4000:]}
json.dump(report, open(report_path, "w"))
'''


# --- the venv --------------------------------------------------------------------------------------

def _venv_dir() -> Path:
    return tool_env_dir(VENV_NAME)


def test_the_venv_lives_apart_from_the_artifact_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checks only where the venv would go; builds nothing."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for cache in (None, tmp_path / "cache"):  # the default artifact cache, then CI's $DRAFTER_CACHE
        if cache is None:
            monkeypatch.delenv("DRAFTER_CACHE", raising=False)
        else:
            monkeypatch.setenv("DRAFTER_CACHE", str(cache))
        monkeypatch.delenv("DRAFTER_TOOLS", raising=False)
        assert _venv_dir() == tmp_path / "home" / ".cache" / "drafter-pipeline-tools" / VENV_NAME
        assert not _venv_dir().is_relative_to(default_cache_dir())
        monkeypatch.setenv("DRAFTER_TOOLS", str(tmp_path / "tools"))
        assert _venv_dir() == tmp_path / "tools" / VENV_NAME
        assert not _venv_dir().is_relative_to(default_cache_dir())


@pytest.fixture(scope="module")
def speculators_python() -> Path:
    return ensure_tool_venv(VENV_NAME, PINS, remove=("torchvision", "torchaudio"),
                            check="from speculators.models.eagle3 import Eagle3DraftModel", timeout=INSTALL_TIMEOUT_S)


# --- the drafter and the comparison ----------------------------------------------------------------

@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Eagle3Drafter, LlamaConfig, Path, dict[str, torch.Tensor]]:
    """A random 3-layer Llama target saved for speculators, a random drafter on its embedding, inputs."""
    tmp_path = tmp_path_factory.mktemp("eagle3")
    torch.manual_seed(0)
    target_config = LlamaConfig(hidden_size=H, intermediate_size=88, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=8, num_hidden_layers=3, vocab_size=V, rms_norm_eps=1e-6,
                                max_position_embeddings=2 * T, tie_word_embeddings=False,
                                rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    target = LlamaForCausalLM(target_config).float()
    target.save_pretrained(tmp_path / "target")
    drafter = Eagle3Drafter(Eagle3Config.from_target(target_config, VD), target.model.embed_tokens)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))  # not ones: a misplaced norm must show
    drafter.set_vocab_maps(*eagle3_offset_maps(np.sort(np.random.default_rng(0).choice(V, VD, replace=False)), V))
    gen = torch.Generator().manual_seed(1)
    inputs = {"input_ids": torch.randint(0, V, (1, T), generator=gen),
              "hidden": torch.randn(1, T, 3 * H, generator=gen),
              "position_ids": torch.arange(1, T + 1).unsqueeze(0),  # speculators' own default, explicit
              "steps": torch.tensor(STEPS)}
    return drafter, target_config, tmp_path / "target", inputs


def ours(drafter: Eagle3Drafter, inputs: dict[str, torch.Tensor]) -> tuple[list, list]:
    """Per-step logits and pre-norm hidden of the unrolled test, fed as speculators feeds it: step ``s``
    reads the ids shifted left by ``s`` (zero-padded), the previous step's output, positions + ``s``."""
    ids, hidden, positions = inputs["input_ids"], inputs["hidden"], inputs["position_ids"]
    cache, logits, pre_norm = TTTCache(), [], []
    with torch.no_grad():
        for s in range(STEPS):
            step_ids = torch.cat([ids[:, s:], ids.new_zeros(1, s)], dim=1)
            hidden = drafter.step(step_ids, hidden, positions + s, cache)
            pre_norm.append(hidden)
            logits.append(drafter.logits(hidden))
    return logits, pre_norm


def compare(drafter: Eagle3Drafter, inputs: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    logits, pre_norm = ours(drafter, inputs)
    for s in range(STEPS):
        for name, mine in ((f"logits_{s}", logits[s]), (f"hidden_{s}", pre_norm[s])):
            diff = (theirs[name] - mine).abs().max().item()
            assert theirs[name].shape == mine.shape, name
            assert torch.allclose(theirs[name], mine, atol=ATOL, rtol=RTOL), f"{name}: max |diff| {diff:.2e}"
        assert torch.equal(theirs[f"tokens_{s}"], logits[s].argmax(-1)), s
    # Every tensor speculators used is ours (or the target's embedding), none left at its NaN/random init.
    state = {**drafter.trainable_state_dict(), "embed_tokens.weight": drafter.embed_tokens.weight}
    for key in SPECULATORS_KEYS:
        assert torch.equal(theirs["state." + key], state[key.replace("layers.0.", "midlayer.")]), key


def test_speculators_loads_and_runs_our_speculators_export(read, setup) -> None:
    drafter, _, _, inputs = setup
    theirs, info = read("eagle3-speculators")
    assert info["speculators"] == "0.9.0" and info["attn_implementation"] == "simple_flex_attention"
    assert info["aux_layer_ids"] == [0, 1, 2] and info["norm_before_residual"] is False
    compare(drafter, inputs, theirs)


def test_speculators_converts_and_runs_our_eagle3_export(read, setup) -> None:
    """speculators' Eagle3Converter reads the EAGLE-3 layout (config.json fields incl. the legacy
    rope_theta, midlayer.* weights, t2d for the target vocabulary) as it reads EAGLE-repo checkpoints.
    The script then makes speculators take the embedding from the verifier explicitly (see SCRIPT)."""
    drafter, _, _, inputs = setup
    theirs, info = read("eagle3-reference")
    assert info["speculators"] == "0.9.0" and info["aux_layer_ids"] == [0, 1, 2]
    compare(drafter, inputs, theirs)


# --- DFlash ----------------------------------------------------------------------------------------
# speculators 0.9.0's DFlashDraftModel runs its own training graph (``_backbone_forward``: every anchor's block side
# by side, its anchor block mask) on our export. With a loss mask that is 1 at exactly the anchors we pick (and
# ``max_anchors`` = their number) its anchor draw takes all of them, so both sides see the same blocks. Its eager
# attention path is used (``_attn_implementation = "eager"``: the float form of the same anchor mask) because its
# flex-attention path compiles the block mask with torch.compile, which this CPU test does not need to exercise.

DFLASH_SCRIPT = r'''
import json, sys
import torch
from importlib.metadata import version
from safetensors.torch import load_file, save_file
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

mode, model_dir, verifier_dir, inputs_path, out_path, scratch = sys.argv[1:7]
if mode == "convert":
    from speculators.convert.dflash.converter import DFlashConverter
    DFlashConverter().convert(model_dir, scratch, base_model=verifier_dir, validate=False)
    model_dir = scratch
config = DFlashSpeculatorConfig.from_pretrained(model_dir)
config.transformer_layer_config._attn_implementation = "eager"
model = DFlashDraftModel.from_pretrained(model_dir, config=config).eval()
x = load_file(inputs_path)
length = x["input_ids"].shape[1]
loss_mask = torch.zeros(1, length, dtype=torch.long)
loss_mask[0, x["anchors"]] = 1
with torch.no_grad():
    hidden, logits, _, _, index = model._backbone_forward(
        x["hidden"], x["input_ids"], loss_mask, torch.zeros(1, length, model.hidden_size),
        torch.zeros(1, length, dtype=torch.long), max_anchors=int(x["anchors"].numel()))
out = {"hidden": hidden, "logits": logits, "index": index}
out.update({"state." + k: v.contiguous() for k, v in model.state_dict().items() if v is not None})
save_file(out, out_path)
print(json.dumps({"aux_hidden_state_layer_ids": list(model.target_layer_ids), "block_size": model.block_size,
                  "mask_token_id": model.mask_token_id, "use_draft_vocab": model.use_draft_vocab,
                  "sliding_window_non_causal": model.config.sliding_window_non_causal,
                  "uses_sliding_window_attn": model.uses_sliding_window_attn,
                  "speculative_tokens": model.config.speculators_config.proposal_methods[0].speculative_tokens,
                  "speculators": version("speculators")}))
'''

DFLASH_T, DFLASH_BLOCK, DFLASH_ANCHORS = 64, 4, (3, 20, 33, 50)


@pytest.fixture(scope="module")
def dflash_setup(tmp_path_factory: pytest.TempPathFactory):
    """A random 4-layer Llama target saved for speculators, a random 2-layer DFlash drafter on its embedding and
    head (norms not ones; its own attention and MLP widths, 8 query heads, 4 key/value heads and 56, where the target
    has 4, 2 and 88, so the consumer must read the drafter's shape from its config), features of its tapped layers and the anchors
    of four blocks."""
    from pipeline.drafters.dflash import DFlashConfig, DFlashDrafter

    tmp_path = tmp_path_factory.mktemp("dflash")
    torch.manual_seed(0)
    target_config = LlamaConfig(hidden_size=H, intermediate_size=88, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=8, num_hidden_layers=4, vocab_size=V, rms_norm_eps=1e-6,
                                max_position_embeddings=2 * T, tie_word_embeddings=False,
                                rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    target = LlamaForCausalLM(target_config).float()
    target.save_pretrained(tmp_path / "target")
    config = DFlashConfig.from_target(target_config, num_hidden_layers=2, block_size=DFLASH_BLOCK, mask_token_id=V - 1,
                                      num_attention_heads=8, num_key_value_heads=4, intermediate_size=56)
    drafter = DFlashDrafter(config, target.model.embed_tokens, target.lm_head)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    gen = torch.Generator().manual_seed(1)
    inputs = {"input_ids": torch.randint(0, V - 1, (1, DFLASH_T), generator=gen),
              "hidden": torch.randn(1, DFLASH_T, len(config.target_layer_ids) * H, generator=gen),
              "anchors": torch.tensor(DFLASH_ANCHORS)}
    return drafter, target, target_config, tmp_path / "target", inputs


def dflash_ours(drafter, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Our training forward on the same blocks: final-normed hidden and logits of every block row."""
    from pipeline.training.dflash_task import block_attention

    ids, size = inputs["input_ids"], drafter.config.block_size
    anchors = inputs["anchors"].unsqueeze(0)
    count = anchors.shape[1]
    block = drafter.block_ids(ids[0, inputs["anchors"]]).view(1, count * size)
    positions = (anchors.unsqueeze(-1) + torch.arange(size)).view(1, count * size)
    mask = block_attention(anchors, torch.ones_like(anchors, dtype=torch.bool), DFLASH_T, size)
    with torch.no_grad():
        hidden = drafter(block, inputs["hidden"], positions, torch.arange(DFLASH_T).unsqueeze(0), mask=mask)
        return hidden, drafter.logits(hidden)


@pytest.fixture(scope="module")
def dflash_draft_vocabulary(dflash_setup):
    """The DFlash drafter with its own head over ``VD`` target ids (every 25th), its rows moved off the target's."""
    from pipeline.drafters.dflash import DFlashDrafter
    from pipeline.vocab.counting import eagle3_offset_maps

    drafter, target = dflash_setup[:2]
    config = dataclasses.replace(drafter.config, draft_vocab_size=VD)
    variant = DFlashDrafter(config, target.model.embed_tokens, target.lm_head)
    variant.load_state_dict(drafter.state_dict(), strict=False)
    variant.set_vocab_maps(*eagle3_offset_maps(np.arange(0, 25 * VD, 25), V))
    with torch.no_grad():
        variant.lm_head.weight.add_(0.05 * torch.randn_like(variant.lm_head.weight))
    return variant


def dflash_compare(drafter, target, inputs: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    from pipeline.drafters.dflash import reference_keys

    hidden, logits = dflash_ours(drafter, inputs)
    expected_index = (inputs["anchors"].unsqueeze(-1) + torch.arange(DFLASH_BLOCK)).flatten()
    assert torch.equal(theirs["index"], expected_index)  # the same blocks at the same positions
    for name, mine in (("hidden", hidden), ("logits", logits)):
        diff = (theirs[name] - mine).abs().max().item()
        assert theirs[name].shape == mine.shape, name
        assert torch.allclose(theirs[name], mine, atol=ATOL, rtol=RTOL), f"{name}: max |diff| {diff:.2e}"
    # Every tensor speculators holds is ours, or the target's embedding / LM head / final norm.
    state = drafter.trainable_state_dict()
    for key in reference_keys(drafter.config):
        assert torch.equal(theirs["state." + key], state[key]), key
    assert torch.equal(theirs["state.embed_tokens.weight"], target.model.embed_tokens.weight)
    assert torch.equal(theirs["state.verifier_norm.weight"], target.model.norm.weight)
    extra = {k.removeprefix("state.") for k in theirs if k.startswith("state.")} - set(reference_keys(drafter.config))
    if drafter.config.draft_vocab_size is None:
        assert torch.equal(theirs["state.lm_head.weight"], target.lm_head.weight)
        assert extra == {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    else:  # its own head and maps are among the reference keys compared above
        assert extra == {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"}


# --- one speculators interpreter for every test's export ---------------------------------------------------------

@pytest.fixture(scope="module")
def read(speculators_python: Path, setup, dflash_setup, dflash_draft_vocabulary,
         tmp_path_factory: pytest.TempPathFactory):
    """Every test's export, written here and read by speculators in one :data:`DRIVER` run; ``read(name)`` gives a
    test its tensors and the script's JSON line, or fails it with speculators' traceback for that export alone."""
    from pipeline.drafters.dflash_export import export_reference
    from pipeline.drafters.dflash_export import export_speculators as export_dflash_speculators

    work = tmp_path_factory.mktemp("speculators")
    drafter, target_config, target_dir, inputs = setup
    dflash, _, dflash_config, dflash_dir, dflash_inputs = dflash_setup
    exports = {  # name: (script, mode, export, verifier, inputs)
        "eagle3-speculators": (SCRIPT, "load", export_speculators(drafter, work / "eagle3-speculators",
                               target_model=str(target_dir), target_config=target_config), target_dir, inputs),
        "eagle3-reference": (SCRIPT, "convert", export_eagle3(drafter, work / "eagle3-reference",
                             target_model=str(target_dir), target_config=target_config), target_dir, inputs),
        "dflash-speculators": (DFLASH_SCRIPT, "load", export_dflash_speculators(
            dflash, work / "dflash-speculators", target_model=str(dflash_dir), target_config=dflash_config),
            dflash_dir, dflash_inputs),
        "dflash-draft-vocabulary": (DFLASH_SCRIPT, "load", export_dflash_speculators(
            dflash_draft_vocabulary, work / "dflash-draft-vocabulary", target_model=str(dflash_dir),
            target_config=dflash_config), dflash_dir, dflash_inputs),
        "dflash-reference": (DFLASH_SCRIPT, "convert", export_reference(
            dflash, work / "dflash-reference", target_model=str(dflash_dir), target_config=dflash_config),
            dflash_dir, dflash_inputs),
    }
    jobs = []
    for name, (script, mode, out, verifier, tensors) in exports.items():
        job = work / f"{name}.run"
        job.mkdir()
        (job / "script.py").write_text(script)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(job / "inputs.safetensors"))
        jobs.append({"name": name, "script": str(job / "script.py"),
                     "args": [mode, str(out), str(verifier), str(job / "inputs.safetensors"),
                              str(job / "outputs.safetensors"), str(job / "converted")]})
    (work / "jobs.json").write_text(json.dumps(jobs))
    (work / "driver.py").write_text(DRIVER)
    done = subprocess.run([str(speculators_python), str(work / "driver.py"), str(work / "jobs.json"),
                           str(work / "report.json")], capture_output=True, text=True, timeout=900, env=clean_env(),
                          cwd=work)
    assert done.returncode == 0, f"the speculators interpreter failed outside any one export:\n{done.stderr[-4000:]}"
    report = json.loads((work / "report.json").read_text())

    def read(name: str) -> tuple[dict[str, torch.Tensor], dict]:
        if "error" in report[name]:
            pytest.fail(f"speculators could not load/run the {name} export:\n{report[name]['error']}")
        return load_file(work / f"{name}.run" / "outputs.safetensors"), \
            json.loads(report[name]["stdout"].strip().splitlines()[-1])

    return read


def test_speculators_loads_and_runs_our_dflash_export(read, dflash_setup) -> None:
    """The speculators layout: aux_hidden_state_layer_ids = reference ids + 1 (the hidden_states indices our
    drafter was trained on), B − 1 speculative tokens, no sliding window (so vLLM's causal = not
    sliding_window_non_causal never applies: no layer is a sliding one), every tensor equal, the same block outputs."""
    drafter, target, _, _, inputs = dflash_setup
    theirs, info = read("dflash-speculators")
    assert info["speculators"] == "0.9.0" and info["use_draft_vocab"] is False
    assert info["aux_hidden_state_layer_ids"] == list(drafter.config.hidden_state_indices)
    assert info["aux_hidden_state_layer_ids"] == [i + 1 for i in drafter.config.target_layer_ids]
    assert info["block_size"] == DFLASH_BLOCK and info["speculative_tokens"] == DFLASH_BLOCK - 1
    assert info["mask_token_id"] == V - 1 and info["uses_sliding_window_attn"] is False
    dflash_compare(drafter, target, inputs, theirs)


def test_speculators_loads_and_runs_our_dflash_export_with_a_draft_vocabulary(read, dflash_setup,
                                                                               dflash_draft_vocabulary) -> None:
    """A drafter with its own head over 40 of the 1,000 ids (``head: draft``): speculators reads it as a
    reduced-vocabulary DFlash (use_draft_vocab), keeps our head, d2t and t2d, and gives our 40-wide logits."""
    _, target, _, _, inputs = dflash_setup
    drafter = dflash_draft_vocabulary
    theirs, info = read("dflash-draft-vocabulary")
    assert info["use_draft_vocab"] is True and theirs["logits"].shape[-1] == VD
    dflash_compare(drafter, target, inputs, theirs)


def test_speculators_converts_and_runs_our_dflash_reference_export(read, dflash_setup) -> None:
    """speculators' DFlashConverter reads the reference layout (what vLLM and SGLang load) as it reads z-lab's
    checkpoints: target_layer_ids become hidden_states indices id + 1, the weights are taken as they are."""
    drafter, target, _, _, inputs = dflash_setup
    theirs, info = read("dflash-reference")
    assert info["aux_hidden_state_layer_ids"] == list(drafter.config.hidden_state_indices)
    assert info["block_size"] == DFLASH_BLOCK and info["mask_token_id"] == V - 1
    dflash_compare(drafter, target, inputs, theirs)
