"""Training data for ``megatron-rrfp train``: where micro-batches come from, by position.

A source hands out the micro-batches of one iteration for one data-parallel rank, given
how many samples the whole job has consumed so far. That count is the only data state a
checkpoint needs: resuming at ``consumed_samples`` continues with the same samples.

Sample order follows Megatron-LM's pretraining sampler: micro-batch ``m`` of an
iteration holds global samples ``consumed + m * mbs * dp + dp_rank * mbs + [0, mbs)``.

  SyntheticTokens   learnable synthetic sequences (default): sample i is an arithmetic
                    progression mod vocab with a start and stride drawn from (seed, i), so
                    the loss falls within a few iterations and any sample is O(1) to make.
  IndexedTokens     a Megatron indexed dataset (``--data-path PREFIX``: PREFIX.bin +
                    PREFIX.idx, as Megatron-LM's tools/preprocess_data.py writes them) read
                    through megatron-core's own GPTDataset: documents concatenated, shuffled
                    and cut into seq_length + 1 windows exactly as Megatron-LM's pretraining
                    does (same seed, same samples), so existing data loads as it is.
(The multimodal recipe's stream is ``recipes.multimodal.MultimodalStream``.)

Make a small indexed dataset (megatron-core's IndexedDatasetBuilder):
``python -m megatron_rrfp.train.data data/text_document --num-tokens 100000``.
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..options import add_options, from_namespace, option

__all__ = ["IndexedTokens", "SyntheticTokens", "check_indexed_dataset", "gpt_batch", "synthetic_tokens",
           "write_indexed_dataset"]

MAX_STRIDE = 7  # synthetic progressions step by 1..MAX_STRIDE tokens


def synthetic_tokens(index: int, length: int, *, vocab_size: int, seed: int) -> np.ndarray:
    """Sample ``index`` of the synthetic corpus: ``(start + stride * j) % vocab_size``."""
    rng = np.random.default_rng((seed, index))
    start, stride = int(rng.integers(vocab_size)), int(rng.integers(1, MAX_STRIDE + 1))
    return (start + stride * np.arange(length, dtype=np.int64)) % vocab_size


def write_indexed_dataset(prefix: str, documents: Sequence[Sequence[int] | np.ndarray]) -> str:
    """Write ``prefix``.bin/.idx with megatron-core's own builder, one document each (uint16
    ids below 65536, int32 above); returns ``prefix``."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    largest = max((int(np.max(d)) for d in documents if len(d)), default=0)
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16 if largest < 2**16 else np.int32)
    for document in documents:
        builder.add_document(torch.as_tensor(np.asarray(document, dtype=np.int64)), [len(document)])
    builder.finalize(prefix + ".idx")
    return prefix


def gpt_batch(samples: np.ndarray, device: torch.device) -> dict:
    """[mbs, seq_length + 1] token ids -> the dict ``models.gpt_forward_step`` reads
    (Megatron-LM's get_batch layout; attention_mask True where attention is blocked)."""
    text = torch.from_numpy(samples.astype(np.int64))
    batch, seq = text.shape[0], text.shape[1] - 1
    return {
        "tokens": text[:, :-1].contiguous().to(device),
        "labels": text[:, 1:].contiguous().to(device),
        "loss_mask": torch.ones(batch, seq, device=device),
        "attention_mask": torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), 1).view(1, 1, seq, seq),
        "position_ids": torch.arange(seq, device=device).unsqueeze(0).expand(batch, -1).contiguous(),
    }


class _IndexedSource:
    """Random-access samples -> this DP rank's micro-batches of one iteration."""

    def __init__(self, *, seq_length: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 device: torch.device) -> None:
        self.seq_length, self.micro_batch_size = seq_length, micro_batch_size
        self.dp_rank, self.dp_size, self.device = dp_rank, dp_size, device

    def sample(self, index: int) -> np.ndarray:  # seq_length + 1 token ids
        raise NotImplementedError

    def microbatches(self, consumed_samples: int, count: int) -> Iterator[dict]:
        mbs = self.micro_batch_size
        for m in range(count):
            first = consumed_samples + m * mbs * self.dp_size + self.dp_rank * mbs
            yield gpt_batch(np.stack([self.sample(first + r) for r in range(mbs)]), self.device)


class SyntheticTokens(_IndexedSource):
    def __init__(self, *, vocab_size: int, seed: int, **common) -> None:
        super().__init__(**common)
        self.vocab_size, self.seed = vocab_size, seed

    def sample(self, index: int) -> np.ndarray:
        return synthetic_tokens(index, self.seq_length + 1, vocab_size=self.vocab_size, seed=self.seed)


