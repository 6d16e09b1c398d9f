"""A thin wrapper over a Hugging Face ``tokenizers.Tokenizer``, and byte-level BPE training.

The trained tokenizer is byte-level, so every string round-trips exactly:
``decode(encode(s)) == s``. Training streams the texts once and keeps only word counts in
memory (inside the Rust library); the tokenizer itself is a JSON file of a few hundred KB.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from ..config import ConfigError

EOT = "<|endoftext|>"
# End-of-text spellings of common published tokenizers, tried in this order.
EOT_CANDIDATES = (EOT, "</s>", "<|end_of_text|>", "<eos>")


class Tokenizer:
    def __init__(self, tk: tokenizers.Tokenizer) -> None:
        self.tk = tk
        self.eot_id: int | None = next(
            (i for i in map(tk.token_to_id, EOT_CANDIDATES) if i is not None), None
        )

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included; every id is < vocab_size."""
        return self.tk.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        # add_special_tokens=False: published tokenizers may add BOS/EOS in a post-processor;
        # documents are separated by eot explicitly instead.
        return self.tk.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many texts at once, in parallel threads inside the Rust library."""
        return [e.ids for e in self.tk.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        # Keep special tokens so decode is the exact inverse of encode.
        return self.tk.decode(list(ids), skip_special_tokens=False)

    def save(self, path: str | Path) -> None:
        """Write tokenizer.json atomically (temp name + rename)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        self.tk.save(str(tmp))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        try:
            tk = tokenizers.Tokenizer.from_file(str(Path(path).expanduser()))
        except Exception as e:  # the library raises a bare Exception for any bad file
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(
                f"tokenizer {str(path)!r} is not a valid tokenizer.json: {reason}"
            ) from None
        return cls(tk)


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE of at most ``vocab_size`` ids (fewer if the corpus is tiny)."""
    tk = tokenizers.Tokenizer(models.BPE())
    # add_prefix_space=False: a leading space would be invented text and break round trips.
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        # All 256 byte symbols, seen or not, so any input (e.g. unseen unicode) is encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(tk)
