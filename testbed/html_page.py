"""The skeleton of the testbed's self-contained HTML reports: plotly.js inline once, so
the page works offline; a short note on how the numbers were made; tables and figures."""

from __future__ import annotations

import html
from pathlib import Path

import plotly.graph_objects as go
import plotly.io as pio

STYLE = """body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1200px; color: #222; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; }
td:nth-child(n+3) { text-align: right; }
th { background: #f2f2f2; }
.note { color: #555; max-width: 60em; }
.fig { margin: 1.5em 0; }
.miss { color: #b00; }"""


def figures_html(figures: list[go.Figure]) -> str:
    """The figures as divs; plotly.js is embedded with the first one only."""
    divs = [pio.to_html(fig, full_html=False, include_plotlyjs=(i == 0), div_id=f"fig-{i}",
                        default_height=f"{fig.layout.height}px")
            for i, fig in enumerate(figures)]
    return "\n".join(f'<div class="fig">{d}</div>' for d in divs)


def table_html(header: list[str], rows: list[list[str]]) -> str:
    """A table of already formatted cells (escaped here)."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "\n".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table>\n<tr>{head}</tr>\n{body}\n</table>"


def write_page(output: str | Path, title: str, note: str, sections: list[tuple[str, str]]) -> Path:
    """Write the page: ``sections`` are (heading, inner HTML) in order."""
    parts = "\n".join(f"<h2>{html.escape(h)}</h2>\n{inner}" for h, inner in sections)
    page = (f"<!DOCTYPE html>\n<html>\n<head>\n<meta charset=\"utf-8\">\n<title>{html.escape(title)}</title>\n"
            f"<style>\n{STYLE}\n</style>\n</head>\n<body>\n<h1>{html.escape(title)}</h1>\n"
            f"<p class=\"note\">{html.escape(note)}</p>\n{parts}\n</body>\n</html>\n")
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out
