"""Corpora at scale: the Parquet / zstd / gzip readers, bad records, shard builds cut into parts
(the same samples whoever builds them, completed parts never rebuilt), tokenizer training on a
uniform sample, and existing SentencePiece models."""

from __future__ import annotations

import gzip
import io
import json
import os
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from data_prep import build_shards as bs
from data_prep import parts as P
from data_prep import train_tokenizer as tt
from data_prep.import_tokenizer import import_tokenizer
from data_prep.import_tokenizer import main as import_main
from data_prep.readers import read_file, read_parquet_file
from data_prep.sources import BadInputReport, iter_documents
from data_prep.tokenizer import load_tokenizer
from tests.synthetic import make_text
from tests.test_data_prep import read_split, split_docs


def write_jsonl_zst(path: Path, lines: list[str]) -> None:
    path.write_bytes(zstandard.ZstdCompressor().compress(("\n".join(lines) + "\n").encode()))


def write_parquet(path: Path, texts: list, row_group_size: int, column: str = "text") -> None:
    table = pa.table({column: pa.array(texts, type=pa.string()), "id": list(range(len(texts)))})
    pq.write_table(table, path, row_group_size=row_group_size)


def samples_multiset(out: Path) -> Counter:
    splits = json.loads((out / "manifest.json").read_text())["splits"]
    return Counter(tuple(s.tolist()) for split in ("train", "val") if splits[split]["samples"]
                   for s in read_split(out / split))


def assert_samples_are_source_spans(out: Path, texts: list[str], sp) -> int:
    """Every document piece of every sample decodes to a span of one source text."""
    pieces = 0
    for sample in read_split(out / "train"):
        cur: list[int] = []
        for t in sample.tolist() + [sp.eos_id()]:
            if t == sp.eos_id():
                if cur:
                    piece = sp.decode(cur)
                    assert any(piece in text for text in texts), piece[:80]
                    pieces += 1
                cur = []
            else:
                cur.append(t)
    return pieces


# --- readers ---------------------------------------------------------------------

