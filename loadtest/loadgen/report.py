"""Summaries of load runs: a terminal table (rich), JSON for machines, and PNG plots (matplotlib).

Percentiles are numpy's linear interpolation between order statistics. Throughput is output tokens of
successful requests over the run's wall time (first send to last response).
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from kvserve.loadtest.loadgen.generator import RunResult

OUT_DIR = Path(__file__).resolve().parents[1] / "out"


@dataclass(slots=True, frozen=True)
class Summary:
    """Aggregate figures of one run. Times in seconds, throughput in tokens/s.

    ``nan`` marks a figure with no data (e.g. TTFT when every request failed).
    """

    label: str
    sent: int
    ok: int
    rejected_429: int
    errors: int
    wall_s: float
    output_tokens: int
    tokens_per_s: float
    e2e_mean_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_mean_s: float
    itl_p99_s: float
    decode_tokens_per_s: float  # mean over requests of (tokens - 1) / (e2e - ttft): one stream's speed


def _stat(values: list[float], fn) -> float:
    return float(fn(np.asarray(values))) if values else float("nan")


def median_over_repeats(figures: list, scalars: tuple[str, ...], mappings: tuple[str, ...] = ()) -> dict:
    """Per-figure medians over the repeats of one system that succeeded (those whose ``error`` is None).

    Args:
        figures: dataclasses with ``system`` and ``error`` fields, one per repeat.
        scalars: names of float fields (None where a repeat has no figure: left out of the median).
        mappings: names of ``dict[str, float]`` fields, medians per key of the first successful repeat.

    Returns ``{"system", *scalars, *mappings, "error": None}``, or the last repeat as a dict (its error kept) if
    none succeeded.
    """
    good = [f for f in figures if f.error is None]
    if not good:
        return asdict(figures[-1])

    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    return {"system": good[0].system, **{k: med(getattr(f, k) for f in good) for k in scalars},
            **{k: {key: med(getattr(f, k).get(key) for f in good) for key in getattr(good[0], k)} for k in mappings},
            "error": None}


def summarize(run: RunResult) -> Summary:
    """Aggregate a run's records."""
    ok = [r for r in run.records if r.ok]
    e2e = [r.e2e_s for r in ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [gap for r in ok for gap in r.itl_s]
    decode = [(r.output_tokens - 1) / (r.e2e_s - r.ttft_s) for r in ok
              if r.ttft_s is not None and r.output_tokens > 1 and r.e2e_s > r.ttft_s]
    tokens = sum(r.output_tokens for r in ok)
    rejected = sum(r.rejected for r in run.records)
    return Summary(
        label=run.label, sent=len(run.records), ok=len(ok), rejected_429=rejected,
        errors=len(run.records) - len(ok) - rejected, wall_s=run.wall_s, output_tokens=tokens,
        tokens_per_s=tokens / run.wall_s if run.wall_s > 0 else float("nan"),
        e2e_mean_s=_stat(e2e, np.mean), e2e_p50_s=_stat(e2e, np.median),
        e2e_p99_s=_stat(e2e, lambda a: np.percentile(a, 99)),
        ttft_mean_s=_stat(ttft, np.mean), ttft_p50_s=_stat(ttft, np.median),
        ttft_p99_s=_stat(ttft, lambda a: np.percentile(a, 99)),
        itl_mean_s=_stat(itl, np.mean), itl_p99_s=_stat(itl, lambda a: np.percentile(a, 99)),
        decode_tokens_per_s=_stat(decode, np.mean),
    )


def print_table(summaries: list[Summary], console: Console | None = None) -> None:
    """One row per run: counts, wall time, throughput, latency (ms)."""
    table = Table(title="load runs")
    for name in ("run", "ok", "429", "err", "wall s", "out tok", "tok/s", "e2e mean ms", "e2e p99 ms",
                 "ttft mean ms", "ttft p99 ms", "itl mean ms", "itl p99 ms"):
        table.add_column(name, justify="left" if name == "run" else "right")
    for s in summaries:
        table.add_row(s.label, str(s.ok), str(s.rejected_429), str(s.errors), f"{s.wall_s:.2f}",
                      str(s.output_tokens), f"{s.tokens_per_s:.1f}", *(f"{1000 * v:.0f}" for v in (
                          s.e2e_mean_s, s.e2e_p99_s, s.ttft_mean_s, s.ttft_p99_s)),
                      f"{1000 * s.itl_mean_s:.1f}", f"{1000 * s.itl_p99_s:.1f}")
    (console or Console(width=200)).print(table)


def error_lines(runs: list[RunResult], most: int = 5) -> list[str]:
    """The commonest reasons requests failed (429s are not failures), ``"3 x ConnectError: ..."``, most first."""
    reasons = Counter(r.error or f"HTTP {r.status}" for run in runs for r in run.records
                      if not r.ok and not r.rejected)
    return [f"{count} x {reason}" for reason, count in reasons.most_common(most)]


def write_json(runs: list[RunResult], path: Path, extra: dict | None = None) -> Path:
    """Write summaries and every request's record as JSON; returns the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"runs": [{"label": run.label, "config": run.config, "summary": summary_dict(summarize(run)),
                     "records": [r.to_json() for r in run.records]} for run in runs]}
    if extra:
        doc.update(extra)
    path.write_text(json.dumps(doc, indent=1))
    return path


def summary_dict(summary: Summary) -> dict:
    """A Summary as a plain dict (for JSON)."""
    return {name: getattr(summary, name) for name in Summary.__slots__}


def plot_latency_cdfs(runs: list[RunResult], path: Path, title: str = "latency CDF") -> Path:
    """Two panels, one line per run: CDF of end-to-end latency and of TTFT (queue + prefill), in seconds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for run in runs:
        ok = [r for r in run.records if r.ok]
        for ax, values in zip(axes, ([r.e2e_s for r in ok], [r.ttft_s for r in ok if r.ttft_s is not None])):
            if values:
                xs = np.sort(values)
                ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=run.label)
    for ax, name in zip(axes, ("end-to-end latency (s)", "time to first token (s)")):
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_throughput(series: dict[str, list[tuple[int, float]]], path: Path,
                    title: str = "throughput vs concurrency") -> Path:
    """Output tokens/s against concurrent streams, one line per system (log2 x axis)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in series.items():
        points = sorted(points)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
