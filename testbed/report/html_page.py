"""The skeleton of the testbed's self-contained HTML reports: plotly.js inline once, so
the page works offline; a short note on how the numbers were made; tables and figures.

It also holds what every report draws with, so that the reports read alike: one colour
per stage (the same in every figure of every report), fixed colours for link levels and
for the series of a figure, log axes where values span more than a decade, and legends
under the plot. Units are the callers' choice; the reports use milliseconds for times
and MiB (2^20 bytes) for bytes in figures.
"""

from __future__ import annotations

import html
import math
import re
import time
from pathlib import Path

import plotly.graph_objects as go
import plotly.io as pio

from testbed.core.files import write_atomic

STYLE = """body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1200px; color: #222; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; vertical-align: top; }
td.num { text-align: right; }
th { background: #f2f2f2; }
.note { color: #555; max-width: 60em; }
.findings { max-width: 60em; border-left: 4px solid #4c78a8; padding: 0.2em 0.9em; background: #f6f8fb; }
.fig { margin: 1.5em 0; }
.wide { overflow-x: auto; }
table.dense { font-size: 0.78em; }
table.dense th, table.dense td { padding: 0.2em 0.35em; }
table.dense td:first-child { min-width: 15em; }
.miss { color: #b00; }"""

#: one colour per stage (testbed.core.stages.STAGES), the same in every figure of every report:
#: a forward stage in the dark shade of a hue, its backward stage in the light shade of the
#: same hue (Tableau 20), the once-per-step stages in hues of their own
STAGE_COLORS = {
    "route": "#1f77b4", "dispatch": "#ff7f0e", "experts": "#2ca02c", "combine": "#d62728",
    "combine_backward": "#ff9896", "experts_backward": "#98df8a", "dispatch_backward": "#ffbb78",
    "route_backward": "#aec7e8", "dense": "#e377c2", "dense_backward": "#f7b6d2",
    "expert_sync": "#9467bd", "dense_sync": "#8c564b", "optimizer": "#7f7f7f", "paging": "#17becf",
    "heat": "#bcbd22",
}

#: one colour per link level (testbed.scenario.topology.LEVELS)
LEVEL_COLORS = {"nvlink": "#4c78a8", "leaf": "#f58518", "spine": "#54a24b", "pcie": "#b279a2"}

#: colours of the series of one figure (runs, rank counts), in order: darker and more muted
#: than the stage colours, so that a run is not read as a stage (Tableau 20b/20c)
SERIES_COLORS = ("#393b79", "#ad494a", "#637939", "#bd9e39", "#7b4173", "#3182bd", "#e6550d", "#31a354",
                 "#756bb1", "#636363", "#843c39", "#8ca252", "#8c6d31", "#a55194", "#6b6ecf")

#: the longest label drawn on an axis or in a legend (characters); the full one is in the hover
LABEL_CHARS = 48

MiB = 2**20
#: the page that lists every report of its folder
INDEX_PAGE = "index.html"


def stage_color(stage: str) -> str:
    """The stage's colour (grey for a name that is not a stage)."""
    return STAGE_COLORS.get(stage, "#999999")


def series_color(i: int) -> str:
    """The colour of series ``i`` of a figure (the list repeats after 15)."""
    return SERIES_COLORS[i % len(SERIES_COLORS)]


def shorten(text: str, limit: int = LABEL_CHARS) -> str:
    """``text`` cut in the middle to at most ``limit`` characters: labels differ most at
    their start (the backend) and end (the last differing field), so both are kept."""
    if len(text) <= limit:
        return text
    head = (limit - 1) // 2
    return text[:head] + "…" + text[len(text) - (limit - 1 - head):]


