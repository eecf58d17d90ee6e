"""Loading from the hub's local cache on a node that cannot reach the hub (fresh processes whose hub is a closed port,
or a local endpoint that answers as the hub's API does): a cached model or dataset loads without a network call, one
the cache lacks is refused after one question instead of minutes of retries, and a dataset read from ``datasets``' own
cache is used only at the commit the artifact ids name.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.checksums import StatCache
from pipeline.data.sources import load_conversations
from pipeline.errors import DrafterError
from pipeline.models import loading
from tests.helpers import hub_cache, offline_hub
from tests.mlflow_server import free_port


def _on_a_node_without_the_hub(cache: Path, setup: str, *loads: str, **env_vars: str) -> subprocess.CompletedProcess:
    """A fresh process whose hub is a closed port on this machine (a node without network), online mode as a user's
    shell leaves it (``env_vars`` set on top: another HF_ENDPOINT gives it a hub), running ``setup`` then each of ``loads`` (expressions); what each gave, in
    order: ``loaded <value>`` or ``refused <DrafterError>``, each ended by a \\x1e."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HUB_CACHE=str(cache), HF_ENDPOINT=f"http://127.0.0.1:{free_port()}")
    env.update(env_vars)
    script = "\n".join([setup, "from pipeline.errors import DrafterError",
                        *(f"try:\n    print('loaded', {load}, end='\\x1e')\n"
                          f"except DrafterError as err:\n    print('refused', err, end='\\x1e')" for load in loads)])
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parent.parent)


def test_a_cached_hub_model_loads_without_the_hub_and_an_absent_one_is_refused_at_once(tmp_path: Path,
                                                                                      tiny_kit) -> None:
    """On a node that cannot reach the hub, the loaders asked it for every file a pinned commit's snapshot lacked
    (optional ones included), five times each with backoff: about 45 s of "Retrying" warnings before refusing a model
    that was never downloaded, and as long for a downloaded one before loading it. Now the cache is read first without
    a network call, and a commit it does not hold is refused after one question to the hub."""
    cache = tmp_path / "hub"
    whole, partial, absent = "1" * 40, "2" * 40, "3" * 40
    hub_cache(cache, "org/cached", {whole: tiny_kit.path("target"), partial: tiny_kit.path("target")})
    (cache / "models--org--cached" / "snapshots" / partial / "model.safetensors").unlink()  # the tokenizer only
    done = _on_a_node_without_the_hub(cache, "from pipeline.models import loading", *(
        f"type(loading.{call}).__name__" for call in (
            f"load_tokenizer('org/cached', '{whole}')", f"load_model('org/cached', '{whole}')",
            f"load_tokenizer('org/cached', '{partial}')", f"load_model('org/cached', '{partial}')",
            f"load_tokenizer('org/absent', '{absent}')", f"load_model('org/absent', '{absent}')")))
    assert done.returncode == 0, done.stderr[-2000:]
    answers = done.stdout.split("\x1e")[:-1]
    tokenizer = type(loading.load_tokenizer(str(tiny_kit.path("target")))).__name__
    assert [answer.split(" ", 2)[:2] for answer in answers] == [
        ["loaded", tokenizer], ["loaded", "LlamaForCausalLM"], ["loaded", tokenizer],
        ["refused", "Could"], ["refused", "'org/absent'"], ["refused", "'org/absent'"]]
    assert "model.safetensors" in answers[3]  # the partial snapshot's missing file is named
    assert "is not in the local Hugging Face cache" in answers[4]
    assert f"hf download org/absent --revision {absent}" in answers[5]
    assert "Retrying" not in done.stderr  # no backoff against the unreachable hub
    assert "ConnectError" in answers[4]  # and the hub was asked: its answer is named