def test_parquet_streams_row_groups_counts_nulls_and_round_trips(tmp_path, tok_dir):
    rng = random.Random(1)
    texts = [make_text(rng, rng.randrange(2, 8)) for _ in range(12)]
    values = texts[:4] + [None] + texts[4:8] + [""] + texts[8:]
    src = tmp_path / "data.parquet"
    write_parquet(src, values, row_group_size=3, column="content")
    assert pq.ParquetFile(src).metadata.num_row_groups == 5

    report = BadInputReport()
    docs = list(iter_documents([src], text_field="content", report=report))
    assert [d.text for d in docs] == texts
    assert docs[4].origin == f"{src}:6"  # 1-based rows: the null was row 5
    assert report.to_dict()["by_reason"] == {"missing or non-string 'content' field": 1}
    assert report.examples == [f"{src}:5: missing or non-string 'content' field"]
    # Read a row group at a time (parts cut by row groups), each row keeps its origin in the file,
    # which its split is hashed from.
    by_group = [d for group in (3, 1, 4, 0, 2) for d in
                read_parquet_file(src, "content", BadInputReport(), row_groups=[group])]
    assert sorted((d.origin, d.text) for d in by_group) == sorted((d.origin, d.text) for d in docs)

    wrong = BadInputReport()
    assert list(iter_documents([src], text_field="text", report=wrong)) == []
    assert wrong.examples == [f"{src}: no 'text' column (columns: content, id)"]

    # A part size below the file size cuts it by row groups; the rows still all arrive, once.
    plan = bs.plan_build([src], tok_dir, tmp_path / "out", seq_len=8, val_fraction=0, text_field="content",
                         part_size=src.stat().st_size // 3)
    groups = [g for part in plan["parts"] for piece in part["pieces"] for g in piece[1]]
    assert len(plan["parts"]) >= 2 and groups == list(range(5))
    bs.build_parts(tmp_path / "out", workers=1)
    m = bs.merge_parts(tmp_path / "out")
    assert m["documents"] == 12 and m["bad_inputs"]["count"] == 1 and m["parts"] == len(plan["parts"])
    sp, _ = load_tokenizer(tok_dir)
    assert assert_samples_are_source_spans(tmp_path / "out", texts, sp) >= 10


def test_a_corrupt_row_group_costs_its_rows_and_a_rewritten_file_fails_its_parts(tmp_path, tok_dir):
    rng = random.Random(2)
    texts = [make_text(rng, rng.randrange(2, 8)) for _ in range(12)]
    src = tmp_path / "data.parquet"
    write_parquet(src, texts, row_group_size=3)
    chunk = pq.ParquetFile(src).metadata.row_group(1).column(0)
    data = bytearray(src.read_bytes())
    data[chunk.data_page_offset:chunk.data_page_offset + 16] = b"\xff" * 16
    src.write_bytes(bytes(data))
    report = BadInputReport()
    docs = [d.text for d in iter_documents([src], report=report)]
    assert docs == texts[:3] + texts[6:]  # the groups after the corrupt one are read too
    assert report.count == 3, report.examples  # the group's rows, each a record lost
    assert report.examples[0].startswith(f"{src}:4 (row group 1, 3 rows): unreadable row group"), report.examples

    # The same rows written again in other row groups after the build was planned by row groups.
    write_parquet(src, texts, row_group_size=3)
    plan = bs.plan_build([src], tok_dir, tmp_path / "out", seq_len=8, val_fraction=0,
                         part_size=src.stat().st_size // 3)
    assert len(plan["parts"]) >= 2
    write_parquet(src, texts, row_group_size=5)
    with pytest.raises(ValueError, match="changed since the build was planned .* plan the build again"):
        list(P.iter_part_documents(P.parts_of(plan)[0], "text", BadInputReport()))


def test_zstd_and_gzip_json_lines_bad_lines_and_truncation(tmp_path, tok_dir):
    rng = random.Random(2)
    texts = [make_text(rng, 4) for _ in range(6)]
    zst = tmp_path / "a.jsonl.zst"
    write_jsonl_zst(zst, [json.dumps({"text": texts[0]}), "{broken", json.dumps({"text": texts[1]})])
    dolma = tmp_path / "b.json.gz"
    with gzip.open(dolma, "wt") as f:
        f.write("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(texts[2:4])) + "\n")
    # A .zst cut short: the records before the cut are kept, the break is counted once.
    many = [make_text(rng, 3) for _ in range(3000)]  # several zstd blocks of 128 KiB
    texts += many
    full = zstandard.ZstdCompressor().compress(("\n".join(json.dumps({"text": t}) for t in many) + "\n").encode())
    cut = tmp_path / "c.json.zst"
    cut.write_bytes(full[: len(full) // 2])

    report = BadInputReport()
    docs = list(iter_documents([tmp_path], report=report))
    by_file = Counter(d.origin.rsplit(":", 1)[0] for d in docs)
    assert [d.text for d in docs if d.origin.startswith(str(zst))] == texts[:2]
    assert [d.text for d in docs if d.origin.startswith(str(dolma))] == texts[2:4]
    assert 0 < by_file[str(cut)] < 3000
    reasons = report.to_dict()["by_reason"]
    assert reasons.pop("malformed JSON") == 1 and report.examples[0] == f"{zst}:2: malformed JSON"
    (unreadable, n), = reasons.items()
    assert n == 1 and unreadable.startswith("unreadable")
    assert report.examples[1].startswith(f"{cut}:{by_file[str(cut)] + 1}: unreadable")

    m = bs.build_shards([tmp_path], tok_dir, tmp_path / "out", seq_len=8, val_fraction=0, workers=1)
    assert m["documents"] == len(docs) and m["bad_inputs"]["count"] == 2
    sp, _ = load_tokenizer(tok_dir)
    assert assert_samples_are_source_spans(tmp_path / "out", texts, sp) > 0


def test_long_window_zstd_is_read_and_empty_compressed_files_are_counted(tmp_path):
    """`zstd --long` frames declare windows over the decompressor's default 128 MiB limit; a 0-byte
    .gz or .zst is no compressed stream at all (a failed download), not an empty corpus file."""
    params = zstandard.ZstdCompressionParameters.from_level(1, window_log=28)  # a 256 MiB window
    writer_out = io.BytesIO()
    with zstandard.ZstdCompressor(compression_params=params).stream_writer(writer_out, closefd=False) as w:
        w.write(b"".join(json.dumps({"text": f"record {i}"}).encode() + b"\n" for i in range(50)))
    data = writer_out.getvalue()
    assert zstandard.get_frame_parameters(data).window_size == 1 << 28
    (tmp_path / "long.jsonl.zst").write_bytes(data)
    for name in ("empty.jsonl.gz", "empty.jsonl.zst"):
        (tmp_path / name).write_bytes(b"")
    report = BadInputReport()
    docs = list(iter_documents([tmp_path], report=report))
    assert [d.text for d in docs] == [f"record {i}" for i in range(50)]
    assert report.to_dict()["by_reason"] == {"unreadable (an empty compressed file: truncated?)": 2}


def test_lone_surrogate_is_counted_not_fatal_in_both_commands(tmp_path, tok_dir, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    good = [make_text(random.Random(i), 30) for i in range(4)]
    lines = [json.dumps({"text": t}) for t in good]
    lines.insert(2, '{"text": "lone \\ud800 surrogate"}')            # valid JSON, invalid Unicode
    lines.insert(3, '{"text": "a pair \\ud83d\\ude00 is fine\\n"}')  # one character, kept
    (corpus / "web.jsonl").write_text("\n".join(lines) + "\n")
    where = f"{corpus / 'web.jsonl'}:3: invalid Unicode (lone surrogate)"

    assert tt.main(["--sources", str(corpus), "--out", str(tmp_path / "tok"), "--vocab-size", "300"]) == 0
    assert where in capsys.readouterr().out
    meta = json.loads((tmp_path / "tok" / "tokenizer.json").read_text())
    assert meta["bad_inputs"]["by_reason"] == {"invalid Unicode (lone surrogate)": 1}
    assert meta["training"]["documents_seen"] == 5

    assert bs.main(["--sources", str(corpus), "--tokenizer", str(tok_dir), "--out", str(tmp_path / "out"),
                    "--seq-len", "8", "--val-fraction", "0", "--workers", "2", "--no-progress"]) == 0
    assert where in capsys.readouterr().out
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["documents"] == 5 and m["bad_inputs"]["by_reason"] == {"invalid Unicode (lone surrogate)": 1}


# --- parts -------------------------------------------------------------------------

def make_corpus(root: Path, files: int = 6, seed: int = 3) -> list[str]:
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    texts = []
    for i in range(files):
        docs = [make_text(rng, rng.randrange(3, 12)) for _ in range(8)]
        (root / f"f{i}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
        texts += docs
    return texts


def test_parts_are_cut_by_the_corpus_alone(tmp_path):
    files = []
    for i, size in enumerate([100, 300, 50, 700, 20, 20, 20]):
        (tmp_path / f"{i}.txt").write_text("x" * size)
        files.append(tmp_path / f"{i}.txt")
    parts = P.plan_parts(files, 400)
    assert [[Path(p.path).name for p in part.pieces] for part in parts] == \
        [["0.txt", "1.txt"], ["2.txt", "3.txt"], ["4.txt", "5.txt", "6.txt"]]
    assert [p.bytes for p in parts] == [400, 750, 60]
    assert P.plan_parts(files, 400) == parts
    assert [p.index for p in P.tasks_parts(parts, 1, 2)] == [1]
    with pytest.raises(ValueError, match="--task must be below --tasks"):
        P.tasks_parts(parts, 2, 2)
    assert P.parse_size("64mb") == 64 << 20 and P.parse_size("1.5kb") == 1536
    for bad in ("lots", "inf", "nan", "-inf gb"):
        with pytest.raises(ValueError, match="e.g. 64mb"):
            P.parse_size(bad)


def test_a_large_json_lines_file_is_cut_at_line_starts(tmp_path, tok_dir, capsys):
    rng = random.Random(5)
    lines = [json.dumps({"text": make_text(rng, rng.randrange(1, 9))}) for _ in range(120)]
    lines[70] = "{broken"  # in a later range: reported with its line number all the same
    lines[100] = lines[10]  # a duplicate in another range, for --dedup exact
    src = tmp_path / "big.jsonl"
    src.write_text("".join(line + "\n" for line in lines))
    data, size = src.read_bytes(), src.stat().st_size
    ranges = P.jsonl_line_ranges(src, size // 5)
    assert len(ranges) >= 4 and ranges[0][0] == 0 and ranges[-1][1] == size
    assert P.jsonl_line_ranges(src, size // 5, progress=True) == ranges
    assert "planning: lines of big.jsonl" in capsys.readouterr().err  # counting a huge file shows progress
    for (start, end, first, planned), (after, *_) in zip(ranges, ranges[1:] + [(size,)]):
        assert end == after and data[end - 1:end] == b"\n" and first == data[:start].count(b"\n") + 1
        assert planned == size
    whole = list(read_file(src, "text", BadInputReport()))
    assert [d for r in ranges for d in read_file(src, "text", BadInputReport(), lines=r)] == whole
    kw = dict(seq_len=16, val_fraction=0.3, workers=1, dedup_mode="exact")
    one = bs.build_shards([src], tok_dir, tmp_path / "one", part_size=size + 1, **kw)
    cut = bs.build_shards([src], tok_dir, tmp_path / "cut", part_size=size // 5, **kw)
    assert one["parts"] == 1 and cut["parts"] == len(ranges) and cut["dedup"]["dropped_documents"] == 1
    assert cut["bad_inputs"] == one["bad_inputs"]
    assert one["bad_inputs"]["examples"] == [f"{src}:71: malformed JSON"]
    for split in ("train", "val"):  # the same documents in each split (their line numbers keyed the split)
        assert {k: cut["splits"][split][k] for k in ("documents", "tokens")} == \
            {k: one["splits"][split][k] for k in ("documents", "tokens")}
    plan = json.loads((tmp_path / "cut" / P.PLAN_FILE).read_text())
    assert [P.Part.from_dict(i, d).pieces[0].lines for i, d in enumerate(plan["parts"])] == ranges

    # An unfinished build planned before files were cut into lines resumes with its own parts.
    out, kw = tmp_path / "older", dict(seq_len=16, val_fraction=0.3, part_size=size // 5)
    older = bs.plan_build([src], tok_dir, out, **kw)
    older["parts"] = [{"pieces": [[str(src), None]], "bytes": size}]
    older["plan_id"] = P.plan_id(older)
    (out / P.PLAN_FILE).write_text(json.dumps(older))
    assert bs.plan_build([src], tok_dir, out, **kw)["plan_id"] == older["plan_id"]
    # A file changed after planning fails its part with the reason, instead of being misread.
    bs.plan_build([src], tok_dir, tmp_path / "changed", **kw)
    src.write_text(json.dumps({"text": "one more"}) + "\n" + data.decode())
    with pytest.raises(ValueError, match="big.jsonl changed since the build was planned"):
        bs.build_parts(tmp_path / "changed", workers=1)


def test_worker_count_does_not_change_the_samples(tmp_path, tok_dir):
    make_corpus(tmp_path / "corpus")
    kw = dict(seq_len=16, val_fraction=0.2, part_size="2kb")
    m1 = bs.build_shards([tmp_path / "corpus"], tok_dir, tmp_path / "w1", workers=1, **kw)
    m2 = bs.build_shards([tmp_path / "corpus"], tok_dir, tmp_path / "w2", workers=2, **kw)
    assert m1 == m2 and m1["parts"] >= 3
    for split in ("train", "val"):
        a, b = read_split(tmp_path / "w1" / split), read_split(tmp_path / "w2" / split)
        assert len(a) == m1["splits"][split]["samples"] > 0
        assert [x.tolist() for x in a] == [x.tolist() for x in b]


def test_tasks_build_their_parts_and_a_killed_part_is_rebuilt_alone(tmp_path, tok_dir, capsys, monkeypatch):
    texts = make_corpus(tmp_path / "corpus")
    kw = dict(seq_len=16, val_fraction=0.2, part_size="2kb")
    bs.build_shards([tmp_path / "corpus"], tok_dir, tmp_path / "local", workers=1, **kw)

    out = tmp_path / "cluster"
    monkeypatch.chdir(tmp_path)  # planned with relative paths, its tasks run elsewhere (other nodes)
    assert bs.main(["--sources", "corpus", "--tokenizer", os.path.relpath(tok_dir), "--out", str(out),
                    "--seq-len", "16", "--val-fraction", "0.2", "--part-size", "2kb", "--plan-only"]) == 0
    (tmp_path / "node").mkdir()
    monkeypatch.chdir(tmp_path / "node")
    plan = P.read_plan(out)
    parts = P.parts_of(plan)
    assert bs.main(["--out", str(out), "--task", "0", "--tasks", "2", "--workers", "1"]) == 0
    assert bs.main(["--out", str(out), "--merge"]) == 2
    assert "not complete (parts 1, 3" in capsys.readouterr().err
    assert bs.main(["--out", str(out), "--task", "1", "--tasks", "2", "--workers", "1"]) == 0

    # What a task killed while writing part 1 leaves: no marker, a half-written shard.
    victim = parts[1]
    P.marker_path(out, victim).unlink()
    shard = next((out / "train" / victim.name).glob("shard.*"))
    shard.write_bytes(shard.read_bytes()[:10])
    kept = {p.index: P.marker_path(out, p).stat().st_mtime_ns for p in parts if p.index != 1}
    assert P.status(out)["todo"] == [1]
    capsys.readouterr()
    assert bs.main(["--out", str(out), "--task", "1", "--tasks", "2", "--workers", "1"]) == 0
    err = capsys.readouterr().err
    assert f"{len(P.tasks_parts(parts, 1, 2)) - 1} of {len(P.tasks_parts(parts, 1, 2))} parts already complete" in err
    assert {p.index: P.marker_path(out, p).stat().st_mtime_ns for p in parts if p.index != 1} == kept
    assert bs.main(["--out", str(out), "--merge"]) == 0

    assert samples_multiset(out) == samples_multiset(tmp_path / "local")
    local = json.loads((tmp_path / "local" / "manifest.json").read_text())
    assert json.loads((out / "manifest.json").read_text())["splits"] == local["splits"]
    sp, _ = load_tokenizer(tok_dir)
    assert assert_samples_are_source_spans(out, texts, sp) > 10


def test_an_unfinished_build_continues_and_other_settings_are_refused(tmp_path, tok_dir):
    make_corpus(tmp_path / "corpus")
    kw = dict(seq_len=16, val_fraction=0.2, part_size="2kb")
    out = tmp_path / "out"
    plan = bs.plan_build([tmp_path / "corpus"], tok_dir, out, **kw)
    bs.build_parts(out, [0], workers=1)
    first = P.marker_path(out, P.parts_of(plan)[0]).stat().st_mtime_ns
    with pytest.raises(FileExistsError, match=r"planned differently \(seq_len: 16 there, 32 now\).*--overwrite"):
        bs.build_shards([tmp_path / "corpus"], tok_dir, out, workers=1, **{**kw, "seq_len": 32})
    m = bs.build_shards([tmp_path / "corpus"], tok_dir, out, workers=1, **kw)
    assert P.marker_path(out, P.parts_of(plan)[0]).stat().st_mtime_ns == first
    assert m == bs.build_shards([tmp_path / "corpus"], tok_dir, tmp_path / "fresh", workers=1, **kw)


# --- tokenizers ------------------------------------------------------------------------

def test_reservoir_sample_is_uniform_and_bounded():
    from data_prep.readers import Document

    docs = [Document("x" * 50, f"d{i}") for i in range(200)]
    hits = Counter()
    for seed in range(300):
        stats: dict = {}
        sample = tt.reservoir_sample(iter(docs), 20, seed, 10, stats)
        assert len(sample) == 20 and stats["documents_seen"] == 200 and all(len(d.text) == 10 for d in sample)
        hits.update(int(d.origin[1:]) // 50 for d in sample)  # which quarter of the stream
    # 300 x 20 draws, 1500 expected per quarter; "the first N" would put all 6000 in the first.
    assert all(1300 < hits[q] < 1700 for q in range(4)), hits
    # One slot, ten documents: each is the sample in a tenth of the seeds (2000 seeds: 200 expected)
    kept = Counter(tt.reservoir_sample(iter(docs[:10]), 1, seed, 10, {})[0].origin for seed in range(2000))
    assert sorted(kept) == [f"d{i}" for i in range(10)] and all(140 < n < 260 for n in kept.values()), kept


def test_tokenizer_trains_on_a_sample_of_all_files(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(30):
        (corpus / f"f{i:02d}.txt").write_text(make_text(random.Random(i), 20))
    meta = tt.train_tokenizer([corpus], tmp_path / "tok", vocab_size=300, sample_docs=10, num_threads=1)
    sample = meta["training"]["sample"]
    origins = (tmp_path / "tok" / sample["origins"]).read_text().split()
    assert sample["documents"] == len(origins) == 10 and meta["training"]["documents_seen"] == 30
    assert max(int(Path(o).stem[1:]) for o in origins) >= 10  # not just the first ten files


def test_existing_sentencepiece_model_is_used_like_ours(tmp_path, tok_dir, capsys):
    import sentencepiece as spm

    corpus = tmp_path / "c.txt"
    corpus.write_text(make_text(random.Random(5), 300))
    # Llama-2's conventions: unigram, dummy prefix, no pad piece, <s> = 1, </s> = 2.
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "llama"), vocab_size=300,
                                   model_type="unigram", pad_id=-1, byte_fallback=True, minloglevel=2)
    meta = import_tokenizer(tmp_path / "llama.model", tmp_path / "imported")
    keys = ("unk_id", "bos_id", "eos_id", "pad_id", "model_type", "add_dummy_prefix", "byte_fallback")
    assert {k: meta[k] for k in keys} == {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": -1, "model_type": "unigram",
                                         "add_dummy_prefix": True, "byte_fallback": True}
    # What the model itself says, other conventions too; a directory holding tokenizer.model is taken.
    (tmp_path / "bpe").mkdir()
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "bpe" / "tokenizer"),
                                   vocab_size=300, model_type="bpe", add_dummy_prefix=False, byte_fallback=False,
                                   bos_id=-1, eos_id=1, unk_id=2, hard_vocab_limit=False, minloglevel=2)
    other = import_tokenizer(tmp_path / "bpe", tmp_path / "bpe_imported")
    assert {k: other[k] for k in keys} == {"unk_id": 2, "bos_id": -1, "eos_id": 1, "pad_id": -1, "model_type": "bpe",
                                          "add_dummy_prefix": False, "byte_fallback": False}
    # Without an end-of-sequence piece documents cannot be separated in shards: refused, nothing written.
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "no_eos"), vocab_size=300,
                                   eos_id=-1, hard_vocab_limit=False, minloglevel=2)
    assert import_main(["--model", str(tmp_path / "no_eos.model"), "--out", str(tmp_path / "no_eos_tok")]) == 2
    assert "has no end-of-sequence piece: build_shards separates documents" in capsys.readouterr().err
    assert not (tmp_path / "no_eos_tok").exists()
    sp, loaded = load_tokenizer(tmp_path / "imported")
    assert loaded == meta and sp.get_piece_size() == meta["vocab_size"]

    m = bs.build_shards([corpus], tmp_path / "imported", tmp_path / "out", seq_len=8, val_fraction=0, workers=1)
    assert m["tokenizer_sha256"] == meta["sha256"] and m["vocab_size"] == meta["vocab_size"]
    stream = np.concatenate(read_split(tmp_path / "out" / "train")).tolist()
    assert stream == (sp.encode(corpus.read_text()) + [2])[: len(stream)] and len(stream) > 100

    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    assert import_main(["--model", str(tmp_path / "tokenizer.json"), "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert "is not a SentencePiece model" in err and "tokenizer.model of a Llama-2-style checkpoint" in err
    assert not (tmp_path / "bad").exists()
    assert import_main(["--model", str(tmp_path / "llama.model"), "--out", str(tmp_path / "imported")]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_first_of_each_keeps_the_first_of_every_128_bit_hash():
    """Both 64-bit halves decide (real texts' hashes never share one half, so only this test shows
    it): against a plain set over small-range halves, which share them often."""
    from data_prep.dedup import first_of_each

    rng = np.random.default_rng(0)
    hi, lo = rng.integers(0, 3, 200).astype(np.uint64), rng.integers(0, 3, 200).astype(np.uint64)
    seen, want = set(), []
    for pair in zip(hi.tolist(), lo.tolist()):
        want.append(pair not in seen)
        seen.add(pair)
    assert first_of_each(hi, lo).tolist() == want and sum(want) == 9
    assert first_of_each(np.array([], np.uint64), np.array([], np.uint64)).tolist() == []


def test_exact_dedup_keeps_first_occurrences_across_parts_and_tasks(tmp_path, tok_dir, capsys):
    rng = random.Random(7)
    a, b, c, d, e = (make_text(rng, 6) for _ in range(5))
    corpus = tmp_path / "corpus"
    corpus.mkdir()

    def write(name: str, docs: list[str]) -> None:  # compressed: one part per file (no line ranges)
        with gzip.open(corpus / f"{name}.jsonl.gz", "wt") as f:
            f.write("".join(json.dumps({"text": t}) + "\n" for t in docs))

    for name, docs in (("f0", [a, b, c]), ("f1", [b, d]), ("f2", [a, a, e]), ("f3", [c])):
        write(name, docs)
    kw = dict(seq_len=8, val_fraction=0, part_size="60b", dedup_mode="exact")
    m = bs.build_shards([corpus], tok_dir, tmp_path / "local", workers=1, **kw)
    assert m["parts"] == 4 and m["dedup"] == {"method": "exact", "dropped_documents": 4}
    assert m["documents"] == 5 and m["splits"]["train"]["documents"] == 5
    plan = P.read_plan(tmp_path / "local")
    markers = [P.read_marker(tmp_path / "local", p, plan) for p in P.parts_of(plan)]
    assert [(x["splits"]["train"]["documents"], x["duplicates"]) for x in markers] == [(3, 0), (1, 1), (1, 2), (0, 1)]
    sp, _ = load_tokenizer(tok_dir)
    first = split_docs(np.concatenate(read_split(tmp_path / "local" / "train" / "part-00000")), sp.eos_id())
    assert [sp.decode(x) for x in first] == [a, b]  # c is cut by the part's last incomplete sample
    assert bs.build_shards([corpus], tok_dir, tmp_path / "w2", workers=2, **kw) == m

    # On a cluster: tasks hash first, one step builds the index, the same tasks then build.
    out = tmp_path / "cluster"
    args = ["--out", str(out), "--tasks", "2", "--workers", "1"]
    assert bs.main(["--sources", str(corpus), "--tokenizer", str(tok_dir), "--out", str(out), "--seq-len", "8",
                    "--val-fraction", "0", "--part-size", "60b", "--dedup", "exact", "--plan-only"]) == 0
    assert bs.main(args + ["--task", "0"]) == 0
    assert P.status(out)["done"] == []  # hashed, not built
    assert "part 0 hashed: 3 documents" in capsys.readouterr().err
    assert bs.main(args + ["--task", "0"]) == 0  # again before the index: it says what to run
    assert f"--out {out} --dedup-index" in capsys.readouterr().err
    assert bs.main(["--out", str(out), "--dedup-index"]) == 2
    assert "have no document hashes yet (parts 1, 3)" in capsys.readouterr().err
    assert bs.main(args + ["--task", "1"]) == 0
    assert bs.main(["--out", str(out), "--dedup-index"]) == 0
    assert "4 of 9 documents are duplicates" in capsys.readouterr().out
    # A build planned without dedup has nothing to index: said so, not "hash them first".
    plain = tmp_path / "plain"
    assert bs.main(["--sources", str(corpus), "--tokenizer", str(tok_dir), "--out", str(plain), "--seq-len", "8",
                    "--val-fraction", "0", "--part-size", "60b", "--plan-only"]) == 0
    assert bs.main(["--out", str(plain), "--dedup-index"]) == 2
    assert "planned without --dedup exact, so there is nothing to index" in capsys.readouterr().err
    # A file that reads differently than when hashed fails its part instead of shifting the mask.
    f0 = corpus / "f0.jsonl.gz"
    hashed = f0.read_bytes()
    write("f0", [a, c])
    assert bs.main(args + ["--task", "0"]) != 0
    assert "document 2 (" in capsys.readouterr().err and P.status(out)["done"] == []
    f0.write_bytes(hashed)
    for task in ("0", "1"):
        assert bs.main(args + ["--task", task]) == 0
    assert bs.main(["--out", str(out), "--merge"]) == 0
    assert samples_multiset(out) == samples_multiset(tmp_path / "local")
    assert json.loads((out / "manifest.json").read_text())["dedup"] == m["dedup"]


def test_corrupt_gzip_data_is_counted_where_it_broke(tmp_path):
    rng = random.Random(9)
    texts = [make_text(rng, 3) for _ in range(4000)]
    data = gzip.compress(("\n".join(json.dumps({"text": t}) for t in texts) + "\n").encode())
    broken = bytearray(data)
    broken[len(broken) // 2: len(broken) // 2 + 64] = bytes(64)  # zeroed deflate data: a zlib error mid-stream
    (tmp_path / "bad.jsonl.gz").write_bytes(bytes(broken))
    report = BadInputReport()
    docs = list(iter_documents([tmp_path], report=report))
    # Deflate has no per-block checksum: the lines just before the error may be garbled, not the rest.
    keep = len(docs) - 20
    assert 1000 < keep < len(texts) and [d.text for d in docs[:keep]] == texts[:keep]
    unreadable = {r: n for r, n in report.by_reason.items() if r.startswith("unreadable")}
    assert list(unreadable.values()) == [1], report.to_dict()  # once, where zlib gave up
    assert set(report.by_reason) - set(unreadable) <= {"malformed JSON", "not UTF-8", "missing or non-string 'text' field"}


def test_unparsable_json_a_bom_and_overlapping_sources(tmp_path):
    rng = random.Random(10)
    texts = [make_text(rng, 3) for _ in range(4)]
    lines = [json.dumps({"text": texts[0]}), '{"text": "x", "id": ' + "1" * 5000 + "}",
             '{"text": "x", "m": ' + "[" * 5000 + "]" * 5000 + "}", json.dumps({"text": texts[1]})]
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.jsonl").write_bytes(b"\xef\xbb\xbf" + ("\n".join(lines) + "\n").encode())  # opens with a BOM
    (corpus / "sub" / "b.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts[2:]) + "\n")
    report = BadInputReport()
    # The folder and a file and subfolder inside it: each file read once.
    docs = list(iter_documents([corpus, corpus / "a.jsonl", corpus / "sub"], report=report))
    assert [d.text for d in docs] == texts and docs[0].origin == f"{corpus / 'a.jsonl'}:1"
    assert report.to_dict()["by_reason"] == {"unparsable JSON (ValueError)": 1, "unparsable JSON (RecursionError)": 1}


def test_parquet_value_that_is_not_utf8_is_one_bad_record(tmp_path):
    from data_prep.readers import read_records

    texts = [f"row {i} text" for i in range(5)]
    raw = [t.encode() for t in texts[:2]] + [b"bad \xff bytes"] + [t.encode() for t in texts[2:]]
    path = tmp_path / "bad.parquet"
    # pyarrow writes (and reads back) string columns without checking them.
    pq.write_table(pa.table({"text": pa.array(raw, pa.binary()).view(pa.string())}), path)
    report, records = BadInputReport(), BadInputReport()
    assert [d.text for d in iter_documents([path], report=report)] == texts
    assert [r["text"] for r, _ in read_records(path, records)] == texts
    for r in (report, records):
        assert r.examples == [f"{path}:3: not UTF-8"]
    # Mixed shapes in one file (messages, or prompt/response): a row holds the fields it has, no nulls.
    mixed = tmp_path / "mixed.parquet"
    pq.write_table(pa.table({"messages": [[{"role": "user", "content": "hi"}], None],
                             "prompt": [None, "q"], "response": [None, "a"]}), mixed)
    assert [r for r, _ in read_records(mixed, BadInputReport())] == [
        {"messages": [{"role": "user", "content": "hi"}]}, {"prompt": "q", "response": "a"}]


def test_parquet_text_in_every_string_layout_and_files_lost_whole_count_their_rows(tmp_path, monkeypatch):
    """string_view and dictionary-encoded (pandas categorical) text columns are text; a file without
    a text column counts each of its rows; any Arrow error on a damaged file is counted, not raised."""
    values = ["hello", None, "", "world"]
    for name, column in (("view", pa.array(values, pa.string_view())), ("dict", pa.array(values).dictionary_encode())):
        pq.write_table(pa.table({"text": column}), tmp_path / f"{name}.parquet")
        report = BadInputReport()
        assert [d.text for d in iter_documents([tmp_path / f"{name}.parquet"], report=report)] == ["hello", "world"]
        assert report.to_dict()["by_reason"] == {"missing or non-string 'text' field": 1}, name
    pq.write_table(pa.table({"text": pa.array([1, 2, 3])}), tmp_path / "numbers.parquet")
    report = BadInputReport()
    assert list(iter_documents([tmp_path / "numbers.parquet"], report=report)) == []
    assert report.count == 3 and report.examples == [f"{tmp_path / 'numbers.parquet'}: column 'text' is int64, "
                                                     "not a string"]
    # A file cut into parts by row groups: each part counts the rows it would have read.
    pq.write_table(pa.table({"text": pa.array(range(300))}), tmp_path / "groups.parquet", row_group_size=100)
    report = BadInputReport()
    for group in range(3):
        assert list(read_parquet_file(tmp_path / "groups.parquet", "text", report, row_groups=[group])) == []
    assert report.count == 300

    def damaged(*args, **kwargs):
        raise pa.lib.ArrowNotImplementedError("Integers with more than 64 bits not implemented")

    monkeypatch.setattr(pq, "ParquetFile", damaged)
    report = BadInputReport()
    assert list(iter_documents([tmp_path / "view.parquet"], report=report)) == []
    assert report.count == 1 and "more than 64 bits" in report.examples[0]


def test_a_long_document_is_encoded_in_pieces_with_the_ids_of_the_whole(tok_dir):
    """A long text is cut just before spaces (else newlines, else anywhere) into pieces whose ids,
    joined, are the whole text's; the document's last piece alone takes the EOS."""
    from data_prep.readers import Document

    sp, _ = load_tokenizer(tok_dir)
    rng = random.Random(3)
    text = "\n".join(make_text(rng, 30) for _ in range(20))
    pieces = bs.document_pieces(text, size=200)
    assert "".join(pieces) == text and len(pieces) > 10
    assert all(len(p) <= 200 for p in pieces) and all(p.startswith(" ") for p in pieces[1:])
    assert [t for p in pieces for t in sp.encode(p)] == sp.encode(text)
    assert bs.document_pieces("x" * 450, size=200) == ["x" * 200, "x" * 200, "x" * 50]  # no space: anywhere
    assert bs.document_pieces("ab\ncd" * 60, size=100)[0].endswith("ab")  # a newline where no space is
    docs = [Document("short one", "a"), Document("word " * 500_000, "b")]  # 2.5M characters: 3 pieces
    batches = list(bs._batches(docs, lambda origin: "train"))
    texts, ends = [t for b in batches for t in b[0]], [e for b in batches for e in b[2]]
    assert "".join(texts) == "short one" + "word " * 500_000 and ends == [True, False, False, True]


def test_no_val_split_leaves_no_val_index(tmp_path, tok_dir):
    rng = random.Random(11)
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"text": make_text(rng, 6)}) for _ in range(30)) + "\n")
    m = bs.build_shards([tmp_path / "c.jsonl"], tok_dir, tmp_path / "out", seq_len=8, val_fraction=0, workers=1)
    assert m["splits"]["val"]["samples"] == 0 and m["splits"]["train"]["samples"] > 0
    assert (tmp_path / "out" / "train" / "index.json").is_file()
    assert not (tmp_path / "out" / "val" / "index.json").exists()  # what pretrain.data reads as no val split


def die_in_worker(job: str, index: int):
    os._exit(9)  # as the OOM killer ends a process: no exception, no result


def test_a_worker_that_dies_fails_the_build_clearly(tmp_path, tok_dir, monkeypatch):
    rng = random.Random(12)
    for i in range(2):
        (tmp_path / f"c{i}.jsonl").write_text(
            "\n".join(json.dumps({"text": make_text(rng, 6)}) for _ in range(20)) + "\n")
    bs.plan_build([tmp_path], tok_dir, tmp_path / "out", seq_len=8, val_fraction=0, part_size=64)
    monkeypatch.setattr(bs, "_in_worker", die_in_worker)  # the pool's processes are forked: they see it
    with pytest.raises(RuntimeError, match="a worker process died .* fewer --workers"):
        bs.build_parts(tmp_path / "out", workers=2)


def test_a_file_system_error_while_planning_a_large_json_lines_file(tmp_path, tok_dir, monkeypatch, capsys):
    """Cutting a large .jsonl into parts reads it whole: an input/output error there names the file and
    the flag, and --skip-unreadable plans it as one piece (its reader counts it if it fails again)."""
    import errno

    rng = random.Random(4)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    big = corpus / "big.jsonl"
    big.write_text("".join(json.dumps({"text": make_text(rng, 3)}) + "\n" for _ in range(60)))
    real_open = open

    def failing_open(path, *args, **kwargs):
        if Path(path) == big:
            raise OSError(errno.EIO, "Input/output error")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(P, "open", failing_open, raising=False)  # the planner's reads only
    args = ["--sources", str(corpus), "--tokenizer", str(tok_dir), "--seq-len", "8", "--val-fraction", "0",
            "--part-size", "1kb", "--workers", "1", "--no-progress"]
    assert bs.main([*args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"could not read {big} to plan its parts: Input/output error" in err and "--skip-unreadable" in err
    assert bs.main([*args, "--out", str(tmp_path / "skipped"), "--skip-unreadable"]) == 0
    assert json.loads((tmp_path / "skipped" / "manifest.json").read_text())["documents"] == 60


def _children(pid: int) -> list[int]:
    def parent(proc: str) -> int | None:
        try:
            return int(Path(f"/proc/{proc}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return None  # gone meanwhile
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and parent(p) == pid]


def _wait_for(condition, what: str, timeout: float = 60.0):
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if result := condition():
            return result
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_killed_or_terminated_build_leaves_no_worker_behind(tmp_path, tok_dir):
    """The build's process killed (SIGKILL, the OOM killer): its workers end too instead of waiting
    on their queue forever. SIGTERM to it alone (kill) or to its process group (timeout, scancel):
    it stops as on Ctrl-C, the running part finishing and kept, and exits 143. A worker is held
    inside a part by a named pipe it reads."""
    import signal
    import subprocess
    import sys

    from tests.dist_utils import REPO, child_env

    make_corpus(tmp_path / "corpus", files=3)
    fifo = tmp_path / "corpus" / "slow.txt"
    os.mkfifo(fifo)
    cmd = [sys.executable, "-m", "data_prep.build_shards", "--sources", str(tmp_path / "corpus"), "--tokenizer",
           str(tok_dir), "--seq-len", "8", "--val-fraction", "0", "--workers", "2", "--part-size", "1kb",
           "--no-progress"]

    def writer_once_a_worker_reads() -> int:  # the part of the pipe is running, its worker held in read()
        def opened():
            try:
                return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:  # no reader yet (ENXIO)
                return None
        return _wait_for(opened, "a worker to open the named pipe")

    for stop, to_group in ((signal.SIGKILL, False), (signal.SIGTERM, False), (signal.SIGTERM, True)):
        out = tmp_path / f"{stop.name}{'-group' * to_group}"
        build = subprocess.Popen([*cmd, "--out", str(out)], cwd=REPO, env=child_env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            write_end = writer_once_a_worker_reads()
            workers = _children(build.pid)
            assert len(workers) == 2, workers
            if to_group:
                os.killpg(build.pid, stop)
            else:
                build.send_signal(stop)
            if stop == signal.SIGTERM:
                _wait_for(lambda: "stopping:" in build.stderr.readline(), "the build to say it stops")
            os.close(write_end)  # the held part reads its end and finishes
            build.wait(timeout=60)  # not its pipes: orphaned workers would hold them open
        finally:
            build.kill()
        assert build.returncode == (-signal.SIGKILL if stop == signal.SIGKILL else 143)
        _wait_for(lambda: not any(Path(f"/proc/{w}").exists() for w in workers), f"the workers to end after {stop!r}",
                  timeout=10)
        if stop == signal.SIGTERM:  # the held part was kept
            plan = P.read_plan(out)
            held = [p for p in P.parts_of(plan) if any("slow.txt" in str(piece[0]) for piece in plan["parts"][p.index]
                                                        ["pieces"])]
            assert len(held) == 1 and P.read_marker(out, held[0], plan) is not None, out
