"""batchbound/files.py on targets that are not files to replace: a device (``--output
/dev/null``: replacing it, as root, turned the system's /dev/null into a regular file), a
FIFO, and a descriptor's name (``--output /dev/stdout > run.log``: the log was replaced by
the result alone, and the lines written after it went to the unlinked old file). Those are
written in place, as ``open(path)`` would, appended where a regular file is behind."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from batchbound.files import write_through, write_whole

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
def test_a_character_device_stays_a_device(tmp_path: Path) -> None:
    null = tmp_path / "null"
    os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    write_whole(null, "result")
    write_through(null, lambda tmp: tmp.write_text("figure"))
    assert stat.S_ISCHR(os.stat(null).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["null"]  # no temporary file left


def test_a_fifo_is_written_not_replaced(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    write_whole(fifo, "result")
    reader.join(timeout=10)
    assert got == [b"result"] and stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_stdout_redirected_to_a_log_keeps_the_log(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    script = ("import sys\nfrom batchbound.files import write_whole\n"
              "print('before', flush=True)\nwrite_whole('/dev/stdout', 'RESULT\\n')\n"
              "print('after', flush=True)\n")
    with log.open("w") as out:
        subprocess.run([sys.executable, "-c", script], stdout=out, check=True,
                       env={**os.environ, "PYTHONPATH": str(SRC)})
    assert log.read_text() == "before\nRESULT\nafter\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.log"]


def test_a_replaced_file_keeps_its_permissions(tmp_path: Path) -> None:
    """`--output` over a file made private (0600): written in place before, its mode was
    kept; a replacement made it 0644 (the umask's), readable by everyone."""
    for write in (lambda p: write_whole(p, "new"),
                  lambda p: write_through(p, lambda tmp: tmp.write_text("new"))):
        target = tmp_path / "result.json"
        target.write_text("old")
        target.chmod(0o600)
        write(target)
        assert target.read_text() == "new" and stat.S_IMODE(target.stat().st_mode) == 0o600
        target.unlink()


def test_a_number_no_pid_can_be_neither_crashes_the_write_nor_goes(tmp_path: Path) -> None:
    """A hidden file whose 'pid' no process can have (os.kill raised OverflowError after the
    write had succeeded: a checkpoint's save ended in a traceback) is not ours: it stays."""
    from batchbound.files import host_tag

    odd = tmp_path / f".ck.pt.{host_tag()}.{2**70}.0123abcd.tmp"
    odd.write_bytes(b"x")
    write_whole(tmp_path / "ck.pt", b"checkpoint")
    assert odd.exists() and (tmp_path / "ck.pt").read_bytes() == b"checkpoint"


def test_train_output_to_a_pipe_is_written_there(tmp_path: Path) -> None:
    """`batchbound train ... --output /dev/stdout | jq`: refused as 'cannot write /dev/stdout:
    No such file or directory' (the claim on the output made a lock file beside the pipe's
    name under /proc); a stream is no file another run could write at the same time."""
    done = subprocess.run(
        [sys.executable, "-m", "batchbound", "train", "--dataset", "digits", "--model",
         "fc(depth=1,width=8)", "--max-iterations", "2", "--no-progress", "--json",
         "--output", "/dev/stdout"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
        env={**os.environ, "PYTHONPATH": str(SRC)})
    assert done.returncode == 0, done.stderr
    assert '"config_hash"' in done.stdout and done.stdout.rstrip().endswith("}")
    assert list(tmp_path.iterdir()) == []
