"""Unit tests of the data layer: exact DP partitioning, pure samples, a learnable synthetic
corpus and the preprocess -> IndexedCorpus round trip (no torch.distributed)."""

from __future__ import annotations

import importlib.util
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from deadpool_megatron.config import DataConfig, ModelConfig
from deadpool_megatron.errors import ConfigError
from deadpool_megatron.megatron.data import (
    IndexedCorpus,
    SyntheticCorpus,
    build_corpus,
    build_tokenizer,
    get_micro_batch,
    micro_batch_indices,
)

ROOT = Path(__file__).resolve().parents[2]


def _load_preprocess():
    spec = importlib.util.spec_from_file_location(
        "preprocess_data", ROOT / "scripts" / "preprocess_data.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


preprocess_data = _load_preprocess()


@pytest.mark.parametrize("dp_size,gbs,mbs", [(1, 16, 2), (2, 16, 2), (4, 16, 4), (3, 12, 1)])
def test_micro_batch_indices_partition_each_global_batch(dp_size, gbs, mbs):
    for iteration in range(3):
        seen = []
        for rank in range(dp_size):
            mbs_of_rank = micro_batch_indices(iteration, rank, dp_size, gbs, mbs)
            assert len(mbs_of_rank) == gbs // dp_size // mbs
            assert all(len(mb) == mbs for mb in mbs_of_rank)
            flat = [i for mb in mbs_of_rank for i in mb]
            lo = iteration * gbs + rank * gbs // dp_size
            assert flat == list(range(lo, lo + gbs // dp_size))  # contiguous slice per rank
            seen += flat
        assert sorted(seen) == list(range(iteration * gbs, (iteration + 1) * gbs))
        assert len(set(seen)) == gbs


@pytest.mark.parametrize(
    "args,names",
    [
        ((0, 0, 3, 16, 2), ["global_batch_size=16", "dp_size=3"]),
        ((0, 0, 2, 16, 3), ["micro_batch_size=3"]),
        ((0, 2, 2, 16, 2), ["dp_rank=2"]),
        ((-1, 0, 1, 16, 2), ["iteration=-1"]),
        ((0, 0, 1, 16, 0), ["micro_batch_size=0"]),
    ],
)
def test_micro_batch_indices_rejects_bad_sizes(args, names):
    with pytest.raises(ValueError) as err:
        micro_batch_indices(*args)
    for name in names:
        assert name in str(err.value)


def test_synthetic_sample_is_pure_function_of_index_and_seed():
    a = SyntheticCorpus(128, 32, seed=7)
    # Read in a different order from a fresh object: nothing may depend on call order.
    b = SyntheticCorpus(128, 32, seed=7)
    _ = [b[i] for i in (99, 3, 50)]
    for i in (0, 1, 50, 10**12):
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            np.testing.assert_array_equal(a[i][key], b[i][key])
    c = SyntheticCorpus(128, 32, seed=8)
    assert not np.array_equal(a[0]["tokens"], c[0]["tokens"])
    assert not np.array_equal(a[0]["tokens"], a[1]["tokens"])


def test_synthetic_sample_layout():
    corpus = SyntheticCorpus(128, 32, seed=1)
    assert len(corpus) >= 2**62
    s = corpus[5]
    assert {k: (v.dtype, v.shape) for k, v in s.items()} == {
        "tokens": (np.int64, (32,)),
        "labels": (np.int64, (32,)),
        "loss_mask": (np.float32, (32,)),
        "position_ids": (np.int64, (32,)),
    }
    np.testing.assert_array_equal(s["labels"][:-1], s["tokens"][1:])
    np.testing.assert_array_equal(s["position_ids"], np.arange(32))
    assert s["tokens"].min() >= 0 and s["tokens"].max() < 128


def test_synthetic_corpus_is_learnable():
    """Empirical H(next | token) must be far below ln(vocab): there is structure to learn."""
    vocab = 128
    corpus = SyntheticCorpus(vocab, 32, seed=1234)
    pairs: Counter = Counter()
    unigram: Counter = Counter()
    for i in range(3000):
        s = corpus[i]
        for t, n in zip(s["tokens"].tolist(), s["labels"].tolist(), strict=True):
            pairs[(t, n)] += 1
            unigram[t] += 1
    total = sum(pairs.values())
    h_cond = -sum(c / total * math.log(c / unigram[t]) for (t, _), c in pairs.items())
    assert h_cond < 0.3 * math.log(vocab), (h_cond, math.log(vocab))
    # ...yet every token occurs: the corpus is not a degenerate constant sequence.
    assert len(unigram) == vocab


def test_get_micro_batch_stacks_cpu_tensors():
    corpus = SyntheticCorpus(128, 16, seed=3)
    batch = get_micro_batch(corpus, [4, 5, 6])
    assert set(batch) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert batch["tokens"].dtype == torch.int64 and batch["tokens"].shape == (3, 16)
    assert batch["labels"].dtype == torch.int64
    assert batch["loss_mask"].dtype == torch.float32
    assert batch["position_ids"].dtype == torch.int64
    assert batch["tokens"].device.type == "cpu"
    np.testing.assert_array_equal(batch["tokens"][1].numpy(), corpus[5]["tokens"])


def test_build_corpus_defaults_to_synthetic():
    corpus = build_corpus(DataConfig(), ModelConfig(), seed=1, num_samples=10)
    assert isinstance(corpus, SyntheticCorpus)
    corpus = build_corpus(
        DataConfig(data_path=["x"], mock_data=True), ModelConfig(), seed=1, num_samples=10
    )
    assert isinstance(corpus, SyntheticCorpus)


def test_tokenizers():
    null = build_tokenizer("NullTokenizer", 128)
    assert null.vocab_size == 128 and null.eod == 127 and null.pad not in (null.eod,)
    assert null.detokenize(null.tokenize("3 17 5")) == "3 17 5"
    byte = build_tokenizer("ByteLevelTokenizer", 128)
    assert byte.vocab_size == 257 and byte.eod == 256
    assert byte.detokenize(byte.tokenize("héllo") + [256]) == "héllo"
    with pytest.raises(ValueError, match="'Bogus'"):
        build_tokenizer("Bogus", 128)


DOCS = [
    "the quick brown fox jumps over the lazy dog",
    "pack my box with five dozen liquor jugs",
    "",
    "sphinx of black quartz, judge my vow — déjà vu",
    "how vexingly quick daft zebras jump",
]


def _write_dataset(tmp_path: Path) -> str:
    text = tmp_path / "docs.txt"
    text.write_text("\n".join(DOCS) + "\n", encoding="utf-8")
    prefix = str(tmp_path / "out" / "docs")
    assert preprocess_data.main(["--input", str(text), "--output-prefix", prefix]) == 0
    return prefix


def _indexed(prefix: str, cache: Path, seed: int = 5) -> IndexedCorpus:
    data = DataConfig(
        data_path=[prefix], tokenizer_type="ByteLevelTokenizer", data_cache_path=str(cache)
    )
    tokenizer = build_tokenizer("ByteLevelTokenizer", 257)
    return IndexedCorpus(data, seq_length=16, seed=seed, num_samples=40, tokenizer=tokenizer)


def test_preprocess_round_trip(tmp_path):
    assert not torch.distributed.is_initialized()
    prefix = _write_dataset(tmp_path)
    corpus = _indexed(prefix, tmp_path / "cache")
    assert len(corpus) >= 40
    docs = [d.encode("utf-8") for d in DOCS if d]
    eod = 256
    for i in range(len(corpus)):
        s = corpus[i]
        assert s["tokens"].dtype == np.int64 and s["tokens"].shape == (16,)
        assert s["loss_mask"].dtype == np.float32 and s["loss_mask"].all()
        np.testing.assert_array_equal(s["labels"][:-1], s["tokens"][1:])
        np.testing.assert_array_equal(s["position_ids"], np.arange(16))
        # The window of 17 ids splits at eod into pieces of the original documents: whole
        # documents in the middle, a suffix first, a prefix last.
        window = s["tokens"].tolist() + [int(s["labels"][-1])]
        pieces = [bytes(p) for p in _split(window, eod)]
        for j, piece in enumerate(pieces):
            if 0 < j < len(pieces) - 1:
                assert piece in docs
            elif j == 0 and len(pieces) > 1:
                assert any(d.endswith(piece) for d in docs), piece
            elif j == len(pieces) - 1 and len(pieces) > 1:
                assert any(d.startswith(piece) for d in docs), piece
            else:
                assert any(piece in d for d in docs), piece
    # Every byte the dataset holds decodes back to the text: all documents appear in one epoch.
    stream = b"".join(
        bytes(t for t in corpus[i]["tokens"].tolist() if t != eod) for i in range(len(corpus))
    )
    for d in docs:
        assert d[:8] in stream
    assert "déjà" in corpus.tokenizer.detokenize(
        [t for i in range(len(corpus)) for t in corpus[i]["tokens"].tolist()]
    )

    # A second build (fresh cache, fresh objects) gives identical samples; another seed differs.
    again = _indexed(prefix, tmp_path / "cache2")
    for i in range(len(corpus)):
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            np.testing.assert_array_equal(corpus[i][key], again[i][key])
    other = _indexed(prefix, tmp_path / "cache3", seed=6)
    assert any(
        not np.array_equal(corpus[i]["tokens"], other[i]["tokens"]) for i in range(len(corpus))
    )
    with pytest.raises(IndexError, match="num_samples"):
        corpus[len(corpus)]


def test_weighted_blend_and_build_corpus(tmp_path):
    prefix = _write_dataset(tmp_path)
    data = DataConfig(
        data_path=["0.3", prefix, "0.7", prefix],
        tokenizer_type="ByteLevelTokenizer",
        data_cache_path=str(tmp_path / "cache"),
    )
    corpus = build_corpus(data, ModelConfig(vocab_size=384, seq_length=16), seed=1, num_samples=30)
    assert isinstance(corpus, IndexedCorpus) and len(corpus) == 30
    assert get_micro_batch(corpus, [0, 29])["tokens"].shape == (2, 16)
    with pytest.raises(ConfigError, match="--vocab-size 128"):
        build_corpus(data, ModelConfig(vocab_size=128), seed=1, num_samples=30)


def test_preprocess_missing_input_exits_2(tmp_path, capsys):
    missing = tmp_path / "nope.txt"
    with pytest.raises(SystemExit) as err:
        preprocess_data.main(["--input", str(missing), "--output-prefix", str(tmp_path / "o")])
    assert err.value.code == 2
    assert str(missing) in capsys.readouterr().err


def test_preprocess_jsonl(tmp_path, capsys):
    src = tmp_path / "docs.jsonl"
    src.write_text('{"text": "abc"}\n{"text": "de"}\n', encoding="utf-8")
    prefix = str(tmp_path / "j")
    assert (
        preprocess_data.main(["--input", str(src), "--output-prefix", prefix, "--json-key", "text"])
        == 0
    )
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(len(ds))] == [[97, 98, 99, 256], [100, 101, 256]]
    with pytest.raises(SystemExit) as err:
        preprocess_data.main(["--input", str(src), "--output-prefix", prefix, "--json-key", "body"])
    assert err.value.code == 2 and "'body'" in capsys.readouterr().err


def _split(ids: list[int], sep: int) -> list[list[int]]:
    out: list[list[int]] = [[]]
    for t in ids:
        if t == sep:
            out.append([])
        else:
            out[-1].append(t)
    return out
