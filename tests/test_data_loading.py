"""Streaming loader partitioning: data-parallel ranks read disjoint samples, tensor-parallel
peers identical ones."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.dist_utils import spawn
from tests.parallel_checks import loader_batches
from tests.synthetic import use_disk_urls, write_synthetic_shards


def test_dp_ranks_disjoint_tp_peers_identical(tmp_path):
    root = write_synthetic_shards(tmp_path / "data", train=128)
    spawn(loader_batches, 4, str(root), str(tmp_path), tensor=2)  # ranks (0,1) and (2,3) are TP peers
    seen = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    assert torch.equal(seen[0], seen[1]) and torch.equal(seen[2], seen[3])
    rows = lambda t: {tuple(r.tolist()) for r in t}  # noqa: E731
    assert len(rows(seen[0])) == 12 and not rows(seen[0]) & rows(seen[2])


def stride(sample: torch.Tensor) -> int:
    """write_synthetic_shards' samples count upward by a stride that depends on the sample index."""
    return int((sample[1] - sample[0]) % 252)


def test_mixture_draws_each_source_by_weight(tmp_path):
    from pretrain.config import load_config
    from pretrain.data import build_loader

    # seed 0: sample indices 0-255, strides 1-2; seed 1000: indices 1000-1255, strides 4-5.
    web = write_synthetic_shards(tmp_path / "web", seed=0)
    code = write_synthetic_shards(tmp_path / "code", seed=1000)
    mix = f"[{{shards: {web / 'shards'}, weight: 3, name: web}}, {{shards: {code / 'shards'}, name: code}}]"
    cfg = load_config(None, [f"data.mix={mix}", "train.micro_batch=8", "model.max_seq_len=32"])
    samples = torch.cat(list(build_loader(cfg, "train", shuffle=True)))  # one epoch: 256 + 256 samples
    sources = [("web" if stride(s) <= 2 else "code") for s in samples]
    assert len(samples) == 512 and sources.count("web") == 384 and sources.count("code") == 128
    rows = {name: [tuple(s.tolist()) for s, src in zip(samples, sources) if src == name] for name in ("web", "code")}
    assert len(set(rows["web"])) == 256  # 384 draws cover all 256 samples, some twice
    assert len(set(rows["code"])) == 128  # 128 draws, none repeated


def test_start_with_bos_prepends_bos_to_every_sample(tmp_path):
    import json

    import pytest

    from pretrain.config import ConfigError, load_config, validate_data
    from pretrain.data import build_loader, load_val_sets
    from tests.dist_utils import single_process_group

    root = write_synthetic_shards(tmp_path / "data", train=16, val=8)
    base = [f"data.shards={root}/shards", f"data.tokenizer={root}/tokenizer", "train.micro_batch=4",
            "model.max_seq_len=32", "model.vocab_size=256", "train.eval_batches=2"]
    plain, bos = load_config(None, base), load_config(None, base + ["data.start_with_bos=true"])
    validate_data(bos)
    with single_process_group():
        a, b = (torch.cat(list(build_loader(c, "train", shuffle=False))) for c in (plain, bos))
        va, vb = (torch.cat(load_val_sets(c)[""]) for c in (plain, bos))
    assert a.shape == b.shape == (16, 33) and (a[:, 0] != 1).all()
    for raw, started in ((a, b), (va, vb)):  # training and validation alike
        assert (started[:, 0] == 1).all() and torch.equal(started[:, 1:], raw[:, :-1])
    from pretrain.data import starting_with

    # A sample that already begins with BOS keeps it (and its last token), once.
    assert starting_with(torch.tensor([[1, 5, 6], [7, 8, 9]]), 1).tolist() == [[1, 5, 6], [1, 7, 8]]
    manifest = root / "shards" / "manifest.json"
    kept = {k: v for k, v in json.loads(manifest.read_text()).items() if k != "bos_id"}
    manifest.write_text(json.dumps(kept))
    with pytest.raises(ConfigError, match="start_with_bos=true needs the BOS id"):
        validate_data(bos)