def wrap(text: str, sep: str = " · ", width: int = 44, max_lines: int = 4) -> str:
    """``text`` broken into lines (plotly's ``<br>``) at ``sep``, each at most ``width``
    characters where the parts allow; past ``max_lines`` the last line is shortened.
    A run label keeps every differing field in view, where cutting it would hide the one
    field that tells two runs apart."""
    lines: list[str] = []
    for part in text.split(sep):
        if lines and len(lines[-1]) + len(sep) + len(part) <= width:
            lines[-1] += sep + part
        else:
            lines.append(part)
    if len(lines) > max_lines:
        lines = lines[:max_lines - 1] + [shorten(sep.join(lines[max_lines - 1:]), width)]
    return "<br>".join(lines)


def spans_decade(values) -> bool:
    """Whether the positive values differ by more than 10x (on a linear axis the small
    ones would flatten to nothing); zeros and None are left out."""
    pos = [v for v in values if v is not None and v > 0]
    return len(pos) > 1 and max(pos) > 10 * min(pos)


def log_ticks(values) -> list[float]:
    """Ticks 1, 2, 5 per decade over the positive values (only the powers of ten past
    four decades), so a log axis is labelled in full-size numbers, not minor digits."""
    pos = [v for v in values if v is not None and v > 0]
    lo, hi = math.floor(math.log10(min(pos))), math.ceil(math.log10(max(pos)))
    steps = (1, 2, 5) if hi - lo <= 4 else (1,)
    return [m * 10.0**e for e in range(lo, hi + 1) for m in steps if m * 10.0**e <= 10.0**hi]


def value_axis(title: str, values, **kw) -> dict:
    """An axis for ``values``: logarithmic when they span more than a decade (the title
    says so), linear from zero otherwise."""
    if spans_decade(values):
        ticks = log_ticks(values)
        return dict(title=f"{title} (log scale)", type="log", tickvals=ticks, ticktext=[f"{t:g}" for t in ticks],
                    **kw)
    return dict(title=title, rangemode="tozero", **kw)


def legend_below(fig: go.Figure, title: str, height: int, subtitle: str = "", **kw) -> go.Figure:
    """Title (and a subtitle: how to read the figure), height and a horizontal legend
    under the plot, in trace order: the legend wraps across the page's width and takes
    room from the plot, never covers data. Titles stay short: the toolbar sits at the
    top right."""
    fig.update_layout(title=dict(text=title, subtitle=dict(text=subtitle)), height=height,
                      margin=dict(l=20, r=20, t=75 if subtitle else 50, b=20),
                      legend=dict(orientation="h", yref="container", y=0, yanchor="bottom", x=0,
                                  traceorder="normal"), **kw)
    fig.update_xaxes(automargin=True)
    fig.update_yaxes(automargin=True)
    return fig


def category_ticks(labels: list[str], texts: list[str] | None = None) -> dict:
    """Axis settings that keep each full label as its own category but draw it wrapped
    (or as ``texts``)."""
    return dict(tickmode="array", tickvals=labels, ticktext=texts or [wrap(s) for s in labels])


def figures_html(figures: list[go.Figure]) -> str:
    """The figures as divs; plotly.js is embedded with the first one only."""
    divs = [pio.to_html(fig, full_html=False, include_plotlyjs=(i == 0), div_id=f"fig-{i}",
                        default_height=f"{fig.layout.height}px")
            for i, fig in enumerate(figures)]
    return "\n".join(f'<div class="fig">{d}</div>' for d in divs)


#: a cell that holds one quantity ("12.5 ms", "-3.1%", "1.00 MiB", "x4", "0.75") or two side by
#: side ("53.82 / 61.92"): right-aligned
_NUMBER = re.compile(r"^[x+\-−]?\d[\d.,]*(e[+-]?\d+)?\s?(%|ms|s|B|KiB|MiB|GiB|TiB|pp)?"
                     r"( / [x+\-−]?\d[\d.,]*\s?(%|ms|s|B|KiB|MiB|GiB|TiB|pp)?)?$")


def _cell(value) -> str:
    text = str(value)
    cls = ' class="num"' if _NUMBER.match(text) else ""
    return f"<td{cls}>{html.escape(text)}</td>"


