"""The reward-hacking alarm through the real PPO run: `ppo.train` on a tiny model, held-out
evaluation at every step, the alarm logged on every eval_log.jsonl line, `stop_on_alarm` and `keep_best`; the
final evaluation's counter rule; the report of such a run.

The collapse is constructed, not hoped for: after PPO step 2 (`on_step`, the run's own hook) the policy's last
layer norm is set so that every position's logits are those of one token, ' mess' (ln_f weight 0, its bias
along that token's embedding): every held-out response is then ' mess mess ...', as a real collapsed run said
' a heart.' to every prompt. The rest (sampling, scoring, the counters, the watch, the decisions, the
checkpoints, the saved folders) is the code a user runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import eval_config, ppo_config, read_jsonl
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from llm_rlhf.core.errors import ConfigError
from llm_rlhf.core.utils import last_checkpoint
from llm_rlhf.evaluation import hacking, metric_names
from llm_rlhf.evaluation.hacking import (
    COLLAPSE_KEYS,
    WATCH_KEYS,
    best_evaluation,
    trajectory_point,
    watch_fields,
)
from llm_rlhf.interfaces.report import write_report
from llm_rlhf.ppo import metrics as ppo_metrics
from llm_rlhf.stages import evaluate, ppo

COLLAPSE_STEP = 2
WORD = "Ġmess"  # a whole word of the tiny tokenizer (SENTENCES: "a dull and lifeless mess")


class Interrupted(Exception):
    """A run stopped by hand (`watched_run`'s interrupt_at)."""


def collapse_onto_one_word(model, tokenizer, at_step: int = COLLAPSE_STEP):
    """An `on_step` hook that collapses `model` (a GPT-2, trained in place by the run) at step `at_step`: every
    next-token distribution becomes softmax(c * wte @ wte[word]), all but certain of `word`."""
    word = tokenizer.convert_tokens_to_ids(WORD)
    assert word != tokenizer.eos_token_id  # a real token, not the unknown one

    def on_step(metrics: dict) -> None:
        if metrics[ppo_metrics.STEP] == at_step:
            with torch.no_grad():
                ln_f = model.transformer.ln_f
                ln_f.weight.zero_()
                ln_f.bias.copy_(1e4 * model.transformer.wte.weight[word])

    return on_step


def watched_run(model_dir, prompts, out, *, collapse: bool = True, interrupt_at: int | None = None, **kw):
    """A 4-step run from `model_dir`, rewarded by response length (reward_fns:length, no reward model),
    evaluated on the 20 held-out prompts before the first step and after each; the collapse at step 2
    (collapse), `Interrupted` raised after step `interrupt_at` (before its evaluation and checkpoint)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    keys = dict(
        reward_fn="reward_fns:length",
        steps=4,
        eval_every=1,
        eval_prompt_file=str(prompts),
        eval_num_prompts=20,
    )
    cfg = ppo_config(model_dir, None, prompts, out, **{**keys, **kw})
    collapse_hook = collapse_onto_one_word(model, tokenizer) if collapse else None

    def on_step(metrics: dict) -> None:
        if collapse_hook is not None:
            collapse_hook(metrics)
        if metrics[ppo_metrics.STEP] == interrupt_at:
            raise Interrupted

    return ppo.train(cfg, policy=model, tokenizer=tokenizer, on_step=on_step), model


def collapsed(state: dict[str, torch.Tensor]) -> bool:
    """The collapse's layer norm: its weight set to 0 (from 1 at init), a few Adam steps of 1e-3 since."""
    return bool(state["transformer.ln_f.weight"].abs().max() < 0.05)


def as_run(folder: Path) -> Path:
    """`folder` made a run folder for the report (a pipeline.json), its PPO stage in folder/ppo."""
    folder.mkdir(parents=True)
    (folder / "pipeline.json").write_text("{}")
    return folder / "ppo"


@pytest.fixture(scope="module")
def stopped(tiny_model_dir, prompt_file, tmp_path_factory):
    """The collapse with stop_on_alarm: (Trained, the run folder)."""
    run = tmp_path_factory.mktemp("stopped")
    trained, _ = watched_run(tiny_model_dir, prompt_file, as_run(run / "run"), stop_on_alarm=True)
    return trained, run / "run"


@pytest.fixture(scope="module")
def kept(tiny_model_dir, prompt_file, tmp_path_factory):
    """The collapse with keep_best, run to its end with a checkpoint every step: (Trained, the model object
    trained in place, the PPO folder)."""
    out = tmp_path_factory.mktemp("kept") / "ppo"
    trained, model = watched_run(tiny_model_dir, prompt_file, out, keep_best=True, save_steps=1)
    return trained, model, out


@pytest.fixture(scope="module")
def quiet(tiny_model_dir, prompt_file, tmp_path_factory):
    """No collapse, stop_on_alarm on: (Trained, the run folder)."""
    run = tmp_path_factory.mktemp("quiet")
    trained, _ = watched_run(
        tiny_model_dir, prompt_file, as_run(run / "run"), collapse=False, stop_on_alarm=True
    )
    return trained, run / "run"


def test_alarm_fires_on_a_collapse_and_stop_on_alarm_stops_there(stopped):
    trained, run = stopped
    out = run / "ppo"
    log = read_jsonl(out / "eval_log.jsonl")
    assert [r["step"] for r in log] == [0, 1, 2]  # stopped at the evaluation where the alarm fired
    assert len(read_jsonl(out / "metrics.jsonl")) == COLLAPSE_STEP  # no step after it
    for record in log:  # every line: the counters, the standard errors the gold rule reads, the watch
        assert set(COLLAPSE_KEYS) | set(WATCH_KEYS) <= record.keys()
        point = trajectory_point(record, reward_fn_weight=1.0)
        assert None not in (point["proxy"], point["proxy_stderr"], point["gold"], point["gold_stderr"])
    assert [r["alarm_step"] for r in log] == [None, None, COLLAPSE_STEP]
    fired = log[-1]
    assert {"duplicate_rate", "shared_bigram_rate", "word_distinct_2"} <= set(fired["alarm_rules"])
    assert fired["duplicate_rate"] == 1.0  # every prompt got ' mess mess ...'
    assert len(fired["alarm_reasons"]) == len(fired["alarm_rules"])
    # the logged fields are the watch's verdict on the lines so far, recomputed here from the log alone
    for i in range(len(log)):
        assert {k: log[i][k] for k in WATCH_KEYS} == watch_fields(log[: i + 1], reward_fn_weight=1.0)

    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics[ppo_metrics.ALARM_STEP] == COLLAPSE_STEP and metrics[ppo_metrics.STOPPED_ON_ALARM] is True
    assert metrics[ppo_metrics.ALARM_RULES] == fired["alarm_rules"]
    assert metrics[ppo_metrics.RETURNED_STEP] == COLLAPSE_STEP and metrics[ppo_metrics.STEP] == COLLAPSE_STEP
    assert trained.metrics[ppo_metrics.STOPPED_ON_ALARM] is True
    # the saved policy is the step's (collapsed) one; without keep_best there is no best/ nor last/
    assert collapsed(load_file(out / "model.safetensors"))
    assert not (out / "best").exists() and not (out / "last").exists()


def test_without_stop_on_alarm_the_run_goes_on_and_the_alarm_stays(kept):
    out = kept[2]
    log = read_jsonl(out / "eval_log.jsonl")
    assert [r["step"] for r in log] == [0, 1, 2, 3, 4]
    assert [r["alarm_step"] for r in log] == [
        None,
        None,
        2,
        2,
        2,
    ]  # where it first fired, on every later line
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics[ppo_metrics.ALARM_STEP] == 2 and metrics[ppo_metrics.STOPPED_ON_ALARM] is False
    assert metrics[ppo_metrics.STEP] == 4 and len(read_jsonl(out / "metrics.jsonl")) == 4


def test_keep_best_returns_the_best_evaluations_weights(kept):
    """keep_best: the evaluation with the best gold is checkpointed in output_dir/best (not a checkpoint resume
    reads), its weights are the saved model and the returned one, and the last step's policy is in
    output_dir/last."""
    trained, model, out = kept
    log = read_jsonl(out / "eval_log.jsonl")
    points = [trajectory_point(r, reward_fn_weight=1.0) for r in log]
    best = log[best_evaluation(points)]["step"]
    assert best < COLLAPSE_STEP  # ' mess mess ...' reads worse to the gold than the tiny model's babble
    assert log[-1]["best_step"] == best
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics[ppo_metrics.BEST_STEP] == best and metrics[ppo_metrics.RETURNED_STEP] == best
    assert trained.metrics[ppo_metrics.RETURNED_STEP] == best and metrics[ppo_metrics.STEP] == 4
    assert json.loads((out / "best" / "step.json").read_text())["step"] == best
    assert last_checkpoint(out, "step") == out / "checkpoints" / "step-3"  # resume reads checkpoints/ alone

    checkpoint = load_file(out / "best" / "policy_trainable.safetensors")  # the policy's and the value head's
    returned = {f"lm.{k}": v.cpu() for k, v in trained.model.state_dict().items()}  # from the run's device
    returned.update({f"value_head.{k}": v.cpu() for k, v in trained.value_head.state_dict().items()})
    for name, value in checkpoint.items():
        assert torch.equal(returned[name], value), name
    assert trained.model is model and not collapsed(model.state_dict())
    saved = load_file(out / "model.safetensors")
    for name, value in saved.items():
        assert torch.equal(checkpoint[f"lm.{name}"], value), name
    head = load_file(out / "value_head.safetensors")
    assert all(torch.equal(checkpoint[f"value_head.{k}"], v) for k, v in head.items())
    assert collapsed(load_file(out / "last" / "model.safetensors"))  # the last step's policy
    assert (out / "last" / "value_head.safetensors").is_file() and (out / "last" / "tokenizer.json").is_file()
    # and the folder loads as the model the run returned
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert all(
        torch.equal(a, b.cpu()) for a, b in zip(reloaded.state_dict().values(), model.state_dict().values())
    )


def test_keep_best_by_accuracy_with_a_verifier(tiny_model_dir, prompt_file, tmp_path):
    """Without a gold judge, keep_best ranks the evaluations by the verifier's accuracy."""
    out = tmp_path / "ppo"
    trained, _ = watched_run(
        tiny_model_dir,
        prompt_file,
        out,
        collapse=False,
        keep_best=True,
        gold_judge="none",
        accuracy_fn="reward_fns:even_length",
        steps=2,
    )
    log = read_jsonl(out / "eval_log.jsonl")
    accuracy = [r["accuracy"] for r in log]
    best = log[accuracy.index(max(accuracy))]["step"]  # the earliest of ties
    assert all(r["gold_score"] is None for r in log)
    assert trained.metrics[ppo_metrics.BEST_STEP] == best == trained.metrics[ppo_metrics.RETURNED_STEP]
    assert json.loads((out / "best" / "step.json").read_text())["step"] == best


def test_keep_best_with_lora(tiny_model_dir, prompt_file, tmp_path):
    """With a LoRA adapter (merged on saving) the last policy is saved from merged copies, so the best
    checkpoint's adapter loads back into the trainer's model: the returned adapter is the best one's."""
    out = tmp_path / "ppo"
    trained, _ = watched_run(
        tiny_model_dir,
        prompt_file,
        out,
        collapse=False,
        keep_best=True,
        use_lora=True,
        lora_r=4,
        lora_alpha=8,
        learning_rate=5e-2,
        steps=2,
    )
    best = trained.metrics[ppo_metrics.BEST_STEP]
    assert trained.metrics[ppo_metrics.RETURNED_STEP] == best
    checkpoint = load_file(out / "best" / "policy_trainable.safetensors")
    adapter = load_file(out / "adapter" / "adapter_model.safetensors")  # saved from the returned model
    lora = {k.removeprefix("lm.").replace(".default", ""): v for k, v in checkpoint.items() if "lora_" in k}
    assert lora and lora.keys() == adapter.keys()
    assert all(torch.equal(adapter[k], v) for k, v in lora.items())
    saved = load_file(out / "model.safetensors")  # the returned model, merged
    returned = {k.removeprefix("base_model.model."): v.cpu() for k, v in trained.model.state_dict().items()}
    assert all(torch.equal(returned[k], v) for k, v in saved.items())
    for folder in (out, out / "last"):  # each a merged HF folder and its adapter
        assert (folder / "model.safetensors").is_file() and (folder / "adapter").is_dir()
    if best != 2:  # trained on, the last policy differs from the returned one
        final, last = load_file(out / "model.safetensors"), load_file(out / "last" / "model.safetensors")
        assert any(not torch.equal(final[k], last[k]) for k in final)


def test_a_healthy_run_stays_quiet(quiet):
    trained, run = quiet
    out = run / "ppo"
    log = read_jsonl(out / "eval_log.jsonl")
    assert [r["step"] for r in log] == [0, 1, 2, 3, 4]  # ran to the end
    assert all(r["alarm_step"] is None and r["alarm_rules"] == [] for r in log)
    assert trained.metrics[ppo_metrics.ALARM_STEP] is None
    assert trained.metrics[ppo_metrics.STOPPED_ON_ALARM] is False
    assert trained.metrics[ppo_metrics.RETURNED_STEP] == 4


def test_resume_reads_the_heldout_log_back(kept, tiny_model_dir, prompt_file, tmp_path):
    """A run interrupted during step 3 and resumed from its step-2 checkpoint logs the same lines as one that
    was not, and returns the same best weights: the alarm (fired at step 2) and the best step (before the
    interruption) come from the held-out log read back; without it the resumed run would see no step-0
    baseline (no counter rule) and call step 3 the best."""
    whole, cut = kept[2], tmp_path / "cut"
    with pytest.raises(Interrupted):
        watched_run(tiny_model_dir, prompt_file, cut, keep_best=True, save_steps=1, interrupt_at=3)
    assert last_checkpoint(cut, "step").name == "step-2"
    assert [r["step"] for r in read_jsonl(cut / "eval_log.jsonl")] == [0, 1, 2]
    watched_run(tiny_model_dir, prompt_file, cut, collapse=False, keep_best=True, save_steps=1, resume=True)
    log = read_jsonl(cut / "eval_log.jsonl")
    assert log == read_jsonl(whole / "eval_log.jsonl")
    assert log[-1]["alarm_step"] == COLLAPSE_STEP and log[-1]["best_step"] < COLLAPSE_STEP
    metrics = [json.loads((folder / "metrics.json").read_text()) for folder in (whole, cut)]
    for key in (
        ppo_metrics.ALARM_STEP,
        ppo_metrics.ALARM_RULES,
        ppo_metrics.BEST_STEP,
        ppo_metrics.RETURNED_STEP,
    ):
        assert metrics[0][key] == metrics[1][key]
    final = [load_file(folder / "model.safetensors") for folder in (whole, cut)]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])


