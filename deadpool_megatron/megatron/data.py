"""Data layer: which samples an iteration reads, and what each sample holds.

Fault tolerance rests on one property: a sample is a pure function of ``(index, seed)``, and
the indices an iteration reads are a pure function of ``(iteration, dp_rank, dp_size, batch
sizes)``. Neither depends on the process, the rank that built the corpus or the order of calls,
so a job restarted from the checkpoint of iteration ``i`` replays exactly the batches a job that
never failed would have read, with no data-loader state to save.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Protocol

import numpy as np
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.utils import get_blend_from_list
from megatron.core.tokenizers import MegatronTokenizerBase

from ..config import DataConfig, ModelConfig
from ..errors import ConfigError

SAMPLE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


class Corpus(Protocol):
    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> dict[str, np.ndarray]: ...


def micro_batch_indices(
    iteration: int, dp_rank: int, dp_size: int, global_batch_size: int, micro_batch_size: int
) -> list[list[int]]:
    """Sample indices of each micro-batch that DP rank ``dp_rank`` reads at ``iteration``.

    Global batch ``i`` is samples ``[i*GBS, (i+1)*GBS)``; rank ``d`` takes the contiguous slice
    ``[d*GBS/dp, (d+1)*GBS/dp)``, cut into micro-batches. Pure, so a restart needs no state.
    """
    if iteration < 0:
        raise ValueError(f"iteration={iteration} must be >= 0")
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must lie in [0, dp_size={dp_size}), dp_size >= 1")
    if micro_batch_size < 1 or global_batch_size < 1:
        raise ValueError(
            f"global_batch_size={global_batch_size} and micro_batch_size={micro_batch_size} "
            "must be positive"
        )
    if global_batch_size % (micro_batch_size * dp_size) != 0:
        raise ValueError(
            f"global_batch_size={global_batch_size} is not divisible by micro_batch_size="
            f"{micro_batch_size} x dp_size={dp_size} = {micro_batch_size * dp_size}"
        )
    per_rank = global_batch_size // dp_size
    start = iteration * global_batch_size + dp_rank * per_rank
    return [
        list(range(s, s + micro_batch_size))
        for s in range(start, start + per_rank, micro_batch_size)
    ]


class SyntheticCorpus:
    """A deterministic corpus a tiny GPT learns within tens of iterations.

    Uniform random tokens would leave the loss flat at ln(vocab), which hides a broken optimizer
    step or a wrong restart. Here each sample walks a seed-derived permutation (next token =
    ``perm[token]``) from a random start, replacing a token by a random one with probability
    ``noise``: the next-token entropy is about 0.8 nats for vocab 128 against ln(128) = 4.85.
    """

    def __init__(self, vocab_size: int, seq_length: int, seed: int, noise: float = 0.1):
        if vocab_size < 2 or seq_length < 1 or seed < 0:
            raise ValueError(
                f"vocab_size={vocab_size} must be >= 2, seq_length={seq_length} >= 1 and "
                f"seed={seed} >= 0"
            )
        self.vocab_size, self.seq_length, self.seed, self.noise = (
            vocab_size,
            seq_length,
            seed,
            noise,
        )
        # Key 2**62 is no valid sample index, so the permutation's stream is no sample's.
        self.perm = np.random.default_rng([seed, 2**62]).permutation(vocab_size)
        self._position_ids = np.arange(seq_length, dtype=np.int64)

    def __len__(self) -> int:
        return 2**62

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample index {index} out of range [0, 2**62)")
        # Seeding with (seed, index) makes every sample independent of all others.
        rng = np.random.default_rng([self.seed, int(index)])
        n = self.seq_length + 1
        noisy = rng.random(n) < self.noise
        random_tokens = rng.integers(0, self.vocab_size, size=n)
        seq = np.empty(n, dtype=np.int64)
        seq[0] = random_tokens[0]
        for t in range(1, n):
            seq[t] = random_tokens[t] if noisy[t] else self.perm[seq[t - 1]]
        return {
            "tokens": seq[:-1].copy(),
            "labels": seq[1:].copy(),
            "loss_mask": np.ones(self.seq_length, dtype=np.float32),
            "position_ids": self._position_ids.copy(),
        }


class _SimpleTokenizer(MegatronTokenizerBase):
    """Download-free tokenizer with what GPTDataset reads: eod, pad, vocab_size and
    ``unique_identifiers`` (hashed into the dataset cache name)."""

    def __init__(self, vocab_size: int, eod: int):
        super().__init__("", {})
        self._vocab_size, self._eod = vocab_size, eod

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    eos = eod

    @property
    def pad(self) -> int:
        # GPTDataset draws seq_length + 1 tokens, so it never pads; -1 (megatron's own
        # "no pad" id) never collides with eod and never masks a real token.
        return -1

    @property
    def vocab(self) -> dict:
        return {i: i for i in range(self._vocab_size)}

    @property
    def inv_vocab(self) -> dict:
        return self.vocab

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(class_=type(self).__name__, vocab_size=self._vocab_size, eod=self._eod)

    def apply_chat_template(self, *args: Any, **kwargs: Any):
        raise NotImplementedError(f"{type(self).__name__} has no chat template")


class NullTokenizer(_SimpleTokenizer):
    """Token ids as written ("3 17 5"); eod is the last id of the vocabulary."""

    def __init__(self, vocab_size: int):
        super().__init__(vocab_size, vocab_size - 1)

    def tokenize(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


class ByteLevelTokenizer(_SimpleTokenizer):
    """UTF-8 bytes 0..255 as ids, eod = 256, vocabulary 257."""

    def __init__(self):
        super().__init__(257, 256)

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def build_tokenizer(tokenizer_type: str, vocab_size: int) -> _SimpleTokenizer:
    """``vocab_size`` sizes the NullTokenizer; the ByteLevelTokenizer is always 257 ids."""
    if tokenizer_type == "NullTokenizer":
        if vocab_size < 2:
            raise ValueError(f"vocab_size={vocab_size} must be >= 2 for the NullTokenizer")
        return NullTokenizer(vocab_size)
    if tokenizer_type == "ByteLevelTokenizer":
        return ByteLevelTokenizer()
    raise ValueError(
        f"tokenizer_type={tokenizer_type!r} is unknown; use NullTokenizer or ByteLevelTokenizer"
    )


def parse_blend(data_path: list[str]) -> tuple[list[str], list[float] | None]:
    """``["0.3", "prefA", "0.7", "prefB"]`` (or one string "0.3 prefA 0.7 prefB") -> blend."""
    flat = [tok for item in data_path for tok in item.split()]
    if not flat:
        raise ValueError("data_path is empty; pass at least one dataset prefix")
    blend = get_blend_from_list(flat)
    prefixes, weights = blend
    if weights is not None and (any(w < 0 for w in weights) or sum(weights) <= 0):
        raise ValueError(f"data_path weights {weights} must be >= 0 and not all zero")
    return list(prefixes), (None if weights is None else list(weights))


@contextlib.contextmanager
def _rank_zero_without_distributed():
    """megatron-core < 0.17's BlendedDataset calls ``torch.distributed.get_rank()`` unguarded
    when it writes its cache (fixed by 0.19); without a process group, answer rank 0."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        yield
        return
    original = dist.get_rank
    dist.get_rank = lambda group=None: 0
    try:
        yield
    finally:
        dist.get_rank = original