def test_a_damaged_file_in_a_cached_snapshot_is_named_with_how_to_download_it_again(
        tmp_path: Path, tiny_kit, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cut safetensors file in a downloaded snapshot got the advice for a hub id that does not exist ("Check the
    name; without network access download the checkpoint elsewhere"): now the snapshot is named, and how to fetch
    that commit again."""
    cache, commit = tmp_path / "hub", "4" * 40
    hub_cache(cache, "org/cut", {commit: tiny_kit.path("target")})
    offline_hub(cache, monkeypatch)
    snapshot = cache / "models--org--cut" / "snapshots" / commit
    weights = snapshot / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(DrafterError, match="Could not load 'org/cut': SafetensorError") as err:
        loading.load_model("org/cut", commit)
    assert f"the cached snapshot at {snapshot}" in err.value.found and "Check the name" not in err.value.fix
    assert f"`hf download org/cut --revision {commit} --force-download` (or delete {snapshot}" in err.value.fix


def test_a_downloaded_hub_dataset_loads_without_the_hub_and_gives_what_its_files_give(tmp_path: Path) -> None:
    """A hub dataset downloaded into the Hugging Face cache (`hf download --repo-type dataset`, which the README
    advises for nodes without network) was refused there: after ~25 s of `datasets`' retries online, and at once with
    HF_HUB_OFFLINE=1, since `datasets` reads only its own cache of an earlier load. Now its snapshot is read without
    asking `datasets` to reach the hub, online or offline, and gives the conversations its data file gives; a dataset
    never downloaded is still refused."""
    commit = "4" * 40
    rows = [{"id": f"chat{i}", "conversations": [{"from": "human", "value": f"What is {i} + {i}?"},
                                                 {"from": "gpt", "value": f"{i} + {i} is {2 * i}."}]}
            for i in range(12)]
    data = "\n".join(json.dumps(row) for row in rows) + "\n"
    repo = tmp_path / "hub" / "datasets--org--chats"
    blob = repo / "blobs" / "0f1e2d"
    blob.parent.mkdir(parents=True)
    blob.write_text(data)
    (repo / "snapshots" / commit / "data").mkdir(parents=True)
    (repo / "snapshots" / commit / "data" / "train.jsonl").symlink_to(Path("../../../blobs/0f1e2d"))  # as hf leaves it
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    local = tmp_path / "chats.jsonl"
    local.write_text(data)
    want = json.dumps([[c.id, c.messages] for c in load_conversations(str(local))[0]])
    loads = ["json.dumps([[c.id, c.messages] for c in load_conversations('org/chats')[0]])",
             "load_conversations('org/chats')[1].notes[-1]"]
    setup = "import json\nfrom pipeline.data.sources import load_conversations"
    for offline in ("0", "1"):  # online, the absent dataset would cost datasets' ~25 s of retries: asked offline only
        absent = [f"load_conversations('org/absent', revision='{'5' * 40}')[1]"] if offline == "1" else []
        done = _on_a_node_without_the_hub(tmp_path / "hub", setup, *loads, *absent, HF_HUB_OFFLINE=offline,
                                          HF_DATASETS_CACHE=str(tmp_path / f"datasets-{offline}"))
        assert done.returncode == 0, done.stderr[-2000:]
        answers = done.stdout.split("\x1e")[:-1]
        assert answers[0] == f"loaded {want}"
        assert answers[1] == f"loaded read from the Hugging Face cache's snapshot of commit {commit[:12]} as it is: " \
                             "the hub did not list the commit's files, so it was not checked to be whole"
        if absent:
            assert answers[2].startswith("refused Could not load 'org/absent'")
        else:
            assert len(answers) == 2
        assert "Retrying" not in done.stderr


def _fake_hub(files: dict[str, str], *, status: int | None = None) -> Iterator[str]:
    """A local HTTP endpoint that serves one hub dataset, ``org/chats``, as the hub's API does for what
    ``huggingface_hub`` and ``datasets`` ask: its info at any commit (the names of ``files`` as its files), its tree,
    and each file's text; 404 to everything else. Its URL. With ``status``, every
    request is answered with that status (a hub that is failing or overloaded)."""
    def listing(folder: str) -> list[dict]:
        prefix = f"{folder}/" if folder else ""
        entries = sorted({prefix + name[len(prefix):].split("/")[0] for name in files if name.startswith(prefix)})
        return [{"type": "file", "path": e, "size": len(files[e].encode()), "oid": "f" * 40} if e in files
                else {"type": "directory", "path": e, "oid": "d" * 40} for e in entries]

    class Hub(http.server.BaseHTTPRequestHandler):
        def answer(self) -> None:
            path = self.path.split("?")[0]
            code, kind, body, commit = 404, "application/json", b"{}", ""
            if match := re.fullmatch(r"/api/datasets/org/chats/revision/(\w+)", path):
                commit = match[1]
                code, body = 200, json.dumps({"id": "org/chats", "sha": commit,
                                              "siblings": [{"rfilename": f} for f in files]}).encode()
            elif match := re.fullmatch(r"/api/datasets/org/chats/tree/(\w+)/?(.*)", path):
                commit = match[1]
                code, body = 200, json.dumps(listing(match[2])).encode()
            elif (match := re.fullmatch(r"/datasets/org/chats/resolve/(\w+)/(.+)", path)) and match[2] in files:
                commit = match[1]
                code, kind, body = 200, "text/plain", files[match[2]].encode()
            code = status or code
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("ETag", f'"{hashlib.sha1(body).hexdigest()}"')
            self.send_header("X-Repo-Commit", commit)
            if code == 404:
                self.send_header("X-Error-Code", "EntryNotFound")
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(body)

        do_GET = do_HEAD = answer

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def test_a_cached_hub_dataset_is_read_once_the_hub_lists_no_file_it_lacks(tmp_path: Path) -> None:
    """Where the hub answers, the snapshot is read when it holds every file the hub lists for the commit; one that
    lacks a listed file (an interrupted download) is not read as the whole dataset: ``datasets`` is asked for it."""
    commit = "6" * 40
    snapshot = tmp_path / "hub" / "datasets--org--chats" / "snapshots" / commit
    (snapshot / "data").mkdir(parents=True)
    chats = [json.dumps({"id": f"c{i}", "conversations": [{"from": "human", "value": f"Hi {i}?"},
                                                          {"from": "gpt", "value": "Hello."}]}) + "\n" for i in (0, 1)]
    (snapshot / "data" / "train.jsonl").write_text(chats[0])
    setup = "from pipeline.data.sources import load_conversations\nfrom pipeline.hub import snapshot_gaps"
    loads = (f"snapshot_gaps('org/chats', '{commit}', 'dataset')",
             f"sorted(c.id for c in load_conversations('org/chats', revision='{commit}')[0])",
             f"' | '.join(load_conversations('org/chats', revision='{commit}')[1].notes)")
    for files, gaps in (({"data/train.jsonl": chats[0]}, []),
                        ({"data/train.jsonl": chats[0], "data/train-2.jsonl": chats[1]}, ["data/train-2.jsonl"])):
        with contextlib.contextmanager(_fake_hub)(files) as endpoint:
            done = _on_a_node_without_the_hub(tmp_path / "hub", setup, *loads, HF_ENDPOINT=endpoint,
                                              HF_DATASETS_CACHE=str(tmp_path / f"datasets-{len(files)}"))
        assert done.returncode == 0, done.stderr[-2000:]
        answers = done.stdout.split("\x1e")[:-1]
        assert answers[0] == f"loaded {gaps}"
        # without gaps the snapshot is read; with one, datasets fetches the commit from the hub, completing the
        # snapshot, which the next load reads
        assert answers[1:] == [f"loaded {['c0', 'c1'] if gaps else ['c0']}",
                               f"loaded read from the Hugging Face cache's snapshot of commit {commit[:12]}"]


def test_a_hub_dataset_datasets_cached_is_read_at_once_without_the_hub_and_only_at_the_planned_commit(
        tmp_path: Path) -> None:
    """A hub dataset not in the Hugging Face cache went to ``datasets``, which, on a node whose hub does not answer,
    retried every request for ~25 s before reading its own cache of an earlier load: its latest copy, of whatever
    commit, while the ids named the pinned one. Now the hub is asked once; when it is silent ``datasets`` reads its
    cache at once, and that copy is used only when it is of the planned commit."""
    commit, other = "8" * 40, "9" * 40
    rows = [{"id": f"chat{i}", "conversations": [{"from": "human", "value": f"Name {i} colours."},
                                                 {"from": "gpt", "value": f"Red and {i} more."}]} for i in range(6)]
    data = "\n".join(json.dumps(row) for row in rows) + "\n"
    local = tmp_path / "chats.jsonl"
    local.write_text(data)
    want = json.dumps([[c.id, c.messages] for c in load_conversations(str(local))[0]])
    setup = "import json\nfrom pipeline.data.sources import load_conversations"
    load = "json.dumps([[c.id, c.messages] for c in load_conversations('org/chats', revision='{}')[0]])"
    ds_cache = str(tmp_path / "datasets")
    with contextlib.contextmanager(_fake_hub)({"data/train.jsonl": data}) as endpoint:  # a first load, hub reachable
        done = _on_a_node_without_the_hub(tmp_path / "hub", setup, load.format(commit),
                                          f"load_conversations('org/absent', revision='{other}')",
                                          HF_ENDPOINT=endpoint, HF_DATASETS_CACHE=ds_cache)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded, refused = done.stdout.split("\x1e")[:-1]
    assert loaded == f"loaded {want}"
    # a hub that answers "no such dataset" is not silent: datasets is asked, and refuses without retrying
    assert refused.startswith("refused Could not load 'org/absent'") and "the hub did not answer" not in refused
    assert "Retrying" not in done.stderr
    shutil.rmtree(tmp_path / "hub" / "datasets--org--chats")  # the hub cache pruned; datasets' own cache kept
    done = _on_a_node_without_the_hub(
        tmp_path / "hub", setup, load.format(commit), f"load_conversations('org/chats', revision='{commit}')[1].notes[-1]",
        load.format(other), f"load_conversations('org/absent', revision='{other}')", "load_conversations('org/absent')",
        HF_DATASETS_CACHE=ds_cache)
    assert done.returncode == 0, done.stderr[-2000:]
    answers = done.stdout.split("\x1e")[:-1]
    # unpinned and never downloaded: refused, saying the hub did not answer and how to download it elsewhere
    assert answers[4].startswith("refused Could not load 'org/absent'") and "the hub did not answer" in answers[4]
    assert "`hf download org/absent --repo-type dataset`" in answers[4], answers[4]
    assert answers[0] == f"loaded {want}"
    assert answers[1] == f"loaded read from datasets' own cache of an earlier load of commit {commit[:12]}: the hub " \
                         "did not answer (ConnectError: [Errno 111] Connection refused)"
    assert answers[2].startswith("refused datasets' own cache holds another copy of 'org/chats'")
    assert f"expected: commit {other[:12]}" in answers[2] and f"latest cached copy is of {commit[:12]}" in answers[2]
    assert answers[3].startswith("refused Could not load 'org/absent'")
    assert "the hub did not answer (ConnectError" in answers[3]
    assert f"hf download org/absent --revision {other} --repo-type dataset" in answers[3]
    assert "Retrying" not in done.stderr
    # a failing hub (503, which huggingface_hub retries with backoff) is as silent as an unreachable one
    with contextlib.contextmanager(_fake_hub)({"data/train.jsonl": data}, status=503) as endpoint:
        done = _on_a_node_without_the_hub(tmp_path / "hub", setup, load.format(commit),
                                          f"load_conversations('org/chats', revision='{commit}')[1].notes[-1]",
                                          HF_ENDPOINT=endpoint, HF_DATASETS_CACHE=ds_cache)
    assert done.returncode == 0, done.stderr[-2000:]
    answers = done.stdout.split("\x1e")[:-1]
    assert answers[0] == f"loaded {want}"
    assert answers[1].startswith(f"loaded read from datasets' own cache of an earlier load of commit {commit[:12]}: "
                                 "the hub did not answer (HfHubHTTPError: Server error '503")
    assert "Retrying" not in done.stderr
    # a hub that answers but refuses the pinned commit (404: deleted, private, gated): datasets falls back to its
    # latest cached copy, of another commit, which is refused
    with contextlib.contextmanager(_fake_hub)({"data/train.jsonl": data}, status=404) as endpoint:
        done = _on_a_node_without_the_hub(tmp_path / "hub", setup, load.format(other), HF_ENDPOINT=endpoint,
                                          HF_DATASETS_CACHE=ds_cache)
    assert done.returncode == 0, done.stderr[-2000:]
    [answer] = done.stdout.split("\x1e")[:-1]
    assert answer.startswith("refused datasets' own cache holds another copy of 'org/chats'")
    assert f"the hub did not give commit {other[:12]}; datasets' latest cached copy is of {commit[:12]}" in answer


def test_a_cached_snapshot_whose_weights_changed_on_disk_is_refused_naming_the_blob(
        tmp_path: Path, tiny_kit, monkeypatch: pytest.MonkeyPatch) -> None:
    """Artifact ids name a hub model by its commit alone: weights changed in the cache after the download (a flipped
    bit on shared storage, a file converted in place) still parse, so every stage published under the commit's ids what
    other weights computed, exit 0. Each safetensors blob the snapshot links is now checked against its name, the
    sha256 the hub gave it: once, then a stat per load."""
    cache, commit = tmp_path / "hub", "5" * 40
    hub_cache(cache, "org/rot", {commit: tiny_kit.path("target")}, blobs=True)
    offline_hub(cache, monkeypatch)
    monkeypatch.setenv("DRAFTER_CACHE", str(tmp_path / "drafter"))  # the weights' stat cache, fresh
    weights = cache / "models--org--rot" / "snapshots" / commit / "model.safetensors"
    blob = weights.resolve()
    assert weights.is_symlink() and len(blob.name) == 64
    stats = StatCache(tmp_path / "stat.json")
    loading.check_snapshot_blobs("org/rot", commit, loading.WEIGHT_FILES, stats)
    loading.check_snapshot_blobs("org/rot", commit, loading.WEIGHT_FILES, stats)
    assert stats.hashed == 1  # the second load only stats the blob
    assert type(loading.load_model("org/rot", commit)).__name__ == "LlamaForCausalLM"

    data = bytearray(blob.read_bytes())
    data[-7] ^= 0x01  # one bit of the last weight: the file still parses and loads
    blob.write_bytes(bytes(data))
    with pytest.raises(DrafterError, match="The cached file model.safetensors of 'org/rot' at commit 5{40} is not"):
        loading.check_snapshot_blobs("org/rot", commit, loading.WEIGHT_FILES, stats)
    with pytest.raises(DrafterError, match="is not the file the hub served") as err:
        loading.load_model("org/rot", commit)
    assert blob.name in err.value.expected and f"hf download org/rot --revision {commit} --force-download" in err.value.fix
    assert type(loading.load_tokenizer("org/rot", commit)).__name__  # the tokenizer reads none of the weights
