"""Do the fast tests see an unmasked environment token? Each mutation below lets the environment's tokens of
an episode into one place of PPO (a loss term, the advantages, the controller's KL, a metric, a count, the
reward function's text) or re-tokenizes a turn's context; the script applies it to a copy of the package,
runs the fast episode tests against the copy and reports whether they failed (caught) or passed (missed).

    python benchmarks/unmasking_mutations.py                 # every mutation
    python benchmarks/unmasking_mutations.py --only policy KL   # those whose name contains "policy" or "KL"

Each mutation is a (file, text, replacement) that must occur exactly once in the file, so a refactor that
moves the code makes the script stop with the mutation's name rather than report a mutation never applied.
Prints one line per mutation and a markdown table; exits 1 if any mutation was missed.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ["tests/rl/test_episodes.py", "tests/rl/test_misbehaving_environments.py"]

UPDATE, TRAINER, SCORING = "llm_rlhf/ppo/update.py", "llm_rlhf/ppo/trainer.py", "llm_rlhf/models/scoring.py"
MEASURES, EPISODES = "llm_rlhf/evaluation/measures.py", "llm_rlhf/rl/episodes.py"
MUTATIONS = [
    # the update's loss terms, one at a time (part: the micro-batch's rows; tokens_mask = policy | environment)
    (
        "policy loss",
        UPDATE,
        "advantages=advantages[mc],\n                    mask=mask,",
        "advantages=advantages[mc],\n                    mask=part.tokens_mask,",
    ),
    (
        "value loss",
        UPDATE,
        "response_mask=mask,\n                cliprange_value",
        "response_mask=part.tokens_mask,\n                cliprange_value",
    ),
    (
        "entropy bonus",
        UPDATE,
        "entropy = ppo_math.masked_mean(entropy, mask)",
        "entropy = ppo_math.masked_mean(entropy, part.tokens_mask)",
    ),
    (
        "KL in the loss",
        UPDATE,
        "ref_logprobs=part.ref_logprobs,\n                response_mask=mask,",
        "ref_logprobs=part.ref_logprobs,\n                response_mask=part.tokens_mask,",
    ),
    (
        "every loss term (the loss mask)",
        UPDATE,
        "            return rollout.response_mask\n",
        "            return rollout.tokens_mask\n",
    ),
    (
        "micro-batch token weight",
        UPDATE,
        "weight = mask.sum() * processes",
        "weight = part.tokens_mask.sum() * processes",
    ),
    # the rewards, advantages and controller
    (
        "KL penalty in the rewards",
        TRAINER,
        "response_mask=rollout.response_mask,\n            eos_penalty",
        "response_mask=rollout.tokens_mask,\n            eos_penalty",
    ),
    (
        "environment rewards placed",
        TRAINER,
        "torch.where(rollout.response_mask, rollout.env_rewards, 0.0)",
        "torch.where(rollout.tokens_mask, rollout.env_rewards, 0.0)",
    ),
    (
        "reward whitening",
        TRAINER,
        "self.whiten(rewards, rollout.response_mask, shift_mean=False)",
        "self.whiten(rewards, rollout.tokens_mask, shift_mean=False)",
    ),
    (
        "advantages (every estimator)",
        TRAINER,
        "response_mask=rollout.response_mask,\n            values=",
        "response_mask=rollout.tokens_mask,\n            values=",
    ),
    # not here: ReMax's baseline sums the greedy rewards, which `rewards` already zeroed off the policy's tokens
    # (so any mask that covers them sums the same: an equivalent mutant)
    (
        "controller's KL",
        TRAINER,
        "kl_seq = ppo_math.sequence_kl(kl=kl, response_mask=rollout.response_mask)",
        "kl_seq = ppo_math.sequence_kl(kl=kl, response_mask=rollout.tokens_mask)",
    ),
    # the step's metrics and counts
    (
        "step metrics (KL, lengths, entropy)",
        TRAINER,
        "mask = rollout.response_mask\n        lengths = mask.sum(-1).float()",
        "mask = rollout.tokens_mask\n        lengths = mask.sum(-1).float()",
    ),
    (
        "value metrics",
        TRAINER,
        "mask = rollout.response_mask\n        return {",
        "mask = rollout.tokens_mask\n        return {",
    ),
    (
        "sampler KL metric",
        TRAINER,
        "rollout.sampler_logprobs - rollout.logprobs, rollout.response_mask",
        "rollout.sampler_logprobs - rollout.logprobs, rollout.tokens_mask",
    ),
    # what the scorers read
    (
        "reward function's text",
        SCORING,
        "samples.response, samples.response_mask\n",
        "samples.response, samples.tokens_mask\n",
    ),
    (
        "group scores metric",
        TRAINER,
        "ppo_math.masked_sum(rollout.env_rewards, rollout.response_mask, dim=-1)",
        "rollout.env_rewards.sum(-1)",
    ),
    (
        "evaluation's KL",
        MEASURES,
        "out.append(ppo_math.sequence_kl(kl=kl, response_mask=batch.response_mask))",
        "out.append(ppo_math.sequence_kl(kl=kl, response_mask=batch.tokens_mask))",
    ),
    (
        "evaluation's lengths",
        MEASURES,
        '"length": int(batch.response_mask[i].sum()),',
        '"length": int(batch.tokens_mask[i].sum()),',
    ),
    # the ids: a turn's context decoded and encoded again instead of the sampled and encoded pieces
    (
        "a turn's context re-tokenized",
        EPISODES,
        "contexts = [list(queries[i]) + episodes[i].ids() for i in rows]",
        "contexts = [list(queries[i]) + tokenizer(tokenizer.decode(episodes[i].ids()), add_special_tokens=False)"
        '["input_ids"] for i in rows]',
    ),
]


def apply(copy: Path, name: str, path: str, text: str, replacement: str) -> None:
    file = copy / path
    source = file.read_text()
    if source.count(text) != 1:
        sys.exit(f"mutation {name!r}: its text occurs {source.count(text)} times in {path}, not once")
    file.write_text(source.replace(text, replacement))


def run_tests(copy: Path) -> tuple[bool, float, str]:
    """(caught, seconds, the first failing test) of the fast episode tests against the package in `copy`."""
    t = time.perf_counter()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            "-m",
            "not slow and not multiprocess",
            *TESTS,
        ],
        cwd=copy,
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "PYTHONPATH": str(copy)},
    )
    failed = next((x for x in out.stdout.splitlines() if x.startswith("FAILED")), "")
    return out.returncode != 0, time.perf_counter() - t, failed


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--only", nargs="*", default=[""], help="run the mutations whose name contains one of these"
    )
    parser.add_argument("--unmutated", action="store_true", help="first check that the tests pass unmutated")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "repo"
        copy.mkdir()
        for name in ("llm_rlhf", "tests"):
            shutil.copytree(ROOT / name, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
        for name in (
            "data",
            "recipes",
            "benchmarks",
            "accelerate_configs",
            "docs",
            "mkdocs.yml",
            "README.md",
        ):
            (copy / name).symlink_to(ROOT / name)
        pristine = {p: (copy / p).read_text() for p in {m[1] for m in MUTATIONS}}
        if args.unmutated:
            caught, seconds, failed = run_tests(copy)
            print(f"unmutated: {'FAILED ' + failed if caught else 'passed'} ({seconds:.0f} s)", flush=True)
            if caught:
                return 1
        for name, path, text, replacement in MUTATIONS:
            if not any(text in name for text in args.only):
                continue
            apply(copy, name, path, text, replacement)
            caught, seconds, failed = run_tests(copy)
            (copy / path).write_text(pristine[path])
            rows.append((name, path, caught, failed.removeprefix("FAILED ").split(" - ")[0]))
            print(
                f"{name}: {'caught by ' + rows[-1][3] if caught else 'MISSED'} ({seconds:.0f} s)", flush=True
            )
    print("\n| unmasked at | file | caught by |\n|---|---|---|")
    for name, path, caught, failed in rows:
        print(f"| {name} | `{path}` | {'`' + failed + '`' if caught else '**missed**'} |")
    return 0 if all(r[2] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
