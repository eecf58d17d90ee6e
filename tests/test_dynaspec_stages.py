"""The DynaSpec stages on the tiny kit's test profile: ``cluster`` (FAISS spherical k-means of the drafter's
head) and ``train_router`` (the router under the shared harness, its held-out routing curves), their
artifacts, a kill -9 mid-training then a rerun ending bit-identical, and bad input."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from jobs import cluster, evaluate, run, train_router
from pipeline.config.sections import PipelineConfig, load_config
from pipeline.dynaspec.budget import ClusterBudget, eq3, match_budgets, match_pa_fr, pa_fr
from pipeline.dynaspec.clusters import Clustering, head_sha256, spherical_kmeans
from pipeline.errors import DrafterError
from pipeline.orchestration.dag import plan
from tests.helpers import CLUSTERS, ROUTER, SMALL
from tests.killing import kill_after_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def ds_cfg(workdir: Path, *extra: str) -> PipelineConfig:
    return load_config(None, [f"workdir={workdir}", *SMALL, *ROUTER, *extra])


@pytest.fixture(scope="module")
def routed(tmp_path_factory: pytest.TempPathFactory, tiny_kit):
    cfg = ds_cfg(tmp_path_factory.mktemp("dynaspec"))
    artifacts = run(cfg, ["train_router"])  # generate, count, cluster first
    return cfg, artifacts


def named_inputs(art) -> list[str]:  # noqa: ANN001 - a train_router Artifact
    """Overrides naming the calibration set, counts and clustering ``art`` was trained on (only train_router
    then runs)."""
    names = json.loads(art.file("router_config.json").read_text())
    return [f"train_router.{key}={art.path.parent / names[key]}" for key in ("calibration", "counts", "clusters")]


def test_budgets_follow_eq3_and_app_a3() -> None:
    """Eq. 3 with k0=12, k1=8: 12, 8, ⌊10/4⌋=2, ⌊11/6⌋=1, ⌊12/8⌋=1, then clamped at k_min instead of 0;
    PA-FR with kmax=600: 600, 600, 200, 150, 120; matching picks the budget closest to the size asked for."""
    assert [eq3(12, 8, t) for t in range(7)] == [12, 8, 2, 1, 1, 1, 1]
    assert eq3(12, 8, 10) == 1 and eq3(12, 8, 10, k_min=2) == 2  # ⌊18/20⌋ = 0 is clamped at k_min
    assert [pa_fr(600, t) for t in range(5)] == [600, 600, 200, 150, 120]
    sizes = [10.0 * k for k in range(1, 17)]  # 10 tokens per cluster
    fixed, pa = match_budgets(sizes, 55.0, gamma=4)
    assert fixed.k1 in (5, 6) and pa.k1 == fixed.k1 and pa.k0 > pa.k1
    assert abs(np.mean([sizes[pa.at(t) - 1] for t in range(4)]) - 55.0) <= 10
    kmax = match_pa_fr(1000, 100.0, gamma=4)
    assert abs(np.mean([pa_fr(kmax, t) for t in range(4)]) - 100.0) <= 1
    for bad, match in ((ClusterBudget("pa", 8, 8), "k0 > k1"), (ClusterBudget("pa", 8, 17), "more clusters"),
                       (ClusterBudget("fixed", 0), "more clusters than exist \\(or fewer")):
        with pytest.raises(DrafterError, match=match):
            bad.check(16)


def test_a_budget_floor_above_the_matched_k_leaves_the_fixed_budget_and_refuses_the_pa_one() -> None:
    """evaluate.dynaspec_k_min floors only the decaying PA budget: with k_min=2 and a matched k of 1, DynaSpec-F's
    k=1 budget is usable (it was refused as "floor above the budget"); the PA budget keeps the configured floor (it
    was silently lowered to 1) and is refused naming the key, the matched k and what to do."""
    curve = [8.0 * k for k in range(1, 9)]  # 8 tokens per cluster: a 10-token shortlist matches k=1
    fixed, pa = match_budgets(curve, 10.0, gamma=5, k_min=2)
    fixed.check(8)
    assert fixed.k1 == 1 and fixed.at(4) == 1 and "k_min" not in fixed.to_dict()
    assert pa.k1 == 1 and pa.k_min == 2 and pa.to_dict()["k_min"] == 2
    with pytest.raises(DrafterError, match=r"evaluate\.dynaspec_k_min(.|\n)*k1=1(.|\n)*dynaspec_k_min to 1 or less"):
        pa.check(8)
    fixed, pa = match_budgets(curve, 10.0, gamma=5, k_min=1)
    fixed.check(8), pa.check(8)


def test_faiss_clustering_is_a_seeded_partition(tiny_kit) -> None:
    """Every token in exactly one cluster (the assignment covers all rows, not FAISS's training sample),
    unit centroids, the same clustering for the same seed and another for another seed, a safetensors round
    trip keyed to the head's SHA-256."""
    from transformers import AutoModelForCausalLM

    head = AutoModelForCausalLM.from_pretrained(tiny_kit.path("drafter")).get_output_embeddings().weight
    a = spherical_kmeans(head, CLUSTERS, seed=0, max_points_per_centroid=8)  # trains on a sample
    assert a.assignment.shape == (head.shape[0],) and a.sizes.sum() == head.shape[0] and (a.sizes > 0).all()
    np.testing.assert_allclose(np.linalg.norm(a.centroids, axis=1), 1.0, atol=1e-5)
    assert np.array_equal(a.assignment, spherical_kmeans(head, CLUSTERS, seed=0, max_points_per_centroid=8).assignment)
    assert not np.array_equal(a.assignment, spherical_kmeans(head, CLUSTERS, seed=1).assignment)
    # nearest centroid by inner product on unit rows: the assignment is the argmax
    rows = head.detach().numpy() / np.linalg.norm(head.detach().numpy(), axis=1, keepdims=True)
    assert np.array_equal(a.assignment, np.argmax(rows @ a.centroids.T, axis=1))
    with pytest.raises(DrafterError, match="does not fit"):
        spherical_kmeans(head, head.shape[0] + 1)


def test_cluster_artifact(routed) -> None:
    cfg, artifacts = routed
    art = artifacts["cluster"]
    clustering = Clustering.load(art.path)
    summary = json.loads(art.file("clusters.json").read_text())
    from transformers import AutoModelForCausalLM

    from pipeline.models.loading import resolve_ref

    head = AutoModelForCausalLM.from_pretrained(resolve_ref("tiny:test/drafter").location).get_output_embeddings().weight
    assert clustering.head_sha256 == head_sha256(head) == summary["head_sha256"]
    assert clustering.num_clusters == CLUSTERS and clustering.sizes.sum() == head.shape[0]
    assert summary["special_token_clusters"] and summary["size_max"] >= summary["size_min"] >= 1
    assert art.metrics["cluster_seconds"] > 0
    # FAISS-GPU or CPU is a run setting: the same id
    assert plan(ds_cfg(cfg.workdir_path, "cluster.device=cpu"), ["cluster"])["cluster"].id == art.id
    assert cluster.main(cfg).id == art.id  # a cache hit


def test_router_artifact_and_routing_curves(routed) -> None:
    """The router is saved with what it was trained for; held-out curves over k = 1..M: sizes and retained
    masses grow with k and reach the whole vocabulary (mass 1) at k = M; the static comparison has the
    routed shortlist's mean size; the kept checkpoint is the best held-out loss."""
    _, artifacts = routed
    art = artifacts["train_router"]
    config = json.loads(art.file("router_config.json").read_text())
    clustering = Clustering.load(artifacts["cluster"].path)
    assert config["clustering_sha256"] == clustering.content_sha256() and config["clusters"] == artifacts["cluster"].id
    curves = json.loads(art.file("routing.json").read_text())
    assert curves["positions"] > 0 and curves["k"] == list(range(1, CLUSTERS + 1))
    for key in ("size", "drafter_mass", "target_mass", "drafter_top_l_recall"):
        assert all(b >= a - 1e-9 for a, b in zip(curves[key], curves[key][1:])), key
    assert curves["size"][-1] == pytest.approx(clustering.vocab_size)
    for key in ("drafter_mass", "target_mass", "drafter_top_l_recall", "static_target_mass"):
        assert curves[key][-1] == pytest.approx(1.0, abs=1e-9), key
    assert all(abs(s - r) <= 1.0 for s, r in zip(curves["static_size"], curves["size"]))
    training = json.loads(art.file("training.json").read_text())
    assert training["best"]["metric"] == "neg_loss" and training["steps"] == 24


def _routing_inputs(routed: tuple, eval_max_rows: int) -> tuple:
    """What routing_curves reads, from the routed fixture's artifacts: the clustering, the drafter and the target
    (float32), the trained router, ``eval_max_rows`` held-out rows and count's frequency ranking."""
    from pipeline.data.rows import CalibrationRows
    from pipeline.dynaspec.router import load_router
    from pipeline.models.loading import load_model
    from pipeline.vocab.counting import frequency_ranking

    cfg, artifacts = routed
    clustering = Clustering.load(artifacts["cluster"].path)
    drafter = load_model(cfg.cluster.drafter, dtype="float32", device="cpu").eval()
    target = load_model(cfg.target.model, dtype="float32", device="cpu").eval()
    router, _ = load_router(artifacts["train_router"].path, clustering, drafter.get_output_embeddings().weight)
    rows = CalibrationRows(artifacts["generate"].path / "data", max_length=128, eval_fraction=0.2,
                           eval_max_rows=eval_max_rows, min_length=2, what="the DynaSpec router",
                           fraction_key="train_router.eval_fraction").heldout
    return clustering, drafter, target, router, rows, frequency_ranking(artifacts["count"])


def test_routing_curves_rank_a_padded_heads_extra_rows_last(routed) -> None:
    """A drafter head with more rows than its tokenizer has tokens (Qwen2.5: 151,936 against 151,665): the count's
    ranking covers the tokens only. The extra rows rank last, so the static shortlists are those of a ranking that
    lists them at its end (before, a ranking shorter than the head failed here, or read uninitialised ranks)."""
    from pipeline.dynaspec.router import routing_curves

    clustering, drafter, target, router, rows, ranking = _routing_inputs(routed, eval_max_rows=4)
    padding = ranking[ranking >= clustering.vocab_size - 5]  # the ids a 5-row-padded head would have no token for
    short = ranking[ranking < clustering.vocab_size - 5]
    curves = [routing_curves(router, drafter, target, rows, clustering, r, top_l=4, keep_ids=[0])
              for r in (short, np.concatenate([short, np.sort(padding)]))]
    assert curves[0] == curves[1]


def test_static_curves_equal_the_per_position_means_without_keeping_every_position(routed) -> None:
    """The static shortlist's figures were means over positions of sums over its members, from every held-out
    position's q, p and top-L distributions kept in memory (3 × V × 8 bytes a position: hundreds of GB for a 128k
    vocabulary at the 8B config's held-out size). They are now sums over members of running per-token means; here
    they equal the per-position computation from the drafter's and the target's own forwards (1e-12)."""
    from pipeline.data.rows import pad_batch
    from pipeline.dynaspec.router import predict_mask, router_features, routing_curves

    clustering, drafter, target, router, rows, ranking = _routing_inputs(routed, eval_max_rows=6)
    curves = routing_curves(router, drafter, target, rows, clustering, ranking, top_l=4, keep_ids=[0], batch_size=4)
    vocab = clustering.vocab_size
    with torch.no_grad():
        batch = pad_batch(rows, 0)
        _, logits = router_features(drafter, batch["input_ids"], batch["attention_mask"])
        mask = predict_mask(batch["loss_mask"], batch["attention_mask"])
        q = torch.softmax(logits[mask].double(), -1)[:, :vocab]
        p = torch.softmax(target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[mask]
                          .double(), -1)[:, :vocab]
    top = torch.topk(q, 4, dim=-1).indices
    topl = torch.zeros_like(q).scatter_(-1, top, q.gather(-1, top))
    rank_of = torch.empty(vocab, dtype=torch.long)
    rank_of[torch.as_tensor(ranking[:vocab])] = torch.arange(vocab)
    assert curves["positions"] == q.shape[0]
    for k, size in enumerate(curves["static_size"]):
        members = rank_of < size - (0 if rank_of[0] < size else 1)
        members[0] = True
        assert int(members.sum()) == size
        assert curves["static_drafter_mass"][k] == pytest.approx(float(q[:, members].sum(-1).mean()), abs=1e-12)
        assert curves["static_target_mass"][k] == pytest.approx(float(p[:, members].sum(-1).mean()), abs=1e-12)
        recall = float((topl[:, members].sum(-1) / topl.sum(-1)).mean())
        assert curves["static_drafter_top_l_recall"][k] == pytest.approx(recall, abs=1e-12)


def test_the_router_is_chosen_on_some_held_out_chats_and_measured_on_the_others(routed) -> None:
    """The kept checkpoint was chosen by its loss on the held-out rows and the routing curves (and the `k*` figures
    the bundle publishes) were then measured on those same rows. Now the held-out chats split: the even-numbered
    ones choose, the odd-numbered ones' answer positions are exactly the curves' positions."""
    from pipeline.data.rows import CalibrationRows, split_by_chat
    from pipeline.dynaspec.router import predict_mask

    cfg, artifacts = routed
    art = artifacts["train_router"]
    tr = cfg.train_router
    heldout = CalibrationRows(artifacts["generate"].path / "data", max_length=tr.max_length,
                              eval_fraction=tr.eval_fraction, eval_max_rows=tr.eval_max_rows, min_length=2,
                              what="the DynaSpec router", fraction_key="train_router.eval_fraction").heldout
    choose, report = split_by_chat(heldout)
    assert choose and report and {r.group for r in choose}.isdisjoint(r.group for r in report)
    assert (art.metrics["choose_rows"], art.metrics["report_rows"]) == (len(choose), len(report))
    positions = sum(int(predict_mask(torch.tensor([r.loss_mask]), torch.ones(1, len(r.loss_mask))).sum())
                    for r in report)
    assert json.loads(art.file("routing.json").read_text())["positions"] == positions


def test_routed_shortlists_keep_every_id_a_decode_stops_at(routed) -> None:
    """An instruct target's end-of-turn token is often only in its generation config's eos_token_id list (Gemma's
    <end_of_turn>); decodes stop there, but DynaSpec's and PA-FR's shortlists kept the tokenizer's EOS alone, so
    the drafter could not propose the end of a turn (FR-Spec's lists keep every special token). Here the target
    model lists a second end id: the policy's kept ids hold both."""
    from pipeline.evaluation.configurations import Configurations
    from pipeline.models.loading import load_model, load_tokenizer

    cfg, artifacts = routed
    cfg = ds_cfg(cfg.workdir_path, "evaluate.methods=[dynaspec,pa_fr]", "evaluate.dynaspec_match=top_k_64")
    tokenizer = load_tokenizer(cfg.target.model)
    target = load_model(cfg.target.model, dtype="float32", device="cpu").eval()
    end_of_turn = 7
    target.generation_config.eos_token_id = [tokenizer.eos_token_id, end_of_turn]
    configurations = Configurations(cfg, target, tokenizer, {}, {k: artifacts[k] for k in ("count", "cluster",
                                    "train_router")}, "cpu", lambda _line: None)
    drafter = load_model(cfg.evaluate.drafter, dtype="float32", device="cpu").eval()
    policy, _ = configurations._policy(drafter, ["dynaspec"])
    record = configurations.policy_record
    assert record["keep_ids"] == sorted({tokenizer.eos_token_id, end_of_turn}) == list(policy.keep_ids)


def test_a_router_is_refused_for_a_drafter_with_its_head_and_another_body(routed, tmp_path: Path) -> None:
    """The router reads the drafter's hidden states, but evaluate checked only the LM head's hash: a fine-tune of
    cluster.drafter with its head frozen passed, and its DynaSpec rows and bundle came from a router trained on
    another drafter's states. Here a copy of the drafter with one attention weight changed (head untouched) is
    refused by name; the drafter the router was trained on is not."""
    import shutil

    from safetensors.torch import save_file

    from pipeline.evaluation.configurations import Configurations
    from pipeline.models.loading import load_model, load_tokenizer, resolve_ref

    cfg, artifacts = routed
    body = tmp_path / "finetuned-drafter"
    shutil.copytree(resolve_ref(cfg.cluster.drafter).location, body)
    weights = load_file(str(body / "model.safetensors"))
    name = next(k for k in weights if "q_proj" in k)
    weights[name] = weights[name] + 0.01
    save_file(weights, str(body / "model.safetensors"), metadata={"format": "pt"})
    tokenizer = load_tokenizer(cfg.target.model)
    target = load_model(cfg.target.model, dtype="float32", device="cpu").eval()
    inputs = {k: artifacts[k] for k in ("count", "cluster", "train_router")}
    for drafter_ref, refused in ((cfg.cluster.drafter, False), (str(body), True)):
        run_cfg = ds_cfg(cfg.workdir_path, "evaluate.methods=[dynaspec]", "evaluate.dynaspec_match=top_k_64",
                         f"evaluate.drafter={drafter_ref}")
        configurations = Configurations(run_cfg, target, tokenizer, {}, inputs, "cpu", lambda _line: None)
        drafter = load_model(drafter_ref, dtype="float32", device="cpu").eval()
        if not refused:
            configurations._policy(drafter, ["dynaspec"])
            continue
        with pytest.raises(DrafterError, match=r"hidden states of another drafter(.|\n)*tiny:test/drafter"):
            configurations._policy(drafter, ["dynaspec"])


def test_a_head_loaded_in_float16_matches_the_clustering_and_router_of_its_checkpoint(routed) -> None:
    """Heads were compared by their digest rounded to bfloat16. A drafter loaded in float16 (``target.dtype:
    float16``: evaluate loads its drafters in the target's dtype) rounds to bfloat16 through float16, so its digest
    differed and evaluate refused the right drafter's clustering. A float16 head is now compared with the float16
    digest the cluster and train_router stages record; another head is still refused."""
    from pipeline.dynaspec.router import load_router
    from pipeline.evaluation.configurations import Configurations
    from pipeline.models.loading import load_model, load_tokenizer

    cfg, artifacts = routed
    clustering = Clustering.load(artifacts["cluster"].path)
    drafter = load_model(cfg.cluster.drafter, dtype="float16", device="cpu").eval()
    head = drafter.get_output_embeddings().weight
    assert head.dtype == torch.float16 and head_sha256(head) != clustering.head_sha256  # what the old check compared
    clustering.check_head(head)
    load_router(artifacts["train_router"].path, clustering, head)
    run_cfg = ds_cfg(cfg.workdir_path, "evaluate.methods=[dynaspec]", "evaluate.dynaspec_match=top_k_64",
                     "target.dtype=float16")
    inputs = {k: artifacts[k] for k in ("count", "cluster", "train_router")}
    target = load_model(cfg.target.model, dtype="float16", device="cpu").eval()
    Configurations(run_cfg, target, load_tokenizer(cfg.target.model), {}, inputs, "cpu",
                   lambda _line: None)._policy(drafter, ["dynaspec"])
    other = head.clone()
    other[0, 0] += 0.5
    with pytest.raises(DrafterError, match=r"another LM head(.|\n)*\(float16\)"):
        clustering.check_head(other)
    with pytest.raises(DrafterError, match=r"trained on another drafter(.|\n)*\(float16\)"):
        load_router(artifacts["train_router"].path, clustering, other)


def test_kill_minus_9_then_rerun_ends_bit_identical(routed, tmp_path: Path) -> None:
    cfg, artifacts = routed
    art = artifacts["train_router"]
    workdir = tmp_path / "killed"
    inputs = named_inputs(art)
    (tmp_path / "base.yaml").write_text(f"workdir: {workdir}\n")
    cmd = [sys.executable, "-m", "jobs.cli", "train_router", "--config", str(tmp_path / "base.yaml"), *SMALL,
           *ROUTER, *inputs]
    landed = kill_after_checkpoint(cmd, workdir, at_step=8, total=24, stage="train_router")
    resumed = train_router.main(ds_cfg(workdir, *inputs))
    assert json.loads(resumed.file("training.json").read_text())["resumed_from"] == max(landed)
    assert resumed.id == art.id
    ours, reference = load_file(str(resumed.file("router.safetensors"))), load_file(str(art.file("router.safetensors")))
    assert ours.keys() == reference.keys()
    for key in ours:
        assert torch.equal(ours[key], reference[key]), key


def test_bad_input(routed, tmp_path: Path) -> None:
    """A drafter with another tokenizer, a router for another clustering, a match shortlist count does not
    have, bad cluster counts: clear errors before any decoding."""
    cfg, artifacts = routed
    with pytest.raises(DrafterError, match="cluster.clusters"):
        ds_cfg(tmp_path, "cluster.clusters=1")
    with pytest.raises(DrafterError, match="does not share the target's tokenizer|fewer LM-head rows"):
        cluster.main(ds_cfg(tmp_path, "cluster.drafter=tiny:test/drafter_other"))
    names = json.loads(artifacts["train_router"].file("router_config.json").read_text())
    shared = [f"evaluate.counts={artifacts['count'].path}", "evaluate.methods=[dynaspec]",
              "evaluate.prompts_per_task=1", "evaluate.max_new_tokens=4", "evaluate.sampling_check_samples=0",
              "evaluate.law_check_generations=0",
              "evaluate.register=false", "evaluate.dynaspec_match=top_k_64", "evaluate.tasks=[code]"]
    other = cluster.main(ds_cfg(tmp_path, "cluster.clusters=8"))  # another clustering of the same head
    with pytest.raises(DrafterError, match="trained for another token clustering"):
        evaluate.main(ds_cfg(tmp_path, *shared, f"evaluate.clusters={other.path}",
                             f"evaluate.router={artifacts['train_router'].path}"))
    with pytest.raises(DrafterError, match="dynaspec_match"):
        evaluate.main(ds_cfg(tmp_path, *shared, "evaluate.dynaspec_match=top_k_5",
                             f"evaluate.clusters={artifacts['cluster'].path}",
                             f"evaluate.router={artifacts['train_router'].path}"))
    assert names["clusters"] == artifacts["cluster"].id


@pytest.mark.gpu
def test_router_trains_under_lightning_deepspeed_and_routes_losslessly_on_gpu(routed, tmp_path: Path) -> None:
    """On a CUDA machine: train_router under Lightning's DeepSpeed ZeRO-2 strategy in bf16, end to end; then the
    routed proposer on the GPU, router on a side stream overlapping the drafter body, gives greedy output equal
    to the target's own and the same q as the same proposer without the side stream."""
    from pipeline.dynaspec.router import load_router
    from pipeline.engine.dynaspec import RoutedShortlistProposer
    from pipeline.engine.loop import generate_autoregressive, generate_speculative
    from pipeline.engine.sampling import SamplingParams
    from pipeline.engine.session import TargetState
    from pipeline.models.loading import load_model
    from pipeline.models.target import Target

    _, artifacts = routed
    gpu = ds_cfg(tmp_path, *named_inputs(artifacts["train_router"]), "train_router.train.strategy=deepspeed",
                 "train_router.train.accelerator=gpu", "train_router.train.devices=1", "train_router.train.bf16=true")
    art = train_router.main(gpu)
    training = json.loads(art.file("training.json").read_text())
    assert training["strategy"] == "deepspeed" and training["deepspeed_config"]["zero_optimization"]["stage"] == 2
    target = Target(gpu.target).model("cuda", dtype="float32")
    drafter = load_model(gpu.cluster.drafter, dtype="float32", device="cuda").eval()
    clustering = Clustering.load(artifacts["cluster"].path)
    router, _ = load_router(art.path, clustering, drafter.get_output_embeddings().weight)
    eos = [Target(gpu.target).tokenizer().eos_token_id]
    budget = ClusterBudget("pa", 4, 8)
    overlapped = RoutedShortlistProposer(drafter, clustering, router, budget, keep_ids=eos)
    plain = RoutedShortlistProposer(drafter, clustering, router, budget, keep_ids=eos, overlap=False)
    assert overlapped._side is not None and plain._side is None
    prompt = Target(gpu.target).tokenizer()("The weather today is")["input_ids"]
    greedy = SamplingParams()
    ar = generate_autoregressive(target, prompt, 24, greedy, torch.Generator(device="cuda").manual_seed(0), None)
    spec = generate_speculative(target, overlapped, prompt, 24, 4, greedy, torch.Generator(device="cuda"), None)
    assert spec.tokens == ar.tokens
    params = SamplingParams(temperature=1.0)
    a = overlapped.propose(prompt, 4, params, torch.Generator(device="cuda").manual_seed(1), TargetState())
    b = plain.propose(prompt, 4, params, torch.Generator(device="cuda").manual_seed(1), TargetState())
    assert a.token_list() == b.token_list()  # the tokens stay on the device: compare them as lists
    torch.testing.assert_close(a.q, b.q, rtol=0, atol=1e-6)
