"""The HTML page: `Page` (the parts and the PNGs it embeds), the stylesheet, tables and cells, the notes a
section writes when its stage is missing or not part of the run.
"""

from __future__ import annotations

import base64
import html
import json
import math
import time
from pathlib import Path
from typing import Any

from llm_rlhf.interfaces.report.figures import png_bytes
from llm_rlhf.interfaces.report.numbers import num
from llm_rlhf.interfaces.report.runs import Run, config_value, planned, without_reward_model


def fmt(value: Any) -> str:
    """A table cell: 4 significant digits for floats, escaped text otherwise."""
    if value is None:
        return "–"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    if isinstance(value, (dict, list)):
        value = json.dumps(value)
    return html.escape(str(value))


CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 2em auto;
       max-width: 1400px; padding: 0 1em; color: #222; line-height: 1.4; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 2px solid #ddd; padding-bottom: 0.2em; margin-top: 2em; }
.meta { color: #666; margin-top: 0; }
.cards { display: flex; flex-wrap: wrap; gap: 0.8em; margin: 1em 0; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: 0.6em 1em; min-width: 11em; background: #fafafa; }
.card .label { font-size: 0.8em; color: #666; text-transform: uppercase; letter-spacing: 0.03em; }
.card .value { font-size: 1.35em; font-weight: 600; }
.card .sub { font-size: 0.8em; color: #666; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 0.3em 0.6em; text-align: left; vertical-align: top; }
th { background: #f0f0f0; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
td { overflow-wrap: anywhere; } td.num { overflow-wrap: normal; white-space: nowrap; }
tr.group th { background: #e9eef5; font-weight: 600; }
.key { display: block; color: #888; font-size: 0.8em; font-family: ui-monospace, monospace; }
table.eval td:first-child { min-width: 12em; }
table.texts { width: 100%; table-layout: fixed; }
table.texts td { white-space: pre-wrap; }
table.pairs th { width: 50%; } tr.prompt td { background: #f7f7f7; font-style: italic; }
table.ppo-samples th:nth-child(1) { width: 30%; } table.ppo-samples th:nth-child(3) { width: 6em; }
table.watch tr:first-child th:nth-child(-n+3) { width: 5.5em; }
table.runs td:nth-child(-n+2) { white-space: nowrap; overflow-wrap: normal; }
.wide { overflow-x: auto; }
.scores { display: block; color: #666; font-size: 0.85em; margin-top: 0.3em; white-space: normal; }
.prompt-text { color: #777; } .empty { color: #999; font-style: italic; }
.ok { color: #1a7f37; font-weight: 600; } .wrong { color: #b42318; font-weight: 600; }
.turn { display: block; } .turn.environment { color: #555; background: #eef3f8; font-family: ui-monospace, monospace;
  font-size: 0.9em; } .turn .who { color: #888; font-size: 0.75em; font-family: ui-monospace, monospace; }
.greedy { display: block; margin-top: 0.4em; padding-top: 0.3em; border-top: 1px dashed #ddd; }
.flag { color: #a15c00; background: #fff0d9; border-radius: 3px; padding: 0 0.3em; font-size: 0.8em;
        white-space: nowrap; }
img { max-width: 100%; height: auto; border: 1px solid #eee; }
figure { margin: 1em 0; } figcaption { color: #666; font-size: 0.85em; }
.note { color: #555; }
.missing { color: #a15c00; background: #fff6e5; border-left: 4px solid #f0a020; padding: 0.4em 0.8em; }
.alarm { color: #7a1a12; background: #fdecea; border-left: 4px solid #b42318; padding: 0.4em 0.8em; }
.quiet { color: #1a5c2e; background: #eef8f0; border-left: 4px solid #1a7f37; padding: 0.4em 0.8em; }
details { margin: 0.4em 0; } summary { cursor: pointer; font-weight: 600; }
pre { background: #f6f8fa; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
nav a { margin-right: 1em; }
"""


class Page:
    """A report page being built: HTML parts plus the PNGs it embeds (also written to `png_dir`)."""

    def __init__(self, png_dir: Path):
        self.parts: list[str] = []
        self.png_dir = png_dir
        self.pngs: list[Path] = []

    def add(self, *parts: str) -> None:
        self.parts.extend(parts)

    def figure(self, fig, name: str, alt: str, caption: str = "") -> None:
        data = png_bytes(fig)
        self.png_dir.mkdir(parents=True, exist_ok=True)
        path = self.png_dir / f"{name}.png"
        path.write_bytes(data)
        self.pngs.append(path)
        encoded = base64.b64encode(data).decode("ascii")
        cap = f"<figcaption>{html.escape(caption)}</figcaption>" if caption else ""
        self.add(
            f'<figure><img alt="{html.escape(alt)}" src="data:image/png;base64,{encoded}">{cap}</figure>'
        )

    def missing(self, text: str) -> None:
        self.add(f'<p class="missing">{html.escape(text)}</p>')

    def html(self, title: str) -> str:
        head = (
            '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{html.escape(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n"
        )
        return head + "\n".join(self.parts) + "\n</body>\n</html>\n"


def table(header: list[str], rows: list[list[Any]], css_class: str = "") -> str:
    """Cells are formatted with `fmt` unless already a `Raw` HTML string; numbers right-aligned."""

    def cell(v: Any) -> str:
        if isinstance(v, RawNumber):
            return f'<td class="num">{v}</td>'
        if isinstance(v, Raw):
            return f"<td>{v}</td>"
        return f'<td class="num">{fmt(v)}</td>' if num(v) is not None else f"<td>{fmt(v)}</td>"

    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(cell(v) for v in row) + "</tr>\n" for row in rows)
    cls = f' class="{css_class}"' if css_class else ""
    return f"<table{cls}>\n<tr>{head}</tr>\n{body}</table>"


class Raw(str):
    """HTML that a table cell shows as is."""


class RawNumber(Raw):
    """A number already formatted (e.g. a percentage): shown as is, aligned as a number."""


def metrics_table(metrics: dict) -> str:
    return table(["metric", "value"], [[k, v] for k, v in metrics.items()])


def formatted(value: float | None, spec: str = ".3g") -> str:
    return "–" if value is None else format(value, spec)


def plus_minus(value: float | None, stderr: float | None) -> str:
    """A fraction as a percentage, ± its standard error when there is one: "62.5% ± 4.0%"."""
    return formatted(value, ".1%") + ("" if value is None or stderr is None else f" ± {stderr:.1%}")


def skipped_note(run: Run, stage: str, files: list[str]) -> str:
    """Why a section has no data: the stage was not part of the run, or which files are missing."""
    if not planned(run, stage):
        return (
            f"The {stage} stage is not part of this run (pipeline_config.yaml stages: {run.stages_planned})."
            + _instead(run, stage)
        )
    return "Missing: " + ", ".join(f"{run.name}/{f}" for f in files) + " — section skipped."


def _instead(run: Run, stage: str) -> str:
    """What took the place of a stage the run left out: the model PPO started from, the score it maximised."""
    if stage == "sft" and config_value(run, "ppo", "model_name_or_path"):
        return f" PPO started from {config_value(run, 'ppo', 'model_name_or_path')}, also its reference."
    if stage == "rm" and without_reward_model(run) and config_value(run, "ppo", "reward_fn"):
        return f" PPO's score is the reward function {config_value(run, 'ppo', 'reward_fn')} alone."
    return ""


def skip_section(page: Page, run: Run, stage: str, files: list[str]) -> None:
    """A section without data: one grey line when its stage is not part of the run, else the missing files."""
    if planned(run, stage):
        page.missing(skipped_note(run, stage, files))
    else:
        page.add(f'<p class="note">{html.escape(skipped_note(run, stage, files))}</p>')


def wall_time_line(run: Run, stage: str) -> str:
    entry = (run.pipeline or {}).get(stage)
    seconds = num(entry.get("wall_time_s")) if isinstance(entry, dict) else None
    return "" if seconds is None else f'<p class="meta">wall time {seconds:.1f} s</p>'


def num_cell(value: float | None, spec: str = ".4g", css: str = "num") -> str:
    return f'<td class="{css}">{"–" if value is None else format(value, spec)}</td>'


def pct(value: Any) -> RawNumber | None:
    return RawNumber(f"{value:.1%}") if num(value) is not None else None


def page_header(page: Page, title: str, folder: Path) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M")
    page.add(
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="meta">{html.escape(str(folder.resolve()))} · built {stamp} by '
        f"<code>llm-rlhf report {html.escape(str(folder))}</code></p>",
    )