class _TokenIds:
    """What megatron-core's GPTDataset needs of a tokenizer when the data are token ids already."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size, self.eod = vocab_size, vocab_size - 1  # eod only matters for --reset-* (not offered)

    @property
    def unique_identifiers(self) -> dict:  # part of GPTDataset's index-cache key
        return {"class": "megatron_rrfp.train.data._TokenIds", "vocab_size": self.vocab_size}


def check_indexed_dataset(prefix: str, seq_length: int) -> int:
    """The token count of the indexed dataset at ``prefix``, read from its index with
    megatron-core's IndexedDataset; ValueError naming --data-path where the files are missing
    or the tokens do not fill one sample (seq_length + 1). Every rank calls it before any
    collective: megatron-core's GPTDataset loops forever on rank 0 over zero tokens
    (``_get_num_epochs``) while the other ranks wait at its barrier. Read without mmap: an
    empty .bin cannot be mapped."""
    for suffix in (".bin", ".idx"):
        if not os.path.isfile(prefix + suffix):
            raise ValueError(f"--data-path {prefix!r}: {prefix + suffix} not found (give the prefix of a Megatron "
                             "indexed dataset: PREFIX.bin and PREFIX.idx, e.g. from Megatron-LM's "
                             "tools/preprocess_data.py or `python -m megatron_rrfp.train.data PREFIX`)")
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    try:
        index = IndexedDataset(prefix, mmap=False)  # held: its lengths are a view of the index's mmap
        tokens = int(np.sum(index.sequence_lengths, dtype=np.int64))
        del index
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign file: megatron-core's own words
        raise ValueError(f"--data-path {prefix!r}: not a readable Megatron indexed dataset "
                         f"({type(exc).__name__}: {exc})") from None
    if tokens < seq_length + 1:
        raise ValueError(f"--data-path {prefix!r} holds {tokens} tokens; one sample of --seq-length {seq_length} "
                         f"needs {seq_length + 1} (seq_length + 1): give a larger dataset or a shorter --seq-length")
    return tokens


class IndexedTokens(_IndexedSource):
    """Samples of megatron-core's GPTDataset over an indexed dataset (see the module doc).

    Collective when built: megatron-core's builder makes the shuffle / sample index on rank 0
    first (cached under ``cache_dir``, default PREFIX's directory as Megatron-LM does), then
    the others read it. ``build`` is False on ranks that read no data (middle stages)."""

    def __init__(self, prefix: str, *, vocab_size: int, num_samples: int, seed: int, build: bool,
                 cache_dir: Optional[str] = None, **common) -> None:
        super().__init__(**common)
        check_indexed_dataset(prefix, self.seq_length)
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

        self.prefix, self.vocab_size = prefix, vocab_size
        config = GPTDatasetConfig(random_seed=seed, sequence_length=self.seq_length, blend=([prefix], None),
                                  split="100,0,0", tokenizer=_TokenIds(vocab_size), path_to_cache=cache_dir,
                                  reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                                  mmap_bin_files=True)
        self.dataset = BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, 0, 0], lambda: build, config).build()[0]

    def sample(self, index: int) -> np.ndarray:
        item = self.dataset[index]
        window = np.concatenate([item["tokens"].numpy(), item["labels"].numpy()[-1:]])
        if window.max() >= self.vocab_size:
            raise ValueError(f"--data-path {self.prefix!r}: token id {int(window.max())} in sample {index} is outside "
                             f"--vocab-size {self.vocab_size}")
        return window


@dataclass(kw_only=True, slots=True)
class DataOptions:
    """``python -m megatron_rrfp.train.data``'s command line."""

    prefix: str = option(None, "output prefix, e.g. data/text_document", positional=True)
    num_tokens: int = option(100_000, "tokens to write, in whole documents")
    vocab_size: int = option(256, "token ids stay below this")
    seq_length: int = option(64, "length of each synthetic document (a progression)")
    seed: int = option(1234, "seed of the documents")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_rrfp.train.data",
                                     description="Write a synthetic Megatron indexed dataset (PREFIX.bin, PREFIX.idx) "
                                                 "for --data-path PREFIX.")
    args = from_namespace(DataOptions, add_options(parser, DataOptions).parse_args(argv))
    pieces = -(-args.num_tokens // args.seq_length)
    documents = [synthetic_tokens(i, args.seq_length, vocab_size=args.vocab_size, seed=args.seed)
                 for i in range(pieces)]
    write_indexed_dataset(args.prefix, documents)
    print(f"wrote {pieces} documents of {args.seq_length} tokens (vocab {args.vocab_size}) to {args.prefix}.bin/.idx")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
