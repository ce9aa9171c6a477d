"""The reward-model library: r_phi(x, y), loading a saved RM, and scoring (used by the RM stage, PPO,
evaluation and `llm-rlhf score`).

    r_phi(x, y) = w . h_L(x + y)[last non-pad token]          (AutoModelForSequenceClassification, num_labels=1)

What the model reads, and where the score lands (the same for training, `RewardModel` and PPO):

    tokens          = tokenizer(prompt + response) + [EOS]      (TRL's convention: EOS appended to each response)
    right padding:    x  x  x  y  y  EOS pad pad        left padding:  pad pad x  x  x  y  y  EOS
    attention_mask:   1  1  1  1  1  1   0   0                         0   0   1  1  1  1  1  1
    position_ids:     0  1  2  3  4  5   5   5                         0   0   0  1  2  3  4  5
    score read at:                   ^                                                         ^

A sampled response that did not end with EOS (cut by a stop string, or truncated at max_new_tokens) is
read the same way: the RM's EOS goes after its last kept token (`end_with_eos`, `RewardModel.score_samples`),
so PPO, evaluation and best-of-n never ask the RM for a score at a token it was not trained to judge at.
`llm-rlhf score` reads prompt/response texts and appends EOS as training did (`encode_pairs`).

`position_ids = cumsum(attention_mask) - 1` (clamped at 0), so left padding does not shift absolute
positions (GPT-2 would otherwise read them from the padded index).

The pad token. transformers' sequence-classification pooling reads "the rightmost token != pad_token_id".
GPT-2 tokenizers have no pad token and the usual fix, pad = EOS, makes that pooling skip the EOS that TRL
appends and read the token before it. So the RM gets a dedicated pad token (`<|pad|>`, one new embedding
row, zero and never read: padded positions are masked). With it TRL's pooling during training, our
`RewardModel.forward` (which gathers at the last position where attention_mask is 1, and so does not even
depend on the pad id) and plain `AutoModelForSequenceClassification` on the saved folder all read the EOS.
Token ids of the SFT tokenizer stay valid RM ids (only the pad token is added).

Normalisation: after training, the mean and (population) std of the raw scores on a reference set, the
unique prompt + response texts (chosen and rejected) of the training pairs, are stored in
`reward_normalization.json` (and in config.json as `reward_normalization` for full models), so that
`load_reward_model(...).score` returns roughly N(0, 1) scores. Plain transformers still loads the folder
and returns raw scores.

Ensembles (`RewardEnsemble`, `load_reward_models`): K saved RMs score the same sequences, each normalised
with its own stored statistics, and `reward_math.combine_member_scores` makes one score per sequence of them
(mean, min, or mean - lambda * std across the members; Coste et al. 2024). PPO and evaluation take one
folder or a list of folders as `reward_model_path`.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from pathlib import Path

import torch
from peft import PeftConfig, PeftModel
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm
from transformers import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING, AutoModelForSequenceClassification
from transformers.utils import logging as hf_logging

from llm_rlhf.core.config import require
from llm_rlhf.core.errors import UserError
from llm_rlhf.core.utils import atomic_write_json, read_json
from llm_rlhf.models.loading import load_tokenizer, shares_vocab, torch_dtype
from llm_rlhf.rl import reward_math
from llm_rlhf.rl.token_math import position_ids_from_mask

PAD_TOKEN = "<|pad|>"
NORMALIZATION_FILE = "reward_normalization.json"


# ---------------------------------------------------------------------------------------------------
# Where the score is read: small pure functions, pinned by tests
# ---------------------------------------------------------------------------------------------------


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last position where attention_mask is 1, for any padding side. (B, T) -> (B,).

    The loop it replaces: `[max(t for t in range(T) if attention_mask[b, t]) for b in range(B)]`.
    """
    if not bool(attention_mask.bool().any(-1).all()):
        raise ValueError("every sequence needs at least one token with attention_mask == 1")
    positions = torch.arange(attention_mask.shape[-1], device=attention_mask.device)  # (T,)
    return (positions * attention_mask.bool()).argmax(-1)  # (B,) the largest unmasked position wins


