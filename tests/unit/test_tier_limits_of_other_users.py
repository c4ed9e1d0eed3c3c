"""The limit declarations (`.limits/`) of a tier directory shared by several users.

The directory was made 0777 without the sticky bit: any user of the tier could remove
another process's live declaration, and then evict that process's entries down to its
own, smaller, limit. It is 1777 now, like /tmp: only a file's owner (or root) removes
it. A dead process's declaration still counts nothing; another user's stays until a
process of that user (or of the directory's owner, the first to declare) finds it.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardcache.node import tiers

pytestmark = pytest.mark.unit

SETPRIV = shutil.which("setpriv")
OLD_UID, NEW_UID, FIRST_UID, GROUP = 2001, 2002, 2003, 3000
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def shared() -> Iterator[Path]:
    """A tier directory as the chart makes it: mode 2770, the sidecars' group."""
    if os.geteuid() != 0 or SETPRIV is None:
        pytest.skip("needs root and setpriv (util-linux) to run a tier as other users")
    top = Path(tempfile.mkdtemp(prefix="tier-limits-", dir="/tmp"))  # searchable by all
    os.chmod(top, 0o755)
    root = top / "disk"
    root.mkdir()
    os.chown(root, 0, GROUP)
    os.chmod(root, 0o2770)
    yield root
    shutil.rmtree(top, ignore_errors=True)


def as_user(uid: int, code: str, *, stdin: bool = False) -> subprocess.Popen[str]:
    assert SETPRIV is not None
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *sys.path]))
    return subprocess.Popen(
        [SETPRIV, f"--reuid={uid}", f"--regid={GROUP}", "--clear-groups",
         sys.executable, "-c", textwrap.dedent(code)],
        env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
    )  # fmt: skip


def run_as(uid: int, code: str) -> str:
    done = as_user(uid, code)
    out, err = done.communicate(timeout=60)
    assert done.returncode == 0, err
    return out


def inserts(root: Path, limit: int, key: str, *, then: str = "") -> str:
    return f"""
        import os, sys
        from pathlib import Path
        from shardcache.node import tiers
        tier = tiers.Tier(Path({str(root)!r}), limit_bytes={limit}, name="disk", wait_timeout=0.2)
        tier.insert({key!r}, 100, lambda p: p.write_bytes(b"x" * 100)).release()
        {then}
        """


def declarations(root: Path) -> dict[str, int]:
    """The limit of each declaration file, by its owner's uid."""
    return {p.name.split("-")[0]: p.stat().st_uid for p in (root / ".limits").iterdir()}


def test_the_limits_directory_is_sticky_whatever_the_umask(tmp_path: Path) -> None:
    before = os.umask(0o077)
    try:
        tiers.Tier(tmp_path, limit_bytes=300, name="disk").insert(
            "k", 100, lambda p: p.write_bytes(b"x" * 100)
        ).release()
    finally:
        os.umask(before)
    assert stat.S_IMODE((tmp_path / ".limits").stat().st_mode) == 0o1777


def test_a_directory_an_older_release_made_0777_is_made_sticky_by_its_owner(
    tmp_path: Path,
) -> None:
    (tmp_path / ".limits").mkdir()
    os.chmod(tmp_path / ".limits", 0o777)
    tiers.Tier(tmp_path, limit_bytes=300, name="disk").insert(
        "k", 100, lambda p: p.write_bytes(b"x" * 100)
    ).release()
    assert stat.S_IMODE((tmp_path / ".limits").stat().st_mode) == 0o1777


def test_another_user_cannot_remove_a_live_declaration(shared: Path) -> None:
    holder = as_user(OLD_UID, inserts(shared, 1000, "b0", then="print('ready', flush=True); sys.stdin.read()"), stdin=True)  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
        [declared] = (shared / ".limits").iterdir()
        attempt = f"""
            import os
            try:
                os.unlink({str(declared)!r})
                print("removed")
            except PermissionError:
                print("refused")
            """
        assert run_as(NEW_UID, attempt) == "refused\n"
        # So a smaller limit still counts against the live larger one: nothing evicted.
        run_as(NEW_UID, inserts(shared, 150, "s0"))
        assert sorted(tiers.Tier(shared, limit_bytes=1000, name="disk").keys()) == ["b0", "s0"]
    finally:
        holder.communicate(input="", timeout=60)


def test_a_declaration_made_under_umask_077_counts_for_another_user(shared: Path) -> None:
    """Declarations are made 0644 whatever the umask (`regular_files.open_regular`): a
    0600 one could not be opened by another user's process, which would count it as
    nothing and evict the live holder's entries to its own smaller limit."""
    keep = "print('ready', flush=True); sys.stdin.read()"
    holder = as_user(OLD_UID, "import os; os.umask(0o077)\n" + textwrap.dedent(inserts(shared, 1000, "b0", then=keep)), stdin=True)  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
        [declared] = (shared / ".limits").iterdir()
        assert stat.S_IMODE(declared.stat().st_mode) == 0o644
        run_as(NEW_UID, inserts(shared, 150, "s0"))
        assert sorted(tiers.Tier(shared, limit_bytes=1000, name="disk").keys()) == ["b0", "s0"]
    finally:
        holder.communicate(input="", timeout=60)


def test_another_users_dead_declaration_counts_nothing_and_its_user_removes_it(
    shared: Path,
) -> None:
    # The directory's owner may remove every file in it: a third user's here.
    run_as(FIRST_UID, inserts(shared, 100, "f0"))
    assert (shared / ".limits").stat().st_uid == FIRST_UID
    assert declarations(shared) == {}  # removed as it ended
    run_as(OLD_UID, inserts(shared, 1000, "b0", then="os._exit(0)"))  # as if killed
    assert declarations(shared) == {"1000": OLD_UID}
    run_as(NEW_UID, inserts(shared, 150, "s0", then="os._exit(0)"))
    # Its limit counted nothing (b0 evicted for s0); the file is not NEW_UID's to remove.
    assert tiers.Tier(shared, limit_bytes=1000, name="disk").keys() == ["s0"]
    assert declarations(shared) == {"1000": OLD_UID, "150": NEW_UID}
    run_as(OLD_UID, inserts(shared, 200, "b1"))
    # OLD_UID's next process removed its own dead declaration, not NEW_UID's.
    assert declarations(shared) == {"150": NEW_UID}
