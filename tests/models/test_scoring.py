"""The values PPO and evaluation share: `rollout.Sampling` (one value from any flat config), `scoring.Scorer` (the one
scorer of PPO and evaluation), `scoring.scored_as`, `PPOTrainer.state_dict`, and the one callable resolver."""

from __future__ import annotations

import pytest
import torch
from helpers import eos_rows, ppo_config, scores_alone, tiny_ppo_trainer

from llm_rlhf.core.callables import resolve_callable
from llm_rlhf.core.errors import ConfigError, UserError
from llm_rlhf.models.gold import load_judge
from llm_rlhf.models.loading import load_tokenizer
from llm_rlhf.models.reward_fn import load_reward_fn
from llm_rlhf.models.reward_model import encode_pair, end_with_eos, load_reward_model
from llm_rlhf.models.scoring import Scorer, scored_as
from llm_rlhf.ppo import trainer as ppo_trainer
from llm_rlhf.rl.rollout import Sampling
from llm_rlhf.stages import evaluate, sft


def test_sampling_of_any_flat_config():
    """PPO's, evaluation's and SFT's configs give the same kind of value; a stage without stop strings or
    min_new_tokens (SFT) gets them off; temperature 0 is greedy."""
    cfg = ppo_trainer.Config(max_new_tokens=12, temperature=0.7, stop_strings=["\n"], min_new_tokens=2)
    assert Sampling.of(cfg) == Sampling(12, temperature=0.7, stop_strings=("\n",), min_new_tokens=2)
    assert Sampling.of(evaluate.Config(top_k=5, top_p=0.9)) == Sampling(32, top_k=5, top_p=0.9)
    assert Sampling.of(sft.Config(temperature=0.0)) == Sampling(48, temperature=0.0)
    assert Sampling(4).generate_kwargs() == {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    assert Sampling(4, temperature=0.0).greedy and Sampling(4, temperature=0.0).generate_kwargs() == {
        "do_sample": False
    }
    assert Sampling.of(cfg).ends() == {"stop_strings": ["\n"], "min_new_tokens": 2}


def test_scored_as_names_every_key_that_decides_a_score():
    cfg = ppo_trainer.Config(
        reward_model_path=["a", "b"],
        ensemble_combine="min",
        reward_fn="m:f",
        reward_fn_weight=0.5,
        stop_strings=["."],
        min_new_tokens=3,
    )
    assert scored_as(cfg) == {
        "reward_model_path": ["a", "b"],
        "ensemble_combine": "min",
        "ensemble_uncertainty_coef": 1.0,
        "reward_fn": "m:f",
        "reward_fn_weight": 0.5,
        "stop_strings": ["."],
        "min_new_tokens": 3,
    }
    eval_cfg = evaluate.Config(**scored_as(cfg))  # an evaluation given them scores as this PPO run
    assert scored_as(eval_cfg) == scored_as(cfg)


def test_ppo_and_evaluation_score_alike(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):
    """The trainer's scores of a rollout are a `Scorer`'s, built as evaluation builds it: rm_score +
    reward_fn_weight * reward_fn, with the parts PPO logs in the order it logs them."""
    cfg = ppo_config(
        tiny_model_dir,
        tiny_rm_dir,
        prompt_file,
        tmp_path,
        reward_fn="reward_fns:length",
        reward_fn_weight=0.5,
    )
    trainer = tiny_ppo_trainer(cfg)
    samples = trainer.collector.generate(trainer.collector.queries(trainer.step))
    got = trainer.collector.score(samples)
    alone = Scorer(
        load_reward_model(str(tiny_rm_dir)), load_reward_fn("reward_fns:length"), reward_fn_weight=0.5
    )
    expected = alone(samples, trainer.tokenizer)
    torch.testing.assert_close(got.scores, expected.scores, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got.scores, expected.rm_score + 0.5 * expected.reward_fn.float())
    assert expected.reward_fn.dtype == torch.float64 and expected.reward_fn.std() > 0
    assert list(got.terms()) == ["rm_score", "reward_fn"]
    assert Scorer(load_reward_model(str(tiny_rm_dir)))(samples, trainer.tokenizer).terms() == {}


def test_trainer_state_dict_round_trip(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):
    """state_dict holds the step, the KL controller and the LR schedule; load_state_dict puts them back."""
    cfg = ppo_config(
        tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, lr_scheduler_type="linear", ppo_epochs=1
    )
    trainer = tiny_ppo_trainer(cfg)
    trainer.ppo_step()
    state = trainer.state_dict()
    assert set(state) == {"step", "kl_ctl", "scheduler"} and state["step"] == 1
    saved = {k: v for k, v in state.items() if k != "scheduler"}, trainer.scheduler.get_last_lr()
    trainer.ppo_step()
    assert trainer.step == 2 and trainer.scheduler.get_last_lr() != saved[1]
    trainer.load_state_dict(state)
    assert (
        {k: v for k, v in trainer.state_dict().items() if k != "scheduler"},
        trainer.scheduler.get_last_lr(),
    ) == saved


def test_one_resolver_for_reward_functions_and_gold_judges(tmp_path, monkeypatch):
    """reward_fn and a gold_judge callable follow the same rules: module:callable from the current directory,
    path/to/file.py:callable, a class built with no arguments, one error line naming the key."""
    (tmp_path / "judges_here.py").write_text(
        "def length(prompts, responses):\n    return [float(len(r)) for r in responses]\n\n"
        "class Broken:\n    def __init__(self):\n        raise TypeError('needs arguments')\n"
    )
    monkeypatch.chdir(tmp_path)
    assert load_judge("judges_here:length")(["p"], ["abc"]) == [3.0]
    assert load_judge(f"{tmp_path / 'judges_here.py'}:length")(["p"], ["ab"]) == [2.0]
    assert load_reward_fn("judges_here.py:length")(["p"], ["a"]) == [1.0]
    with pytest.raises(UserError, match="^gold_judge 'judges_here:Broken': building the class"):
        load_judge("judges_here:Broken")
    with pytest.raises(ConfigError, match="^gold_judge 'nope': expected a judge JSON file"):
        load_judge("nope")
    with pytest.raises(UserError, match="^my_key 'judges_here:missing': 'judges_here' has no attribute"):
        resolve_callable("judges_here:missing", "my_key")


# ---------------------------------------------------------------------------------------------------
# Every response is scored ending with the RM's EOS, as the RM was trained to read text
# ---------------------------------------------------------------------------------------------------


def test_end_with_eos_layout():
    """A stopped or truncated row gets EOS after its last real token (a full-width row in the added
    column); a finished row keeps its EOS in place (rewritten to the RM's id)."""
    E, p = 9, 0
    ids = torch.tensor([[p, 3, 4, 5, p], [p, 3, 4, 8, p], [3, 4, 5, 6, 7]])  # (3, 5)
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    got_ids, got_mask = end_with_eos(ids, mask, eos_token_id=E, finished=torch.tensor([False, True, False]))
    assert got_ids.tolist() == [[p, 3, 4, 5, E, E], [p, 3, 4, E, p, E], [3, 4, 5, 6, 7, E]]
    assert got_mask.tolist() == [[0, 1, 1, 1, 1, 0], [0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]


def test_stopped_and_truncated_responses_are_scored_as_their_text_ending_in_eos(tiny_model_dir, tiny_rm_dir):
    """The Scorer (PPO, eval, best-of-n) reads a response cut by a stop string, and one truncated at
    max_new_tokens, as the same tokens followed by the RM's EOS, the only place the RM learned to score
    text at; a response that ended with EOS is read as it is. Scored as they are, the first two would be
    read at their last token (the stop token, or wherever max_new_tokens fell)."""
    tokenizer = load_tokenizer(str(tiny_model_dir))
    rm = load_reward_model(str(tiny_rm_dir))
    samples, with_eos = eos_rows(tokenizer)
    got = Scorer(rm)(samples, tokenizer).scores  # (3,)
    with torch.no_grad():
        expected = scores_alone(rm, with_eos)  # (3,)
        at_last_token = rm.score(
            samples.sequence, samples.attention_mask
        )  # (3,) where the score used to be read
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert (got[:2] - at_last_token[:2]).abs().min() > 1e-3  # reading at the last token would fail this test
    # `llm-rlhf score` reads the same texts, prompt + response, and appends EOS as RM training did
    texts = [tokenizer.decode(r[:-1], clean_up_tokenization_spaces=False) for r in with_eos]
    assert [encode_pair(rm.tokenizer, t, "") for t in texts] == with_eos
