"""The math and sampling: the pure PPO/estimator math (`ppo_math`), the estimator table, the sampler, text
checks for the hacking watch. Imports only `core` (and torch/transformers)."""
