"""Learning test: the PPO math of `llm_rlhf.rl.ppo_math` trains an actor-critic to balance CartPole.

The unit tests pin each equation; this one checks that together they learn. Episodes are laid out
exactly like RLHF responses: a (B, T) batch, one episode per row, `response_mask` True on its steps
and padding after it, and the same `logprobs_from_logits`, `compute_gae`, `masked_whiten`,
`policy_loss`, `value_loss` and `entropy_from_logits` calls as the PPO stage makes.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from llm_rlhf.rl.ppo_math import compute_gae, masked_mean, masked_whiten, policy_loss, value_loss
from llm_rlhf.rl.token_math import entropy_from_logits, logprobs_from_logits

# CartPole-v1 of gym (Barto, Sutton & Anderson 1983), explicit Euler integration.
GRAVITY, MASSCART, MASSPOLE = 9.8, 1.0, 0.1
TOTAL_MASS = MASSCART + MASSPOLE
LENGTH = 0.5  # half the pole's length
POLEMASS_LENGTH = MASSPOLE * LENGTH
FORCE_MAG, TAU = 10.0, 0.02
THETA_LIMIT = 12 * 2 * math.pi / 360
X_LIMIT = 2.4
MAX_STEPS = 500

# PPO hyperparameters (cleanrl `ppo.py` for CartPole, with one full episode per row).
N_EPISODES = 16
GAMMA, LAM = 0.99, 0.95
CLIPRANGE, CLIPRANGE_VALUE = 0.2, 0.2
VF_COEF, ENT_COEF = 0.5, 0.01
EPOCHS, MINIBATCH_EPISODES = 4, 4
LR, MAX_GRAD_NORM = 2.5e-3, 0.5
# One step of reward is 1; the agent sees it scaled by (1 - gamma) so returns stay in [0, 1], the
# scale the value head sees in RLHF with normalised scores (and the scale cliprange_value suits).
REWARD_SCALE = 1 - GAMMA


def cartpole_reset(n: int, generator: torch.Generator) -> torch.Tensor:
    """(n, 4) states (x, x_dot, theta, theta_dot), each uniform in [-0.05, 0.05]."""
    return torch.empty(n, 4).uniform_(-0.05, 0.05, generator=generator)


def cartpole_step(state: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of n carts: state (n, 4), action (n,) in {0: push left, 1: push right}.
    Returns (next state (n, 4), terminated (n,) bool)."""
    x, x_dot, theta, theta_dot = state.unbind(dim=-1)  # each (n,)
    force = torch.where(action == 1, FORCE_MAG, -FORCE_MAG)
    cos, sin = torch.cos(theta), torch.sin(theta)
    temp = (force + POLEMASS_LENGTH * theta_dot**2 * sin) / TOTAL_MASS
    theta_acc = (GRAVITY * sin - cos * temp) / (LENGTH * (4.0 / 3.0 - MASSPOLE * cos**2 / TOTAL_MASS))
    x_acc = temp - POLEMASS_LENGTH * theta_acc * cos / TOTAL_MASS
    x, x_dot = x + TAU * x_dot, x_dot + TAU * x_acc
    theta, theta_dot = theta + TAU * theta_dot, theta_dot + TAU * theta_acc
    terminated = (x.abs() > X_LIMIT) | (theta.abs() > THETA_LIMIT)
    return torch.stack([x, x_dot, theta, theta_dot], dim=-1), terminated


def test_cartpole_dynamics_match_gym_for_one_step():
    """Hand-computed first step from the upright rest state, pushing right (gym CartPole-v1)."""
    next_state, terminated = cartpole_step(torch.zeros(1, 4), torch.tensor([1]))
    temp = FORCE_MAG / TOTAL_MASS
    theta_acc = -temp / (LENGTH * (4.0 / 3.0 - MASSPOLE / TOTAL_MASS))
    x_acc = temp - POLEMASS_LENGTH * theta_acc / TOTAL_MASS
    torch.testing.assert_close(next_state, torch.tensor([[0.0, TAU * x_acc, 0.0, TAU * theta_acc]]))
    assert not terminated.item()
    _, fell = cartpole_step(torch.tensor([[0.0, 0.0, 0.21, 0.0], [2.4, 1.0, 0.0, 0.0]]), torch.tensor([1, 1]))
    assert fell.tolist() == [True, True]


