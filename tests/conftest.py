"""Fixtures shared by several test modules."""

import random

import pytest

from tests.synthetic import make_text


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """A small tokenizer trained once per test module."""
    from data_prep import train_tokenizer as tt

    root = tmp_path_factory.mktemp("tokcorpus")
    rng = random.Random(0)
    for i in range(20):
        (root / f"doc{i:02d}.txt").write_text(make_text(rng, 40))
    out = tmp_path_factory.mktemp("tok")
    tt.train_tokenizer([root], out, vocab_size=400, model_type="bpe", overwrite=True, num_threads=1)
    return out
