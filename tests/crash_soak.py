"""`make soak`: the crash matrix at random, for a nightly-size run (not in `make test`).

Draws a fault point and a count (the n-th time the point is reached) at random, runs
that episode (tests/support/crashes.py: kill, restart, check every invariant), and
repeats until `--kills` kills were survived. Any broken invariant stops the run with
the episode's seed, point and count, so it can be replayed. Prints a summary per point
and, with `--report`, writes it as Markdown for docs/faults.md.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import random
import shutil
import signal
import sys
import tempfile
import time

from tests.support import crashes, s3server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=100, help="kills to survive (100)")
    parser.add_argument("--seed", type=int, default=None, help="replay a run")
    parser.add_argument("--minio", type=pathlib.Path, default=None, help="MinIO binary")
    parser.add_argument("--report", type=pathlib.Path, default=None, help="Markdown out")
    args = parser.parse_args()
    # SIGTERM (a CI timeout) unwinds through the finally below: MinIO and agents stop.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    rng = random.Random(seed)
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="shardcache-soak-"))
    server = s3server.S3Server(args.minio or s3server.minio_binary(), workdir / "minio")
    server.start()
    survived: collections.Counter[str] = collections.Counter()
    started = time.monotonic()
    try:
        for episode in range(args.kills):
            reaches = {**crashes.CHECKPOINT_REACHES, **crashes.CACHE_REACHES}
            point = rng.choice(sorted(reaches))
            count = rng.randint(1, reaches[point])
            where = workdir / f"episode-{episode}"
            where.mkdir()
            print(f"[{episode + 1}/{args.kills}] kill at {point}:{count} ...", flush=True)
            try:
                if point in crashes.CACHE_REACHES:
                    crashes.cache_episode(where, point, count)
                else:
                    crashes.checkpoint_episode(server, server.make_bucket(), where, point, count)
            except AssertionError as exc:
                print(f"FAILED at {point}:{count} (seed {seed}, episode {episode}): {exc}")
                return 1
            survived[f"{point}:{count}"] += 1
            shutil.rmtree(where, ignore_errors=True)
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    minutes = (time.monotonic() - started) / 60
    lines = [
        f"{sum(survived.values())} kills survived, nothing lost or served wrong "
        f"(seed {seed}, {minutes:.1f} min):",
        "",
        "| fault point:n | kills |",
        "|---|---|",
        *(f"| `{name}` | {n} |" for name, n in sorted(survived.items())),
    ]
    print("\n".join(lines))
    if args.report is not None:
        args.report.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
