"""K rank processes of `make bench-node` (`bench.node_rank`), started and driven as one.

A group is started before it is timed (interpreters, imports), then told to go at one
instant on the machine-wide monotonic clock; each pass comes back as one `Pass`, which
`Expected.check` holds against the dataset: together the ranks read every row once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
#: Seconds between telling the ranks to go and the go itself, so all K start together.
START_DELAY_S = 0.2
#: Seconds a stopped rank gets to close its dataset (unregister) and exit.
STOP_TIMEOUT_S = 60.0


@dataclasses.dataclass
class Pass:
    """One epoch read by K ranks in one mode: what each rank reported (`node_rank`)."""

    ranks: list[dict[str, Any]]

    @property
    def seconds(self) -> float:
        """From the common go to the last rank's end."""
        return max(float(r["end_s"]) for r in self.ranks)

    def total(self, key: str) -> int:
        return sum(int(r[key]) for r in self.ranks)

    def gbps(self) -> float:
        """Token bytes (4 per int32 token) per second, all ranks together."""
        return self.total("tokens") * 4 / self.seconds / 1e9


@dataclasses.dataclass(frozen=True)
class Expected:
    """What one epoch holds, from the decoded files (`node_ceiling.Ceiling`)."""

    rows: int
    tokens: int
    token_sum: int

    def check(self, what: str, p: Pass, *, verify_rows: bool) -> None:
        """Exit with FAILED unless the ranks read every row and token once: counts and
        sums always (the uids are 0..rows-1), every uid with `verify_rows`."""
        found = (p.total("rows"), p.total("uid_sum"), p.total("tokens"), p.total("token_sum"))
        wanted = (self.rows, self.rows * (self.rows - 1) // 2, self.tokens, self.token_sum)
        if found != wanted:
            raise SystemExit(
                f"FAILED: {what} read (rows, uid sum, tokens, token sum) = {found}, "
                f"expected {wanted}"
            )
        if verify_rows:
            uids = sorted(u for r in p.ranks for u in r["uids"])
            if uids != list(range(self.rows)):
                raise SystemExit(f"FAILED: {what}: the ranks did not read every row exactly once")


class Ranks:
    """K rank processes in one mode ("raw" or "sidecar"), driven pass by pass."""

    def __init__(
        self, mode: str, k: int, work: Path, env: dict[str, str], config: dict[str, Any]
    ) -> None:
        self.mode = mode
        self.procs: list[subprocess.Popen[str]] = []
        self.logs: list[Path] = []
        for rank in range(k):
            path = work / f"rank-{mode}-{k}-{rank}.json"
            path.write_text(json.dumps({**config, "mode": mode, "rank": rank, "world_size": k}))
            log = work / f"rank-{mode}-{k}-{rank}.log"
            self.logs.append(log)
            with open(log, "w") as err:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "bench.node_rank", str(path)],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=err,
                        text=True,
                        cwd=REPO,
                        env=env,
                    )
                )
        for i in range(k):
            self._read(i)  # {"ready": true}: imported

    def _read(self, i: int) -> dict[str, Any]:
        proc = self.procs[i]
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            proc.wait(STOP_TIMEOUT_S)
            raise SystemExit(
                f"{self.mode} rank {i} exited with {proc.returncode}:\n"
                + self.logs[i].read_text()[-3000:]
            )
        answer: dict[str, Any] = json.loads(line)
        return answer

    def run(self, epoch: int, go: float | None = None) -> Pass:
        """One epoch, all K ranks starting at `go` (default: in `START_DELAY_S`)."""
        go = time.monotonic() + START_DELAY_S if go is None else go
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps({"go": go, "epoch": epoch}) + "\n")
            proc.stdin.flush()
        return Pass([self._read(i) for i in range(len(self.procs))])

    def close(self) -> None:
        """Stop the ranks; they close their datasets (readers unregister). Idempotent."""
        for proc in self.procs:
            assert proc.stdin is not None
            if not proc.stdin.closed:
                with contextlib.suppress(OSError, ValueError):
                    proc.stdin.write(json.dumps({"stop": True}) + "\n")
                    proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def started(
    mode: str, k: int, work: Path, env: dict[str, str], config: dict[str, Any]
) -> Iterator[Ranks]:
    group = Ranks(mode, k, work, env, config)
    try:
        yield group
    finally:
        group.close()
