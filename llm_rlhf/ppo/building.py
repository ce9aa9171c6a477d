"""Building a PPO run: its inputs checked before anything is written (the tokenizer, the prompts, the reward
function and the verifier, each probed once on real prompts), the models (policy with its value head, frozen
reference, reward model or ensemble, optional critic) and the `PPOTrainer` around them."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

from llm_rlhf.core.config import check_report_to_installed, is_off
from llm_rlhf.core.data import load_prompt_dataset, prompt_rules
from llm_rlhf.core.errors import UserError
from llm_rlhf.core.utils import (
    seed_everything,
)
from llm_rlhf.evaluation.measures import (
    load_heldout_inputs,
    load_verifier,
)
from llm_rlhf.models.accelerated import loading_whole_models
from llm_rlhf.models.loading import (
    PolicyWithValue,
    Reference,
    ValueHead,
    check_not_adapter_only,
    freeze,
    load_causal_lm,
    load_tokenizer,
    tokenizer_or_load,
    use_eager_attention,
    use_fused_gelu,
)
from llm_rlhf.models.lora import lora_placement
from llm_rlhf.models.reward_fn import RewardFn, decode_texts, load_reward_fn, probe
from llm_rlhf.models.reward_model import (
    check_members_exist,
    load_reward_model,
    member_paths,
)
from llm_rlhf.models.scoring import scoring_reward_model
from llm_rlhf.ppo.config import Config  # the keys of `llm-rlhf ppo`
from llm_rlhf.ppo.trainer import PPOModels, PPOTrainer
from llm_rlhf.rl.episodes import EpisodeLimits
from llm_rlhf.rl.rollout import encode_prompt, left_pad
from llm_rlhf.tasks.environments import environment_factory


def load_prompt_ids(cfg: Config, tokenizer, prompts=None) -> list[list[int]]:
    """The training prompts as token ids: prompt_file's, or `prompts` (`data.InMemory` rows) in its place."""
    ds = load_prompt_dataset(prompts or cfg.prompt_file, tokenizer, **prompt_rules(cfg))
    return [encode_prompt(tokenizer, p) for p in ds["prompt"]]  # with BOS where the tokenizer adds one


def build_models(cfg: Config, *, policy=None, reward_model=None, teacher=None, tokenizer=None) -> PPOModels:
    """policy (+ value head with gae, unless a separate critic), reference, reward model (a `RewardEnsemble` when
    reward_model_path is a list, its members loaded once; None when reward_model_path is none) and optional
    critic (from the first member of an ensemble).

    policy: a loaded causal LM in place of model_name_or_path (trained in place; the reference is a frozen
    copy of it as it is now); reward_model: a `RewardModel` or a list of them (an ensemble combined with the
    config's ensemble keys) in place of reward_model_path (the Python API); teacher: a causal LM in place of
    teacher_model_path (`load_teacher`, checked against `tokenizer`, the policy's)."""
    if policy is None:
        policy = load_causal_lm(
            cfg.model_name_or_path, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code
        )
    lm = use_fused_gelu(policy)
    if cfg.gradient_checkpointing:
        lm.gradient_checkpointing_enable()
    if cfg.use_lora:
        lora = LoraConfig(
            r=cfg.lora_r,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout,
            **lora_placement(lm, cfg.lora_target_modules, cfg.lora_layers),
            task_type="CAUSAL_LM",
        )
        lm = get_peft_model(lm, lora)
        ref_model = Reference(lm)  # the same network; reference_context() disables the adapter
    else:
        ref_lm = freeze(copy.deepcopy(lm))  # the policy before any update: the same weights, its own memory
        assert ref_lm is not lm and all(
            a.data_ptr() != b.data_ptr() for a, b in zip(ref_lm.parameters(), lm.parameters())
        )
        ref_model = Reference(ref_lm)
    lm.eval()  # dropout off for the policy too: ratio == 1 exactly at the first minibatch
    hidden = (
        lm.config.get_text_config().hidden_size
        if hasattr(lm.config, "get_text_config")
        else lm.config.hidden_size
    )
    # With a separate critic the policy has no value head: every trainable parameter takes part in the loss.
    # The critic-free estimators (`Estimator.critic` false) have neither: no value function is built, trained,
    # checkpointed or saved.
    with_head = cfg.value_model == "policy" and cfg.estimator.critic
    value_head = ValueHead(hidden).to(next(lm.parameters()).dtype) if with_head else None
    policy = PolicyWithValue(lm, value_head)
    # the one loading of a config's reward model (`scoring.scoring_reward_model`, as eval and compare load it);
    # None with reward_model_path none: the score is the reward_fn's alone
    reward_model = scoring_reward_model(cfg, reward_model, fused_gelu=True)
    critic = None
    if cfg.value_model == "reward":
        critic = use_fused_gelu(
            load_reward_model(
                member_paths(cfg.reward_model_path)[0],
                dtype=cfg.dtype,
                trust_remote_code=cfg.trust_remote_code,
            )
        ).as_critic()
    teacher = load_teacher(cfg, teacher, tokenizer=tokenizer, policy_lm=lm)
    return PPOModels(policy, ref_model, reward_model=reward_model, critic=critic, teacher=teacher)


