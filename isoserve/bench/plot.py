"""Throughput vs load and latency percentiles vs load, as one PNG (matplotlib, Agg backend).

Several runs (label, summaries) may share the figure, one line style per run.
"""
from __future__ import annotations

from pathlib import Path


def plot_runs(runs: list[tuple[str, list[dict]]], path: str | Path, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import ScalarFormatter

    fig, (tput, ttft, itl) = plt.subplots(1, 3, figsize=(15, 4.5))
    xlabel, xs = "concurrency", set()
    for i, (label, summaries) in enumerate(runs):
        by_rate = any(s.get("request_rate") is not None for s in summaries)
        xlabel = "request rate (req/s)" if by_rate else "concurrency"
        x = [s["request_rate"] if by_rate else s["concurrency"] for s in summaries]
        xs.update(x)
        name = f"{label} " if label else ""
        tput.plot(x, [s["output_tokens_per_s"] for s in summaries], marker="o", label=label or None)
        for axis, key in ((ttft, "ttft_ms"), (itl, "itl_ms")):
            for p, style in (("p50", "-"), ("p90", "--"), ("p99", ":")):
                axis.plot(x, [s[key][p] for s in summaries], linestyle=style, marker="o",
                          color=f"C{i}", label=f"{name}{p}")
    for axis, what in ((tput, "output tokens/s"), (ttft, "time to first token (ms)"),
                       (itl, "inter-token latency (ms)")):
        axis.set_xlabel(xlabel)
        axis.set_ylabel(what)
        axis.grid(True, alpha=0.3)
        if xlabel == "concurrency":
            axis.set_xscale("log", base=2)
            axis.set_xticks(sorted(xs))
            axis.xaxis.set_major_formatter(ScalarFormatter())
            axis.minorticks_off()
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
    tput.set_ylim(bottom=0)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
