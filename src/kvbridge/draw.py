"""Draw a plan as an SVG picture: prefill ranks on the left, decode ranks on the right, one line per read."""
from __future__ import annotations

from html import escape

from .plan import TransferPlan

_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]


def plan_svg(plan: TransferPlan) -> str:
    P, D = plan.prefill, plan.decode
    groups = [g.name for g in P.model.groups]
    row, top = 34, 60
    n = max(P.num_ranks, D.num_ranks)
    h = top + n * row + 40
    w = 760
    y_p = {r: top + i * row * n / P.num_ranks for i, r in enumerate(P.ranks())}
    y_d = {r: top + i * row * n / D.num_ranks for i, r in enumerate(D.ranks())}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="monospace" font-size="12">',
           f'<text x="10" y="20" font-size="14">{escape(P.model.name)}: prefill tp={P.tp} pp={P.pp} -> '
           f'decode tp={D.tp} pp={D.pp}</text>']
    for i, g in enumerate(groups):
        out.append(f'<text x="{10 + 150 * i}" y="40" fill="{_COLORS[i % len(_COLORS)]}">&#9632; {escape(g)}</text>')
    for r, y in y_p.items():
        out.append(f'<rect x="20" y="{y}" width="150" height="24" fill="#eee" stroke="#333"/>'
                   f'<text x="28" y="{y + 16}">P pp{r[0]} tp{r[1]}</text>')
    for r, y in y_d.items():
        out.append(f'<rect x="{w - 170}" y="{y}" width="150" height="24" fill="#eef" stroke="#333"/>'
                   f'<text x="{w - 162}" y="{y + 16}">D pp{r[0]} tp{r[1]}</text>')
    for _k, rd in enumerate(plan.reads):
        gi = groups.index(rd.group)
        off = (gi - (len(groups) - 1) / 2) * 4
        y1, y2 = y_p[rd.prefill] + 12 + off, y_d[rd.decode] + 12 + off
        units = " ".join(f"{a}:{b}" for a, b in rd.units if b > a)
        out.append(f'<line x1="170" y1="{y1}" x2="{w - 170}" y2="{y2}" stroke="{_COLORS[gi % len(_COLORS)]}" '
                   f'stroke-width="2" opacity="0.7"><title>{escape(rd.group)} layers {rd.layers[0]}:{rd.layers[1]} '
                   f'units {units}</title></line>')
    out.append("</svg>")
    return "\n".join(out)


def draw_plan(plan: TransferPlan, path: str) -> None:
    with open(path, "w") as f:
        f.write(plan_svg(plan))