def load_teacher(cfg: Config, teacher=None, *, tokenizer=None, policy_lm=None) -> Reference | None:
    """On-policy distillation's teacher, frozen, as a `Reference` (the same forward as the reference's, so a
    teacher equal to the policy gives log pi_teacher == log pi_theta exactly): `teacher` (a causal LM) or
    teacher_model_path loaded in teacher_dtype (null: the run's dtype), on teacher_device. None without one.
    A teacher that does not load, or whose vocabulary is not the policy's (the tokenizer's token -> id map
    where the teacher's folder has a tokenizer, and the LM head's rows), is a one-line UserError."""
    path = cfg.teacher_model_path
    if teacher is None and path is None:
        return None
    name = "the teacher" if teacher is not None else f"teacher_model_path '{path}'"
    if teacher is None:
        try:
            teacher = load_causal_lm(
                path, dtype=cfg.teacher_dtype or cfg.dtype, trust_remote_code=cfg.trust_remote_code
            )
        except UserError as e:
            raise UserError(f"teacher_model_path: {e}") from None
        if tokenizer is not None and has_tokenizer(path):
            theirs = load_tokenizer(path, trust_remote_code=cfg.trust_remote_code).get_vocab()
            ours = tokenizer.get_vocab()
            if theirs != ours:
                other = sorted(set(theirs.items()) ^ set(ours.items()), key=lambda kv: kv[1])[0]
                raise UserError(
                    f"{name}: its tokenizer is not the policy's ({len(theirs)} tokens against {len(ours)}; "
                    f"{other[0]!r} is id {theirs.get(other[0])} there, {ours.get(other[0])} here): "
                    "distillation compares the log-probs of the same token ids"
                )
    rows = teacher.get_output_embeddings().weight.shape[0]
    if policy_lm is not None and rows != (policy_rows := policy_lm.get_output_embeddings().weight.shape[0]):
        raise UserError(
            f"{name}: its LM head scores {rows} tokens, the policy's {policy_rows}: distillation compares the "
            "log-probs of the same token ids over the same vocabulary"
        )
    teacher = freeze(use_fused_gelu(teacher))
    if cfg.teacher_device is not None:
        teacher.to(cfg.teacher_device)
    return Reference(teacher)


def has_tokenizer(path: str) -> bool:
    """Whether a local model folder holds a tokenizer (a hub name is assumed to)."""
    folder = Path(path).expanduser()
    files = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    return not folder.is_dir() or any((folder / f).is_file() for f in files)


def build_trainer(
    cfg: Config,
    accelerator,
    tokenizer,
    prompts: list[list[int]],
    reward_fn: RewardFn | None = None,
    *,
    policy=None,
    reward_model=None,
    verifier: RewardFn | None = None,
    teacher=None,
) -> PPOTrainer:
    """The models and the trainer. reward_fn: `cfg.reward_fn` already loaded (`llm_rlhf.stages.ppo.train`
    loads and probes it first, `check_inputs`), else loaded here; policy, reward_model: objects in place of the config's folders (`build_models`);
    verifier: `cfg.accuracy_fn` loaded, else loaded here where dynamic sampling ties groups on its verdicts;
    teacher: a causal LM in place of teacher_model_path (`load_teacher`)."""
    if cfg.reward_fn is not None and reward_fn is None:
        reward_fn = load_reward_fn(cfg.reward_fn)
    if (
        (cfg.dynamic_sampling or cfg.environment is not None)
        and cfg.accuracy_fn is not None
        and verifier is None
    ):
        verifier = load_reward_fn(cfg.accuracy_fn, key="accuracy_fn", binary=True)
    make_environment = None  # episodes of several turns: one fresh environment per episode
    if cfg.environment is not None:
        make_environment = environment_factory(
            cfg.environment, verifier=verifier, limits=EpisodeLimits.of(cfg)
        )
    seed_everything(cfg.seed, accelerator.process_index)
    with loading_whole_models(accelerator):  # whole on every process, not ZeRO-3 partitions
        models = build_models(
            cfg, policy=policy, reward_model=reward_model, teacher=teacher, tokenizer=tokenizer
        )
    if models.reward_model is not None:
        models.reward_model.to(accelerator.device)
    if models.teacher is not None and cfg.teacher_device is None:
        models.teacher.to(accelerator.device)
    if not cfg.use_lora:
        models.ref_model.to(accelerator.device)
    for model in (models.policy, models.ref_model, models.reward_model, models.critic):
        if model is not None:
            use_eager_attention(model, bf16=cfg.bf16, device=accelerator.device)
    if models.teacher is not None:
        use_eager_attention(models.teacher, bf16=cfg.bf16, device=cfg.teacher_device or accelerator.device)
    return PPOTrainer(
        cfg,
        accelerator=accelerator,
        models=models,
        tokenizer=tokenizer,
        prompts=prompts,
        reward_fn=reward_fn,
        verifier=verifier if cfg.dynamic_sampling else None,
        make_environment=make_environment,
    )


