"""The stages, one command each (sft, rm, dpo, ppo, eval, compare, score, judge). Import the floors below."""
