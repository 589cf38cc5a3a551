"""Streaming loader partitioning: data-parallel ranks read disjoint samples, tensor-parallel
peers identical ones."""

import torch

from tests.dist_utils import spawn
from tests.parallel_checks import loader_batches
from tests.synthetic import write_synthetic_shards


def test_dp_ranks_disjoint_tp_peers_identical(tmp_path):
    root = write_synthetic_shards(tmp_path / "data", train=128)
    spawn(loader_batches, 4, str(root), str(tmp_path), tensor=2)  # ranks (0,1) and (2,3) are TP peers
    seen = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    assert torch.equal(seen[0], seen[1]) and torch.equal(seen[2], seen[3])
    rows = lambda t: {tuple(r.tolist()) for r in t}  # noqa: E731
    assert len(rows(seen[0])) == 12 and not rows(seen[0]) & rows(seen[2])