def test_an_empty_val_index_is_no_val_split(tmp_path, capsys):
    """Shards whose val split holds no sample (built with --val-fraction 0 before such builds left out
    val/index.json) train without validation instead of failing in the streaming library."""
    from pretrain.config import load_config
    from pretrain.data import load_val_sets
    from tests.dist_utils import single_process_group

    root = write_synthetic_shards(tmp_path / "data", train=16, val=0)
    cfg = load_config(None, [f"data.shards={root}/shards", "train.micro_batch=4", "model.max_seq_len=32",
                             "train.eval_batches=2", f"data.cache={tmp_path}/cache"])
    with single_process_group():
        assert load_val_sets(cfg) == {}
        full = write_synthetic_shards(tmp_path / "full", train=16, val=8)
        cfg.data.shards = f"{full}/shards"
        assert len(load_val_sets(cfg)[""]) == 2
        # A split smaller than eval_batches x micro_batch: fewer batches, no sample twice (it would
        # weigh double in val/loss), and the start says so.
        cfg.train.eval_batches = 5
        capsys.readouterr()
        rows = torch.cat(load_val_sets(cfg)[""])
        assert len(rows) == 8 and len({tuple(r.tolist()) for r in rows}) == 8
        assert "holds 8 samples, 2 batches of train.micro_batch=4" in capsys.readouterr().out
        # In a mixture, a source without val split is left out of val/loss, and the start says so.
        cfg = load_config(None, [f"data.mix=[{{shards: {root}/shards, name: web}}, {{shards: {full}/shards}}]",
                                 "train.micro_batch=4", "model.max_seq_len=32", f"data.cache={tmp_path}/cache"])
        assert list(load_val_sets(cfg)) == ["shards"]
        assert "data.mix entry 'web' has no val split (built with --val-fraction 0)" in capsys.readouterr().out


def test_each_data_parallel_rank_validates_on_its_own_samples_each_once(tmp_path, monkeypatch, capsys):
    """12 val samples, micro-batch 4, two data-parallel ranks: one batch each (8 samples), disjoint,
    no sample read twice to fill train.eval_batches."""
    from pretrain import data
    from pretrain.config import load_config
    from tests.dist_utils import single_process_group

    root = write_synthetic_shards(tmp_path / "data", train=16, val=12)
    cfg = load_config(None, [f"data.shards={root}/shards", "train.micro_batch=4", "model.max_seq_len=32",
                             "train.eval_batches=4", f"data.cache={tmp_path}/cache"])
    rows = []
    with single_process_group():
        alone = data.load_val_sets(cfg)[""]
        monkeypatch.setattr(data.ps, "get_data_parallel_world_size", lambda: 2)
        for rank in (0, 1):
            monkeypatch.setattr(data.ps, "get_data_parallel_rank", lambda: rank)
            batches = data.load_val_sets(cfg)[""]
            assert len(batches) == 1, rank
            rows += [tuple(row.tolist()) for row in batches[0]]
    assert len(rows) == len(set(rows)) == 8
    # Rank 0's first batch, the sink metrics' probe, is the same at any data-parallel size.
    assert [tuple(row.tolist()) for row in alone[0]] == rows[:4]
    assert "holds 12 samples, 1 batches of train.micro_batch=4 x 2 data-parallel ranks" in capsys.readouterr().out


