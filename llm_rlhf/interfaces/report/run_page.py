"""One run's page: the headline cards, then its sections in order."""

from __future__ import annotations

import html
from pathlib import Path

from llm_rlhf.interfaces.report.cards import headline_cards
from llm_rlhf.interfaces.report.evaluation import section_eval
from llm_rlhf.interfaces.report.hacking_watch import section_hacking
from llm_rlhf.interfaces.report.methods import section_methods
from llm_rlhf.interfaces.report.page import Page, page_header
from llm_rlhf.interfaces.report.ppo_curves import section_ppo
from llm_rlhf.interfaces.report.runs import Run
from llm_rlhf.interfaces.report.sft_rm import section_rm, section_sft


def section_configs(page: Page, run: Run) -> None:
    page.add('<h2 id="configs">Resolved configs</h2>')
    if not run.configs:
        page.missing("Missing: pipeline_config.yaml and every <stage>/config.yaml.")
    for rel, text in run.configs.items():
        page.add(f"<details><summary>{html.escape(rel)}</summary><pre>{html.escape(text)}</pre></details>")


def build_run_page(run: Run, png_dir: Path) -> Page:
    page = Page(png_dir)
    page_header(page, f"RLHF run: {run.name}", run.path)
    page.add(headline_cards(run))
    page.add(
        '<nav><a href="#sft">SFT</a><a href="#rm">Reward model</a><a href="#ppo">PPO</a>'
        '<a href="#eval">Evaluation</a><a href="#hacking">Reward-hacking watch</a><a href="#configs">Configs</a></nav>'
    )
    if run.missing:
        page.missing("Not found in this run folder: " + ", ".join(run.missing))
    for section in (
        section_sft,
        section_rm,
        section_ppo,
        section_eval,
        section_hacking,
        section_methods,
        section_configs,
    ):
        section(page, run)
    return page
