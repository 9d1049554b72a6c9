"""Reports of ``pdserve.bench.serve``: the comparison table (metrics as rows, endpoints as columns)
and the PNG plot (TTFT, TPOT and ITL CDFs, output throughput with SLO attainment)."""

from __future__ import annotations

from pathlib import Path

from pdserve.bench.serve_metrics import RequestRecord, Summary


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def format_table(summaries: list[Summary]) -> str:
    """Metrics as rows, endpoints as columns."""
    rows: list[tuple[str, list[str]]] = [
        ("completed / failed", [f"{s.completed} / {s.failed}" for s in summaries]),
        ("duration (s)", [f"{s.duration_s:.2f}" for s in summaries]),
        ("requests/s", [f"{s.request_throughput:.2f}" for s in summaries]),
        ("output tokens/s", [f"{s.output_throughput:.1f}" for s in summaries]),
        ("input tokens/s", [f"{s.input_throughput:.1f}" for s in summaries]),
    ]
    for metric in ("ttft", "tpot", "itl", "e2e"):
        for stat in ("mean", "p50", "p90", "p99"):
            values = []
            for s in summaries:
                dist = getattr(s, metric)
                values.append(_ms(None if dist is None else getattr(dist, stat)))
            rows.append((f"{metric.upper()} {stat} (ms)", values))
    rows.append(("TTFT SLO attainment", [_pct(s.ttft_attainment) for s in summaries]))
    rows.append(("TPOT SLO attainment", [_pct(s.tpot_attainment) for s in summaries]))
    rows.append(("SLO attainment (both)", [_pct(s.slo_attainment) for s in summaries]))
    header = ["metric", *[s.endpoint for s in summaries]]
    widths = [max(len(header[0]), *(len(r[0]) for r in rows))]
    for i in range(len(summaries)):
        widths.append(max(len(header[i + 1]), *(len(r[1][i]) for r in rows)))

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    out = [line(header), line(["-" * w for w in widths])]
    out += [line([name, *values]) for name, values in rows]
    return "\n".join(out)


def write_plot(
    path: Path, results: dict[str, list[RequestRecord]], summaries: list[Summary]
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = [
        (axes[0][0], "TTFT (ms)", lambda r: [r.ttft] if r.ttft is not None else []),
        (axes[0][1], "TPOT (ms)", lambda r: [r.tpot] if r.tpot is not None else []),
        (axes[1][0], "ITL (ms)", lambda r: r.itl),
    ]
    for ax, title, pick in panels:
        for name, records in results.items():
            values = np.sort([v * 1000 for r in records if r.ok for v in pick(r)])
            if len(values):
                ax.plot(values, np.arange(1, len(values) + 1) / len(values), label=name)
        ax.set_title(f"{title}: CDF")
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of requests" if "ITL" not in title else "fraction of gaps")
        ax.grid(alpha=0.3)
        ax.legend()
    ax = axes[1][1]
    names = [s.endpoint for s in summaries]
    ax.bar(names, [s.output_throughput for s in summaries], color="tab:blue")
    ax.set_title("output tokens/s (label: SLO attainment)")
    for i, s in enumerate(summaries):
        ax.annotate(_pct(s.slo_attainment), (i, s.output_throughput), ha="center",
                    va="bottom")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
