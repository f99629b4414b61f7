"""BERT masking for MLM (bert; condenser §3.3 "we follow the masking scheme").

Each maskable token (every token that is neither special nor padding) is selected with probability
``probability``; with ``whole_word`` the draw is per word and selects all of its WordPiece pieces (a
piece starting with ``##`` continues the previous word). Of the selected tokens ``mask_fraction``
become [MASK], ``random_fraction`` a random non-special token, and the rest stay unchanged. Labels are
the original ids at selected positions and -100 (ignored by cross-entropy) elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from densepass.errors import ConfigError

IGNORE = -100


@dataclass
class Masker:
    """Masking constants derived once from a tokenizer."""

    mask_id: int
    special: torch.Tensor  # [V] bool: never masked, never used as a random replacement
    continuation: torch.Tensor  # [V] bool: '##' word pieces
    replacement_ids: torch.Tensor  # ids a random replacement is drawn from
    probability: float = 0.15
    mask_fraction: float = 0.8
    random_fraction: float = 0.1
    whole_word: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.probability < 1:
            raise ConfigError(f"masking probability must be in (0, 1), got {self.probability}")
        if self.mask_fraction < 0 or self.random_fraction < 0 or self.mask_fraction + self.random_fraction > 1:
            raise ConfigError("mask_fraction and random_fraction must be >= 0 and sum to at most 1")

    @classmethod
    def from_tokenizer(cls, tokenizer: PreTrainedTokenizerBase, **options) -> Masker:
        """A masker with the tokenizer's special, mask and vocabulary ids."""
        if tokenizer.mask_token_id is None:
            raise ConfigError(f"tokenizer {tokenizer.name_or_path!r} has no mask token; MLM needs one")
        vocab = max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)
        special = torch.zeros(vocab, dtype=torch.bool)
        special[list(tokenizer.all_special_ids)] = True
        continuation = torch.zeros(vocab, dtype=torch.bool)
        for token, index in tokenizer.get_vocab().items():
            continuation[index] = token.startswith("##")
        return cls(tokenizer.mask_token_id, special, continuation, (~special).nonzero().squeeze(1), **options)

    def word_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, L] index of each token's word (a '##' piece shares its predecessor's); specials get their own."""
        starts = ~self.continuation[input_ids] | self.special[input_ids]
        return starts.long().cumsum(1)

    def __call__(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(masked input ids, labels) for a [B, L] batch; ``input_ids`` is not modified."""
        maskable = attention_mask.bool() & ~self.special[input_ids]
        if self.whole_word:
            words = self.word_ids(input_ids)
            draw = torch.rand(words.shape[0], int(words.max()) + 1, generator=generator)
            selected = (draw < self.probability).gather(1, words) & maskable
        else:
            selected = (torch.rand(input_ids.shape, generator=generator) < self.probability) & maskable
        labels = torch.where(selected, input_ids, torch.full_like(input_ids, IGNORE))
        action = torch.rand(input_ids.shape, generator=generator)
        to_mask = selected & (action < self.mask_fraction)
        to_random = selected & (action >= self.mask_fraction) & (action < self.mask_fraction + self.random_fraction)
        random_ids = self.replacement_ids[
            torch.randint(len(self.replacement_ids), input_ids.shape, generator=generator)
        ]
        masked = torch.where(to_mask, torch.full_like(input_ids, self.mask_id), input_ids)
        masked = torch.where(to_random, random_ids, masked)
        return masked, labels
