"""Tier 1 (pure, files only): the isolation of a script replay's runs (fault_injection.sandbox, issue 46).

Each run starts from a copy of the working directory as it was before the replay (files copied, big ones and
read-only folders linked, the replay's own work dir left out); what the clean run saved outside it with
torch.save is put back between runs; a run that wrote through a link to the user's file is said."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from distdebug.fault_injection import sandbox
from distdebug.fault_injection.console import isolation as said
from distdebug.fault_injection.sandbox import BACKUP_FOLDER, Isolation, Snapshot, before_save, restore, saved_outside


def tree(root: Path) -> dict[str, object]:
    """Relative path -> bytes of a file, ('link', target) of a symlink, 'dir' of a folder."""
    out: dict[str, object] = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            out[rel] = ("link", os.readlink(p))
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = p.read_bytes()
    return out


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A user's working directory: code, a nested config, a big file, version control, a virtualenv,
    bytecode, symlinks (inside, climbing out, absolute) and a sibling folder beside it."""
    cwd = tmp_path / "project"
    (cwd / "conf" / "deep").mkdir(parents=True)
    (cwd / "train.py").write_text("print('train')\n")
    (cwd / "conf" / "deep" / "model.yaml").write_text("width: 8\n")
    (cwd / "data").mkdir()
    (cwd / "data" / "shard.bin").write_bytes(b"x" * 4000)
    (cwd / "data" / "labels.csv").write_text("a,b\n")
    (cwd / ".git").mkdir()
    (cwd / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (cwd / "venv").mkdir()
    (cwd / "venv" / "pyvenv.cfg").write_text("home = /usr\n")
    (cwd / "__pycache__").mkdir()
    (cwd / "__pycache__" / "train.cpython-311.pyc").write_bytes(b"pyc")
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "vocab.txt").write_text("vocab\n")
    os.symlink("conf/deep/model.yaml", cwd / "model.yaml")  # inside: stays relative
    os.symlink("../shared/vocab.txt", cwd / "vocab.txt")  # climbs out: made absolute
    os.symlink("/etc/hostname", cwd / "host")  # absolute: as it is
    return cwd


def test_the_copy_holds_the_files_links_what_is_big_or_only_read_and_keeps_symlinks(project, tmp_path):
    snap = Snapshot.take(project, max_file=1000)
    dest = tmp_path / "copy"
    snap.make(dest)
    got = tree(dest)
    # Files copied (bytes and mtime), nested folders made.
    assert got["train.py"] == b"print('train')\n" and got["conf/deep/model.yaml"] == b"width: 8\n"
    assert got["data/labels.csv"] == b"a,b\n" and got["data"] == "dir"
    assert (dest / "train.py").stat().st_mtime_ns == (project / "train.py").stat().st_mtime_ns
    assert not (dest / "train.py").is_symlink()
    # Bigger than the size per file: linked to the user's. Version control and a virtualenv: linked whole.
    assert got["data/shard.bin"] == ("link", str(project / "data" / "shard.bin"))
    assert got[".git"] == ("link", str(project / ".git")) and got["venv"] == ("link", str(project / "venv"))
    # Bytecode copied with its source's time kept (valid: no run compiles the copy again), never linked (Python
    # would write the copy's bytecode into the user's folder).
    assert got["__pycache__"] == "dir" and got["__pycache__/train.cpython-311.pyc"] == b"pyc"
    # Symlinks stay symlinks; one that climbs out of the tree points where it pointed from the original.
    assert got["model.yaml"] == ("link", "conf/deep/model.yaml")
    assert (dest / "model.yaml").read_text() == "width: 8\n" and (dest / "model.yaml").resolve().is_relative_to(dest)
    assert got["vocab.txt"] == ("link", str(tmp_path / "shared" / "vocab.txt"))
    assert got["host"] == ("link", "/etc/hostname")
    assert {e.rel: e.why for e in snap.linked} == {".git": "folder", "venv": "folder", "data/shard.bin": "big"}
    # What a run writes stays in its copy.
    (dest / "snapshot.pt").write_bytes(b"state")
    (dest / "train.py").write_text("changed")
    assert not (project / "snapshot.pt").exists() and (project / "train.py").read_text() == "print('train')\n"