def test_a_remote_source_without_val_split_trains_without_validation(tmp_path, monkeypatch, capsys):
    """Remote shards (any URL streaming downloads from) are checked for a val split by their index,
    as local ones are; here the "remote" is a directory under a URL scheme of the test's own."""
    from streaming.base.storage import download

    from pretrain.config import load_config
    from pretrain.data import REMOTE_INDEXES, _split_location, load_val_sets, resumed_position, sources_record
    from tests.dist_utils import single_process_group

    monkeypatch.setattr(download, "DOWNLOADER_MAPPINGS", dict(download.DOWNLOADER_MAPPINGS))
    use_disk_urls()
    without = write_synthetic_shards(tmp_path / "without", train=16, val=0)
    (without / "shards" / "val" / "index.json").unlink(missing_ok=True)  # as --val-fraction 0 builds now
    full = write_synthetic_shards(tmp_path / "full", train=16, val=8)
    base = ["train.micro_batch=4", "model.max_seq_len=32", "train.eval_batches=2"]
    with single_process_group():
        for shards in (f"disk://{without}/shards", f"disk://{tmp_path}/nowhere"):
            cfg = load_config(None, [f"data.shards={shards}", f"data.cache={tmp_path}/cache", *base])
            assert load_val_sets(cfg) == {}, shards
        remote = load_config(None, [f"data.shards=disk://{full}/shards", f"data.cache={tmp_path}/cache2", *base])
        local = load_config(None, [f"data.shards={full}/shards", f"data.cache={tmp_path}/cache3", *base])
        got, want = load_val_sets(remote)[""], load_val_sets(local)[""]
        # Other shards at another URL through the same cache (a moved data.shards, a shared data.cache):
        # read from there, not from the copy of the first.
        other = write_synthetic_shards(tmp_path / "other", train=16, val=8, seed=500)
        moved = load_config(None, [f"data.shards=disk://{other}/shards", f"data.cache={tmp_path}/cache2", *base])
        got_other = load_val_sets(moved)[""]
        want_other = load_val_sets(load_config(None, [f"data.shards={other}/shards", *base]))[""]
        # A run on local compressed shards through the same cache keeps the remote copies.
        load_val_sets(load_config(None, [f"data.shards={other}/shards", f"data.cache={tmp_path}/cache2", *base]))
        remote_copies = [_split_location(c, c.data.sources[0], "val")["local"] for c in (remote, moved)]
        assert all(Path(copy, "index.json").is_file() for copy in remote_copies)
    assert len(got) == 2 and all(torch.equal(g, w) for g, w in zip(got, want))
    assert not torch.equal(got_other[0], got[0]) and all(torch.equal(g, w) for g, w in zip(got_other, want_other))
    # The same URL rebuilt (another index; a new process downloads it): its new shards, not the
    # cached copy of the old ones, which goes; and a resume notices the change.
    record = sources_record(remote)
    shutil.rmtree(full / "shards")
    write_synthetic_shards(full, train=16, val=8, seed=700)
    REMOTE_INDEXES.clear()
    with single_process_group():
        rebuilt = load_val_sets(remote)[""]
        want_rebuilt = load_val_sets(load_config(None, [f"data.shards={full}/shards", *base]))[""]
    assert not torch.equal(rebuilt[0], got[0]) and all(torch.equal(g, w) for g, w in zip(rebuilt, want_rebuilt))
    current = Path(_split_location(remote, remote.data.sources[0], "val")["local"])
    assert current != Path(remote_copies[0]) and Path(remote_copies[0], "index.json").is_file()
    assert f"was rebuilt since data.cache took copies of it ({remote_copies[0]}): this run reads the new one" \
        in capsys.readouterr().out
    assert Path(remote_copies[1], "index.json").is_file()  # another URL's copy stays
    saved = {"epoch": 0, "sample_in_epoch": 8}
    assert resumed_position(saved, {"data_sources": record}, remote)[1] is not None
    legacy = [{**record[0], "train_index": None}]  # recorded before remote indexes were: same place, same data
    assert resumed_position(saved, {"data_sources": legacy}, remote) == (saved, None)


def _remote_index_of(rank: int, shards: str, stale: bytes, cache: str) -> None:
    import torch.distributed as dist

    from pretrain.config import load_config
    from pretrain.data import REMOTE_INDEXES, _split_location, share_remote_indexes, sources_record

    use_disk_urls()
    os.environ["SLURMD_NODENAME"] = f"node{rank}"  # a node each, each with its own cache folder
    cfg = load_config(None, [f"data.shards={shards}", f"data.cache={cache}"])
    if rank == 1:  # read before the set was rebuilt at the same URL
        REMOTE_INDEXES[f"{shards}/train"] = stale
    share_remote_indexes(cfg)
    local = Path(_split_location(cfg, cfg.data.sources[0], "train")["local"])
    seen = [None, None]
    dist.all_gather_object(seen, ((local / "index.json").read_bytes(), sources_record(cfg)))
    assert seen[0] == seen[1], f"rank {rank}: the ranks read different versions of the train index"


def test_every_rank_reads_rank_zeros_version_of_a_remote_index(tmp_path):
    """A remote set rebuilt while a job starts: ranks that each downloaded the index would read
    different samples (streaming reads the index it finds in the cache) and record different data."""
    current = write_synthetic_shards(tmp_path / "current", train=16)
    stale = write_synthetic_shards(tmp_path / "stale", train=24, seed=500) / "shards" / "train" / "index.json"
    spawn(_remote_index_of, 2, f"disk://{current}/shards", stale.read_bytes(), str(tmp_path / "cache"))
    copies = sorted((tmp_path / "cache").glob("node*/shards/train@*/index.json"))
    assert len(copies) == 2 and all(c.read_bytes() == (current / "shards/train/index.json").read_bytes() for c in copies)


