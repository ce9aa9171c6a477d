"""`llm-rlhf report DIR`: one self-contained report.html per pipeline run, rebuilt from its logs.

    llm-rlhf report runs/reviews          # one run: DIR/report.html and DIR/report/*.png
    llm-rlhf report runs/kl_sweep         # sub-folders that are runs: compared side by side

A run folder is recognised by `pipeline.json`. The HTML embeds every plot as a base64 PNG and has
no external CSS or JS, so it opens offline in any browser; the same PNGs are written to
DIR/report/. What the report reads (any of it may be missing: that section says so and is skipped):

    DIR/pipeline.json, DIR/pipeline_config.yaml, DIR/<stage>/config.yaml, DIR/<stage>/metrics.json
    DIR/sft/train_log.json   (or log.jsonl)   HF Trainer log history: SFT train / eval loss
    DIR/rm/train_log.json    (or log.jsonl)   RM loss, accuracy and margin
    DIR/ppo/metrics.jsonl    one line per PPO step;   DIR/ppo/samples.jsonl   logged responses
    DIR/ppo/eval_log.jsonl   held-out kl, rm_score, gold_score during PPO (the over-optimisation curve), the
                             degeneracy rates (`llm_rlhf.evaluation.hacking`) and, on a task with a verifier, accuracy
                             (sampled and greedy, with standard errors): accuracy against step and KL
    DIR/ppo/eval_samples.jsonl   each held-out sample's proxy and gold score (the reward-hacking watch)
    DIR/eval/metrics.json, DIR/eval/samples.jsonl    final policy vs baseline (SFT; the starting model of a
                             run without an SFT stage); with a verifier, held-out accuracy and each sample's
                             correctness
    DIR/compare/points.jsonl, DIR/compare/metrics.json   PPO, DPO and best-of-n: gold against KL (optional)

When DIR holds several runs, DIR/report.html overlays their PPO curves (legend = folder name),
tabulates their headline metrics and the config keys in which they differ, and draws gold and
proxy reward against KL for each, so one sees what the KL penalty buys, and, with a verifier, every run's
held-out accuracy against step and KL (a sweep of estimators, or of seeds: one curve per run), then the runs
that differ only by their seed averaged (`seeds`: final accuracy and KL, mean ± standard error over the seeds,
and the mean accuracy against responses sampled, KL and wall seconds); each run gets its own report.html as well. A stage that pipeline_config.yaml's `stages` leaves out (PPO
straight from an instruct model: `stages: [ppo, eval]`) gets one line saying so, and its files are not
missing. matplotlib is imported only here (an optional dependency of the core).
"""

from __future__ import annotations

import sys
from pathlib import Path

from llm_rlhf.core.utils import atomic_write_text
from llm_rlhf.interfaces.report.compare_page import build_compare_page
from llm_rlhf.interfaces.report.figures import plot_style
from llm_rlhf.interfaces.report.page import Page
from llm_rlhf.interfaces.report.run_page import build_run_page
from llm_rlhf.interfaces.report.runs import Run, find_runs, load_run, looks_like_run, parse_jsonl

# the entry points: write a report; read a run as the report does
__all__ = ["Run", "cli", "find_runs", "load_run", "parse_jsonl", "write_report"]


def write_report(run_dir: str | Path) -> Path:
    """Write run_dir/report.html (self-contained) and run_dir/report/*.png; return the HTML path.

    run_dir is one pipeline run, or a folder whose sub-folders are runs: then each run gets its own
    report and run_dir/report.html compares them."""
    folder = Path(run_dir)
    runs = find_runs(folder)
    with plot_style():
        if len(runs) > 1 or (runs and runs[0] != folder):
            loaded = []
            for path in runs:
                run = load_run(path, name=path.relative_to(folder).as_posix())
                _write(build_run_page(run, path / "report"), path / "report.html", f"RLHF run {run.name}")
                loaded.append(run)
            page = build_compare_page(loaded, folder, folder / "report")
            title = f"RLHF runs: {folder.resolve().name}"
        else:
            run = load_run(folder)
            page, title = build_run_page(run, folder / "report"), f"RLHF run {run.name}"
    return _write(page, folder / "report.html", title)


def _write(page: Page, path: Path, title: str) -> Path:
    atomic_write_text(path, page.html(title))
    return path


def cli(argv: list[str]) -> int:
    """`llm-rlhf report DIR`: rebuild DIR/report.html from the logs in DIR."""
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    if len(argv) != 1:
        print(
            "error: usage: llm-rlhf report DIR (a pipeline run folder, or a folder of runs)", file=sys.stderr
        )
        return 2
    folder = Path(argv[0])
    if not folder.is_dir():
        print(f"error: report folder '{folder}' does not exist", file=sys.stderr)
        return 2
    if not find_runs(folder) and not looks_like_run(folder):
        print(
            f"error: '{folder}' holds no pipeline run (no pipeline.json in it or below it)", file=sys.stderr
        )
        return 2
    print(f"report: {write_report(folder)}")
    return 0
