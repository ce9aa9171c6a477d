"""The verifier of this task folder (written by llm_rlhf.tasks.gym.write_task; see its docstring).

reward_fn: <this folder>/verifier.py:reward       score_answer of the extracted answer, 0..1
accuracy_fn: <this folder>/verifier.py:accuracy   1.0 where that score is 1.0, else 0.0
"""

from pathlib import Path

from llm_rlhf.tasks.gym import load_verifiers

reward, accuracy = load_verifiers(Path(__file__).resolve().parent)