def test_local_compressed_shards_decompress_into_the_cache(tmp_path, monkeypatch):
    """Read in place, streaming would write each decompressed shard next to its .zstd file (a
    read-only dataset fails; nodes sharing the folder race on one temporary name). They go to the
    cache, in the node's own folder, under a name that changes when the shards are rebuilt."""

    from pretrain.config import DataSource, load_config
    from pretrain.data import build_loader, load_val_sets, read_samples
    from tests.dist_utils import single_process_group

    monkeypatch.setenv("SLURMD_NODENAME", "n7")
    (tmp_path / "cache" / "shards" / "train-0123456789ab").mkdir(parents=True)  # from before node folders
    root = write_synthetic_shards(tmp_path / "data", train=16, val=8)
    shards = root / "shards"
    cfg = load_config(None, [f"data.shards={shards}", "train.micro_batch=4", "model.max_seq_len=32",
                             "train.eval_batches=2", f"data.cache={tmp_path}/cache"])
    with single_process_group():
        first = torch.cat(list(build_loader(cfg, "train", shuffle=False)))
        val = torch.cat(load_val_sets(cfg)[""])
    assert torch.equal(read_samples(shards / "val", 8), val)
    assert first.shape == (16, 33) and len(list(shards.rglob("*.mds.zstd"))) == 2
    # A held-out set of the same name (eval.val_sets) is cached apart: each removes other copies in its folder
    from pretrain.data import _split_location

    train_copy = Path(_split_location(cfg, cfg.data.sources[0], "train")["local"])
    held_copy = Path(_split_location(cfg, DataSource("shards", str(shards)), "train", held_out=True)["local"])
    assert train_copy.is_dir() and held_copy.parent != train_copy.parent
    assert not list(shards.rglob("*.mds")) and len(list((tmp_path / "cache").rglob("*.mds"))) == 2
    assert not (tmp_path / "cache" / "shards").exists() or not list((tmp_path / "cache" / "shards").iterdir())
    shutil.rmtree(shards)
    write_synthetic_shards(tmp_path / "data", train=16, val=8, seed=500)  # rebuilt in place
    with single_process_group():
        again = torch.cat(list(build_loader(cfg, "train", shuffle=False)))
    assert again.shape == first.shape and not torch.equal(again, first)
    assert len(list((tmp_path / "cache" / "n7" / "shards").glob("train-*"))) == 1  # the old copy is gone


def test_an_epoch_without_a_micro_batch_is_a_clear_error():
    """Remote shards too small for one micro-batch per rank (validate_data checks local ones)."""
    from pretrain.data import Batches

    with pytest.raises(RuntimeError, match="lower train.micro_batch"):
        next(Batches([]))
    batches = Batches([[1], [2]])
    assert [next(batches) for _ in range(3)] == [[1], [2], [1]]  # a new epoch after the last


def test_tools_read_shards_beside_a_run_without_releasing_shared_memory(tmp_path, monkeypatch):
    """Tools read through a temporary local folder and release no streaming shared memory: a
    training start does that, before its first dataset (test_a_start_releases_...)."""
    import pretrain.data
    import pretrain.shared_memory
    from pretrain.config import load_config
    from pretrain.data import load_val_batches, read_samples
    from tests.dist_utils import single_process_group

    def released(cache):
        raise AssertionError("a tool released the node's streaming shared memory")

    monkeypatch.setattr(pretrain.shared_memory, "release_stale", released)
    monkeypatch.setattr(pretrain.data, "_released", False)  # as in a tool's own process
    root = write_synthetic_shards(tmp_path / "data", train=16, val=8)
    rows = read_samples(root / "shards" / "val", 10)
    assert rows.shape == (10, 33) and torch.equal(rows[8], rows[0])  # 8 samples, wrapped around
    cfg = load_config(None, [f"data.shards={root / 'shards'}", "model.max_seq_len=32", "train.micro_batch=2",
                             "train.eval_batches=2"])
    with single_process_group():
        batches = load_val_batches(cfg, apart=True)
    assert [b.shape for b in batches] == [(2, 33), (2, 33)] and torch.equal(batches[0], rows[:2])


