"""`make flake-check`: the whole suite, several times back to back, on a fresh clone,
with the machine loaded by a CPU burner this check starts itself (issue 17).

A test that passes alone but fails when the machine is busy waits on a clock somewhere;
this is how such a test is found before CI finds it. Each run is `make test` in a fresh
`git clone` of this checkout's HEAD (uncommitted changes are not part of it), so set-up
steps are exercised too (tools and images come from the shared cache, as in CI). The
burner is `--burners` busy processes at normal priority: on a 2-core machine the default
(half the cores) doubles the suite's wall time.

Prints one line per run and a summary; exits non-zero when any run failed. Logs are kept
under `--logs`, one per run, so a failure can be read afterwards.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time


def _burn() -> None:
    # A pure-Python busy loop: it holds one core and nothing else (no memory, no I/O).
    x = 0
    while True:
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF


def _summary_line(log: str) -> str:
    """The pytest summary lines of a run's log ("N passed, M failed in S s")."""
    lines = re.findall(r"^=+ (.*(?:passed|failed|error).*) =+$", log, flags=re.M)
    return " | ".join(lines) if lines else "(no pytest summary found)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="back-to-back runs (3)")
    parser.add_argument(
        "--burners",
        type=int,
        default=max(1, (os.cpu_count() or 2) // 2),
        help="busy processes to load the machine with (half the cores)",
    )
    parser.add_argument("--logs", type=pathlib.Path, default=pathlib.Path("test-artifacts/flake"))
    parser.add_argument("--keep", action="store_true", help="keep the clones")
    args = parser.parse_args()
    if args.runs < 1 or args.burners < 0:
        parser.error(f"--runs must be >= 1 and --burners >= 0, got {args.runs}, {args.burners}")

    repo = pathlib.Path(__file__).resolve().parent.parent
    head = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()
    args.logs.mkdir(parents=True, exist_ok=True)
    burners = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(args.burners)]
    for b in burners:
        b.start()
    print(f"flake-check: {args.runs} runs of `make test` on {head[:12]}, {args.burners} burner(s)")
    failures = 0
    try:
        for i in range(1, args.runs + 1):
            clone = pathlib.Path(tempfile.mkdtemp(prefix=f"shardcache-flake{i}-"))
            subprocess.run(["git", "clone", "--quiet", str(repo), str(clone)], check=True)
            subprocess.run(["git", "-C", str(clone), "checkout", "--quiet", head], check=True)
            log_path = args.logs / f"run{i}.log"
            started = time.monotonic()
            with log_path.open("w") as log:
                rc = subprocess.run(
                    ["make", "test"], cwd=clone, stdout=log, stderr=subprocess.STDOUT
                ).returncode
            took = time.monotonic() - started
            summary = _summary_line(log_path.read_text(errors="replace"))
            print(f"run {i}: rc={rc} in {took:.0f} s: {summary} (log {log_path})", flush=True)
            failures += rc != 0
            if not args.keep:
                subprocess.run(["rm", "-rf", str(clone)], check=False)
    finally:
        for b in burners:
            b.terminate()
    verdict = "no failures" if failures == 0 else f"{failures} failed run(s)"
    print(f"flake-check: {args.runs} runs, {verdict}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
