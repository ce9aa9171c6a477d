"""PPO's options under `accelerate launch` with 2 processes on this CPU (DDP over gloo; FSDP2 where named):
episodes of several turns, stop strings, min_new_tokens and chat prompts, keep_best and stop_on_alarm, the
policy-loss family, reward functions and reward-model ensembles give on every process what one process gives,
and no process waits at a collective the other never reaches."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import (
    CHATS,
    RENDERED,
    REWARD_FNS,
    SCRIPTS,
    SENTIMENT_JUDGE,
    STOP_STRINGS,
    naive_end,
    ppo_cli_args,
    read_jsonl,
    write_jsonl,
)
from processes import launch
from safetensors.torch import load_file

from llm_rlhf.models.loading import freeze, load_causal_lm, load_tokenizer
from llm_rlhf.ppo import metrics as ppo_metrics

EVEN = REWARD_FNS + ":even_length"  # 0 / 1 scores: groups tie often
KEYWORD_FILE = "tests/reward_fns.py:keyword"  # the file form, relative to the repo root


# --- episodes of several turns ------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_episodes_are_the_same_on_one_and_two_processes(tiny_model_dir, prompt_file, tmp_path):
    """The global prompts of a step played greedily on 1 process and on 2 (each rank its half, the ranks taking
    different numbers of turns): the same ids and masks for every prompt; then a sampled PPO step on 2 ranks
    completes (no rank waits at a collective the other never reaches)."""
    runs = {}
    for n in (1, 2):
        out = tmp_path / f"{n}.json"
        launch([str(SCRIPTS / "episode_ranks.py"), str(tiny_model_dir), str(prompt_file), str(out)], n)
        runs[n] = json.loads(out.read_text())
    assert (runs[1]["world"], runs[2]["world"]) == (1, 2)
    one, two = runs[1]["episodes"], runs[2]["episodes"]
    assert len(one) == len(two) == 8 and one == two
    assert any(sum(e["env_mask"]) > 0 for e in one) and len({e["turns"] for e in one}) > 1
    assert runs[2]["metrics"]["env/turns"] >= 1


@pytest.mark.multiprocess
@pytest.mark.parametrize("sharding", ["fsdp2", "zero3"])
def test_episodes_sharded_on_two_processes_are_those_of_one(tiny_model_dir, prompt_file, tmp_path, sharding):
    """FSDP2 (fsdp.yaml) and DeepSpeed ZeRO-3 (deepspeed_zero3.yaml, every parameter partitioned), fp32, on 2 CPU
    processes: every forward gathers the shards, so the ranks must run as many sampling calls while their
    episodes take different numbers of turns. The greedy episodes are those of 1 process, id for id, and a
    sampled PPO step on them completes on both ranks."""
    one = tmp_path / "1.json"
    launch([str(SCRIPTS / "episode_ranks.py"), str(tiny_model_dir), str(prompt_file), str(one)], 1)
    two = tmp_path / f"{sharding}.json"
    script = [str(SCRIPTS / "episode_ranks.py"), str(tiny_model_dir), str(prompt_file), str(two)]
    if sharding == "fsdp2":
        launch([str(SCRIPTS / "fsdp2_on_cpu.py"), *script], 2, config="fsdp.yaml", mixed_precision="no")
    else:
        launch(script, 2, config="deepspeed_zero3.yaml", mixed_precision="no", timeout=600)
    one, two = json.loads(one.read_text()), json.loads(two.read_text())
    assert two["world"] == 2 and two["distributed_type"].endswith(
        "FSDP" if sharding == "fsdp2" else "DEEPSPEED"
    )
    assert one["episodes"] == two["episodes"]
    rank0, rank1 = two["episodes"][:4], two["episodes"][4:]  # each rank's contiguous half of the prompts
    assert max(e["turns"] for e in rank0) != max(e["turns"] for e in rank1)  # unequal sampling calls per rank
    assert two["metrics"]["env/turns"] >= 1


# --- stop strings, min_new_tokens, chat prompts -----------------------------------------------------


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_with_stop_strings_and_min_new_tokens(
    eos_prone_dir, tiny_rm_dir, prompt_file, tmp_path
):
    """`accelerate launch` with 2 DDP processes: two PPO steps and held-out evaluations with stop strings and
    min_new_tokens. Every rollout row on each process is cut at its first stop string and no shorter than
    min_new_tokens, and the logged response_length and eos_rate are those of the rows of both processes."""
    out, record = tmp_path / "run", tmp_path / "rollouts"
    args = ppo_cli_args(eos_prone_dir, tiny_rm_dir, prompt_file, out, 2)[2:]  # without "-m llm_rlhf"
    args += [
        "--max_new_tokens",
        "10",
        "--stop_strings",
        '["e", "a"]',
        "--min_new_tokens",
        "2",
        "--save_steps",
        "0",
        "--eval_every",
        "1",
        "--eval_prompt_file",
        str(prompt_file),
        "--eval_num_prompts",
        "4",
        "--gold_judge",
        SENTIMENT_JUDGE,
    ]
    launch([str(SCRIPTS / "record_rollouts.py"), str(record), *args], 2)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    ranks = [json.loads((record / f"rollouts_{r}.json").read_text()) for r in (0, 1)]
    assert len(metrics) == 2 and all(len(steps) == 2 for steps in ranks)
    assert metrics[0]["objective/kl"] == 0.0
    tokenizer = load_tokenizer(str(eos_prone_dir))
    eos = tokenizer.eos_token_id
    stopped_rows = 0
    for step, m in enumerate(metrics):
        lengths, ended = [], []
        for steps in ranks:
            rollout = steps[step]
            for ids, mask, stopped, end in zip(
                rollout["response"], rollout["response_mask"], rollout["stopped"], rollout["ended"]
            ):
                real = [i for i, keep in zip(ids, mask) if keep]
                assert mask == [True] * len(real) + [False] * (len(mask) - len(real))
                assert 2 <= len(real) <= 10
                text_ids = real[:-1] if real[-1] == eos else real
                assert naive_end(tokenizer, text_ids, STOP_STRINGS, 2) == (len(real) if stopped else None)
                assert end == (stopped or real[-1] == eos)
                stopped_rows += stopped
                lengths.append(len(real))
                ended.append(end)
        assert m["response_length"] == pytest.approx(sum(lengths) / len(lengths), rel=1e-6)
        assert m["eos_rate"] == pytest.approx(sum(ended) / len(ended), rel=1e-6)
    assert stopped_rows > 0
    heldout = [json.loads(line) for line in (out / "eval_log.jsonl").read_text().splitlines()]
    assert len(heldout) == 3 and all(r["response_length"] >= 2 for r in heldout)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_with_chat_prompts(chat_model_dir, tiny_rm_dir, tmp_path):
    """`accelerate launch` with 2 DDP processes on chat `messages` prompts, with stop strings and
    min_new_tokens: every process's queries are the template's rendering of a chat,
    and the first step's old log-probs, after the stop-string cuts, are those of the distribution sampled
    from: recomputed here by a plain forward of the model on each prompt + kept response, alone and unpadded,
    at the temperature with EOS masked before min_new_tokens. KL = 0 exactly at that step on every row."""
    chats = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS] * 4)
    out, record = tmp_path / "run", tmp_path / "rollouts"
    args = ppo_cli_args(chat_model_dir, tiny_rm_dir, chats, out, 2)[2:]  # without "-m llm_rlhf"
    args += [
        "--max_new_tokens",
        "8",
        "--max_prompt_length",
        "40",
        "--temperature",
        "0.8",
        "--stop_strings",
        json.dumps(STOP_STRINGS),
        "--min_new_tokens",
        "2",
        "--save_steps",
        "0",
    ]
    launch([str(SCRIPTS / "record_rollouts.py"), str(record), *args], 2)
    ranks = [json.loads((record / f"rollouts_{r}.json").read_text()) for r in (0, 1)]
    tokenizer = load_tokenizer(str(chat_model_dir))
    lm = freeze(load_causal_lm(str(chat_model_dir)))  # the policy before its first update
    eos = tokenizer.eos_token_id
    queries = [tokenizer.decode(q) for steps in ranks for q in steps[0]["query"]]
    assert len(queries) == 8 and set(queries) <= set(RENDERED)  # 4 rows per process, each a rendered chat
    assert all(len(steps) == 2 for steps in ranks)
    assert any(any(steps[0]["stopped"]) for steps in ranks)
    for steps in ranks:
        first = steps[0]
        for query, ids, mask, logprobs, ref in zip(
            first["query"],
            first["response"],
            first["response_mask"],
            first["logprobs"],
            first["ref_logprobs"],
        ):
            kept = [i for i, keep in zip(ids, mask) if keep]
            assert len(kept) >= 2
            with torch.no_grad():
                logits = lm(torch.tensor([query + kept])).logits[0, len(query) - 1 : -1] / 0.8  # (L, V)
            logits[:2, eos] = float("-inf")  # min_new_tokens: EOS cannot end the response before token 2
            naive = logits.log_softmax(-1).gather(-1, torch.tensor(kept)[:, None]).squeeze(-1)  # (L,)
            torch.testing.assert_close(torch.tensor(logprobs[: len(kept)]), naive, atol=2e-5, rtol=1e-5)
            assert logprobs[: len(kept)] == ref[: len(kept)]  # policy == reference at the first step


# --- keep_best and stop_on_alarm ----------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("config", ["multi_gpu.yaml", "fsdp.yaml"])
def test_keep_best_and_stop_on_alarm_on_two_processes(config, tiny_model_dir, prompt_file, tmp_path):
    """`llm-rlhf ppo` on 2 processes (DDP, and FSDP2 whose saving is a collective): the main process decides,
    every process saves the best checkpoint and the last policy and loads the best back together (a
    mismatch would hang or fail the launch); the outputs say the same step everywhere."""
    out = tmp_path / "run"
    args = ppo_cli_args(
        tiny_model_dir,
        "none",
        prompt_file,
        out,
        3,
        reward_fn="tests/reward_fns.py:length",
        eval_every=1,
        eval_prompt_file=prompt_file,
        eval_num_prompts=20,
        gold_judge=SENTIMENT_JUDGE,
        keep_best="true",
        stop_on_alarm="true",
        save_steps=0,
    )[2:]
    script = [str(SCRIPTS / "fsdp2_on_cpu.py")] if config == "fsdp.yaml" else ["-m", "llm_rlhf"]
    launch([*script, *args], 2, config=config)
    log = read_jsonl(out / "eval_log.jsonl")
    metrics = json.loads((out / "metrics.json").read_text())
    last = log[-1]
    assert [r["step"] for r in log] == list(range(len(log)))
    assert metrics[ppo_metrics.STOPPED_ON_ALARM] == (last["alarm_step"] is not None)
    assert len(log) == (last["alarm_step"] + 1 if last["alarm_step"] is not None else 4)
    best = last["best_step"]
    assert metrics[ppo_metrics.BEST_STEP] == metrics[ppo_metrics.RETURNED_STEP] == best
    assert json.loads((out / "best" / "step.json").read_text())["step"] == best
    assert (out / "last" / "model.safetensors").is_file() and (out / "model.safetensors").is_file()
    final = load_file(out / "model.safetensors")
    if config == "multi_gpu.yaml":  # the best checkpoint's trainable weights are the saved model's
        checkpoint = load_file(out / "best" / "policy_trainable.safetensors")
        assert all(torch.equal(checkpoint[f"lm.{k}"], v) for k, v in final.items())
    else:  # FSDP2: every process's shards of it
        assert len(list((out / "best" / "sharded").glob("*.distcp"))) == 2
    if best != log[-1]["step"]:  # the returned policy is not the last one
        last_model = load_file(out / "last" / "model.safetensors")
        assert any(not torch.equal(final[k], last_model[k]) for k in final)


# --- the policy-loss family ---------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.slow
def test_loss_options_two_ranks_and_accumulation_equal_one(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path
):
    """tests/scripts/ppo_ranks.py MODE loss_options on 1 and on 2 processes (two launches): dapo (clip-higher,
    dual clip, seq_mean_token_mean, TIS, overlong shaping, mask_truncated, dynamic sampling with a tied group
    in the first round), gspo (token_sum_norm, MIS), cispo (on gae) and on-policy distillation (the reverse KL in the reward, on gae; the JSD over the teacher's
    top 16 as a loss term, on grpo), each with ordinary minibatches and
    with micro-batches of one episode: the raw gradient of every update (2 steps x 2 epochs) and the steps'
    metrics are those of one process without accumulation."""
    runs = {}
    for world in (1, 2):
        out = tmp_path / f"{world}.json"
        args = [
            str(SCRIPTS / "ppo_ranks.py"),
            str(tiny_model_dir),
            str(tiny_rm_dir),
            str(prompt_file),
            str(out),
            "loss_options",
        ]
        launch(args, world)
        runs[world] = json.loads(out.read_text())["runs"]
    one = runs[1]
    assert set(one) == {
        f"{n}{a}" for n in ("dapo", "gspo", "cispo", "distill", "distill_jsd") for a in ("", "/accumulate")
    }
    for key in one:
        name = key.split("/")[0]
        base = one[name]
        for run in (one[key], runs[2][key]):
            assert len(run["grads"]) == len(base["grads"]) == 4, key
            for update, (ga, gb) in enumerate(zip(base["grads"], run["grads"])):
                # after an Adam step (lr 1e-2) the weights differ by float rounding: |diff| < 2e-6 there
                torch.testing.assert_close(
                    torch.tensor(gb),
                    torch.tensor(ga),
                    atol=1e-7 if update == 0 else 2e-6,
                    rtol=1e-4,
                    msg=f"{key} update {update + 1}",
                )
            for m1, m2 in zip(base["metrics"], run["metrics"]):
                for k, v in m1.items():
                    if k.startswith(("loss/", "policy/", "sampler/", "sampling/", "objective/")):
                        assert m2[k] == pytest.approx(v, rel=1e-4, abs=1e-5), (key, m1["step"], k)
    dapo = one["dapo"]["metrics"]
    assert [m["sampling/rounds"] for m in dapo] == [2.0, 2.0] and dapo[0]["sampling/groups_dropped"] == 2.0
    assert dapo[0]["sampler/corrected_frac"] > 0 and dapo[0]["objective/overlong_penalty"] < 0
    assert one["gspo"]["metrics"][0]["sampler/corrected_frac"] > 0
    assert one["cispo"]["metrics"][1]["policy/clipfrac_high"] > 0
    distill = one["distill"]["metrics"]  # the teacher is the policy's start: 0, then the moved student's KL
    assert distill[0]["objective/distill_kl"] == 0.0 and distill[1]["objective/distill_kl"] != 0.0
    jsd = one["distill_jsd"]["metrics"]  # the JSD over the teacher's top 16 as a loss term
    assert jsd[0]["objective/distill_kl"] == 0.0 and jsd[1]["loss/distill"] > 0


@pytest.mark.multiprocess
@pytest.mark.slow
def test_fsdp2_with_dynamic_sampling(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):
    """fsdp.yaml (FSDP2) on 2 CPU processes: grpo with dynamic sampling, clip-higher and seq_mean_token_mean;
    the rounds are the same on every process (the sharded forwards are collectives), the run ends."""
    out = tmp_path / "fsdp"
    args = ppo_cli_args(
        tiny_model_dir,
        "none",
        prompt_file,
        out,
        3,
        advantage_estimator="grpo",
        samples_per_prompt=2,
        rollout_batch_size=2,
        mini_batch_size=4,
        reward_fn=EVEN,
        dynamic_sampling="true",
        cliprange_high=0.28,
        loss_aggregation="seq_mean_token_mean",
        gold_judge="none",
    )[2:]
    launch([str(SCRIPTS / "fsdp2_on_cpu.py"), *args], 2, config="fsdp.yaml", mixed_precision="no")
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all("sampling/rounds" in m and "policy/clipfrac_high" in m for m in metrics)
    assert (out / "model.safetensors").is_file()


# --- reward functions and ensembles -------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_combined_score_and_a_failure_on_one_rank(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path
):
    """2 processes: each scores its own samples with the function (named in its file form, the RM beside it); the
    logged global means keep scores = rm_score + weight * reward_fn. Then a function that fails on rank 1
    only, at the first step: both processes stop with a one-line error (rank 1 its own, rank 0 naming the
    other process) instead of rank 0 waiting for ever."""
    out = tmp_path / "ok"
    launch(
        ppo_cli_args(
            tiny_model_dir,
            tiny_rm_dir,
            prompt_file,
            out,
            3,
            save_steps=0,
            reward_fn=KEYWORD_FILE,
            reward_fn_weight=0.5,
        )
    )
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    for m in lines:
        assert m["objective/scores"] == pytest.approx(
            m["objective/rm_score"] + 0.5 * m["objective/reward_fn"], abs=1e-5
        )
        assert m["objective/reward_fn"] > 0
    assert (out / "model.safetensors").is_file()

    bad = tmp_path / "bad"
    named = "tests/reward_fns.py:WrongLengthOnRank1AfterProbe"
    result = launch(
        ppo_cli_args(tiny_model_dir, "none", prompt_file, bad, 3, save_steps=0, reward_fn=named), check=False
    )
    assert result.returncode != 0
    for message in (  # each rank's one line (the two ranks' writes to stderr may interleave)
        f"error: reward_fn '{named}' returned 3 scores for 4 responses",
        f"error: reward_fn '{named}' failed on another process (see its error)",
    ):
        assert message in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr.split("exitcode")[0], "no traceback from the ranks themselves"
    assert not (bad / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ensemble_two_ranks_equals_one(members, tiny_model_dir, prompt_file, tmp_path):
    """One PPO step of a fixed global rollout (tests/scripts/ppo_ranks.py) scored by a 3-member ensemble:
    every rank scores its own samples with every member, and the global member scores, disagreement,
    combined score, losses and the raw gradient equal those of one process."""

    script = SCRIPTS / "ppo_ranks.py"

    def run(num_processes):
        out = tmp_path / f"{num_processes}.json"
        launch(
            [
                str(script),
                str(tiny_model_dir),
                ",".join(members),
                str(prompt_file),
                str(out),
                "same",
                "uncertainty",
            ],
            num_processes,
        )
        return json.loads(out.read_text())

    one, two = run(1), run(2)
    assert (one["world"], two["world"]) == (1, 2)
    torch.testing.assert_close(torch.tensor(two["grads"]), torch.tensor(one["grads"]), atol=1e-7, rtol=1e-4)
    m1, m2 = one["metrics"][0], two["metrics"][0]
    keys = [f"objective/scores_member_{k}" for k in range(3)] + ["objective/scores_disagreement"]
    keys += ["objective/scores", "objective/rlhf_reward", "loss/policy", "loss/value"]
    for key in keys:
        assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key
    assert m1["objective/scores_disagreement"] > 0.01
    means = torch.tensor([m1[f"objective/scores_member_{k}"] for k in range(3)])
    assert m1["objective/scores"] < float(means.mean())  # uncertainty: below the mean of the members


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ppo_command_with_an_ensemble_on_two_processes(members, tiny_model_dir, prompt_file, tmp_path):
    """`accelerate launch ... llm-rlhf ppo` with a 2-member ensemble: training steps, logged samples and the
    held-out evaluation (every process scores with every member; the main one writes) log the members."""

    out = tmp_path / "run"
    args = ppo_cli_args(tiny_model_dir, members[0], prompt_file, out, 2)
    args[args.index("--reward_model_path") + 1] = f"[{members[1]}, {members[2]}]"
    args += ["--ensemble_combine", "min", "--eval_every", "1", "--eval_prompt_file", str(prompt_file)]
    args += ["--eval_num_prompts", "4", "--gold_judge", "none", "--log_samples_every", "1"]
    launch(args, 2)
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2] and steps[-1]["episodes"] == 2 * 4 * 2
    for m in steps:
        worst = min(m["objective/scores_member_0"], m["objective/scores_member_1"])
        assert m["objective/scores"] <= worst + 1e-6 and m["objective/scores_disagreement"] > 0
    evals = [json.loads(line) for line in (out / "eval_log.jsonl").read_text().splitlines()]
    assert len(evals) == 3 and all("rm_score_member_1" in r for r in evals)