@dataclasses.dataclass(frozen=True)
class RunInputs:
    """Everything a run reads besides the models, checked before anything is written: the tokenizer, the
    training prompts (ids), the reward function (probed), the held-out prompts and gold judge, the verifier."""

    tokenizer: object
    prompts: list[list[int]]
    reward_fn: RewardFn | None
    eval_prompts: list[str]
    judge: object
    verifier: RewardFn | None


def check_inputs(cfg: Config, *, policy, tokenizer, reward_model, reward_fn, prompts) -> RunInputs:
    """Step 1: the tokenizer, the prompts (validated row by row), the reward function and the verifier (each
    called once on real prompts: a broken one stops the run here), the held-out inputs, the RM folders."""
    check_report_to_installed(cfg.report_to)
    if policy is None:
        check_not_adapter_only(cfg.model_name_or_path)
    tokenizer = tokenizer_or_load(cfg, tokenizer, policy, padding_side="left")
    prompts = load_prompt_ids(cfg, tokenizer, prompts)
    reward_fn = load_and_probe_reward_fn(cfg, tokenizer, prompts, reward_fn)
    eval_prompts, judge = load_heldout_inputs(cfg, tokenizer)
    verifier = load_and_probe_verifier(cfg, tokenizer, prompts, eval_prompts)
    if reward_model is None and not is_off(cfg.reward_model_path):
        check_members_exist(cfg.reward_model_path)
    return RunInputs(tokenizer, prompts, reward_fn, eval_prompts, judge, verifier)


def load_and_probe_reward_fn(
    cfg: Config, tokenizer, prompts: list[list[int]], reward_fn: RewardFn | None = None
) -> RewardFn | None:
    """`cfg.reward_fn` imported and called once (`reward_fn.probe`) on the first two training prompts, as
    text as training decodes them (`reward_fn.decode_texts`), with dummy responses: before any model is
    loaded or any output written. Every process probes on the same inputs, so a deterministic function
    fails on all of them alike. None without a reward_fn."""
    if reward_fn is None and cfg.reward_fn is None:
        return None
    reward_fn = reward_fn or load_reward_fn(cfg.reward_fn)
    probe(reward_fn, prompt_texts(tokenizer, prompts[:2]))
    return reward_fn


def load_and_probe_verifier(
    cfg: Config, tokenizer, prompts: list[list[int]], eval_prompts: list[str]
) -> RewardFn | None:
    """`cfg.accuracy_fn` loaded and probed before any model, as the reward_fn (`measures.load_verifier`),
    where something reads it: held-out evaluation's accuracy (probed on the held-out prompts) or dynamic
    sampling, which ties groups on its verdicts (probed on the first two training prompts). Else None."""
    if cfg.accuracy_fn is None or not (eval_prompts or cfg.dynamic_sampling):
        return None
    return load_verifier(cfg.accuracy_fn, eval_prompts or prompt_texts(tokenizer, prompts[:2]))


def prompt_texts(tokenizer, prompts: list[list[int]]) -> list[str]:
    """Prompts (token ids) as text, as training decodes them for a reward function (`reward_fn.decode_texts`)."""
    query, query_mask = left_pad(prompts, tokenizer.pad_token_id)  # (n, P) each
    no_response = torch.zeros((query.shape[0], 0), dtype=torch.bool)  # (n, 0)
    return decode_texts(tokenizer, query, query_mask, no_response.long(), no_response)[0]