def trim_padding_columns(
    input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the leading and trailing columns that are padding in every row (any padding side); the
    columns in between stay, so every real token keeps its place, its position
    (`position_ids_from_mask` counts real tokens only) and what it attends to. (B, T) each -> (B, T') each.

        pad pad x x y EOS pad pad          pad x x y EOS pad
        pad x   x y y y   EOS pad    ->    x   x y y y   EOS      (a PPO rollout: responses padded to
        pad pad x y EOS   pad pad pad      pad x y EOS pad pad     max_new_tokens, the RM pays for none)

    The score, read at the last real token, is the same up to float rounding (`tests/ppo/test_trim.py`).
    """
    real = attention_mask.bool().any(0)  # (T,) a real token in some row
    start = int(real.int().argmax())  # the first such column
    end = real.shape[0] - int(real.flip(0).int().argmax())  # one past the last
    return input_ids[:, start:end], attention_mask[:, start:end]  # (B, T') each


def end_with_eos(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, *, eos_token_id: int, finished: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row as the RM was trained to read text (`encode_pairs`): its real tokens, then the RM's EOS.
    A finished row (its last real token is an EOS) gets that token set to `eos_token_id` (a no-op when the
    ids agree); any other row (a response cut by a stop string, or truncated at max_new_tokens) gets
    `eos_token_id` in the column after its last real token, so the score is read at an EOS, where the RM
    learned to judge a whole response, not at whatever token the response stopped on.
    (B, T) each, finished (B,) bool -> (B, T + 1) each; one column is added so a full-width row fits.

        stopped / truncated:  pad x x y y pad   ->  pad x x y y EOS pad
        finished:             pad x x y EOS pad ->  pad x x y EOS pad pad
        full width:           x   x y y y   y   ->  x   x y y y   y   EOS
    """
    B = input_ids.shape[0]
    rows = torch.arange(B, device=input_ids.device)  # (B,)
    last = last_token_index(attention_mask)  # (B,) the last real token of each row
    ids = torch.cat([input_ids, input_ids.new_full((B, 1), eos_token_id)], dim=1)  # (B, T + 1)
    mask = torch.cat([attention_mask, attention_mask.new_zeros((B, 1))], dim=1)  # (B, T + 1)
    at = torch.where(finished, last, last + 1)  # (B,) where the EOS goes: on the old one, or after the end
    ids[rows, at] = eos_token_id
    mask[rows, at] = 1
    return ids, mask


def encode_pairs(tokenizer, prompts: list[str], responses: list[str]) -> list[list[int]]:
    """The token ids the RM scores: tokenizer(prompt + response), then EOS (unless the tokenizer added
    one). The same as TRL's RewardTrainer, which appends the EOS text to each response."""
    texts = [p + r for p, r in zip(prompts, responses, strict=True)]
    if not texts:
        return []
    eos = tokenizer.eos_token_id
    return [ids if ids and ids[-1] == eos else ids + [eos] for ids in tokenizer(texts)["input_ids"]]


def encode_pair(tokenizer, prompt: str, response: str) -> list[int]:
    return encode_pairs(tokenizer, [prompt], [response])[0]


def pad_right(sequences: list[list[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to the longest sequence: (input_ids, attention_mask), both (B, T) long."""
    width = max(len(s) for s in sequences)
    input_ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in sequences], device=device)  # (B, T)
    attention_mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences], device=device)
    return input_ids, attention_mask


# ---------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------


class RewardModel(nn.Module):
    """r_phi(x, y) of a sequence-classification model (num_labels=1), possibly wrapped by peft.

    forward(input_ids, attention_mask) -> (B,) raw scores, read at the last position where attention_mask
    is 1 (left, right or both-sided padding; the pad id does not matter; columns that are padding in
    every row are dropped first, `trim_padding_columns`). score(...) -> (B,) normalised:
    (raw - mean) / std. Attributes: `model`, `tokenizer` (with its dedicated pad token), `mean`, `std`,
    `normalization` (the stored record, None if the folder has none: then mean 0, std 1), `device` (where
    its weights are, as a transformers model's: the device its inputs go to).
    """

    def __init__(self, model, tokenizer, normalization: dict | None = None):
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.normalization = normalization
        self.mean = float(normalization["mean"]) if normalization else 0.0
        self.std = float(normalization["std"]) if normalization else 1.0
        self._vocab = (None, False)  # (the tokenizer last seen, whether it shares this RM's vocabulary)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def _trunk_and_head(self):
        """(transformer trunk, score head) of the sequence classifier, looking through a peft wrapper."""
        model = self.model
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        return inner.base_model, inner.score

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Last-layer hidden states (B, T, H), with positions that ignore padding."""
        trunk, _ = self._trunk_and_head()
        out = trunk(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
        )
        return out.last_hidden_state  # (B, T, H)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Raw scores (B,) on the RM's device, wherever the ids come from (a policy's rollouts may be on another
        device than the RM: a GPU's RM scoring a CPU policy's samples, or one given on another card)."""
        _, head = self._trunk_and_head()
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        # (B, T') each: no compute on columns that are padding in every row
        input_ids, attention_mask = trim_padding_columns(input_ids, attention_mask)
        hidden = self.hidden_states(input_ids, attention_mask)  # (B, T', H)
        last = last_token_index(attention_mask)  # (B,)
        rows = torch.arange(hidden.shape[0], device=hidden.device)  # (B,)
        hidden_last = hidden[rows, last]  # (B, H): the hidden state at the last non-pad token (the EOS)
        return head(hidden_last).squeeze(-1).float()  # (B,)

    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Normalised scores (raw - mean) / std: (B,)."""
        return (self.forward(input_ids, attention_mask) - self.mean) / self.std

    def score_samples(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, tokenizer) -> torch.Tensor:
        """Normalised scores of sampled sequences (query | response | pad) written in `tokenizer`'s ids (a
        policy's): (B,). Every row is read as the RM was trained to read text, ending with the RM's own EOS,
        whether the response ended with EOS, was cut by a stop string or was truncated at max_new_tokens:
        with the same vocabulary the ids go in with that EOS put at their end (`end_with_eos`); with another
        the text is re-encoded (`score_tokens`). What PPO, evaluation and best-of-n score (`scoring.Scorer`).
        The scores are on the device of `input_ids`, whichever device the RM is on."""
        if self._vocab[0] is not tokenizer:  # comparing vocabularies costs a dict walk: once per tokenizer
            self._vocab = (tokenizer, shares_vocab(tokenizer, self.tokenizer))
        if not self._vocab[1]:
            return self.score_tokens(input_ids, attention_mask, tokenizer)
        where = input_ids.device
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)  # (B,)
        finished = input_ids[rows, last_token_index(attention_mask)] == tokenizer.eos_token_id  # (B,)
        ids, mask = end_with_eos(
            input_ids, attention_mask, eos_token_id=self.tokenizer.eos_token_id, finished=finished
        )  # (B, T + 1) each
        return self.score(ids, mask).to(where)  # beside the samples it scores

    def score_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, tokenizer) -> torch.Tensor:
        """Normalised scores of sequences written in another tokenizer's ids (a policy's rollouts): (B,).

        Each row's unmasked tokens are decoded and re-encoded exactly as in training (`encode_pair`), so
        the RM sees the tokens it was trained on whatever the policy's tokenizer, BOS handling or
        tokenization of sampled text. Every row ends with the RM's EOS: a row that ends with the policy's
        EOS loses it first, a response cut by a stop string or truncated is scored as the same text ending
        there (the RM never saw text that does not end in EOS).
        """
        texts = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.bool().tolist()):
            ids = [t for t, keep in zip(ids, mask) if keep]  # the row without its padding
            finished = bool(ids) and ids[-1] == tokenizer.eos_token_id
            text = tokenizer.decode(ids[:-1] if finished else ids, clean_up_tokenization_spaces=False)
            bos = self.tokenizer.bos_token
            if bos and bos != self.tokenizer.eos_token and text.startswith(bos):
                text = text[len(bos) :]  # the RM tokenizer adds its own BOS
            texts.append(text)
        encoded = encode_pairs(self.tokenizer, texts, [""] * len(texts))  # each ends with the RM's EOS
        rm_ids, rm_mask = pad_right(encoded, self.tokenizer.pad_token_id, device=self.device)
        return self.score(rm_ids, rm_mask).to(input_ids.device)  # beside the samples it scores

    def as_critic(self) -> RewardCritic:
        """A trainable critic initialised from this RM (shares its weights: load a fresh RM for it)."""
        return RewardCritic(self)


class RewardCritic(nn.Module):
    """V(s_t) for every position: the RM's score head on each hidden state, normalised like its scores.
    (B, T) ids and mask -> (B, T) values. The classic critic initialisation from the reward model
    (Ouyang et al. 2022, sec. 3.5). Its token ids must be the RM's (the SFT tokenizer's ids are)."""

    def __init__(self, reward_model: RewardModel):
        super().__init__()
        self.reward_model = reward_model
        for p in self.reward_model.parameters():
            p.requires_grad_(True)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        rm = self.reward_model
        _, head = rm._trunk_and_head()
        hidden = rm.hidden_states(input_ids, attention_mask)  # (B, T, H)
        values = head(hidden).squeeze(-1).float()  # (B, T)
        return (values - rm.mean) / rm.std


def add_pad_token(model, tokenizer) -> None:
    """Give the RM a pad token of its own when it has none or pad == EOS (see the module docstring).
    The new embedding row is set to zero: padded positions are masked, so it is never read."""
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})
    embeddings = model.get_input_embeddings()
    old_rows = embeddings.num_embeddings
    if tokenizer.pad_token_id >= old_rows:  # never shrink: some models carry spare rows
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        with torch.no_grad():
            model.get_input_embeddings().weight[old_rows:] = 0.0
    model.config.pad_token_id = tokenizer.pad_token_id