def test_the_budget_copies_the_smallest_files_first_and_links_the_rest(tmp_path):
    for name, size in (("a.py", 10), ("b.bin", 300), ("c.bin", 200), ("d.cfg", 20)):
        (tmp_path / "src").mkdir(exist_ok=True)
        (tmp_path / "src" / name).write_bytes(b"z" * size)
    snap = Snapshot.take(tmp_path / "src", budget=240)
    assert [e.rel for e in snap.copied] == ["a.py", "d.cfg", "c.bin"]  # 230 bytes of 240
    assert [(e.rel, e.why) for e in snap.linked] == [("b.bin", "budget")]


def test_the_work_dir_inside_the_working_directory_is_never_in_the_copy(project, tmp_path):
    """The default work dir is ./distdebug-runs/<time>-faults: inside the tree copied. It is left out, the folder
    that holds it is made (a link to it would hold the copy itself), and the earlier runs beside it are linked."""
    runs = project / "distdebug-runs"
    work = runs / "20261204-faults"
    (work / "clean-script" / "run").mkdir(parents=True)
    (runs / "older-faults").mkdir()
    (runs / "older-faults" / "events.jsonl").write_text("{}\n")
    (project / "elsewhere-runs").mkdir()
    snap = Snapshot.take(project, exclude=(work,))
    dest = tmp_path / "copy"
    snap.make(dest)
    assert (dest / "distdebug-runs").is_dir() and not (dest / "distdebug-runs").is_symlink()
    assert not (dest / "distdebug-runs" / "20261204-faults").exists()
    assert os.readlink(dest / "distdebug-runs" / "older-faults") == str(runs / "older-faults")
    # Any other distdebug-runs folder is linked whole.
    nested = project / "sub" / "distdebug-runs"
    nested.mkdir(parents=True)
    assert {e.rel: e.kind for e in Snapshot.take(project, exclude=(work,)).entries}["sub/distdebug-runs"] == "link"


def test_a_folder_of_many_entries_is_linked_whole(tmp_path):
    src = tmp_path / "src"
    (src / "images" / "cat").mkdir(parents=True)
    for i in range(30):
        (src / "images" / "cat" / f"{i}.jpg").write_bytes(b"j")
    (src / "images" / "index.txt").write_text("cat\n")
    (src / "train.py").write_text("")
    snap = Snapshot.take(src, max_entries=20)
    assert {e.rel: (e.kind, e.why) for e in snap.linked} == {"images/cat": ("link", "many")}
    assert [e.rel for e in snap.copied] == ["train.py", "images/index.txt"]  # the folder's other entries copied


def test_bytecode_is_copied_whole_or_left_out_never_linked(tmp_path):
    """A __pycache__ too big for the copy, or of too many entries, is left out (the run compiles its sources
    again), never linked: Python would write the copy's bytecode into the user's folder."""
    src = tmp_path / "src"
    for pkg, n in (("small", 2), ("wide", 30)):
        (src / pkg / "__pycache__").mkdir(parents=True)
        for i in range(n):
            (src / pkg / "__pycache__" / f"m{i}.cpython-311.pyc").write_bytes(b"c")
    (src / "small" / "__pycache__" / "huge.cpython-311.pyc").write_bytes(b"c" * 2000)
    snap = Snapshot.take(src, max_entries=20, max_file=1000)
    assert snap.linked == []
    assert [e.rel for e in snap.copied] == [f"small/__pycache__/m{i}.cpython-311.pyc" for i in (0, 1)]
    assert [e.rel for e in snap.entries if e.kind == "dir"] == ["small", "small/__pycache__", "wide"]


