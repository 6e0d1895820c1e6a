"""Training data for ``megatron-rrfp train``: where micro-batches come from, by position.

A source hands out the micro-batches of one iteration for one data-parallel rank, given
how many samples the whole job has consumed so far. That count is the only data state a
checkpoint needs: resuming at ``consumed_samples`` continues with the same samples.

Sample order follows Megatron-LM's pretraining sampler: micro-batch ``m`` of an
iteration holds global samples ``consumed + m * mbs * dp + dp_rank * mbs + [0, mbs)``.

  SyntheticTokens   learnable synthetic sequences (default): sample i is an arithmetic
                    progression mod vocab with a start and stride drawn from (seed, i), so
                    the loss falls within a few iterations and any sample is O(1) to make.
  TokenFile         a flat file of token ids (``--data-path``): ``.npy`` (dtype from its
                    header) or raw little-endian uint16 like nanoGPT's ``train.bin``; read
                    through a memory map; sample i is the window at ``i * seq_length``.
(The multimodal recipe's stream is ``recipes.multimodal.MultimodalStream``.)

Make a token file:  ``python -m megatron_rrfp.train.data tokens.npy --num-tokens 100000``.
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Iterator, Sequence
from typing import Optional

import numpy as np
import torch

__all__ = ["SyntheticTokens", "TokenFile", "gpt_batch", "synthetic_tokens",
           "write_token_file"]

MAX_STRIDE = 7  # synthetic progressions step by 1..MAX_STRIDE tokens


def synthetic_tokens(index: int, length: int, *, vocab_size: int, seed: int) -> np.ndarray:
    """Sample ``index`` of the synthetic corpus: ``(start + stride * j) % vocab_size``."""
    rng = np.random.default_rng((seed, index))
    start, stride = int(rng.integers(vocab_size)), int(rng.integers(1, MAX_STRIDE + 1))
    return (start + stride * np.arange(length, dtype=np.int64)) % vocab_size


def write_token_file(path: str, tokens: Sequence[int] | np.ndarray) -> str:
    """Write token ids: ``.npy`` keeps the dtype; any other name is raw uint16."""
    array = np.asarray(tokens)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if path.endswith(".npy"):
        np.save(path, array.astype(np.int32 if array.max(initial=0) >= 2**16 else np.uint16))
    else:
        if array.max(initial=0) >= 2**16:
            raise ValueError(f"{path}: raw token files are uint16; token id {int(array.max())} needs a .npy file")
        array.astype("<u2").tofile(path)
    return path


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


class TokenFile(_IndexedSource):
    def __init__(self, path: str, *, vocab_size: int, **common) -> None:
        super().__init__(**common)
        if not os.path.isfile(path):
            raise ValueError(f"--data-path {path!r}: no such file")
        self.path, self.vocab_size = path, vocab_size
        self.tokens = np.load(path, mmap_mode="r") if path.endswith(".npy") else np.memmap(path, dtype="<u2", mode="r")
        if self.tokens.ndim != 1 or len(self.tokens) < self.seq_length + 1:
            raise ValueError(f"--data-path {path!r}: need a flat array of at least seq_length + 1 = "
                             f"{self.seq_length + 1} token ids, got shape {self.tokens.shape}")
        self.windows = (len(self.tokens) - 1) // self.seq_length  # samples before wrapping around

    def sample(self, index: int) -> np.ndarray:
        start = (index % self.windows) * self.seq_length
        window = np.asarray(self.tokens[start:start + self.seq_length + 1])
        if window.max() >= self.vocab_size:
            raise ValueError(f"--data-path {self.path!r}: token id {int(window.max())} at offset >= {start} "
                             f"is outside --vocab-size {self.vocab_size}")
        return window


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_rrfp.train.data",
                                     description="Write a synthetic token file for --data-path.")
    parser.add_argument("path", help=".npy (dtype in header) or any other name for raw uint16")
    parser.add_argument("--num-tokens", type=int, default=100_000)
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--seq-length", type=int, default=64, help="length of each synthetic progression")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    pieces = -(-args.num_tokens // args.seq_length)
    tokens = np.concatenate([synthetic_tokens(i, args.seq_length, vocab_size=args.vocab_size, seed=args.seed)
                             for i in range(pieces)])[:args.num_tokens]
    print(f"wrote {len(tokens)} tokens (vocab {args.vocab_size}) to {write_token_file(args.path, tokens)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