def test_datasets_on_a_node_are_built_one_job_at_a_time(tmp_path):
    """Streaming's ranks each scan /dev/shm for a dataset's prefix: another job creating one in
    between made them disagree. A build waits while another holds the node's lock."""
    import fcntl
    import threading
    import time

    from pretrain import shared_memory
    from pretrain.data import read_samples

    root = write_synthetic_shards(tmp_path / "data", train=16, val=8)
    shared_memory._owners_dir().mkdir(exist_ok=True)
    result = {}
    with open(shared_memory.CREATE_LOCK, "a+") as held:  # another job building
        fcntl.flock(held, fcntl.LOCK_EX)
        reader = threading.Thread(target=lambda: result.update(rows=read_samples(root / "shards" / "val", 2)))
        reader.start()
        time.sleep(1.0)
        assert reader.is_alive() and not result  # waiting for the lock
    reader.join(timeout=60)
    assert result["rows"].shape == (2, 33)


def test_two_multi_node_jobs_sharing_nodes_take_the_locks_without_deadlock(tmp_path, monkeypatch):
    """Jobs A (nodes X, Y) and B (Y, X), simulated by threads, each node's first rank one thread:
    A holding X's lock and B holding Y's while waiting for the other deadlocked both jobs until
    their barrier timed out. A job takes all its nodes' locks or none."""
    import fcntl
    import threading
    import time

    import torch
    import torch.distributed as dist

    import pretrain.distributed
    from pretrain import shared_memory

    local = threading.local()
    monkeypatch.setattr(shared_memory, "_open_create_lock", lambda: open(tmp_path / f"{local.node}.lock", "a+"))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(pretrain.distributed, "device", lambda: torch.device("cpu"))

    class Job:  # the collectives of a two-rank job
        def __init__(self):
            self.values, self.result = [], None
            self.gather = threading.Barrier(2, action=self.reduce, timeout=20)
            self.barrier = threading.Barrier(2, timeout=20)

        def reduce(self):
            self.result, self.values = min(self.values), []

        def all_reduce(self, tensor, op=None):
            self.values.append(float(tensor.item()))
            self.gather.wait()
            tensor.fill_(self.result)
            self.barrier.wait()  # every rank read the result before the next round

    jobs = {"A": Job(), "B": Job(), "C": Job()}
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, op=None: jobs[local.job].all_reduce(tensor, op))
    monkeypatch.setattr(dist, "barrier", lambda: jobs[local.job].barrier.wait())
    monkeypatch.setattr(shared_memory, "_node_leader", lambda: local.leader)
    holders, overlaps, done = {"X": set(), "Y": set()}, [], []

    def rank(job: str, node: str, delay: float, leader: bool = True):
        local.job, local.node, local.leader = job, node, leader
        time.sleep(delay)
        with shared_memory.creating_datasets():
            holders[node].add(job)
            if len(holders[node]) > 1:
                overlaps.append(node)
            time.sleep(0.2)  # building
            holders[node].discard(job)
        done.append((job, node))

    threads = [threading.Thread(target=rank, args=a, daemon=True)
               for a in (("A", "X", 0), ("B", "Y", 0), ("A", "Y", 0.3), ("B", "X", 0.3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(done) == [("A", "X"), ("A", "Y"), ("B", "X"), ("B", "Y")] and not overlaps
    # Job C: two ranks of node X, the second holding no lock, while another job holds X's a while
    held = open(tmp_path / "X.lock", "a+")
    fcntl.flock(held, fcntl.LOCK_EX)
    threads = [threading.Thread(target=rank, args=a, daemon=True) for a in (("C", "X", 0), ("C", "X", 0, False))]
    for t in threads:
        t.start()
    time.sleep(0.5)
    held.close()
    for t in threads:
        t.join(timeout=60)
    assert sorted(done)[-2:] == [("C", "X"), ("C", "X")]


def test_a_run_starting_on_the_node_keeps_a_live_runs_loader_state(tmp_path, monkeypatch):
    """A start releases only the shared memory of exited processes. streaming's own cleaner cleared
    a live run's too: a resumed run's next checkpoint then counted its position from the resume."""
    import tempfile

    import pretrain.data
    from pretrain.config import load_config
    from pretrain.data import Batches, build_loader

    (tmp_path / "locks").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "locks"))  # no filelocks: prefixes from 0
    root = write_synthetic_shards(tmp_path / "data", train=32)

    def start(run: str, in_new_process: bool) -> Batches:
        if in_new_process:
            monkeypatch.setattr(pretrain.data, "_released", False)
        cfg = load_config(None, [f"data.shards={root / 'shards'}", "model.max_seq_len=32",
                                 "train.micro_batch=2", "data.num_workers=0", f"run.dir={tmp_path / run}"])
        return Batches(build_loader(cfg, "train", shuffle=False))

    first = start("first", True)
    for _ in range(5):
        next(first)
    resumed = start("first", False)
    resumed.load_state_dict(first.state_dict())
    next(resumed), next(resumed)
    assert resumed.state_dict()["sample_in_epoch"] == 14
    start("second", True)  # another run starts on this node
    assert resumed.state_dict()["sample_in_epoch"] == 14


def test_a_start_releases_only_what_exited_processes_left(tmp_path, monkeypatch):
    import os
    import subprocess
    import sys
    import tempfile

    from streaming.base.shared.prefix import _pack_locals

    from pretrain import shared_memory

    shm, locks, cache = tmp_path / "shm", tmp_path / "locks", tmp_path / "cache" / "run" / "node"
    shm.mkdir(), locks.mkdir()
    monkeypatch.setattr(shared_memory, "SHM_DIR", shm)
    monkeypatch.setattr(tempfile, "tempdir", str(locks))
    exited = subprocess.Popen(["true"])
    exited.wait()

    def blocks(prefix: int, local: Path, owner: int | None = None, recorded: Path | None = None,
               namespace: str | None = None, locked: bool = False) -> Path:
        (shm / f"{prefix:06}_locals").write_bytes(_pack_locals([str(local)], prefix))
        (shm / f"{prefix:06}_resume").write_bytes(b"{}")
        (locks / f"{prefix:06}_cache_filelock").touch()
        entry = shared_memory._owners_dir() / f"{prefix:06}.{owner}"
        if owner is not None:
            shared_memory._owners_dir().mkdir(exist_ok=True)
            record = {"start": shared_memory._start_time(owner), "locals": [str(recorded or local)],
                      "pid_namespace": namespace or shared_memory._pid_namespace(), "locked": locked}
            entry.write_text(json.dumps(record))
        return entry

    blocks(1, tmp_path / "elsewhere", owner=exited.pid)  # a killed run's: released
    blocks(2, cache / "shards" / "train", owner=os.getpid())  # in use here: kept
    blocks(3, tmp_path / "elsewhere", owner=None)  # unregistered, another program's perhaps: kept
    blocks(4, cache / "shards" / "val", owner=None)  # unregistered in this run's cache: released
    # An exited process's prefix, reused since by an unregistered dataset: kept.
    blocks(5, tmp_path / "other", owner=exited.pid, recorded=tmp_path / "elsewhere")
    blocks(6, tmp_path / "elsewhere", owner=exited.pid, namespace="pid:[1]")  # another container's: kept
    assert shared_memory.release_stale(cache) == [1, 4]
    left = sorted(p.name.split("_")[0] for p in shm.iterdir() if p.is_file())
    assert left == ["000002", "000002", "000003", "000003", "000005", "000005", "000006", "000006"]
    assert sorted(p.name for p in locks.iterdir()) == [f"00000{n}_cache_filelock" for n in (2, 3, 5, 6)]
    kept = sorted(p.name for p in shared_memory._owners_dir().iterdir() if p.name != ".lock")
    assert kept == [f"000002.{os.getpid()}", f"000006.{exited.pid}"]

    blocks(5, cache / "shards" / "train", owner=os.getppid())  # the same run, live in another process
    with pytest.raises(RuntimeError, match=f"process {os.getppid()} .* already running"):
        shared_memory.release_stale(cache)
    for prefix in (5, 6):
        for block in shm.glob(f"{prefix:06}_*"):
            block.unlink()

    # Registrations hold a lock while their process lives, which tells a dead process in another pid
    # namespace (a killed run in a container sharing /dev/shm) from a live one, where a pid cannot.
    blocks(7, cache / "shards" / "train", owner=2, namespace="pid:[1]", locked=True)  # dead: released
    assert shared_memory.release_stale(cache) == [7] and not (shared_memory._owners_dir() / "000007.2").exists()
    held = blocks(8, cache / "shards" / "val", owner=3, namespace="pid:[1]", locked=True)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1]); "
                               "fcntl.flock(f, fcntl.LOCK_SH); print('held', flush=True); time.sleep(60)", str(held)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RuntimeError, match="process 3 .* already running"):  # live, reading this cache
            shared_memory.release_stale(cache)
    finally:
        holder.kill()
        holder.wait()
    assert shared_memory.release_stale(cache) == [8]
    # This process's own registration is locked while it lives (and gone once it unregisters).
    shared_memory.register(10)
    entry, held = shared_memory._registered.pop(), shared_memory._held.pop()  # this test's alone
    try:
        assert entry == shared_memory._owners_dir() / f"000010.{os.getpid()}"
        assert json.loads(entry.read_text())["locked"] and shared_memory._alive(entry, {"locked": True}, os.getpid())
    finally:
        held.close()
        entry.unlink()
    assert not shared_memory._alive(entry, {"locked": True}, os.getpid())