def test_the_script_is_run_from_the_copy_when_it_is_in_the_working_directory(project, tmp_path):
    before = tree(project)
    iso = Isolation(project, project / "distdebug-runs" / "w", max_file=1000)
    copy = iso.copy(tmp_path / "cell")
    assert copy == tmp_path / "cell" / "cwd" / "project"
    assert iso.script(["train.py", "--lr", "1"], copy) == [str(copy / "train.py"), "--lr", "1"]
    assert iso.script([str(project / "train.py")], copy) == [str(copy / "train.py")]
    assert iso.script(["../shared/run.py"], copy) == [str(tmp_path / "shared" / "run.py")]
    assert iso.script(["/opt/run.py"], copy) == ["/opt/run.py"]
    # Beside the copy, what is beside the working directory: a path that climbs out finds the same file.
    assert (copy / ".." / "shared" / "vocab.txt").read_text() == "vocab\n"
    iso.remove_copy(tmp_path / "cell")
    assert not (tmp_path / "cell" / "cwd").exists()
    # Removing the copy removes links, never what they point to (the big file, .git, the sibling folder).
    assert tree(project) == before and (tmp_path / "shared" / "vocab.txt").read_text() == "vocab\n"


def test_paths_saved_outside_are_backed_up_once_and_put_back(tmp_path):
    work = tmp_path / "project" / "distdebug-runs" / "w"
    backups = str(work / BACKUP_FOLDER)
    outside = tmp_path / "ckpt"
    outside.mkdir()
    (outside / "old.pt").write_bytes(b"original")
    # Before the clean run's first save to each path (each rank calls it: the first claims the path).
    assert before_save(str(outside / "new.pt"), backups) is False
    assert before_save(str(outside / "old.pt"), backups) is True
    (outside / "old.pt").write_bytes(b"by rank 0")
    assert before_save(str(outside / "old.pt"), backups) is True  # rank 1, after rank 0 saved: not kept again
    (outside / "new.pt").write_bytes(b"made by the run")
    assert before_save(str(outside / "opened.pt"), backups, opened=True) is None  # the script opened it itself
    assert before_save(str(work / "clean-script" / "cwd" / "p" / "snapshot.pt"), backups) is False  # in a copy
    saved = saved_outside(Path(backups))
    assert [(Path(s.path).name, s.existed) for s in saved] == [("new.pt", False), ("old.pt", True),
                                                                ("opened.pt", None)]
    assert restore(saved) == []
    assert sorted(p.name for p in outside.iterdir()) == ["old.pt"]
    assert (outside / "old.pt").read_bytes() == b"original"
    assert restore(saved) == []  # again after the next run: nothing left to do is no problem
    assert before_save(str(outside / "x.pt"), None) is False  # not the replay's clean run: nothing kept
    assert len(saved_outside(Path(backups))) == 3


def test_a_run_that_writes_through_a_link_to_the_users_file_is_said_once(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "data.bin").write_bytes(b"d" * 100)
    (src / "train.py").write_text("")
    iso = Isolation(src, tmp_path / "work", max_file=50)
    copy = iso.copy(tmp_path / "work" / "clean-script")
    iso.watch("clean")
    assert iso.changed == []  # read, not written
    with open(copy / "data.bin", "ab") as f:  # through the link: the user's file
        f.write(b"more")
    iso.watch("nan_grad")
    iso.watch("bitflip_param")
    assert [(run, e.rel) for run, e in iso.changed] == [("nan_grad", "data.bin")]
    lines, warnings = said(iso)
    assert lines == [f"each run started from a copy of {src} (1 file, 0 B; linked, not copied: data.bin (100 B))"]
    assert warnings == [f"warning: the run nan_grad changed {src / 'data.bin'} through its link to your file "
                        "(linked, not copied: bigger than the size copied per file); the replay cannot undo it"]


