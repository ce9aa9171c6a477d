"""Length-grouped batches in random order (`llm_rlhf.training.length_groups`): the same batches as
transformers' group_by_length, shuffled, through the stages' trainers."""

from __future__ import annotations

import torch
from transformers.trainer_pt_utils import get_length_grouped_indices

from llm_rlhf.training.length_groups import MixedLengthSampler, mixed_length_groups


def batches_of(indices: list[int], size: int) -> list[tuple[int, ...]]:
    return [tuple(indices[k : k + size]) for k in range(0, len(indices), size)]


def test_the_grouped_batches_shuffled_longest_first_partial_last():
    lengths = torch.randint(3, 60, (1003,), generator=torch.Generator().manual_seed(0)).tolist()
    size = 8
    grouped = get_length_grouped_indices(lengths, size, generator=torch.Generator().manual_seed(1))
    mixed = mixed_length_groups(lengths, size, generator=torch.Generator().manual_seed(1))
    assert sorted(mixed) == list(range(1003))
    before, after = batches_of(grouped, size), batches_of(mixed, size)
    assert sorted(before) == sorted(after)  # the same batches: the same padding
    assert after[0] == before[0] and max(lengths) in [lengths[i] for i in after[0]]
    assert after[-1] == before[-1] and len(after[-1]) == 1003 % size == 3  # the partial batch stays last

    # transformers' order: mean lengths fall within each mega-batch of 50 batches; mixed: no trend.
    def window_means(batches):
        means = [sum(lengths[i] for i in b) / len(b) for b in batches[:-1]]
        return [sum(means[k : k + 10]) / 10 for k in range(0, 120, 10)]

    spread = lambda xs: max(xs) - min(xs)  # noqa: E731
    assert spread(window_means(before)) > 2 * spread(window_means(after)), (
        window_means(before),
        window_means(after),
    )


def test_the_sft_and_reward_trainers_use_it(tmp_path, tiny_model_dir, sft_files, pref_files):
    from llm_rlhf.stages import reward, sft
    from llm_rlhf.stages.reward import _tokenize

    cfg = sft.Config(
        model_name_or_path=str(tiny_model_dir),
        train_file=str(sft_files[0]),
        eval_file=str(sft_files[1]),
        output_dir=str(tmp_path / "sft"),
        max_length=32,
        max_steps=2,
    )
    tokenizer, model, train, val = sft.load_inputs(cfg)
    trainer = sft.build_trainer(cfg, model, tokenizer, train, val)
    assert isinstance(trainer._get_train_sampler(), MixedLengthSampler)
    cfg = reward.Config(
        model_name_or_path=str(tiny_model_dir),
        train_file=str(pref_files[0]),
        eval_file=str(pref_files[1]),
        output_dir=str(tmp_path / "rm"),
        max_length=32,
        max_steps=2,
        eval_steps=0,
    )
    inputs = reward.load_inputs(cfg)
    train, _ = _tokenize(inputs.train, inputs.tokenizer, cfg.max_length)
    trainer = reward.build_trainer(cfg, inputs.model, inputs.tokenizer, train, None)
    assert isinstance(trainer._get_train_sampler(), MixedLengthSampler)
    cfg.group_by_length = False
    trainer = reward.build_trainer(cfg, inputs.model, inputs.tokenizer, train, None)
    assert not isinstance(trainer._get_train_sampler(), MixedLengthSampler)