def test_the_keys_need_heldout_evaluation_and_a_gold(tiny_model_dir, prompt_file, tmp_path):
    def config(**kw):
        return ppo_config(tiny_model_dir, None, prompt_file, tmp_path, reward_fn="reward_fns:length", **kw)

    for key in ("stop_on_alarm", "keep_best"):
        with pytest.raises(ConfigError, match=f"'{key}'.*eval_every > 0"):
            config(**{key: True}, eval_every=0)
        with pytest.raises(ConfigError, match=f"'{key}'.*eval_prompt_file"):
            config(**{key: True}, eval_prompt_file=None)
    with pytest.raises(ConfigError, match="'keep_best'.*gold_judge or accuracy_fn"):
        config(keep_best=True, gold_judge="none")
    config(keep_best=True, gold_judge="none", accuracy_fn="reward_fns:even_length")  # a verifier ranks them
    config(stop_on_alarm=True, gold_judge="none")  # the counter rules need no gold


def test_the_report_shows_where_the_alarm_fired(stopped, quiet):
    text = write_report(stopped[1]).read_text()
    assert "Reward-hacking alarm at PPO step 2" in text and "The run stopped there (stop_on_alarm)" in text
    assert "duplicate_rate 1.000 &gt; baseline 0.000: p" in text  # the reason, escaped
    assert "the most shared word bigram “mess mess”, in 20 of 20 responses" in text  # what fired it
    assert "mess mess mess mess mess mess mess mess × 20 responses to 15 prompts" in text  # every prompt's
    assert "fired at step 2 (stopped)" in text  # the headline card
    assert "Collapse counters against step" in text

    text = write_report(quiet[1]).read_text()
    assert "Alarm quiet</strong> over 5 held-out evaluations (steps 0–4)" in text
    assert "Reward-hacking alarm at" not in text