def test_what_was_isolated_is_said_in_one_line_and_the_paths_put_back_in_another(project, tmp_path):
    work = project / "distdebug-runs" / "w"
    iso = Isolation(project, work, max_file=1000)
    (tmp_path / "ckpt").mkdir()
    before_save(str(tmp_path / "ckpt" / "model.pt"), str(iso.backups))
    iso.learn()
    iso.serial_from = 2
    lines, warnings = said(iso)
    size = sum(len(p.read_bytes()) for p in (project / "train.py", project / "conf/deep/model.yaml",
                                            project / "data/labels.csv", project / "__pycache__/train.cpython-311.pyc"))
    assert lines == [
        f"each run started from a copy of {project} (4 files, {size} B; linked, not copied: .git/, "
        "data/ (1 file, 4.0 kB), venv/)",
        f"restored between runs: {tmp_path / 'ckpt' / 'model.pt'} (created by the clean run); the runs went one "
        "at a time (not -j 2): they all write there"]
    assert warnings == []
    iso.restore()
    iso.close()
    assert not iso.backups.exists()


def test_an_unreadable_folder_is_linked_and_the_copy_is_still_made(tmp_path, monkeypatch):
    src = tmp_path / "src"
    (src / "locked").mkdir(parents=True)
    (src / "train.py").write_text("")
    scandir = os.scandir

    def denied(path):  # a folder root could read whatever its mode: refused as it is to a user
        if Path(path).name == "locked":
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", denied)
    snap = Snapshot.take(src)
    snap.make(tmp_path / "copy")
    assert [(e.rel, e.why) for e in snap.linked] == [("locked", "other")]
    assert (tmp_path / "copy" / "locked").is_symlink() and (tmp_path / "copy" / "train.py").is_file()


def test_a_replay_cut_short_in_the_clean_run_puts_the_paths_back_and_keeps_what_it_could_not(tmp_path):
    """Ctrl-C during the clean run: nothing was learnt yet, restore() reads the backups itself; close() removes
    them only when every path was put back, else keeps them and says where."""
    src, outside = tmp_path / "src", tmp_path / "ckpt"
    src.mkdir()
    outside.mkdir()
    (outside / "user.pt").write_bytes(b"the user's checkpoint")
    iso = Isolation(src, tmp_path / "work")
    before_save(str(outside / "user.pt"), str(iso.backups))
    (outside / "user.pt").write_bytes(b"by the clean run")  # then Ctrl-C: no learn()
    iso.restore()
    iso.close()
    assert (outside / "user.pt").read_bytes() == b"the user's checkpoint"
    assert not iso.backups.exists() and iso.kept is None
    # A copy cut short (the claimer killed mid-copy): never copied back, kept, and said.
    iso = Isolation(src, tmp_path / "work2")
    before_save(str(outside / "user.pt"), str(iso.backups))
    slot = next(iso.backups.iterdir())
    (slot / "entry.json").write_text(json.dumps({"path": str(outside / "user.pt"), "existed": None}))
    (slot / "original").write_bytes(b"the user's")
    iso.restore()
    iso.close()
    assert (outside / "user.pt").read_bytes() == b"the user's checkpoint" and iso.kept == iso.backups
    assert (slot / "original").is_file()
    assert said(iso)[1] == [f"warning: not every path the clean run saved to outside could be put back; what was "
                            f"there is kept in {iso.backups}"]
    # close() without a finished restore() keeps them too.
    iso = Isolation(src, tmp_path / "work3")
    before_save(str(outside / "user.pt"), str(iso.backups))
    iso.close()
    assert iso.backups.is_dir() and iso.kept == iso.backups


def test_a_rank_that_loses_the_claim_waits_for_the_winners_copy(tmp_path, monkeypatch):
    """Two ranks save to one path outside: the loser's torch.save would truncate the file while the winner still
    copies it; it waits until the winner's entry says the copy is done (bounded)."""
    outside = tmp_path / "ckpt"
    outside.mkdir()
    user = outside / "user.pt"
    user.write_bytes(b"u" * 1000)
    backups = str(tmp_path / "work" / BACKUP_FOLDER)
    copying, finish = threading.Event(), threading.Event()
    real_copy = sandbox.shutil.copy2

    def slow_copy(a, b, *args, **kwargs):  # the winner, mid-copy
        copying.set()
        assert finish.wait(10)
        return real_copy(a, b, *args, **kwargs)

    monkeypatch.setattr(sandbox.shutil, "copy2", slow_copy)
    winner = threading.Thread(target=before_save, args=(str(user), backups))
    winner.start()
    assert copying.wait(10)
    loser = threading.Thread(target=lambda: (before_save(str(user), backups), user.write_bytes(b"rank 1")))
    loser.start()
    loser.join(0.3)
    assert loser.is_alive()  # waiting: the user's file not truncated under the winner's copy
    finish.set()
    winner.join(10)
    loser.join(10)
    assert not loser.is_alive()
    assert restore(saved_outside(Path(backups))) == [] and user.read_bytes() == b"u" * 1000
    # A claimer that died before its copy was done: the wait is bounded.
    slot = Path(backups) / "dead"
    slot.mkdir()
    assert sandbox._wait_done(slot, 0.1) is False


