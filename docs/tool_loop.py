"""Draw docs/tool_loop.png: one search-delete-rewrite round of the tool loop on a news-world document.

    python docs/tool_loop.py
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

POLICY, SANDBOX, FINAL = "#e8f0fb", "#fdf3e3", "#e9f6ec"
EDGE = {POLICY: "#3b6fb6", SANDBOX: "#c98a1b", FINAL: "#3c8d50"}
WRONG, RIGHT, MONO = "#c0392b", "#1e7b34", "DejaVu Sans Mono"

# (lane, step title, lines); a line is a list of (text, colour) runs, colour None for plain text
STEPS = [
    ("policy", "1  writes a sentence, then checks it",
     [[("Ashford Airlines agreed to buy Sable Telecom", None)],
      [("for ", None), ("$310 million", WRONG), (".", None)],
      [("<search>Ashford Airlines buy Sable Telecom</search>", EDGE[POLICY])]]),
    ("sandbox", "2  BM25 over the document's sentences",
     [[("<results>", EDGE[SANDBOX])],
      [("<0>", EDGE[SANDBOX]), ("Ashford Airlines agreed to buy Sable Telecom", None)],
      [("   for ", None), ("$360 million", RIGHT), (" on March 4, 2024.", None), ("</0>", EDGE[SANDBOX])],
      [("<1>", EDGE[SANDBOX]), ("Corvid Group had made a rival bid of", None)],
      [("   ", None), ("$310 million", WRONG), (" for Sable Telecom in May 2023.", None), ("</1>", EDGE[SANDBOX])],
      [("</results>", EDGE[SANDBOX])]]),
    ("policy", "3  retracts the sentence",
     [[('<delete scope="sentence"/>', EDGE[POLICY])]]),
    ("sandbox", "4  removes it from the summary",
     [[("the policy now sees the prompt, the kept summary,", None)],
      [("the search, its results and the delete tag", None)]]),
    ("policy", "5  rewrites it with the found fact",
     [[("Ashford Airlines agreed to buy Sable Telecom", None)],
      [("for ", None), ("$360 million", RIGHT), (" on March 4, 2024.", None)]]),
]
FINAL_LINES = [[("Ashford Airlines agreed to buy Sable Telecom for ", None), ("$360 million", RIGHT),
                (" on March 4, 2024. The deal is", None)],
               [("expected to close in June 2025. ...", None)]]
X = {"policy": 2.0, "sandbox": 52.0}
W = 46.0
GAP = 3.5  # vertical space between two boxes
LINE = 2.35  # height of one text line, in axis units


def runs_text(ax, x, y, runs, size=9.2):
    """Write coloured runs of monospace text from (x, y), left to right."""
    renderer = ax.figure.canvas.get_renderer()
    for text, colour in runs:
        t = ax.text(x, y, text, family=MONO, size=size, color=colour or "#222222", va="top", ha="left")
        bb = t.get_window_extent(renderer=renderer).transformed(ax.transData.inverted())
        x = bb.x1


def height(lines):
    """A box's height for its title and `lines`."""
    return 4.0 + len(lines) * LINE


def box(ax, x, top, face, title, lines, *, w=W):
    h = height(lines)
    ax.add_patch(FancyBboxPatch((x, top - h), w, h, boxstyle="round,pad=0.4,rounding_size=1.2",
                                fc=face, ec=EDGE[face], lw=1.4))
    ax.text(x + 1.2, top - 0.9, title, size=10, weight="bold", color=EDGE[face], va="top")
    for i, line in enumerate(lines):
        runs_text(ax, x + 1.2, top - 3.6 - i * LINE, line)


def arrow(ax, start, end, rad=0.0):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=14, lw=1.3, color="#555555",
                                 connectionstyle=f"arc3,rad={rad}", shrinkA=2, shrinkB=2))


def main(out: Path = Path(__file__).with_name("tool_loop.png")) -> None:
    tops, top = [], 93.0
    for _, _, lines in STEPS:
        tops.append(top)
        top -= height(lines) + GAP
    ftop = top - 0.5
    bottom = ftop - height(FINAL_LINES) - 1.5
    fig = plt.figure(figsize=(11.5, 11.5 * (100 - bottom) / 100 * 0.78), dpi=110)
    ax = fig.add_axes([0, 0, 1, 1])
    ax.set_xlim(0, 100)
    ax.set_ylim(bottom, 100)
    ax.axis("off")
    fig.canvas.draw()

    ax.text(X["policy"] + W / 2, 97.0, "policy (writes tokens)", size=12, weight="bold", ha="center",
            color=EDGE[POLICY])
    ax.text(X["sandbox"] + W / 2, 97.0, "sandbox (runs the tool on the document)", size=12, weight="bold",
            ha="center", color=EDGE[SANDBOX])
    ax.plot([50, 50], [ftop + 2.0, 95.0], color="#bbbbbb", lw=1, ls=(0, (4, 4)))

    for (lane, title, lines), top in zip(STEPS, tops):
        box(ax, X[lane], top, POLICY if lane == "policy" else SANDBOX, title, lines)

    # each box to the next, across the lanes
    for i in range(len(STEPS) - 1):
        lane, top, h, ntop = STEPS[i][0], tops[i], height(STEPS[i][2]), tops[i + 1]
        if lane == "policy":
            arrow(ax, (X[lane] + W + 0.6, top - h / 2), (X["sandbox"] + 10, ntop + 0.6), rad=-0.3)
        else:
            arrow(ax, (X[lane] - 0.6, top - h / 2), (X["policy"] + W - 10, ntop + 0.6), rad=0.3)

    # the final summary: what is kept once the tool blocks are stripped
    box(ax, X["policy"], ftop, FINAL, "6  final summary (tool blocks and retracted text removed)", FINAL_LINES,
        w=X["sandbox"] + W - X["policy"])
    last = tops[-1] - height(STEPS[-1][2])
    arrow(ax, (X["policy"] + W / 2, last - 0.6), (X["policy"] + W / 2, ftop + 0.6))

    fig.savefig(out, dpi=110, facecolor="white")
    print(out)


if __name__ == "__main__":
    main()