class ActorCritic(nn.Module):
    """Separate actor and critic MLPs, 4 -> 64 -> 64 -> (2 logits | 1 value), as in cleanrl."""

    def __init__(self, hidden: int = 64):
        super().__init__()
        self.actor = nn.Sequential(
            nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 2)
        )
        self.critic = nn.Sequential(
            nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 1)
        )
        for layer in [*self.actor, *self.critic]:
            if isinstance(layer, nn.Linear):
                nn.init.orthogonal_(layer.weight, math.sqrt(2))
                nn.init.zeros_(layer.bias)
        nn.init.orthogonal_(self.actor[-1].weight, 0.01)  # near-uniform initial policy
        nn.init.orthogonal_(self.critic[-1].weight, 1.0)

    def forward(self, observations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """observations (..., 4) -> (logits (..., 2), values (...))."""
        return self.actor(observations), self.critic(observations).squeeze(-1)


@torch.no_grad()
def rollout(model: ActorCritic, n_episodes: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Play n_episodes episodes in parallel until all have ended or MAX_STEPS passed.

    Returns (B, T) tensors with T the longest episode; row b is laid out `step step ... step pad pad`
    like a right-padded response: observations (B, T, 4), actions, response_mask; plus truncated (B,)
    (still balancing after MAX_STEPS) and final_values (B,) = V(s_T) to bootstrap those rows.
    """
    state = cartpole_reset(n_episodes, generator)  # (B, 4)
    alive = torch.ones(n_episodes, dtype=torch.bool)  # (B,)
    observations, actions, masks = [], [], []
    for _ in range(MAX_STEPS):
        logits, _ = model(state)  # (B, 2)
        action = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).squeeze(-1)  # (B,)
        observations.append(state)
        actions.append(action)
        masks.append(alive)
        next_state, terminated = cartpole_step(state, action)
        state = torch.where(alive.unsqueeze(-1), next_state, state)  # ended carts stay put
        alive = alive & ~terminated
        if not alive.any():
            break
    return {
        "observations": torch.stack(observations, dim=1),  # (B, T, 4)
        "actions": torch.stack(actions, dim=1),  # (B, T)
        "response_mask": torch.stack(masks, dim=1),  # (B, T)
        "truncated": alive,  # (B,)
        "final_values": model(state)[1],  # (B,)
    }


@torch.no_grad()
def advantages_and_returns(model: ActorCritic, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Old log-probs and values by the same code path as the update, then GAE as in RLHF."""
    mask = batch["response_mask"]  # (B, T)
    logits, values = model(batch["observations"])  # (B, T, 2), (B, T)
    logprobs = logprobs_from_logits(logits=logits, labels=batch["actions"])  # (B, T)
    rewards = torch.where(mask, REWARD_SCALE, 0.0)  # (B, T) one (scaled) reward per step
    # A truncated episode did not end: bootstrap with gamma * V(s_T) at its last step, since
    # compute_gae takes the value after the last masked step as 0 (right for a pole that fell).
    last = mask.sum(dim=-1) - 1  # (B,) index of each episode's last step
    rows = torch.arange(mask.shape[0])
    rewards[rows, last] += GAMMA * batch["final_values"] * batch["truncated"]
    advantages, returns = compute_gae(
        rewards=rewards, values=values, response_mask=mask, gamma=GAMMA, lam=LAM
    )
    return {
        "old_logprobs": logprobs,
        "old_values": values,
        "advantages": masked_whiten(advantages, mask),
        "returns": returns,
    }


def ppo_update(model, optimizer, batch, generator) -> None:
    """EPOCHS passes over shuffled minibatches of whole episodes (rows), as the PPO stage does."""
    n_episodes = batch["response_mask"].shape[0]
    for _ in range(EPOCHS):
        for rows in torch.randperm(n_episodes, generator=generator).split(MINIBATCH_EPISODES):
            mb = {key: value[rows] for key, value in batch.items()}
            mask = mb["response_mask"]  # (b, T)
            logits, values = model(mb["observations"])  # (b, T, 2), (b, T)
            logprobs = logprobs_from_logits(logits=logits, labels=mb["actions"])  # (b, T)
            pg_loss, _ = policy_loss(
                logprobs=logprobs,
                old_logprobs=mb["old_logprobs"],
                advantages=mb["advantages"],
                response_mask=mask,
                cliprange=CLIPRANGE,
            )
            vf_loss, _ = value_loss(
                values=values,
                old_values=mb["old_values"],
                returns=mb["returns"],
                response_mask=mask,
                cliprange_value=CLIPRANGE_VALUE,
            )
            entropy = masked_mean(entropy_from_logits(logits=logits), mask)
            loss = pg_loss + VF_COEF * vf_loss - ENT_COEF * entropy
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
            optimizer.step()


@pytest.mark.slow
def test_ppo_balances_cartpole():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only add overhead
    try:
        torch.manual_seed(0)
        generator = torch.Generator().manual_seed(0)
        model = ActorCritic()
        optimizer = torch.optim.Adam(model.parameters(), lr=LR, eps=1e-5)
        lengths = []
        for _ in range(60):
            batch = rollout(model, N_EPISODES, generator)
            lengths.append(batch["response_mask"].sum(dim=-1).float().mean().item())
            if lengths[-1] >= 450:
                break
            batch.update(advantages_and_returns(model, batch))
            ppo_update(model, optimizer, batch, generator)

        evaluation = rollout(model, 32, generator)
        mean_length = evaluation["response_mask"].sum(dim=-1).float().mean().item()
    finally:
        torch.set_num_threads(threads)
    assert mean_length >= 195, f"mean episode length {mean_length:.1f}; training means {lengths}"
