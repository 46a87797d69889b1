"""The loss curve of a run, drawn from its metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

from mfsdp.train.metrics import read_metrics


def needs_matplotlib(what: str) -> str:
    """Why ``what`` (a plot) was not drawn, and the fix: matplotlib ships with the train extra."""
    return f"not drawn ({what} needs matplotlib, part of the train extra: pip install 'mfsdp[train]')"


def plot_loss(metrics_path: str | Path, out: str | Path) -> Path | None:
    """Write the loss curve (raw and smoothed, with the validation loss where measured) above the
    throughput (tokens/s) to ``out``; None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")  # files only: training nodes have no display
    import matplotlib.pyplot as plt

    records = [r for r in read_metrics(metrics_path) if "loss" in r]
    steps = [r["step"] for r in records]
    losses = [r["loss"] for r in records]
    held_out = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    speed = [(r["step"], r["tokens_per_s"]) for r in records if r.get("tokens_per_s")]
    fig, (ax, ax_speed) = plt.subplots(2, 1, figsize=(7, 6), sharex=True,
                                       gridspec_kw={"height_ratios": [2, 1]})
    ax.plot(steps, losses, color="tab:blue", alpha=0.35, linewidth=1, label="loss")
    if len(losses) >= 10:
        ax.plot(steps, _moving_average(losses, max(2, len(losses) // 20)), color="tab:blue",
                linewidth=2, label="moving average")
    if held_out:
        ax.plot([s for s, _ in held_out], [v for _, v in held_out], color="tab:orange",
                marker="o", linewidth=1.5, label="validation loss")
    ax.set_ylabel("cross-entropy loss (nats/token)")
    ax.set_title("mfsdp training loss")
    ax.grid(alpha=0.3)
    ax.legend()
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


def _moving_average(values: list[float], window: int) -> list[float]:
    averaged, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        averaged.append(total / min(i + 1, window))
    return averaged