def test_a_resume_starts_a_new_epoch_where_the_train_data_changed(tmp_path):
    """The saved position is kept for the same data (shards moved elsewhere included); a changed
    weight or rebuilt shards (another index) start the next epoch, with the reason."""
    import copy

    from pretrain.config import load_config
    from pretrain.data import resumed_position, sources_record

    root = write_synthetic_shards(tmp_path / "data", train=8, val=4)
    cfg = load_config(None, [f"data.shards={root}/shards", f"data.tokenizer={root}/tokenizer"])
    saved = {"epoch": 2, "sample_in_epoch": 40}
    record = sources_record(cfg)
    assert record[0]["train_index"] and resumed_position(saved, {"data_sources": record}, cfg) == (saved, None)
    moved = copy.deepcopy(record)
    moved[0]["shards"] = "/elsewhere/shards"  # the same index: the same data
    assert resumed_position(saved, {"data_sources": moved}, cfg) == (saved, None)
    for field, before in (("weight", 0.5), ("train_index", "0123456789abcdef")):
        changed = copy.deepcopy(record)
        changed[0][field] = before
        state, reason = resumed_position(saved, {"data_sources": changed}, cfg)
        assert state == {"epoch": 3, "sample_in_epoch": 0} and "the train data changed" in reason, field
    # What the resume keeps of its own is noted where the config says otherwise.
    from pretrain.train import Task

    class Lines(list):
        print = list.append

    lines = Lines()
    state = {**saved, "shuffle_seed": 1234, "num_canonical_nodes": 2}
    assert Task().resumed_data(cfg, state, {"data_sources": record, "start_with_bos": True}, lines) == state
    assert lines == ["note: data.num_canonical_nodes=1 (the run's is 2): the resumed run goes on in the sample "
                     "order of its checkpoint; a new order needs a new run.dir",
                     "note: data.start_with_bos=False where the checkpoint trained with True: from here on its "
                     "samples no longer begin with BOS"]