class IndexedCorpus:
    """Megatron indexed datasets (.bin/.idx), through megatron-core's GPTDataset.

    GPTDataset shuffles documents and samples with ``seed`` and caches the resulting index
    under ``data_cache_path``; a sample therefore depends only on (index, seed, the data and
    ``num_samples``) -- keep ``num_samples`` fixed across restarts. Works with or without
    torch.distributed (initialised, rank 0 builds the cache first and the others wait).
    """

    def __init__(self, data: DataConfig, seq_length: int, seed: int, num_samples: int, tokenizer):
        if num_samples < 1:
            raise ValueError(f"num_samples={num_samples} must be positive")
        self.tokenizer = tokenizer
        self.seq_length = seq_length
        config = GPTDatasetConfig(
            random_seed=seed,
            sequence_length=seq_length,
            blend=parse_blend(data.data_path),
            split=data.split,
            path_to_cache=data.data_cache_path,
            tokenizer=tokenizer,
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            create_attention_mask=False,  # the model builds the causal mask itself
            mmap_bin_files=True,
        )
        builder = BlendedMegatronDatasetBuilder(
            GPTDataset, [num_samples, 0, 0], lambda: True, config
        )
        with _rank_zero_without_distributed():
            self.dataset = builder.build()[0]
        if self.dataset is None:
            raise ValueError(
                f"split={data.split!r} leaves no training data in {data.data_path}; give the "
                "train split a positive weight, e.g. 100,0,0"
            )

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < len(self):
            raise IndexError(
                f"sample index {index} out of range [0, {len(self)}); build the corpus with a "
                "larger num_samples"
            )
        sample = self.dataset[int(index)]
        out = {}
        for key in SAMPLE_KEYS:
            value = sample[key]
            value = value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
            out[key] = value.astype(np.float32 if key == "loss_mask" else np.int64)
        return out


def build_corpus(data: DataConfig, model: ModelConfig, seed: int, num_samples: int) -> Corpus:
    """The synthetic corpus unless real data is given (and --mock-data is not set)."""
    if data.mock_data or not data.data_path:
        return SyntheticCorpus(model.vocab_size, model.seq_length, seed)
    tokenizer = build_tokenizer(data.tokenizer_type, model.vocab_size)
    if tokenizer.vocab_size > model.vocab_size:
        raise ConfigError(
            f"--vocab-size {model.vocab_size} is smaller than the {data.tokenizer_type}'s "
            f"{tokenizer.vocab_size} ids; pass --vocab-size {tokenizer.vocab_size} or more"
        )
    return IndexedCorpus(data, model.seq_length, seed, num_samples, tokenizer)


def get_micro_batch(corpus: Corpus, indices: list[int]) -> dict[str, torch.Tensor]:
    """Stack samples into CPU tensors [b, s]; no attention mask (the model's is causal)."""
    if not indices:
        raise ValueError("indices is empty; a micro-batch needs at least one sample")
    samples = [corpus[i] for i in indices]
    batch = {}
    for key in SAMPLE_KEYS:
        dtype = np.float32 if key == "loss_mask" else np.int64
        batch[key] = torch.from_numpy(np.stack([s[key] for s in samples]).astype(dtype))
    return batch