@contextlib.contextmanager
def _quiet_transformers():
    """Silence the load report that lists `score.weight` as newly initialised (expected from a causal LM)."""
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def load_sequence_classifier(name_or_path: str, *, dtype: str, trust_remote_code: bool, need_head: bool):
    """AutoModelForSequenceClassification with one label, safetensors only. need_head: the score head must
    come from the checkpoint (a trained RM), not be freshly initialised."""
    try:
        with _quiet_transformers():
            model, info = AutoModelForSequenceClassification.from_pretrained(
                name_or_path,
                num_labels=1,
                dtype=torch_dtype(dtype),
                use_safetensors=True,
                trust_remote_code=trust_remote_code,
                output_loading_info=True,
            )
    except (OSError, ValueError, RuntimeError) as e:
        raise UserError(f"cannot load model '{name_or_path}': {str(e).strip().splitlines()[0]}") from None
    if not hasattr(model, "score"):
        raise UserError(
            f"'{name_or_path}': {type(model).__name__} has no `score` head; not a causal-LM architecture"
        )
    if need_head and any(k.startswith("score") for k in info["missing_keys"]):
        raise UserError(
            f"'{name_or_path}' has no trained score head (is it a causal-LM folder?); train one with `llm-rlhf rm`"
        )
    return model


