"""llm_rlhf: the classic RLHF pipeline (SFT -> reward model -> PPO) on Hugging Face libraries."""

__version__ = "0.1.0"
