"""Batches of similar length in random order, so that a logged training curve shows learning.

transformers' `group_by_length` (`get_length_grouped_indices`) permutes the examples, cuts them into
mega-batches of 50 batches and sorts each mega-batch by length, longest first: within a mega-batch the batches
run from long to short. A loss logged every few steps then follows the sequences' lengths as well as the
training (on the tiny reviews SFT the logged loss went from 4.28 to 6.38 where a new mega-batch began, and was
flat without grouping). Here the batches keep their members (the same padding saved) and are shuffled:

    indices = get_length_grouped_indices(lengths, B)     # B = examples per optimizer step and process
    batches = [indices[k B : (k + 1) B] for k]            # similar lengths within each
    order   = batches[0], then the other full batches permuted, then a last partial batch if any

The first batch (the one holding the longest example: an out-of-memory error comes at once) and the partial
batch at the end stay where they are, so every other batch is whole.
"""

from __future__ import annotations

import torch
from transformers.trainer_pt_utils import LengthGroupedSampler, get_length_grouped_indices


def mixed_length_groups(lengths: list[int], batch_size: int, generator=None) -> list[int]:
    """Example indices whose consecutive slices of `batch_size` hold similar lengths, the slices in random
    order (module docstring). A permutation of range(len(lengths))."""
    indices = get_length_grouped_indices(lengths, batch_size, generator=generator)
    full = len(indices) // batch_size
    batches = [indices[k * batch_size : (k + 1) * batch_size] for k in range(full)]
    rest = indices[full * batch_size :]
    if len(batches) > 1:
        order = torch.randperm(len(batches) - 1, generator=generator).tolist()
        batches = [batches[0]] + [batches[1 + k] for k in order]
    return [i for batch in batches for i in batch] + rest


class MixedLengthSampler(LengthGroupedSampler):
    """`LengthGroupedSampler` with its batches in random order (`mixed_length_groups`)."""

    def __iter__(self):
        return iter(mixed_length_groups(self.lengths, self.batch_size, generator=self.generator))


class MixedLengthBatches:
    """Trainer mixin: under `train_sampling_strategy="group_by_length"` the train sampler is a
    `MixedLengthSampler` with the Trainer's own lengths and batch size (examples per optimizer step)."""

    def _get_train_sampler(self, train_dataset=None):
        sampler = super()._get_train_sampler(train_dataset)
        if type(sampler) is LengthGroupedSampler:
            mixed = MixedLengthSampler(
                sampler.batch_size, lengths=sampler.lengths, generator=sampler.generator
            )
            return mixed
        return sampler