def sequence_classifier_from(model, *, dtype: str):
    """`load_sequence_classifier` for a model already loaded (the Python API): a sequence classifier with one
    label holding a copy of `model`'s weights, built as from the folder it would have been saved to. A causal
    LM drops its LM head and gets a new score head (drawn from the RNG as the folder's load draws it); a
    sequence classifier (a reward model's) keeps its score head. A peft model's adapter is merged into the
    copy. `model` itself is left as it is: the reward model trains its own weights."""
    weights = copy.deepcopy(model)
    if isinstance(weights, PeftModel):
        weights = weights.merge_and_unload()
    config = copy.deepcopy(weights.config)
    config.num_labels = 1  # what `from_pretrained(folder, num_labels=1)` sets
    try:
        model_class = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING[type(config)]
    except KeyError:
        raise UserError(
            f"model: transformers has no sequence-classification class for {type(config).__name__}; give the "
            "model as a folder (model_name_or_path)"
        ) from None
    with _quiet_transformers():  # the load report: lm_head unexpected, score missing (new)
        return model_class.from_pretrained(
            None, config=config, state_dict=weights.state_dict(), dtype=torch_dtype(dtype)
        )


def load_reward_model(
    path: str | os.PathLike, *, dtype: str = "float32", trust_remote_code: bool = False, device=None
) -> RewardModel:
    """A saved RM folder (full model, or a LoRA adapter folder with its score head) as a `RewardModel`
    in eval mode, with the stored normalisation. A LoRA adapter is merged into its base (the SFT folder
    named in adapter_config.json) for speed; the scores are the adapter's."""
    folder = Path(path)
    if not folder.is_dir():
        raise UserError(f"reward model '{path}': no such folder (train one with `llm-rlhf rm`)")
    tokenizer = load_tokenizer(str(folder), trust_remote_code=trust_remote_code)
    if (folder / "adapter_config.json").is_file():
        model = _load_lora_reward_model(folder, tokenizer, dtype=dtype, trust_remote_code=trust_remote_code)
    else:
        model = load_sequence_classifier(
            str(folder), dtype=dtype, trust_remote_code=trust_remote_code, need_head=True
        )
    add_pad_token(model, tokenizer)  # a no-op for our folders; RMs from elsewhere may lack a pad token
    normalization = (
        read_json(folder / NORMALIZATION_FILE) if (folder / NORMALIZATION_FILE).is_file() else None
    )
    reward_model = RewardModel(model, tokenizer, normalization).eval()
    return reward_model.to(device) if device is not None else reward_model


