"""A sweep's seeds table for a README: held-out accuracy against steps, responses, KL and seconds.

    python data/seed_table.py runs/gym-chain_sum-t2d1-losses [MORE_SWEEP_FOLDERS] \\
        [--kl K] [--seconds S] [--responses R]

Reads the same files and groups the same runs as the report's seeds section (`llm_rlhf/interfaces/report/seeds.py`:
runs whose PPO configs differ only by seed are a group, named by their folder's stem, "gspo" for gspo-seed0, ...)
and prints one markdown row per group: the sampled held-out accuracy at each shared held-out step, the greedy one,
each pass@k the evaluations logged (eval_pass_at_k) and the held-out KL at the last, the accuracy read at KL K, at S PPO wall seconds and at R responses sampled (dynamic sampling's discarded
groups count; linear between held-out evaluations; K, S and R default to the lowest last-step KL, the shortest
PPO wall time and the fewest responses of any run, so every run is read where all of them have been),
seconds a step, PPO's wall seconds, the responses sampled, and the share of groups of equal rewards
(`objective/groups_tied`, the mean over steps; "-" for estimators without groups). Each cell is the mean ± the
standard error over the seeds (sd with n - 1, over sqrt n); the last-step sampled accuracy also each seed's value.
Then each group's difference from the best last-step sampled accuracy, with the standard errors combined.
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from llm_rlhf.interfaces.report.evaluation import pass_at_logged
from llm_rlhf.interfaces.report.runs import find_runs, load_run
from llm_rlhf.interfaces.report.seeds import group_evaluations, group_labels, seed_groups, seed_mean_stderr
from llm_rlhf.ppo import metrics as ppo_metrics


def read_at(x, y, at: float) -> float:
    """y read at x = at, linear between the points (x ascending, (N,) each); NaN outside [x_0, x_N-1].

    y(at) = y_i + (y_i+1 - y_i) * (at - x_i) / (x_i+1 - x_i)   for x_i <= at <= x_i+1"""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if not len(x) or at < x[0] or at > x[-1]:
        return math.nan
    return float(np.interp(at, x, y))


def mean_se(values, spec: str = ".3f", seeds: bool = False) -> str:
    x = np.asarray(values, dtype=float)[:, None]  # (S, 1)
    if not np.isfinite(x).all():  # a seed without the number (outside its range, an older log)
        return "-"
    mean, se = (float(v[0]) for v in seed_mean_stderr(x))
    text = format(mean, spec) + ("" if math.isnan(se) else f" ± {format(se, spec)}")
    return text + (" (" + ", ".join(format(v, spec) for v in x[:, 0]) + ")" if seeds else "")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folders", nargs="+", help="sweep folders (each run a subfolder with ppo/)")
    parser.add_argument("--kl", type=float, default=None, help="read every group's accuracy at this KL")
    parser.add_argument("--seconds", type=float, default=None, help="... and at these PPO wall seconds")
    parser.add_argument("--responses", type=float, default=None, help="... and at these responses sampled")
    args = parser.parse_args()
    runs = [load_run(path) for folder in args.folders for path in find_runs(folder)]
    groups = seed_groups([run for run in runs if run.eval_log and run.metrics.get("ppo")])  # finished runs
    labels = group_labels(groups)
    sampled = [group_evaluations(g, "accuracy") for g in groups]
    greedy = [group_evaluations(g, "accuracy_greedy") for g in groups]
    logs = [line for g in groups for run in g for line in run.eval_log]
    passes = {k: [group_evaluations(g, key) for g in groups] for k, (key, _) in pass_at_logged(logs)}
    steps = sorted(set.intersection(*(set(ev["step"].tolist()) for ev in sampled)))
    kl = args.kl if args.kl is not None else min(float(np.nanmin(ev["kl"][:, -1])) for ev in sampled)
    seconds = (
        args.seconds
        if args.seconds is not None
        else min(float(np.nanmin(ev["seconds"][:, -1])) for ev in sampled)
    )
    responses = (
        args.responses
        if args.responses is not None
        else min(float(np.nanmin(ev["responses"][:, -1])) for ev in sampled)
    )
    head = [f"sampled, step {s:g}" for s in steps[1:]]
    print(
        "| run | seeds | "
        + " | ".join(head)
        + f" | greedy, step {steps[-1]:g} | "
        + "".join(f"pass@{k}, step {steps[-1]:g} | " for k in passes)
        + f"KL, step {steps[-1]:g} | sampled at KL {kl:.3g} | s a step | PPO wall s"
        + f" | sampled at {seconds:.0f} s | responses sampled | sampled at {responses:.0f} sampled"
        + " | groups with no signal |"
    )
    print("|---|---|" + "---:|" * (len(head) + len(passes) + 9))
    finals = []
    for g, (group, label, ev, ev_greedy) in enumerate(zip(groups, labels, sampled, greedy)):
        at = [int(np.flatnonzero(ev["step"] == s)[0]) for s in steps[1:]]
        last = at[-1]
        finals.append(ev["accuracy"][:, last])
        history = [run.ppo_history or [] for run in group]
        step_s = [np.mean([r[ppo_metrics.TIME_STEP] for r in h]) for h in history]
        tied = [np.mean([r.get(ppo_metrics.OBJECTIVE_GROUPS_TIED, math.nan) for r in h]) for h in history]
        cells = [mean_se(ev["accuracy"][:, i], seeds=i == last) for i in at]
        cells[-1] = f"**{cells[-1]}**"
        cells.append(mean_se(ev_greedy["accuracy"][:, np.flatnonzero(ev_greedy["step"] == steps[-1])[0]]))
        for evs in passes.values():  # pass@k at the last step ("-" where a seed did not log it there)
            at_last = np.flatnonzero(evs[g]["step"] == steps[-1])
            cells.append(mean_se(evs[g]["accuracy"][:, at_last[0]]) if len(at_last) else "-")
        cells += [
            mean_se(ev["kl"][:, last], ".2f"),
            mean_se([read_at(ev["kl"][i], ev["accuracy"][i], kl) for i in range(len(group))]),
            mean_se(step_s, ".1f"),
            mean_se(ev["seconds"][:, last], ".0f"),
            mean_se([read_at(ev["seconds"][i], ev["accuracy"][i], seconds) for i in range(len(group))]),
            mean_se(ev["responses"][:, last], ".0f"),
            mean_se([read_at(ev["responses"][i], ev["accuracy"][i], responses) for i in range(len(group))]),
            mean_se(tied, ".2f"),
        ]
        seeds = ", ".join(str(run.name.rsplit("seed", 1)[-1]) for run in group)
        print(f"| `{label}` | {seeds} | " + " | ".join(cells) + " |")
    best = int(np.argmax([np.mean(f) for f in finals]))
    print()
    for i, (label, final) in enumerate(zip(labels, finals)):
        if i == best:
            continue
        diff = float(np.mean(finals[best]) - np.mean(final))
        se = math.sqrt(
            sum(float(seed_mean_stderr(np.asarray(f)[:, None])[1][0]) ** 2 for f in (finals[best], final))
        )
        resolved = (
            "one seed: no standard error"
            if math.isnan(se)
            else ("" if abs(diff) > 2 * se else "not ") + "resolved at 2 se"
        )
        print(f"- {labels[best]} - {label}: {diff:+.3f} ± {se:.3f} ({resolved})")


if __name__ == "__main__":
    main()