def table_html(header: list[str], rows: list[list[str]], dense: bool = False) -> str:
    """A table of already formatted cells (escaped here); cells that hold one number are
    right-aligned. ``dense``: smaller type, for tables of many columns. Wide tables scroll
    sideways instead of widening the page."""
    # stage names are one long word each: let a header break after an underscore
    head = "".join(f"<th>{html.escape(h).replace('_', '_<wbr>')}</th>" for h in header)
    body = "\n".join("<tr>" + "".join(_cell(c) for c in row) + "</tr>" for row in rows)
    cls = ' class="dense"' if dense else ""
    return f"<div class=\"wide\"><table{cls}>\n<tr>{head}</tr>\n{body}\n</table></div>"


def write_page(output: str | Path, title: str, note: str, sections: list[tuple[str, str]],
               scenario: str = "", findings: list[str] = ()) -> Path:
    """Write the page: ``sections`` are (heading, inner HTML) in order. ``findings``: one
    or two sentences computed from the page's figures, what they show, which open the
    page. ``note`` is plain text on how the numbers were made; blank lines in it start a
    new paragraph. ``scenario``: what the page's runs ran (a config name, a sweep), shown
    by the folder's index page, which is rewritten after every report."""
    parts = "\n".join(f"<h2>{html.escape(h)}</h2>\n{inner}" for h, inner in sections)
    shown = "".join(f"<p>{html.escape(f)}</p>" for f in findings if f)
    paragraphs = (f"<div class=\"findings\">{shown}</div>\n" if shown else "") + "\n".join(
        f"<p class=\"note\">{html.escape(p.strip())}</p>" for p in note.split("\n\n") if p.strip())
    created = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    meta = (f"<meta name=\"testbed-created\" content=\"{created}\">\n"
            f"<meta name=\"testbed-scenario\" content=\"{html.escape(scenario, quote=True)}\">\n")
    page = (f"<!DOCTYPE html>\n<html>\n<head>\n<meta charset=\"utf-8\">\n{meta}<title>{html.escape(title)}</title>\n"
            f"<style>\n{STYLE}\n</style>\n</head>\n<body>\n<h1>{html.escape(title)}</h1>\n"
            f"{paragraphs}\n{parts}\n</body>\n</html>\n")
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, page)
    if out.name != INDEX_PAGE:
        write_index(out.parent)
    return out


_META = re.compile(r'<meta name="testbed-(created|scenario)" content="([^"]*)">')
_TITLE = re.compile(r"<title>(.*?)</title>", re.S)


def write_index(folder: str | Path) -> Path:
    """``folder/index.html``: a link to every report in the folder, newest first, with its
    title, date and scenario (as each page states them; pages made before pages carried
    them show their file's modification time)."""
    folder = Path(folder)
    rows = []
    for page in folder.glob("*.html"):
        if page.name == INDEX_PAGE:
            continue
        head = page.read_text(encoding="utf-8", errors="replace")[:4000]
        meta = dict(_META.findall(head))
        title = _TITLE.search(head)
        created = meta.get("created") or time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(page.stat().st_mtime))
        rows.append((created, page.name, html.unescape(title.group(1)) if title else page.name,
                     html.unescape(meta.get("scenario", ""))))
    rows.sort(reverse=True)
    body = "\n".join(f"<tr><td><a href=\"{html.escape(name)}\">{html.escape(t)}</a></td><td>{html.escape(c)}</td>"
                     f"<td>{html.escape(sc)}</td><td>{html.escape(name)}</td></tr>" for c, name, t, sc in rows)
    page = (f"<!DOCTYPE html>\n<html>\n<head>\n<meta charset=\"utf-8\">\n<title>Reports</title>\n"
            f"<style>\n{STYLE}\n</style>\n</head>\n<body>\n<h1>Reports</h1>\n"
            f"<p class=\"note\">Every report in this folder, newest first. Each page names the runs its numbers "
            f"come from.</p>\n<div class=\"wide\"><table>\n<tr><th>report</th><th>written</th><th>scenario</th>"
            f"<th>file</th></tr>\n{body}\n</table></div>\n</body>\n</html>\n")
    return write_atomic(folder / INDEX_PAGE, page)