def test_the_clean_run_writing_through_a_link_makes_the_runs_go_one_at_a_time_and_says_so(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "data.bin").write_bytes(b"d" * 100)
    iso = Isolation(src, tmp_path / "work", max_file=50)
    iso.serial_from = 2  # as _replay_script sets it when the clean run's watch found a change
    assert said(iso)[0][1:] == ["the runs went one at a time (not -j 2): the clean run wrote through a link to "
                                "your file"]


def test_the_script_given_through_a_linked_path_runs_from_the_copy(project, tmp_path):
    """The working directory reached through a symlink (macOS's /tmp, a linked home), or SCRIPT given by a linked
    path: both sides resolved, the script still runs from the copy, never the user's in place."""
    link = tmp_path / "linked"
    os.symlink(project, link)
    iso = Isolation(link, tmp_path / "work", max_file=1000)
    copy = iso.copy(tmp_path / "cell")
    assert iso.script([str(link / "train.py")], copy) == [str(copy / "train.py")]
    assert iso.script([str(project / "train.py")], copy) == [str(copy / "train.py")]


def test_the_run_dirs_of_cells_whose_fault_did_not_act_are_kept(tmp_path):
    from distdebug.fault_injection.matrix import Cell, _prune

    cells = []
    for status in ("caught-localised", "did-not-act", "miss"):
        run = tmp_path / status / "run"
        run.mkdir(parents=True)
        cells.append(Cell(fault=status, engine="script", spec="", status=status, run_dir=str(run)))
    _prune(cells, keep=False)
    assert [(c.status, bool(c.run_dir), (tmp_path / c.status).exists()) for c in cells] == [
        ("caught-localised", False, False), ("did-not-act", True, True), ("miss", True, True)]


def test_a_backup_the_disk_refuses_is_said_at_restore_and_no_rank_waits_for_it(tmp_path):
    # The replay's work dir (where the backups go) on a file system too small for the checkpoint: the copy
    # fails with ENOSPC; the claim still ends (the other ranks' saves do not wait out CLAIM_WAIT_S), and the
    # restore says the path cannot be put back instead of leaving it silently overwritten.
    import time

    from tests.helpers import small_fs

    outside = tmp_path / "ckpt"
    outside.mkdir()
    (outside / "big.pt").write_bytes(b"x" * (512 << 10))
    with small_fs(tmp_path / "fs", 256) as fs:
        work = fs / "distdebug-runs" / "w"
        backups = str(work / BACKUP_FOLDER)
        assert before_save(str(outside / "big.pt"), backups) is True
        t0 = time.monotonic()
        assert before_save(str(outside / "big.pt"), backups) is True  # rank 1: the claim is over at once
        assert time.monotonic() - t0 < 5
        (saved,) = saved_outside(Path(backups))
        assert saved.existed and saved.backup is None and "space" in (saved.failed or "")
        (problem,) = restore([saved])
        assert problem.startswith(f"could not put back {outside / 'big.pt'}: no copy of it could be kept")
    twin = tmp_path / "twin" / "distdebug-runs" / "w" / BACKUP_FOLDER  # the same on a disk with room
    assert before_save(str(outside / "big.pt"), str(twin)) is True
    (kept,) = saved_outside(twin)
    assert kept.backup is not None and kept.failed is None and restore([kept]) == []
