"""Tests of data_prep: corpus readers, tokenizer training, shard building and reading back."""

import gzip
import json
import os
import random
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from data_prep import build_shards as bs
from data_prep import tokenizer as tok
from data_prep import train_tokenizer as tt
from data_prep.sources import BadInputReport, EmptyCorpusError, default_corpus, iter_documents, list_files
from tests.synthetic import make_text


def read_split(path: Path) -> list[np.ndarray]:
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    ds = StreamingDataset(local=str(path), shuffle=False, batch_size=1)
    samples = [ds[i]["tokens"] for i in range(ds.num_samples)]
    del ds
    return samples


def split_docs(tokens: np.ndarray, eos: int) -> list[list[int]]:
    """Complete documents in a token stream (the part after the last EOS is cut off)."""
    docs, cur = [], []
    for t in tokens.tolist():
        if t == eos:
            docs.append(cur)
            cur = []
        else:
            cur.append(t)
    return docs


# --- tokenizer -------------------------------------------------------------------

def test_tokenizer_files_ids_and_byte_fallback(tok_dir):
    meta = json.loads((tok_dir / "tokenizer.json").read_text())
    assert (tok_dir / "tokenizer.model").is_file()
    assert {k: meta[k] for k in ("unk_id", "bos_id", "eos_id", "pad_id")} == \
        {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": 3}
    assert meta["model_type"] == "bpe"
    assert meta["sha256"] == tok.sha256_file(tok_dir / "tokenizer.model")

    sp, loaded = tok.load_tokenizer(tok_dir)
    assert loaded == meta
    assert meta["vocab_size"] == sp.get_piece_size() <= 400
    # Characters never seen in training come out as UTF-8 byte pieces, not <unk>.
    text = "fox ☃ 𝔘 ü\n\t  two  spaces\n"
    ids = sp.encode(text)
    assert 0 not in ids
    assert any(sp.id_to_piece(i).startswith("<0x") for i in ids)
    assert sp.decode(ids) == text


def test_unigram_and_overwrite_guard(tmp_path, tok_dir):
    corpus = tmp_path / "c.txt"
    corpus.write_text(make_text(random.Random(1), 300))
    meta = tt.train_tokenizer([corpus], tmp_path / "tok", vocab_size=300, model_type="unigram")
    assert meta["model_type"] == "unigram" and meta["eos_id"] == 2
    with pytest.raises(FileExistsError, match="--overwrite"):
        tt.train_tokenizer([corpus], tmp_path / "tok", vocab_size=300)
    meta2 = tt.train_tokenizer([corpus], tmp_path / "tok", vocab_size=300, model_type="bpe", overwrite=True)
    assert meta2["model_type"] == "bpe"


def test_train_tokenizer_cli(tmp_path, capsys):
    corpus = tmp_path / "c.md"
    corpus.write_text(make_text(random.Random(2), 200))
    out = tmp_path / "tok"
    assert tt.main(["--sources", str(corpus), "--out", str(out), "--vocab-size", "300"]) == 0
    assert "tokenizer.model" in capsys.readouterr().out
    assert tt.main(["--sources", str(corpus), "--out", str(out), "--vocab-size", "300"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    # More tokens than the text has pieces for: SentencePiece stops short, and the note says what to set.
    assert tt.main(["--sources", str(corpus), "--out", str(tmp_path / "big"), "--vocab-size", "5000"]) == 0
    got = json.loads((tmp_path / "big" / "tokenizer.json").read_text())["vocab_size"]
    assert got < 5000 and (f"note: the corpus gave {got} tokens, fewer than --vocab-size 5000: set "
                           f"model.vocab_size={got}") in capsys.readouterr().out


def test_load_tokenizer_missing(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError,
                       match=re.escape(f"no tokenizer at {missing}: run python -m data_prep.train_tokenizer --out {missing}")):
        tok.load_tokenizer(missing)


def test_load_tokenizer_detects_replaced_model(tmp_path, tok_dir):
    import shutil

    copy = shutil.copytree(tok_dir, tmp_path / "tok")
    meta = json.loads((copy / "tokenizer.json").read_text())
    (copy / "tokenizer.json").write_text(json.dumps({**meta, "sha256": "0" * 64}))
    with pytest.raises(ValueError, match="does not match the sha256"):
        tok.load_tokenizer(copy)


# --- sources -------------------------------------------------------------------

def test_default_corpus_is_stdlib_py():
    import sysconfig

    src = default_corpus()
    assert src.path == Path(sysconfig.get_paths()["stdlib"])
    files = list_files([src])
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert not any({"site-packages", "test", "tests"} & set(f.relative_to(src.path).parts) for f in files)
    docs = list(iter_documents(None, max_docs=3))
    assert len(docs) == 3 and docs[0].origin == str(files[0])


def test_empty_corpus_is_clear_error(tmp_path, tok_dir):
    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)
    (empty / "sub" / "data.bin").write_bytes(b"\0\1")
    (empty / "blank.txt").write_text("")
    with pytest.raises(EmptyCorpusError, match=re.escape(f"no documents found in {empty}") + ".*--sources"):
        tt.train_tokenizer([empty], tmp_path / "tok", vocab_size=300)
    with pytest.raises(EmptyCorpusError, match=re.escape(f"no documents found in {empty}")):
        bs.build_shards([empty], tok_dir, tmp_path / "out", seq_len=8, val_fraction=0)
    with pytest.raises(FileNotFoundError, match="corpus source not found"):
        bs.build_shards([tmp_path / "missing"], tok_dir, tmp_path / "out", seq_len=8, val_fraction=0)


# --- shards --------------------------------------------------------------------

def test_roundtrip_single_document(tmp_path, tok_dir):
    text = make_text(random.Random(3), 60)
    (tmp_path / "one.txt").write_text(text)
    m = bs.build_shards([tmp_path / "one.txt"], tok_dir, tmp_path / "out", seq_len=16, val_fraction=0, workers=1)
    sp, _ = tok.load_tokenizer(tok_dir)
    expected = sp.encode(text) + [sp.eos_id()]

    samples = read_split(tmp_path / "out" / "train")
    assert len(samples) == m["splits"]["train"]["samples"] == len(expected) // 17
    assert all(s.shape == (17,) and s.dtype == np.uint16 for s in samples)
    stream = np.concatenate(samples)
    assert stream.tolist() == expected[: len(stream)]
    decoded = sp.decode(stream[stream != sp.eos_id()].tolist())
    assert text.startswith(decoded) and len(decoded) > len(text) - 17 * 8
    assert m["splits"]["train"]["tokens"] == len(expected)
    assert m["splits"]["val"]["samples"] == 0


def test_documents_keep_order_with_workers(tmp_path, tok_dir):
    rng = random.Random(4)
    texts = [make_text(rng, rng.randrange(1, 6)) for _ in range(30)]
    for i, t in enumerate(texts):
        (tmp_path / f"d{i:02d}.txt").write_text(t)
    bs.BATCH_DOCS, old = 3, bs.BATCH_DOCS  # many small batches so several are in flight at once
    try:
        bs.build_shards([tmp_path], tok_dir, tmp_path / "out", seq_len=8, val_fraction=0, workers=2)
    finally:
        bs.BATCH_DOCS = old
    sp, _ = tok.load_tokenizer(tok_dir)
    docs = split_docs(np.concatenate(read_split(tmp_path / "out" / "train")), sp.eos_id())
    assert len(docs) >= 25
    assert [sp.decode(d) for d in docs] == texts[: len(docs)]


def test_split_deterministic_disjoint_and_counted(tmp_path, tok_dir):
    src = tmp_path / "docs.jsonl"
    with src.open("w") as f:
        for i in range(80):
            f.write(json.dumps({"text": f"doc{i:03d} the quick brown fox\n"}) + "\n")
    kw = dict(seq_len=16, val_fraction=0.3, seed=7, workers=1)
    m1 = bs.build_shards([src], tok_dir, tmp_path / "a", **kw)
    m2 = bs.build_shards([src], tok_dir, tmp_path / "b", **kw)
    assert m1 == m2 == json.loads((tmp_path / "a" / "manifest.json").read_text())
    for split in ("train", "val"):
        files = [f for f in (tmp_path / "a" / split).rglob("*") if f.is_file()]
        assert any(f.name == "index.json" and f.parent.name.startswith("part-") for f in files)
        for f in files:
            assert f.read_bytes() == (tmp_path / "b" / f.relative_to(tmp_path / "a")).read_bytes()

    tr, va = m1["splits"]["train"], m1["splits"]["val"]
    assert tr["documents"] + va["documents"] == m1["documents"] == 80
    assert 0 < va["documents"] < 40  # about 30% of them
    # The share the hash gives over many origins is the val fraction asked for.
    for seed, fraction in ((7, 0.3), (1, 0.02)):
        share = sum(bs.assign_split(f"dir/f{i}.jsonl:{i % 9 + 1}", seed, fraction) == "val"
                    for i in range(20000)) / 20000
        assert abs(share - fraction) < 0.1 * fraction + 0.005, (seed, fraction, share)
    for st in (tr, va):
        assert 0 < st["samples"] * 17 <= st["tokens"]
        assert st["tokens"] - st["samples"] * 17 == st["dropped_tokens"] < 17
    assert m1["token_dtype"] == "uint16" and m1["seq_len"] == 16
    # What a benchmark records of the build it read.
    from bench.provenance import shards_identity

    ident = shards_identity(tmp_path / "a")
    assert ident["plan_id"] == m1["plan_id"] and ident["tokenizer_sha256"] == m1["tokenizer_sha256"]
    assert ident["documents"] == 80 and ident["tokens"] == {"train": tr["tokens"], "val": va["tokens"]}
    assert shards_identity(tmp_path / "none") == {"missing": str(tmp_path / "none" / "manifest.json")}

    sp, _ = tok.load_tokenizer(tok_dir)
    seen = {}
    for split in ("train", "val"):
        stream = np.concatenate(read_split(tmp_path / "a" / split))
        assert len(stream) == m1["splits"][split]["samples"] * 17
        seen[split] = {sp.decode(d)[:6] for d in split_docs(stream, sp.eos_id())}
        want = {f"doc{i:03d}" for i in range(80) if bs.assign_split(f"docs.jsonl:{i + 1}", 7, 0.3) == split}
        assert seen[split] and seen[split] <= want
    assert not seen["train"] & seen["val"]
    # The seed really picks the split.
    picks = [{i for i in range(80) if bs.assign_split(f"docs.jsonl:{i + 1}", seed, 0.3) == "val"}
             for seed in (7, 8)]
    assert picks[0] != picks[1]


def test_split_same_wherever_the_corpus_lies(tmp_path, tok_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    here, moved = Path("here/corpus"), tmp_path / "moved" / "elsewhere"
    for root in (here, moved):  # the same files, given relative here and absolute there
        (root / "sub").mkdir(parents=True)
        for i in range(40):
            (root / ("sub" if i % 2 else "") / f"d{i:02d}.txt").write_text(f"doc{i:02d} the quick brown fox\n")
    kw = dict(seq_len=8, val_fraction=0.3, seed=1, workers=1)
    val = {}
    for name, root, key in (("here", here, "relative"), ("moved", moved, "relative"), ("path", here, "path")):
        manifest = bs.build_shards([root], tok_dir, name, split_key=key, **kw)
        assert manifest["split_key"] == key and 0 < manifest["splits"]["val"]["documents"] < 40
        val[name] = np.concatenate(read_split(Path(name) / "val"))
    assert np.array_equal(val["here"], val["moved"])
    assert not np.array_equal(val["here"], val["path"])  # "here/corpus/d00.txt" hashed, not "d00.txt"
    assert "split_key" not in json.loads(Path("path/plan.json").read_text())["settings"]  # as older plans
    with pytest.raises(ValueError, match="split_key 'name': choose one of relative, path"):
        bs.plan_build([here], tok_dir, "other", split_key="name", dry_run=True)


def test_bad_inputs_counted_and_reported(tmp_path, tok_dir, capsys):
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "good.txt").write_text("fox jumps over the lazy dog\n" * 10)
    (d / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    (d / "gone.txt").symlink_to(tmp_path / "does-not-exist")  # unreadable, even for root
    (d / "loop.jsonl").symlink_to("loop.jsonl")  # a link to itself: unreadable too, not a traceback
    (d / "data.jsonl").write_text("\n".join([
        json.dumps({"text": "good json line fox\n" * 5}),
        "{not json",
        json.dumps({"other": "no text field"}),
        json.dumps({"text": 5}),
        "[1, 2]",
        "",
        json.dumps({"text": "another good line dog\n" * 5}),
    ]) + "\n")
    out = tmp_path / "out"
    assert bs.main(["--sources", str(d), "--tokenizer", str(tok_dir), "--out", str(out), "--seq-len", "8",
                    "--val-fraction", "0", "--workers", "1", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "bad inputs: 7 skipped" in printed and f"{d / 'data.jsonl'}:2: malformed JSON" in printed

    m = json.loads((out / "manifest.json").read_text())
    bad = m["bad_inputs"]
    assert bad["count"] == 7
    assert bad["by_reason"] == {"malformed JSON": 1, "missing or non-string 'text' field": 3, "not UTF-8": 1,
                                "unreadable (No such file or directory)": 1,
                                "unreadable (Too many levels of symbolic links)": 1}
    assert len(bad["examples"]) == 5
    assert bad["examples"][:4] == [f"{d / 'data.jsonl'}:2: malformed JSON",
                                   f"{d / 'data.jsonl'}:3: missing or non-string 'text' field",
                                   f"{d / 'data.jsonl'}:4: missing or non-string 'text' field",
                                   f"{d / 'data.jsonl'}:5: missing or non-string 'text' field"]
    assert bad["examples"][4].startswith(f"{d / 'gone.txt'}: unreadable")
    assert m["documents"] == 3  # two good JSONL lines + good.txt
    assert m["splits"]["train"]["samples"] > 0


def test_a_plain_text_file_over_the_limit_is_a_bad_file(tmp_path, monkeypatch):
    """A plain-text file is one document read whole: past MAX_TEXT_FILE_BYTES it is counted and
    skipped (naming the fix) before it is read, and files up to the limit are read as ever."""
    from data_prep import readers

    monkeypatch.setattr(readers, "MAX_TEXT_FILE_BYTES", 64)
    (tmp_path / "small.txt").write_text("a" * 64)
    (tmp_path / "big.txt").write_text("b" * 65)
    report = BadInputReport()
    assert [d.text for d in readers.read_file(tmp_path / "small.txt", "text", report)] == ["a" * 64]
    assert list(readers.read_file(tmp_path / "big.txt", "text", report)) == [] and report.count == 1
    assert report.examples == [f"{tmp_path / 'big.txt'}: plain-text file over 64 bytes (one document, read "
                               "whole): split it into files or JSON Lines records"]


def test_jsonl_gz_with_text_field(tmp_path, tok_dir):
    src = tmp_path / "docs.jsonl.gz"
    with gzip.open(src, "wt") as f:
        for i in range(5):
            f.write(json.dumps({"content": f"fox number {i} jumps\n" * 4}) + "\n")
    report = BadInputReport()
    docs = list(iter_documents([src], text_field="content", report=report))
    assert [d.origin for d in docs] == [f"{src}:{i}" for i in range(1, 6)] and report.count == 0
    m = bs.build_shards([src], tok_dir, tmp_path / "out", seq_len=8, val_fraction=0, text_field="content",
                        workers=1)
    assert m["documents"] == 5 and m["splits"]["train"]["samples"] > 0


def test_missing_tokenizer_and_bad_args(tmp_path, tok_dir):
    (tmp_path / "a.txt").write_text("fox\n")
    with pytest.raises(FileNotFoundError, match="no tokenizer at .*train_tokenizer --out"):
        bs.build_shards([tmp_path / "a.txt"], tmp_path / "no-tok", tmp_path / "out", seq_len=8)
    for kw in ({"seq_len": 0}, {"val_fraction": 1.0}, {"val_fraction": -0.1}):
        args = {"seq_len": 8, "val_fraction": 0.1, **kw}
        with pytest.raises(ValueError, match="seq_len|val_fraction"):
            bs.build_shards([tmp_path / "a.txt"], tok_dir, tmp_path / "out", **args)
    assert not (tmp_path / "out").exists()


def test_too_few_tokens_for_a_sample(tmp_path, tok_dir, monkeypatch):
    (tmp_path / "a.txt").write_text("fox jumps\n")
    with pytest.raises(ValueError, match="no complete sample.*--seq-len"):
        bs.build_shards([tmp_path / "a.txt"], tok_dir, tmp_path / "out", seq_len=4096, val_fraction=0, workers=1)
    assert not (tmp_path / "out" / "manifest.json").exists()
    # The built parts are kept (a cluster's work is not thrown away); other settings need --overwrite.
    assert (tmp_path / "out" / "plan.json").exists()
    with monkeypatch.context() as m:  # refused before the corpus is cut into parts (large files read whole)
        m.setattr(bs.P, "plan_parts", lambda *a, **k: pytest.fail("the corpus was cut before the refusal"))
        with pytest.raises(FileExistsError, match="planned differently.*--overwrite"):
            bs.build_shards([tmp_path / "a.txt"], tok_dir, tmp_path / "out", seq_len=4, val_fraction=0, workers=1)


def test_a_build_without_workers_is_refused(tmp_path, capsys):
    for workers in ("0", "-3"):
        with pytest.raises(SystemExit):
            bs.main(["--out", str(tmp_path / "out"), "--workers", workers])
        assert f"--workers {workers}: give at least 1 process" in capsys.readouterr().err


def test_a_tokenizer_out_that_cannot_be_written_is_refused_before_training(tmp_path, monkeypatch, capsys):
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    (tmp_path / "afile").write_text("")
    monkeypatch.setattr(tt, "list_files", lambda *a, **k: pytest.fail("the corpus was read before the refusal"))
    assert tt.main(["--sources", str(tmp_path / "a.txt"), "--out", str(tmp_path / "afile" / "tok"),
                    "--no-progress"]) == 2
    assert f"--out {tmp_path / 'afile' / 'tok'}: cannot write there" in capsys.readouterr().err


def test_existing_shards_need_overwrite(tmp_path, tok_dir, monkeypatch):
    src = tmp_path / "a.txt"
    src.write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    out = tmp_path / "out"
    kw = dict(seq_len=8, val_fraction=0, workers=1)
    first = bs.build_shards([src], tok_dir, out, **kw)
    (out / "train" / "stale.mds").write_bytes(b"old")
    with monkeypatch.context() as m:  # refused before the corpus is listed or read
        m.setattr(bs, "list_files", lambda *a, **k: pytest.fail("the corpus was listed before the refusal"))
        with pytest.raises(FileExistsError, match="already contains shards.*--overwrite"):
            bs.build_shards([src], tok_dir, out, **kw)
    again = bs.build_shards([src], tok_dir, out, overwrite=True, **kw)
    assert again == first and not (out / "train" / "stale.mds").exists()
    assert len(read_split(out / "train")) == first["splits"]["train"]["samples"]


def test_file_names_that_are_not_utf8(tmp_path, tok_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)  # origins "corpus/NAME": the split below does not depend on tmp_path
    corpus = Path("corpus")
    corpus.mkdir()
    rng = random.Random(3)
    names = [os.fsdecode(b"caf\xe9.txt"), "plain.txt"]  # a Latin-1 name, as old archives have
    for i, name in enumerate(names):
        (corpus / name).write_text(make_text(rng, 30) + f" doc{i}\n")
    seed = next(s for s in range(100) if {bs.assign_split(n, s, 0.5) for n in names} == {"train", "val"})
    m = bs.build_shards([corpus], tok_dir, "out", seq_len=8, val_fraction=0.5, seed=seed, workers=1)
    assert m["documents"] == 2 and m["bad_inputs"]["count"] == 0
    (corpus / os.fsdecode(b"bad\xff.txt")).write_bytes(b"\xff\xfe not UTF-8")  # reported with its name escaped
    report = BadInputReport()
    list(iter_documents([corpus], report=report))
    assert report.examples == ["corpus/bad\\xff.txt (byte 0): not UTF-8"] and report.summary().encode("utf-8")
    meta = tt.train_tokenizer([corpus], "tok", vocab_size=300, num_threads=1)
    origins = Path("tok", tt.SAMPLE_FILE).read_bytes()
    assert b"corpus/caf\xe9.txt\n" in origins and meta["training"]["sample"]["documents"] == 2
    tok.load_tokenizer("tok")


def test_bad_compression_refused_before_overwrite(tmp_path, tok_dir):
    src = tmp_path / "a.txt"
    src.write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    out = tmp_path / "out"
    first = bs.build_shards([src], tok_dir, out, seq_len=8, val_fraction=0, workers=1, compression="zstd:7")
    for bad in ("zst", "zstd:30", "gz:x", "zstd:", "zstd:07"):
        with pytest.raises(ValueError, match=f"--compression '{bad}': choose none or one of .*zstd"):
            bs.build_shards([src], tok_dir, out, seq_len=8, val_fraction=0, workers=1, compression=bad,
                            overwrite=True)
    assert json.loads((out / "manifest.json").read_text()) == first  # the finished build is kept


def test_symlinked_folders_followed_and_other_files_counted(tmp_path, tok_dir, capsys):
    real = tmp_path / "real"
    real.mkdir()
    rng = random.Random(4)
    (real / "a.jsonl").write_text(json.dumps({"text": make_text(rng, 30)}) + "\n")
    (real / "b.json").write_text("{}")
    (real / "c.jsonl.bz2").write_bytes(b"BZh")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "web").symlink_to(real)
    (corpus / "web-again").symlink_to(real)  # the same folder twice: listed once
    (corpus / "loop").symlink_to(corpus)  # a link to an ancestor must not loop
    (corpus / "d.txt").write_text(make_text(rng, 30))
    for i in range(22):  # many kinds: the 20 most common are kept
        (real / f"note.x{i:02d}").write_text("")
    (real / "README").write_text("")
    skipped = Counter()
    assert list_files([corpus], skipped) == [corpus / "d.txt", corpus / "web" / "a.jsonl"]
    assert skipped == {".json": 1, ".bz2": 1, "(no suffix)": 1, **{f".x{i:02d}": 1 for i in range(22)}}
    out = tmp_path / "out"
    assert bs.main(["--sources", str(corpus), "--tokenizer", str(tok_dir), "--out", str(out), "--seq-len", "8",
                    "--val-fraction", "0", "--workers", "1", "--no-progress"]) == 0
    assert "skipped files no reader takes, by suffix ((no suffix) 1, .json 1, .bz2 1, .x00 1" in capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["documents"] == 2 and len(manifest["skipped_files"]) == 20
    assert list(manifest["skipped_files"])[:3] == ["(no suffix)", ".json", ".bz2"]  # in listing order


def test_a_file_system_error_fails_the_part_for_a_rerun(tmp_path, tok_dir, monkeypatch, capsys):
    import errno

    from data_prep import parts as P

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = random.Random(6)
    for name in ("a.txt", "b.txt"):
        (corpus / name).write_text(make_text(rng, 30))
    flaky = corpus / "b.txt"
    real_read = Path.read_bytes

    def failing_read(path):
        if path == flaky:
            raise OSError(errno.EIO, "Input/output error")
        return real_read(path)

    monkeypatch.setattr(Path, "read_bytes", failing_read)
    args = ["--sources", str(corpus), "--tokenizer", str(tok_dir), "--out", str(tmp_path / "out"), "--seq-len", "8",
            "--val-fraction", "0", "--workers", "1", "--no-progress"]
    assert bs.main(args) == 2
    assert f"could not read {flaky}: Input/output error" in capsys.readouterr().err
    assert P.status(tmp_path / "out")["done"] == []  # not complete: its documents are not lost
    assert bs.main(args[:5] + [str(tmp_path / "counted")] + args[6:] + ["--skip-unreadable"]) == 0  # when asked
    counted = json.loads((tmp_path / "counted" / "manifest.json").read_text())["bad_inputs"]
    assert counted["by_reason"] == {"unreadable (Input/output error)": 1}
    monkeypatch.setattr(Path, "read_bytes", real_read)
    assert bs.main(args) == 0  # the same command retries it
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["documents"] == 2 and manifest["bad_inputs"]["count"] == 0
    # The first file failing too: planning (which reads a first document) counts it when asked, in
    # both commands; without the flag the tokenizer's error names it.
    flaky = corpus / "a.txt"
    monkeypatch.setattr(Path, "read_bytes", failing_read)
    assert bs.main(args[:5] + [str(tmp_path / "first")] + args[6:] + ["--skip-unreadable"]) == 0
    first = json.loads((tmp_path / "first" / "manifest.json").read_text())
    assert first["documents"] == 1 and first["bad_inputs"]["by_reason"] == {"unreadable (Input/output error)": 1}
    tok_args = ["--sources", str(corpus), "--out", str(tmp_path / "tok"), "--vocab-size", "300", "--no-progress"]
    assert tt.main(tok_args) == 2 and "rerun with --skip-unreadable" in capsys.readouterr().err
    assert tt.main(tok_args + ["--skip-unreadable"]) == 0
