"""Turning runner results into a verdict, a table, the RESULT line, docs and a chart.

Pure functions over plain dicts, apart from `chart` (matplotlib, Agg backend) and
`update_docs` (rewrites the generated part of docs/benchmarks.md).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.peers import loaders, tallies

MiB = 1 << 20
DOCS_BEGIN = "<!-- bench-peers:results:begin -->"
DOCS_END = "<!-- bench-peers:results:end -->"


def judge(raw: dict[str, Any], expected: dict[str, int], family: str) -> dict[str, Any]:
    """A runner's raw output checked against the expected tally.

    Every pass (cold, warm, and the two halves of a resumed epoch) must deliver exactly
    the expected samples; otherwise the loader is FAILED and none of its figures count.
    """
    row: dict[str, Any] = {"loader": raw["loader"], "family": family}
    if "error" in raw:
        row.update(status="FAILED", failure=raw["error"].strip().splitlines()[-1])
        return row
    problems = []
    # Every warm pass, not only the one whose time is reported.
    warm = raw.get("warm_passes", [raw["warm"]])
    passes = [("cold pass", raw["cold"])] + [
        (f"warm pass {i + 1} of {len(warm)}" if len(warm) > 1 else "warm pass", done)
        for i, done in enumerate(warm)
    ]
    for name, done in passes:
        wrong = tallies.mismatch(expected, done["tally"])
        if wrong:
            problems.append(f"{name}: {wrong}")
    resume = raw["resume"]
    if resume["supported"]:
        wrong = tallies.mismatch(expected, resume["tally"])
        if wrong:
            problems.append(f"resumed epoch: {wrong}")
    if problems:
        row.update(status="FAILED", failure="; ".join(problems))
        return row
    tokens = expected["tokens"]
    row.update(
        status="ok",
        settings=raw["settings"],
        setup_s=raw["setup_s"],
        cold_tps=tokens / raw["cold"]["seconds"],
        warm_tps=tokens / raw["warm"]["seconds"],
        cold_ttfb_ms=1000 * raw["cold"]["ttfb_s"],
        warm_ttfb_ms=1000 * raw["warm"]["ttfb_s"],
        resume_ms=1000 * resume["ttfb_s"] if resume["supported"] else None,
    )
    return row


def _fmt_rate(tps: float) -> str:
    return f"{tps / 1e6:,.1f}"


def _fmt_ms(ms: float | None) -> str:
    return "n/a" if ms is None else f"{ms:,.0f}"


HEADER = (
    "loader",
    "shuffle",
    "cold Mtok/s",
    "warm Mtok/s",
    "warm GB/s",
    "1st batch cold ms",
    "1st batch warm ms",
    "resume ms",
    "peak RSS MiB",
    "peak tree PSS MiB",
    "memory tier MiB",
    "check",
)


def table_rows(rows: Sequence[dict[str, Any]]) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for r in rows:
        mem = (
            f"{r.get('peak_rss', 0) / MiB:,.0f}",
            f"{r.get('peak_pss', 0) / MiB:,.0f}",
            f"{r.get('tier_bytes', 0) / MiB:,.0f}" if r.get("tier_bytes") else "-",
        )
        shuffle = loaders.GRANULARITY.get(r["loader"], "?")
        if r["status"] != "ok":
            out.append((r["loader"], shuffle, *("FAILED",) * 6, *mem, "FAILED"))
            continue
        out.append(
            (
                r["loader"],
                shuffle,
                _fmt_rate(r["cold_tps"]),
                _fmt_rate(r["warm_tps"]),
                f"{r['warm_tps'] * 4 / 1e9:.2f}",
                _fmt_ms(r["cold_ttfb_ms"]),
                _fmt_ms(r["warm_ttfb_ms"]),
                _fmt_ms(r["resume_ms"]),
                *mem,
                "exact",
            )
        )
    return out


def text_table(rows: Sequence[dict[str, Any]]) -> str:
    body = [HEADER, *table_rows(rows)]
    widths = [max(len(line[i]) for line in body) for i in range(len(HEADER))]
    lines = [
        "  ".join(
            c.rjust(w) if i else c.ljust(w)
            for i, (c, w) in enumerate(zip(line, widths, strict=True))
        )
        for line in body
    ]
    failures = [f"FAILED {r['loader']}: {r['failure']}" for r in rows if r["status"] != "ok"]
    return "\n".join(lines + failures)


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows(rows)]
    return "\n".join(lines)


def _compared(rows: Sequence[dict[str, Any]], family: str) -> list[dict[str, Any]]:
    """A peer family's rows that the RESULT line weighs: like with like, its per-sample
    shuffles; pyarrow has none (it shuffles the file order only), so its rows count as
    they are, which favours pyarrow."""
    members = [r for r in rows if r["family"] == family]
    return [r for r in members if loaders.shuffles_samples(r["loader"])] or members


def ratios(rows: Sequence[dict[str, Any]]) -> dict[str, str]:
    """shardcache-through-the-sidecar warm tokens/s, in sample mode, over each peer
    family's best per-sample-shuffle variant.

    Like with like: shardcache's block mode hands out zero-copy runs of 4,096 rows,
    which no peer's per-sample shuffle can, so its figure here is the sample-mode
    sidecar row, and a peer's is its fastest variant that shuffles samples. Any such
    sidecar row that was not exact makes the ratios FAILED, so speed is never weighed
    against a wrong delivery.
    """
    sidecars = [r for r in rows if r["loader"] in loaders.SIDECAR_SAMPLE]
    out: dict[str, str] = {}
    for family in ("mosaic", "litdata", "pyarrow"):
        members = _compared(rows, family)
        ok = [r for r in members if r["status"] == "ok"]
        if not sidecars or not members:
            out[family] = "n/a"
        elif any(r["status"] != "ok" for r in sidecars) or not ok:
            out[family] = "FAILED"
        else:
            best = max(r["warm_tps"] for r in sidecars)
            out[family] = f"{best / max(r['warm_tps'] for r in ok):.2f}"
    return out


def result_basis(rows: Sequence[dict[str, Any]]) -> str:
    """One sentence naming the rows the RESULT line divided, for the docs."""
    sidecars = [r for r in rows if r["loader"] in loaders.SIDECAR_SAMPLE and r["status"] == "ok"]
    if not sidecars:
        return "No exact sample-mode sidecar row: no ratio."
    best = max(sidecars, key=lambda r: r["warm_tps"])
    peers = []
    for family in ("mosaic", "litdata", "pyarrow"):
        ok = [r for r in _compared(rows, family) if r["status"] == "ok"]
        if ok:
            peers.append(max(ok, key=lambda r: r["warm_tps"])["loader"])
    block = [r for r in rows if r["loader"] in loaders.SIDECAR and r["status"] == "ok"]
    versus = ""
    if block:
        fastest = max(block, key=lambda r: r["warm_tps"])
        versus = (
            f" Sample mode delivered {best['warm_tps'] / fastest['warm_tps']:.2f}x the warm "
            f"tokens/s of block mode (`{fastest['loader']}`) in this run."
        )
    return (
        f"shardcache's figure is `{best['loader']}` ({best['warm_tps'] / 1e6:,.1f} M tokens/s "
        f"warm), per-sample shuffle through the sidecar; the peers' are their fastest "
        "per-sample-shuffle variants: "
        + (", ".join(f"`{p}`" for p in peers) or "none")
        + " (pyarrow shuffles only the file order, so its row is coarser than ours)."
        + versus
    )


def result_line(rows: Sequence[dict[str, Any]]) -> str:
    r = ratios(rows)
    return f"RESULT vs_mosaic={r['mosaic']} vs_litdata={r['litdata']} vs_pyarrow={r['pyarrow']}"


def _label(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:,.1f}"


def chart(rows: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    names = [r["loader"] for r in ok]
    x = range(len(ok))
    fig, ax = plt.subplots(figsize=(10, 5), dpi=110)
    width = 0.4
    cold = [r["cold_tps"] / 1e6 for r in ok]
    warm = [r["warm_tps"] / 1e6 for r in ok]
    ax.bar([i - width / 2 for i in x], cold, width, label="cold (first pass)", color="#8da0cb")
    ax.bar([i + width / 2 for i in x], warm, width, label="warm (median pass)", color="#1b4f9c")
    for i, (c, w) in enumerate(zip(cold, warm, strict=True)):
        ax.annotate(_label(c), (i - width / 2, c), ha="center", va="bottom", fontsize=7)
        ax.annotate(_label(w), (i + width / 2, w), ha="center", va="bottom", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("million tokens/s delivered to the loop (log scale)")
    ax.set_xticks(list(x), names, rotation=20, ha="right")
    ax.set_title(title)
    ax.legend()
    ax.grid(axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def update_docs(path: Path, section: str) -> None:
    """Replace the generated section of `path` (between the markers), keeping the rest."""
    text = path.read_text() if path.exists() else f"{DOCS_BEGIN}\n{DOCS_END}\n"
    if DOCS_BEGIN not in text or DOCS_END not in text:
        text = text.rstrip("\n") + f"\n\n{DOCS_BEGIN}\n{DOCS_END}\n"
    pattern = re.compile(re.escape(DOCS_BEGIN) + ".*?" + re.escape(DOCS_END), re.S)
    path.write_text(pattern.sub(lambda _: f"{DOCS_BEGIN}\n{section.strip()}\n{DOCS_END}", text))
