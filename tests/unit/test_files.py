"""batchbound/files.py: every file the project writes is whole or not at all, and the
temporary files of writers killed mid-write are removed by the next write of the target."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from batchbound.files import remove_stale_temps, write_new, write_through, write_whole
from batchbound.study.store import Store, export


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(done.stdout)


def _hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_a_write_that_fails_keeps_the_file_as_it_was_and_leaves_nothing(tmp_path):
    target = tmp_path / "out.csv"
    write_whole(target, "a,b\n1,2\n")

    def half(tmp: Path) -> None:
        tmp.write_text("a,b\n1,")
        raise OSError(27, "File too large")

    with pytest.raises(OSError, match="too large"):
        write_through(target, half)
    assert target.read_text() == "a,b\n1,2\n" and _hidden(tmp_path) == []


def test_bytes_text_and_new_names(tmp_path):
    write_whole(tmp_path / "b.bin", memoryview(b"\x00\x01"))
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    first = write_new(tmp_path, "r-", ".json", "{}")
    second = write_new(tmp_path, "r-", ".json", "{}")
    assert first != second and first.read_text() == "{}" and _hidden(tmp_path) == []


def test_a_dead_writers_temporary_file_goes_a_live_ones_and_a_users_stay(tmp_path):
    target = tmp_path / "ck.pt"
    from batchbound.files import host_tag

    host = host_tag()
    dead = tmp_path / f".ck.pt.{host}.{_dead_pid()}.0123abcd.tmp"
    live = tmp_path / f".ck.pt.{host}.{os.getpid()}.0123abcd.tmp"
    users = [tmp_path / ".ck.pt.5.bak", tmp_path / ".ck.pt.swp", tmp_path / ".ck.pt.12.notours.tmp",
             tmp_path / f".ck.pt.{host}.12.notours.tmp"]
    for path in [dead, live, *users]:
        path.write_bytes(b"x")
    write_whole(target, b"checkpoint")
    assert not dead.exists() and live.exists() and all(p.exists() for p in users)
    remove_stale_temps(target)  # idempotent
    assert live.exists()


def test_an_export_cut_short_keeps_the_earlier_tables(tmp_path, monkeypatch):
    store = Store(tmp_path / "s.sqlite")
    export(store, tmp_path / "csv", "csv")
    before = {p.name: p.read_bytes() for p in (tmp_path / "csv").iterdir()}
    def full_disk(self, path, *args, **kwargs):  # the first bytes, then the disk is full
        Path(path).write_text("run")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pd.DataFrame, "to_csv", full_disk)
    with pytest.raises(OSError, match="No space"):
        export(store, tmp_path / "csv", "csv")
    after = {p.name: p.read_bytes() for p in (tmp_path / "csv").iterdir()}
    assert after == before


def test_another_hosts_temporary_file_stays_whatever_its_pid(tmp_path):
    """A folder shared by several hosts (NFS, a cluster's home): a pid says nothing about a
    process on another host, so the temporary file of a writer there is never removed here,
    whether its pid is dead here or alive here; this host's dead writer's is. A name from
    before the host was in it (no host) is nobody's to judge, and stays too."""
    from batchbound.files import host_tag

    target = tmp_path / "ck.pt"
    dead = _dead_pid()
    other = host_tag("node-b.cluster.example")
    assert other != host_tag() and "." not in other
    theirs = [tmp_path / f".ck.pt.{other}.{dead}.0123abcd.tmp",  # dead here, maybe not there
              tmp_path / f".ck.pt.{other}.{os.getpid()}.0123abcd.tmp",
              tmp_path / f".ck.pt.{dead}.0123abcd.tmp"]  # the old name, without a host
    ours = tmp_path / f".ck.pt.{host_tag()}.{dead}.0123abcd.tmp"
    for path in [*theirs, ours]:
        path.write_bytes(b"x")
    write_whole(target, b"checkpoint")
    assert all(p.exists() for p in theirs) and not ours.exists()
    # this process's own temporary files carry this host
    written: list[str] = []
    write_through(target, lambda tmp: written.append(tmp.name) or tmp.write_bytes(b"y"))
    assert written[0].startswith(f".ck.pt.{host_tag()}.{os.getpid()}.")
    # two host names alike once made safe for a file name stay apart
    assert host_tag("a.b") != host_tag("a_b")


def test_a_long_name_is_written_and_its_dead_writers_temp_removed(tmp_path):
    """A name near the 255-byte limit: the temporary file's name (host, pid, random part
    added) went past it, and the write failed with "File name too long"."""
    from batchbound.files import _temp_name

    for name in ("a" * 250, "é" * 120 + ".json"):  # bytes, not characters, count
        target = tmp_path / name
        write_whole(target, "{}")
        write_whole(target, "{}")  # over an existing one: os.replace
        assert target.read_text() == "{}" and _hidden(tmp_path) == []
        dead = _temp_name(target)
        dead = dead.with_name(dead.name.replace(f".{os.getpid()}.", f".{_dead_pid()}.", 1))
        assert len(os.fsencode(dead.name)) <= 255
        dead.write_bytes(b"x")
        remove_stale_temps(target)
        assert not dead.exists()