def test_synthetic_data_splits_over_ranks_and_resumes_at_any_data_parallel_size():
    """data.synthetic: rank r of R reads the r-th micro-batch of every step's R, the samples of one
    rank's run in order; a state saved at one size continues at another; validation is apart."""
    from pretrain.synthetic_data import SyntheticLoader, val_batches

    def loader(rank: int, ranks: int) -> SyntheticLoader:
        return SyntheticLoader(seed=7, vocab_size=50, length=9, micro_batch=2, rank=rank, ranks=ranks)

    alone = loader(0, 1)
    one = torch.cat([next(alone) for _ in range(4)])  # 8 samples
    two = [loader(0, 2), loader(1, 2)]
    steps = [[next(r) for r in two] for _ in range(2)]
    assert torch.equal(torch.cat([b for step in steps for b in step]), one)
    assert one.shape == (8, 9) and int(one.max()) < 50 and len({tuple(s.tolist()) for s in one}) == 8
    resumed = loader(0, 1)
    resumed.load_state_dict(two[0].state_dict())  # 8 samples consumed at two ranks
    assert two[0].state_dict()["sample_in_epoch"] == 8
    assert torch.equal(next(resumed), torch.cat([next(alone)]))
    val = val_batches(7, 50, 9, 2, rank=0, count=2)
    assert len(val) == 2 and not any(torch.equal(v, b) for v in val for b in one.split(2))
