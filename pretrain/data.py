"""Streaming shards -> micro-batches, partitioned by data-parallel rank, resumable mid-epoch."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from pretrain import shared_memory
from pretrain.config import Config, ConfigError, DataSource
from pretrain.synthetic_data import SyntheticLoader
from pretrain.synthetic_data import val_batches as synthetic_val

# streaming (which imports transformers) is imported where shards are read: processes that read
# none (post-training on JSON Lines, tools.generate) start 2 s sooner.
if TYPE_CHECKING:
    from streaming import StreamingDataLoader

_released = False


def release_shared_memory_once(cfg: Config) -> None:
    """Release the streaming shared memory that killed processes left on this node (it would break
    this run's start), once per process, before its first dataset: on each node's first rank while
    the others wait. Blocks that live processes use, another run's or a tool's, are kept
    (pretrain/shared_memory.py)."""
    global _released
    if _released:
        return
    from pretrain.distributed import device

    problem = ""
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        try:
            released = shared_memory.release_stale(cache_root(cfg))
        except RuntimeError as err:  # the same run started twice on this node
            problem = str(err)
        else:
            if released:
                print(f"released the streaming shared memory of {len(released)} exited process(es) on "
                      "this node", flush=True)
    if dist.is_available() and dist.is_initialized():  # the barrier, telling every rank of a refusal
        refused = torch.tensor([float(bool(problem))], device=device())
        dist.all_reduce(refused, op=dist.ReduceOp.MAX)
        if refused.item() and not problem:
            problem = "the first rank of a node refused to start (its error says why)"
    if problem:
        raise ConfigError(problem)
    _released = True


def _collate(samples: list[dict], bos: int | None = None) -> torch.Tensor:
    batch = torch.from_numpy(np.stack([s["tokens"].astype(np.int64) for s in samples]))
    return batch if bos is None else starting_with(batch, bos)


def starting_with(batch: torch.Tensor, bos: int) -> torch.Tensor:
    """Samples [B, L] that each begin with `bos`: prepended (the last token drops off, the length
    stays) unless a sample already begins with it."""
    prepended = torch.cat([torch.full_like(batch[:, :1], bos), batch[:, :-1]], dim=1)
    return torch.where(batch[:, :1] == bos, batch, prepended)


def sample_bos(cfg: Config) -> int | None:
    """data.start_with_bos: the BOS id of the shards (first local manifest; validate_data checks
    that it is there), else None."""
    if not cfg.data.start_with_bos:
        return None
    for source in cfg.data.sources:
        manifest = Path(source.shards) / "manifest.json"
        if "://" not in source.shards and manifest.is_file():
            return int(json.loads(manifest.read_text())["bos_id"])
    raise ValueError("data.start_with_bos=true needs a local manifest.json with bos_id (validate_data)")


def sources_record(cfg: Config) -> list[dict]:
    """What the train loader reads, for the checkpoint marker: each source's name, shards and
    weight, and a fingerprint of its train split's index (None where it has none)."""
    if cfg.data.synthetic:
        return [{"name": "", "shards": "synthetic", "weight": 1.0, "train_index": None}]
    record = []
    for source in cfg.data.sources:
        if "://" in source.shards:
            text = remote_index(split_url(source, "train"))
        else:
            index = Path(source.shards) / "train" / "index.json"
            text = index.read_bytes() if index.is_file() else None
        record.append({"name": source.name, "shards": source.shards, "weight": source.weight,
                       "train_index": hashlib.sha256(text).hexdigest()[:16] if text is not None else None})
    return record


def resumed_position(saved: dict, marker: dict, cfg: Config) -> tuple[dict, str | None]:
    """The loader state to resume from a checkpoint's (`saved`, its marker `marker`), and why it
    differs: where the train data changed since (sources, weights or rebuilt shards), the saved
    position points into another epoch order, so the loader starts the next epoch of the new data."""
    before, now = marker.get("data_sources"), sources_record(cfg)

    def same(a: dict, b: dict) -> bool:  # shards by their index (moved ones are the same), else by place
        if (a["name"], a["weight"]) != (b["name"], b["weight"]):
            return False
        # Checkpoints of earlier versions recorded no index for remote shards.
        return a["train_index"] == b["train_index"] if a["train_index"] and b["train_index"] else a["shards"] == b["shards"]

    if before is None or (len(before) == len(now) and all(map(same, before, now))):
        return saved, None
    changes = [f"{s['name'] or 'data.shards'}: {s['shards']} weight {s['weight']}" for s in now]
    return ({**saved, "epoch": saved["epoch"] + 1, "sample_in_epoch": 0},
            f"the train data changed since the checkpoint (now {'; '.join(changes)}): starting epoch "
            f"{saved['epoch'] + 1} of it from its first sample")


def starts_with_bos(cfg: Config | None, meta: dict) -> bool | None:
    """A run's data.start_with_bos: from its config, else as its checkpoint meta records it (None:
    a checkpoint of an older run away from its config.yaml)."""
    return cfg.data.start_with_bos if cfg is not None else meta.get("start_with_bos")


def run_bos(cfg: Config | None, meta: dict) -> int | None:
    """The BOS id a run's samples begin with (starts_with_bos; the id from its checkpoint meta, or an
    imported model's config), else None."""
    if not starts_with_bos(cfg, meta):
        return None
    return meta.get("bos_id", meta.get("special_ids", {}).get("bos"))


def run_document_eos(cfg: Config | None, meta: dict) -> int | None:
    """The EOS id a run's attention stops at between documents (data.document_mask from its config,
    else as its checkpoint meta records it; the id from the meta or data manifest), else None."""
    masked = cfg.data.document_mask if cfg is not None else meta.get("document_mask", False)
    return meta.get("eos_id") if masked else None


def collate_fn(cfg: Config):
    """Samples -> one [B, seq_len + 1] batch, as data.* asks (picklable for loader workers)."""
    return functools.partial(_collate, bos=sample_bos(cfg))


def node_name() -> str:
    """This node's name: Slurm's (nodes of one host, as in a test cluster, differ), else the host's."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def cache_root(cfg: Config) -> Path:
    """data.cache, else /tmp/pretrain-cache/RUN_NAME-<hash of run.dir> (one per run, so that runs of
    one config on one node, a sweep, do not share it), then a folder per node: each node's leader
    decompresses the shards it reads, and two nodes writing one folder (a cache on a shared file
    system) would remove each other's files mid-read."""
    if cfg.data.cache:
        base = Path(cfg.data.cache)
    else:
        run = hashlib.sha256(str(Path(cfg.run.dir).resolve()).encode()).hexdigest()[:8]
        base = Path("/tmp/pretrain-cache") / f"{cfg.run.name}-{run}"
    return base / node_name()


def _split_location(cfg: Config, source: DataSource, split: str, held_out: bool = False) -> dict:
    """Where a StreamingDataset reads a source's split: remote shards into the local cache; local
    compressed shards into the cache too (decompressed there, see compressed_split), and local
    uncompressed shards in place. `held_out`: an eval.val_sets entry, cached apart from the training
    sources (a name may be the same: each removes the other copies in its folder)."""
    name, root = source.name or "shards", cache_root(cfg)
    if held_out:
        name = f"val_sets/{name}"
    if "://" in source.shards:
        # Named after the URL and its index: streaming reuses an index it finds in the folder, so
        # another URL (a resume after data.shards moved, runs sharing data.cache) or the same URL
        # rebuilt must not find this one's. Other folders stay, out of reach of the cleanup of local
        # compressed copies ("{split}-*"): another run sharing data.cache may read them (removed
        # under it, its missing shards would come from the rebuilt set); the unnamed folder of
        # earlier releases goes.
        url = split_url(source, split)
        index = remote_index(url)
        place = f"{split}@{hashlib.sha256(url.encode()).hexdigest()[:12]}"
        copy = root / name / f"{place}-{hashlib.sha256(index or b'').hexdigest()[:12]}"
        shutil.rmtree(root / name / split, ignore_errors=True)
        earlier = sorted(str(p) for p in copy.parent.glob(f"{place}-*") if p != copy)
        if earlier and (not dist.is_initialized() or dist.get_rank() == 0):
            print(f"note: {url} was rebuilt since data.cache took copies of it ({', '.join(earlier)}): this run reads "
                  "the new one; remove the old copies when no run reads them", flush=True)
        if index is not None and not (copy / "index.json").is_file():
            # streaming reads an index it finds there instead of downloading one: the run's version.
            copy.mkdir(parents=True, exist_ok=True)
            part = copy / f"index.json.{node_name()}-{os.getpid()}"
            part.write_bytes(index)
            os.replace(part, copy / "index.json")
        return {"remote": url, "local": str(copy)}
    directory = Path(source.shards) / split
    fingerprint = compressed_split(directory)
    if not fingerprint:
        return {"remote": None, "local": str(directory)}
    copy = root / name / f"{split}-{fingerprint}"
    # Copies of this split before its shards were rebuilt, and from before caches had a folder per node.
    for stale in [*copy.parent.glob(f"{split}-*"), *(root.parent / name).glob(f"{split}-*")]:
        if stale != copy:
            shutil.rmtree(stale, ignore_errors=True)
    return {"remote": str(directory), "local": str(copy)}


def split_url(source: DataSource, split: str) -> str:
    return f"{source.shards.rstrip('/')}/{split}"


REMOTE_INDEXES: dict[str, bytes | None] = {}  # split URL -> its index.json, as this run reads it


def remote_index(url: str) -> bytes | None:
    """A remote split's index.json (url: the split's), None where it has none. Downloaded once per
    process (a small file), so that what a run records of its data (sources_record) is the version
    its loaders read; in a distributed run, rank 0's copy (share_remote_indexes)."""
    from streaming.base.storage import CloudDownloader

    if url not in REMOTE_INDEXES:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                CloudDownloader.direct_download(f"{url}/index.json", os.path.join(tmp, "index.json"))
                REMOTE_INDEXES[url] = Path(tmp, "index.json").read_bytes()
            except FileNotFoundError:
                REMOTE_INDEXES[url] = None
    return REMOTE_INDEXES[url]


def share_remote_indexes(cfg: Config) -> None:
    """Every rank takes rank 0's copy of each remote split's index (collective: all ranks call it).
    Each rank downloading its own, a set rebuilt while a job starts would give ranks different
    versions: other samples per rank, and checkpoints whose data record depends on the rank."""
    urls = [split_url(s, split) for s in [*cfg.data.sources, *cfg.eval.val_sets] if "://" in s.shards
            for split in ("train", "val")]
    if not urls or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    box = [{url: remote_index(url) for url in urls} if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    REMOTE_INDEXES.update(box[0])


def compressed_split(directory: Path) -> str | None:
    """A fingerprint of a local split's index when its shards are compressed, else None. Read in
    place, streaming would decompress each shard next to it: into the dataset's folder, which may
    be read-only, and from every node at once under one temporary name. Such a split is read
    through the cache instead (node-local, under a name that changes when the shards are rebuilt)."""
    index = directory / "index.json"
    if not index.is_file():
        return None
    text = index.read_bytes()
    if not any(shard.get("compression") for shard in json.loads(text).get("shards", [])):
        return None
    return hashlib.sha256(text + str(index.stat().st_mtime_ns).encode()).hexdigest()[:12]


def streaming_dataset(**kwargs):
    """streaming.StreamingDataset(**kwargs), built while this node builds no other job's dataset, and
    its shared memory registered as this process's (pretrain/shared_memory.py)."""
    from streaming import StreamingDataset

    with shared_memory.creating_datasets():
        dataset = StreamingDataset(**kwargs)
    shared_memory.register(dataset._shm_prefix_int)
    return dataset


def build_loader(cfg: Config, split: str, shuffle: bool) -> StreamingDataLoader | SyntheticLoader:
    """A fresh dataset and loader (data.synthetic: random tokens). Resume must load state into a
    fresh loader: a used one ignores the state and restarts at sample 0."""
    from streaming import Stream, StreamingDataLoader

    if cfg.data.synthetic:
        return SyntheticLoader(cfg.data.shuffle_seed, cfg.model.vocab_size, cfg.model.max_seq_len + 1,
                               cfg.train.micro_batch, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
    release_shared_memory_once(cfg)
    sources = cfg.data.sources
    if cfg.data.mix:  # streaming draws weight / sum(weights) of every epoch from each source
        where = {"streams": [Stream(**_split_location(cfg, s, split), proportion=s.weight) for s in sources]}
    else:
        where = _split_location(cfg, sources[0], split)
    dataset = streaming_dataset(
        **where,
        shuffle=shuffle,
        shuffle_seed=cfg.data.shuffle_seed,
        num_canonical_nodes=cfg.data.num_canonical_nodes,
        batch_size=cfg.train.micro_batch,
        # Tensor-parallel peers are consecutive ranks and must see identical samples.
        replication=ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else None,
    )
    return StreamingDataLoader(
        dataset,
        batch_size=cfg.train.micro_batch,
        num_workers=cfg.data.num_workers,
        collate_fn=collate_fn(cfg),
        drop_last=True,
        persistent_workers=False,
        pin_memory=torch.cuda.is_available(),  # page-locked batches: the copy to the GPU runs asynchronously
    )


def has_samples(location: dict) -> bool:
    """Whether a split (from _split_location) has an index listing shards: shards built with
    --val-fraction 0 have no val split (older builds: an empty index)."""
    remote = location["remote"]
    if remote is not None and "://" in remote:
        text = remote_index(remote)
    else:
        index = Path(remote or location["local"]) / "index.json"  # local shards, read in place or through the cache
        text = index.read_bytes() if index.is_file() else None
    return text is not None and bool(json.loads(text)["shards"])


def load_val_sets(cfg: Config, apart: bool = False) -> dict[str, list[torch.Tensor]]:
    """Fixed validation sets, one per source with a val split and one per eval.val_sets entry (the
    same samples at every evaluation, split by data-parallel rank): {name: batches}; "" names data.shards.
    apart (tools): read through a temporary local folder, beside any run on this node."""
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    micro = cfg.train.micro_batch
    collate = collate_fn(cfg)
    sets = {}
    if cfg.data.synthetic:
        sets[""] = synthetic_val(cfg.data.shuffle_seed, cfg.model.vocab_size, cfg.model.max_seq_len + 1, micro, dp_rank,
                                 cfg.train.eval_batches)
    training = [] if cfg.data.synthetic else cfg.data.sources
    for held_out, source in [*((False, s) for s in training), *((True, s) for s in cfg.eval.val_sets)]:
        location = _split_location(cfg, source, "val", held_out)
        if held_out and not has_samples(location):  # all of a held-out set built with --val-fraction 0
            location = _split_location(cfg, source, "train", held_out)
        if not has_samples(location):  # no val split (shards built with --val-fraction 0)
            if (len(cfg.data.sources) > 1 or held_out) and (not dist.is_initialized() or dist.get_rank() == 0):
                print(f"validation: eval.val_sets entry {source.name!r} holds no samples" if held_out else
                      f"validation: data.mix entry {source.name!r} has no val split (built with --val-fraction 0); "
                      "val/loss covers the other entries", flush=True)
            continue
        folder = tempfile.TemporaryDirectory(prefix="pretrain-val-") if apart else contextlib.nullcontext()
        with folder as tmp:
            if apart:
                location = {"remote": location["remote"] or location["local"], "local": tmp}
            else:
                release_shared_memory_once(cfg)
            dataset = streaming_dataset(**location, shuffle=False, batch_size=micro)
            # Full batches without a sample twice (it would weigh double in the mean): fewer than
            # train.eval_batches where the split is smaller; every rank the same count.
            fit = dataset.num_samples // (micro * dp_size)
            count = min(cfg.train.eval_batches, max(fit, 1))
            if count < cfg.train.eval_batches and (not dist.is_initialized() or dist.get_rank() == 0):
                print(f"validation {source.name or 'data.shards'}: its val split holds {dataset.num_samples} samples, "
                      f"{count} batches of train.micro_batch={micro} x {dp_size} data-parallel ranks, not "
                      f"train.eval_batches={cfg.train.eval_batches}"
                      + ("" if fit else " (fewer than one batch: some samples are read twice)"), flush=True)
            batches = []
            for b in range(count):
                # len(dataset) counts this rank's share; indexing is over all samples. Each rank takes
                # a block of them, so that rank 0's first batch, the sink probe, is the first samples
                # at any data-parallel size.
                first = (dp_rank * count + b) * micro
                batches.append(collate([dataset[(first + i) % dataset.num_samples] for i in range(micro)]))
        sets[source.name] = batches
    return sets


def all_batches(val_sets: dict[str, list[torch.Tensor]]) -> list[torch.Tensor]:
    """The batches of every validation set, in order, one list."""
    return [batch for batches in val_sets.values() for batch in batches]


def load_val_batches(cfg: Config, apart: bool = False) -> list[torch.Tensor]:
    return all_batches(load_val_sets(cfg, apart))


def read_samples(location: str | Path, count: int, wrap: bool = True) -> torch.Tensor:
    """The first `count` samples [count, seq + 1] of one split directory, in order, wrapping
    around a small split (wrap=False: all of a smaller split, each once), for tools that read shards
    outside training. Read through a temporary local folder (compressed shards decompressed there,
    not next to themselves), and without releasing the node's streaming shared memory: a run on this
    node keeps its loader's state."""
    with tempfile.TemporaryDirectory(prefix="pretrain-samples-") as tmp:
        dataset = streaming_dataset(remote=str(location), local=tmp, shuffle=False, batch_size=1)
        n = len(dataset)
        if n == 0:
            raise ValueError(f"{location} holds no samples")
        return _collate([dataset[i % n] for i in range(count if wrap else min(count, n))])


def split_batch(batch: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples hold seq_len + 1 tokens: inputs and next-token labels."""
    batch = batch.to(device, non_blocking=True)
    return batch[:, :-1], batch[:, 1:]


class Batches:
    """Endless iterator over a loader: a new epoch starts when the last one ends."""

    def __init__(self, loader: StreamingDataLoader):
        self.loader = loader
        self._it = None

    def __next__(self) -> torch.Tensor:
        if self._it is None:
            self._it = iter(self.loader)
        try:
            return next(self._it)
        except StopIteration:
            self._it = iter(self.loader)
        try:
            return next(self._it)
        except StopIteration:  # a whole epoch without one micro-batch (validate_data checks local shards)
            raise RuntimeError("an epoch of the train data gave no micro-batch: it holds fewer "
                               "samples than train.micro_batch per data-parallel rank; lower "
                               "train.micro_batch or use more data") from None

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)