def _load_lora_reward_model(folder: Path, tokenizer, *, dtype: str, trust_remote_code: bool):
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        raise UserError(f"'{folder}': adapter_config.json without adapter_model.safetensors")
    with safe_open(str(weights), "pt") as f:
        if not any(".score." in key or key.startswith("score.") for key in f.keys()):
            raise UserError(
                f"'{folder}': the adapter holds no score head (train with modules_to_save=['score'])"
            )
    base_path = PeftConfig.from_pretrained(str(folder)).base_model_name_or_path
    base = load_sequence_classifier(
        base_path, dtype=dtype, trust_remote_code=trust_remote_code, need_head=False
    )
    add_pad_token(base, tokenizer)  # the same extra (zero) row as in training, before the adapter loads
    return PeftModel.from_pretrained(base, str(folder)).merge_and_unload()


# ---------------------------------------------------------------------------------------------------
# Ensembles of reward models
# ---------------------------------------------------------------------------------------------------


class RewardEnsemble(nn.Module):
    """K frozen reward models that score the same sequences (Coste et al. 2024, reward-model ensembles
    against over-optimisation):

        member_scores[k] = (raw_k(x, y) - mean_k) / std_k     each member normalised with its own statistics
        scores           = reward_math.combine_member_scores(member_scores, combine, uncertainty_coef)

    member_scores(input_ids, attention_mask, tokenizer) -> (K, B); combine((K, B)) -> (B,). The sequences
    are written in `tokenizer`'s ids (a policy's samples); a member that shares that vocabulary reads the
    ids, any other decodes and re-encodes the text its own way (`RewardModel.score_tokens`), so members
    need not share a tokenizer. Attributes: `members` (nn.ModuleList of `RewardModel`), `combine_mode`,
    `uncertainty_coef`, `paths` (the member folders, for the logs).

    Memory: each member is a whole RM held in memory (frozen: no gradients, no optimiser state), loaded
    once per process; in PPO they sit beside the policy, the reference and the value head, so an ensemble
    of K costs K - 1 more reward models than one RM (`dtype` applies to them too).
    """

    def __init__(
        self,
        members: list[RewardModel],
        *,
        combine: str,
        uncertainty_coef: float,
        paths: list[str] | None = None,
    ):
        super().__init__()
        if not members:
            raise ValueError("an ensemble needs at least one member")
        if combine not in reward_math.ENSEMBLE_COMBINES:
            raise ValueError(f"unknown ensemble combine {combine!r}")
        self.members = nn.ModuleList(members)
        self.combine_mode, self.uncertainty_coef = combine, uncertainty_coef
        self.paths = list(paths) if paths is not None else None

    def member_scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, tokenizer) -> torch.Tensor:
        """Normalised scores of every member: (B, T) ids of `tokenizer` and their mask -> (K, B) float32.
        Each member reads every row ending with its own EOS (`RewardModel.score_samples`)."""
        rows = [
            m.score_samples(input_ids, attention_mask, tokenizer).float() for m in self.members
        ]  # (B,) each
        return torch.stack(rows)  # (K, B)

    def combine(self, member_scores: torch.Tensor) -> torch.Tensor:
        """(K, B) -> (B,): `reward_math.combine_member_scores` with this ensemble's mode and lambda."""
        return reward_math.combine_member_scores(
            member_scores=member_scores, combine=self.combine_mode, uncertainty_coef=self.uncertainty_coef
        )


def member_paths(reward_model_path: str | list[str]) -> list[str]:
    """The folders of `reward_model_path`: [path] for one reward model, the list for an ensemble."""
    return [reward_model_path] if isinstance(reward_model_path, str) else list(reward_model_path)