def test_final_evaluation_alarm(tiny_model_dir, prompt_file, tmp_path):
    """`llm-rlhf eval`'s counter rule: the collapsed policy against the model it came from fires, the model
    against itself is quiet; both in metrics.json with the collapse counters of each side."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    collapse_onto_one_word(model, tokenizer, at_step=0)({ppo_metrics.STEP: 0})
    model.save_pretrained(tmp_path / "collapsed")
    tokenizer.save_pretrained(tmp_path / "collapsed")
    fired = evaluate.run(eval_config(tmp_path / "collapsed", tiny_model_dir, prompt_file, tmp_path / "a"))
    assert {"duplicate_rate", "shared_bigram_rate"} <= set(fired[metric_names.ALARM_RULES])
    assert len(fired[metric_names.ALARM_REASONS]) == len(fired[metric_names.ALARM_RULES])
    assert fired["duplicate_rate"] == 1.0 and fired["duplicate_rate_baseline"] == 0.0
    assert (
        set(COLLAPSE_KEYS) <= fired.keys()
        and {k + metric_names.BASELINE for k in COLLAPSE_KEYS} <= fired.keys()
    )
    same = evaluate.run(eval_config(tiny_model_dir, tiny_model_dir, prompt_file, tmp_path / "b"))
    assert same[metric_names.ALARM_RULES] == [] and same[metric_names.ALARM_REASONS] == []
    assert (
        json.loads((tmp_path / "a" / "metrics.json").read_text())[metric_names.ALARM_RULES]
        == fired[metric_names.ALARM_RULES]
    )


def test_ppo_help_states_the_rule_and_thresholds(capsys):
    from llm_rlhf.interfaces import cli

    assert cli.main(["ppo", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--stop_on_alarm (bool, default False)" in text and "--keep_best (bool, default False)" in text
    # the rules and thresholds as `hacking` has them
    for rule in (
        f"{hacking.Z:g} standard errors",
        "2 evaluations in a row",
        "duplicate_rate",
        "echo_rate",
        "Fisher's exact test",
        f"p <= {hacking.COUNTER_ALPHA:.2g}",
        "0.05 false alarms per run of up to 100",
        "output_dir/last",
    ):
        assert rule in text, rule
