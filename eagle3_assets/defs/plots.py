"""Small PNG plots embedded in Dagster metadata as Markdown (the asset page renders them inline)."""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence


def _figure():  # type: ignore[no-untyped-def]
    # lazy: loads matplotlib (heavy), which only this path needs
    import matplotlib

    matplotlib.use("Agg")  # no display on workers
    # lazy: loads matplotlib (heavy), which only this path needs
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(6, 3.2), dpi=90)


def _to_markdown(fig, title: str) -> str:  # type: ignore[no-untyped-def]
    # lazy: loads matplotlib (heavy), which only this path needs
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    encoded = base64.b64encode(buffer.getvalue()).decode()
    return f"![{title}](data:image/png;base64,{encoded})"


def histogram_markdown(values: Sequence[float], title: str, xlabel: str, bins: int = 40) -> str:
    fig, ax = _figure()
    if len(values):
        ax.hist(values, bins=bins, color="#4C72B0")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("samples")
    return _to_markdown(fig, title)


def lines_markdown(series: Mapping[str, Sequence[float]], title: str, xlabel: str, ylabel: str) -> str:
    fig, ax = _figure()
    for name, ys in series.items():
        ax.plot(range(1, len(ys) + 1), ys, marker="o", label=name)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend()
    return _to_markdown(fig, title)


def bars_markdown(groups: Mapping[str, Sequence[float]], labels: Sequence[str], title: str, ylabel: str) -> str:
    fig, ax = _figure()
    width = 0.8 / max(len(groups), 1)
    for i, (name, values) in enumerate(groups.items()):
        ax.bar([x + i * width for x in range(len(values))], values, width=width, label=name)
    ax.set_xticks([x + width * (len(groups) - 1) / 2 for x in range(len(labels))], labels)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.legend()
    return _to_markdown(fig, title)


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return float(ordered[index])
