"""The curves of a run (its objective's metrics, then the throughput), drawn from its metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

from mfsdp.train.report.metrics import read_metrics


def needs_matplotlib(what: str) -> str:
    """Why ``what`` (a plot) was not drawn, and the fix: matplotlib ships with the train extra."""
    return f"not drawn ({what} needs matplotlib, part of the train extra: pip install 'mfsdp[train]')"


def plot_loss(metrics_path: str | Path, out: str | Path, objective) -> Path | None:
    """Write a panel for each of ``objective``'s metrics (raw and smoothed, with its validation value
    where measured) above the throughput (tokens/s) to ``out``; None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")  # files only: training nodes have no display
    import matplotlib.pyplot as plt

    names = objective.metrics
    records = [r for r in read_metrics(metrics_path) if names[0] in r]
    speed = [(r["step"], r["tokens_per_s"]) for r in records if r.get("tokens_per_s")]
    fig, axes = plt.subplots(len(names) + 1, 1, figsize=(7, 3 + 3 * len(names)), sharex=True,
                             gridspec_kw={"height_ratios": [2] * len(names) + [1]})
    for ax, name in zip(axes, names):
        _plot_metric(ax, name, records, objective.axis_names.get(name, name))
    axes[0].set_title("mfsdp training loss")
    ax_speed = axes[-1]
    if speed:
        ax_speed.plot([s for s, _ in speed], [v for _, v in speed], color="tab:green",
                      linewidth=1)
    ax_speed.set_ylabel("tokens/s (all ranks)")
    ax_speed.set_xlabel("step")
    ax_speed.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _plot_metric(ax, name: str, records: list[dict], label: str) -> None:
    """One metric's panel: its values, their moving average, and its validation values."""
    steps, values = [r["step"] for r in records], [r.get(name) for r in records]
    held_out = [(r["step"], r[f"val_{name}"]) for r in records if r.get(f"val_{name}") is not None]
    ax.plot(steps, values, color="tab:blue", alpha=0.35, linewidth=1, label=name)
    if len(values) >= 10:
        ax.plot(steps, _moving_average(values, max(2, len(values) // 20)), color="tab:blue",
                linewidth=2, label="moving average")
    if held_out:
        ax.plot([s for s, _ in held_out], [v for _, v in held_out], color="tab:orange",
                marker="o", linewidth=1.5, label=f"validation {name}")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    ax.legend()


def _moving_average(values: list[float], window: int) -> list[float]:
    averaged, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        averaged.append(total / min(i + 1, window))
    return averaged