def check_ensemble_keys(cfg) -> None:
    """reward_model_path (one folder or a non-empty list of distinct ones), ensemble_combine and
    ensemble_uncertainty_coef of a PPO or evaluation config: a ConfigError naming the key."""
    path = cfg.reward_model_path
    if isinstance(path, list):
        require(len(path) > 0, "reward_model_path", "an empty list; give one folder or a list of them")
        require(
            all(isinstance(p, str) and p.strip() and p.strip().lower() != "none" for p in path),
            "reward_model_path",
            f"every member of the list must be a folder, got {path}",
        )
        require(len(set(path)) == len(path), "reward_model_path", f"lists a folder twice: {path}")
    require(
        cfg.ensemble_combine in reward_math.ENSEMBLE_COMBINES,
        "ensemble_combine",
        f"must be one of {', '.join(reward_math.ENSEMBLE_COMBINES)}, got {cfg.ensemble_combine!r}",
    )
    require(
        math.isfinite(cfg.ensemble_uncertainty_coef) and cfg.ensemble_uncertainty_coef >= 0,
        "ensemble_uncertainty_coef",
        f"must be a finite number >= 0, got {cfg.ensemble_uncertainty_coef}",
    )


def check_members_exist(reward_model_path: str | list[str]) -> None:
    """Every folder of reward_model_path exists, else a one-line UserError naming the key (and the member)."""
    paths = member_paths(reward_model_path)
    for k, path in enumerate(paths):
        if not Path(path).exists():
            which = f" member {k} " if isinstance(reward_model_path, list) else " "
            raise UserError(
                f"reward_model_path{which}'{path}': no such reward model folder (train one with `llm-rlhf rm`)"
            )


def load_reward_models(
    reward_model_path: str | list[str],
    *,
    combine: str = "mean",
    uncertainty_coef: float = 1.0,
    dtype: str = "float32",
    trust_remote_code: bool = False,
    device=None,
) -> RewardModel | RewardEnsemble:
    """One folder: `load_reward_model`. A list (even of one): a `RewardEnsemble` of its members, each
    loaded by `load_reward_model` (so with its own normalisation), in list order."""
    if isinstance(reward_model_path, str):
        return load_reward_model(
            reward_model_path, dtype=dtype, trust_remote_code=trust_remote_code, device=device
        )
    members = [
        load_reward_model(p, dtype=dtype, trust_remote_code=trust_remote_code, device=device)
        for p in reward_model_path
    ]
    return RewardEnsemble(
        members, combine=combine, uncertainty_coef=uncertainty_coef, paths=reward_model_path
    )


@torch.no_grad()
def score_pairs(
    model: RewardModel,
    prompts: list[str],
    responses: list[str],
    *,
    batch_size: int = 32,
    normalize: bool = True,
    max_length: int | None = None,
    progress: bool | str = False,
) -> torch.Tensor:
    """r(x, y) of each (prompt, response), batched: (N,) float32, in input order, normalised or raw.

    Sequences are sorted by length so each batch pads little. A sequence longer than `max_length`
    (default: the model's maximum positions) keeps its last `max_length` tokens: the score is read at the end.
    """
    tokenizer = model.tokenizer
    config = model.model.config
    limit = (
        max_length or getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    )
    encoded = encode_pairs(tokenizer, prompts, responses)
    if limit:
        encoded = [ids[-limit:] for ids in encoded]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out = torch.empty(len(encoded))
    starts = range(0, len(order), batch_size)
    for start in tqdm(
        starts, desc=progress if isinstance(progress, str) else "scoring", disable=not progress
    ):
        idx = order[start : start + batch_size]
        input_ids, attention_mask = pad_right([encoded[i] for i in idx], tokenizer.pad_token_id, device)
        scores = (
            model.score(input_ids, attention_mask) if normalize else model(input_ids, attention_mask)
        )  # (b,)
        out[idx] = scores.float().cpu()
    model.train(was_training)
    return out


def save_reward_model(reward_model: RewardModel, folder: Path, *, merge_lora: bool) -> None:
    """The model (full folder, or LoRA adapter folder with its score head), tokenizer, normalisation."""
    model, tokenizer = reward_model.model, reward_model.tokenizer
    if hasattr(model, "merge_and_unload") and merge_lora:
        model = model.merge_and_unload()
    if hasattr(model, "peft_config"):
        # The extra pad row is zero and rebuilt by the loader: keep the adapter small.
        model.save_pretrained(folder, safe_serialization=True, save_embedding_layers=False)
    else:
        model.config.pad_token_id = tokenizer.pad_token_id
        if reward_model.normalization:
            model.config.reward_normalization = reward_model.normalization
        model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    if reward_model.normalization:
        atomic_write_json(folder / NORMALIZATION_FILE, reward_model.normalization)
