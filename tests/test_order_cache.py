"""The epoch order cache (``DocumentReader(order_cache=...)``, Megatron's ``--data-cache-path``): a large
dataset's epoch order is built once into a file and memory-mapped by every rank of a node. The order is
the in-memory one; resume stays exact; ranks racing to build it get one good file; a damaged file is
found by its checksums and rebuilt; an unusable directory is refused naming it. Issue 37: a full disk is a
one-line refusal (space reserved first), the files are team-readable and the lock any permitted user's,
a killed build's temp files go, and a refusal keeps why the file was unusable. Since issue 49 the cache holds
only ``ORDER_NUMPY_SHUFFLE``, the order of checkpoints saved before the Feistel order (which needs no file)."""

from __future__ import annotations

import multiprocessing
import os
import types

import numpy as np
import pytest
from test_stream_scale import synthetic  # the sparse synthetic corpus, one definition

from megatron_wlb.data import reader as reader_module
from megatron_wlb.data.reader import (
    ORDER_HEADER_BYTES,
    ORDER_NUMPY_SHUFFLE,
    DocumentReader,
    cached_order,
    check_order_file,
    order_cache_file,
    shuffled_order,
)
from megatron_wlb.megatron.data.packed import WlbDataIterator
from megatron_wlb.packing import PackingConfig, make_packer


@pytest.fixture
def small_threshold(monkeypatch):
    """Cache every order of at least 100 documents (the default keeps orders under 1e6 in memory)."""
    monkeypatch.setattr(reader_module, "ORDER_CACHE_MIN_DOCUMENTS", 100)


def blend(tmp_path, **reader_options) -> DocumentReader:
    """The two-corpus blend (written on the first call per ``tmp_path``), read with ``reader_options``."""
    rng = np.random.default_rng(0)
    if (tmp_path / "a.idx").exists():
        prefixes = (str(tmp_path / "a"), str(tmp_path / "b"))
    else:
        prefixes = (synthetic(tmp_path, "a", rng.integers(1, 3000, size=4000)),
                    synthetic(tmp_path, "b", rng.integers(1, 500, size=300)))
    return DocumentReader([(prefixes[0], 0.7), (prefixes[1], 0.3)], split="9,1,0", seed=5, **reader_options)


def test_the_cached_order_is_the_in_memory_order(tmp_path):
    for documents in (1, 1000, 1_234_567):
        got = cached_order(str(tmp_path / "cache"), 3, 1, 4, documents)
        assert isinstance(got, np.memmap) and np.array_equal(got, shuffled_order(3, 1, 4, documents))
    assert check_order_file(order_cache_file(str(tmp_path / "cache"), 3, 1, 4, 1000), 3, 1, 4, 1000) is None


def test_a_cached_stream_is_the_stream_and_resumes_exactly(tmp_path, small_threshold):
    cache = str(tmp_path / "cache")
    plain = blend(tmp_path, order=ORDER_NUMPY_SHUFFLE)
    cached = blend(tmp_path, order_cache=cache, order=ORDER_NUMPY_SHUFFLE)
    tokens = 40_000_000  # ~10 epochs of a, ~200 of b
    ids, lengths = plain.stream(tokens).collect()
    got_ids, got_lengths = cached.stream(tokens).collect()
    assert np.array_equal(got_ids, ids) and np.array_equal(got_lengths, lengths)
    assert isinstance(cached._epoch_order(0, 3), np.memmap)  # file-backed, not private memory
    assert len([f for f in os.listdir(cache) if f.endswith(".bin")]) > 10  # epochs of a and of b
    cfg = PackingConfig(seq_len=4096, n=2, dp=2, max_seq_len=6144)
    full = WlbDataIterator(plain, plain.stream(30 * cfg.tokens_per_iteration), make_packer("wlb", cfg), 0)
    plans = [full.next_plan().micro_batches for _ in range(12)]
    first = WlbDataIterator(cached, cached.stream(30 * cfg.tokens_per_iteration), make_packer("wlb", cfg), 0)
    for _ in range(5):
        first.next_plan()
    # a restarted rank: maps the files the first run built
    resumed_reader = blend(tmp_path, order_cache=cache, order=ORDER_NUMPY_SHUFFLE)
    resumed = WlbDataIterator(resumed_reader, resumed_reader.stream(30 * cfg.tokens_per_iteration),
                              make_packer("wlb", cfg), 0)
    resumed.load_state_dict(first.state_dict())
    assert [resumed.next_plan().micro_batches for _ in range(7)] == plans[5:]


def _build_in_a_process(directory: str, documents: int, queue) -> None:
    order = cached_order(directory, 11, 0, 0, documents)
    queue.put(int(np.asarray(order, dtype=np.int64) @ np.arange(documents, dtype=np.int64)))


def test_ranks_racing_to_build_get_one_good_file(tmp_path):
    documents, directory = 2_000_003, str(tmp_path / "cache")
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    ranks = [context.Process(target=_build_in_a_process, args=(directory, documents, queue)) for _ in range(4)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(120)
    assert [p.exitcode for p in ranks] == [0] * 4
    expected = int(shuffled_order(11, 0, 0, documents).astype(np.int64) @ np.arange(documents, dtype=np.int64))
    assert [queue.get(timeout=5) for _ in ranks] == [expected] * 4
    path = order_cache_file(directory, 11, 0, 0, documents)
    assert sorted(os.listdir(directory)) == sorted([os.path.basename(path), os.path.basename(path) + ".lock"])
    assert check_order_file(path, 11, 0, 0, documents) is None


@pytest.mark.parametrize("damage, reason", [
    ("body", "the order's checksum fails"),
    ("header", "the header checksum fails"),
    ("truncate", "bytes, expected"),
    ("other epoch", "its header is for seed, dataset, epoch, documents, bytes = [7, 0, 2, 5000, 4]"),
])
def test_a_damaged_cache_file_is_found_and_rebuilt(tmp_path, damage, reason):
    directory = str(tmp_path / "cache")
    path = order_cache_file(directory, 7, 0, 1, 5000)
    cached_order(directory, 7, 0, 1, 5000)
    if damage == "other epoch":  # another epoch's (valid) file under this name
        cached_order(directory, 7, 0, 2, 5000)
        os.replace(order_cache_file(directory, 7, 0, 2, 5000), path)
    else:
        with open(path, "r+b") as f:
            if damage == "truncate":
                f.truncate(ORDER_HEADER_BYTES + 100)
            else:
                f.seek(ORDER_HEADER_BYTES + 4 * 1234 if damage == "body" else 20)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0x5A]))
    assert reason in check_order_file(path, 7, 0, 1, 5000)
    with pytest.warns(UserWarning, match=f"epoch order cache {path}: .*; rebuilding it"):
        order = cached_order(directory, 7, 0, 1, 5000)
    assert np.array_equal(order, shuffled_order(7, 0, 1, 5000))
    assert check_order_file(path, 7, 0, 1, 5000) is None


def test_an_unusable_cache_directory_is_refused_naming_it(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=f"--data-cache-path {blocker}/cache: cannot write the epoch order cache"):
        cached_order(str(blocker / "cache"), 1, 0, 0, 10)


def test_megatron_data_cache_path_reaches_the_reader(tmp_path):
    from megatron_wlb.megatron import reader_from_args

    prefix = synthetic(tmp_path, "c", np.full(50, 7))
    args = types.SimpleNamespace(data_path=[prefix], split="1,0,0", seed=3, data_cache_path=str(tmp_path / "cache"))
    assert reader_from_args(args).order_cache == str(tmp_path / "cache")
    args.data_cache_path = None
    assert reader_from_args(args).order_cache is None


# -- issue 37: space reserved, team modes and lock, stale temp files, reasons kept (D4, D8-D11) ----------------
def _only_the_lock(directory: str, documents: int) -> bool:
    return os.listdir(directory) == [os.path.basename(order_cache_file(directory, 1, 0, 0, documents)) + ".lock"]


def test_a_full_cache_disk_is_refused_in_one_line_leaving_nothing(tmp_path, monkeypatch):
    import errno

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    directory = str(tmp_path / "cache")
    with pytest.raises(ValueError, match=rf"--data-cache-path {directory}: the epoch order .*docs5000\.bin needs "
                       rf"{ORDER_HEADER_BYTES + 4 * 5000} bytes and \d+ are free there \(No space left on device\)"
                       ) as caught:
        cached_order(directory, 1, 0, 0, 5000)
    assert "\n" not in str(caught.value) and _only_the_lock(directory, 5000)


FULL_DISK_SCRIPT = """
import os, sys
from megatron_wlb.data.reader import cached_order
try:
    cached_order(sys.argv[1], 1, 0, 0, 1_000_000)
except ValueError as exc:
    print("REFUSED", exc)
print("LEFT", sorted(os.listdir(sys.argv[1])))
"""


def test_a_really_full_tmpfs_is_refused_not_a_sigbus(tmp_path):
    """A 1 MiB tmpfs (mounted in a private mount namespace: root only) and an order of 4 MB."""
    import shutil
    import subprocess
    import sys

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("mounting a small tmpfs needs root and unshare")
    small = tmp_path / "small"
    small.mkdir()
    run = subprocess.run(["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=1m tmpfs "$1" || exit 77; shift; '
                          'exec "$@"', "sh", str(small), sys.executable, "-c", FULL_DISK_SCRIPT, str(small)],
                         capture_output=True, text=True, timeout=120)
    if run.returncode == 77:
        pytest.skip(f"cannot mount a tmpfs here: {run.stderr.strip()}")
    assert run.returncode == 0, (run.returncode, run.stderr)  # before: -7 (SIGBUS), the tmpfs left full
    assert f"REFUSED --data-cache-path {small}: the epoch order" in run.stdout and "No space left" in run.stdout
    assert "LEFT ['wlb-order-seed1-dataset0-epoch0-docs1000000.bin.lock']" in run.stdout, run.stdout


@pytest.mark.parametrize("umask, order_mode, lock_mode", [(0o022, 0o644, 0o664), (0o002, 0o644, 0o664),
                                                          (0o077, 0o600, 0o600), (0o027, 0o640, 0o660)],
                         ids=["umask022", "umask002", "umask077", "umask027"])
def test_cache_files_are_team_readable_and_the_lock_group_writable(tmp_path, umask, order_mode, lock_mode):
    old = os.umask(umask)
    try:
        cached_order(str(tmp_path / "cache"), 1, 0, 0, 1000)
    finally:
        os.umask(old)
    path = order_cache_file(str(tmp_path / "cache"), 1, 0, 0, 1000)
    assert (os.stat(path).st_mode & 0o777, os.stat(path + ".lock").st_mode & 0o777) == (order_mode, lock_mode)


def test_a_killed_build_s_temp_files_are_removed_under_the_lock(tmp_path):
    directory = tmp_path / "cache"
    directory.mkdir()
    path = order_cache_file(str(directory), 1, 0, 0, 1000)
    stale = [f"{os.path.basename(path)}.k1ll3d.tmp", f"{os.path.basename(path)}.x9.tmp"]
    other = os.path.basename(order_cache_file(str(directory), 1, 0, 0, 10000)) + ".abc.tmp"  # another order's
    for name in (*stale, other):
        (directory / name).write_bytes(b"\0" * 4096)
    cached_order(str(directory), 1, 0, 0, 1000)
    assert sorted(os.listdir(directory)) == sorted([os.path.basename(path), os.path.basename(path) + ".lock", other])


def test_a_directory_at_the_order_file_s_path_is_refused_in_one_line(tmp_path):
    directory = str(tmp_path / "cache")
    path = order_cache_file(directory, 1, 0, 0, 1000)
    os.makedirs(path)
    with pytest.raises(ValueError, match=rf"--data-cache-path {directory}: {path} is a directory, where the epoch "
                       "order file belongs; remove it") as caught:
        cached_order(directory, 1, 0, 0, 1000)
    assert "\n" not in str(caught.value)


def test_both_build_paths_write_the_same_file(tmp_path, monkeypatch):
    """D9: an order that fits in memory is shuffled there and written in chunks; a larger one is shuffled
    inside the file's map. The files are byte for byte the same (the in-memory ``shuffled_order``)."""
    documents = 300_001
    cached_order(str(tmp_path / "memory"), 2, 1, 3, documents)
    monkeypatch.setattr(reader_module, "ORDER_IN_MEMORY_SHARE", 0.0)  # force the map
    mapped = cached_order(str(tmp_path / "map"), 2, 1, 3, documents)
    assert np.array_equal(mapped, shuffled_order(2, 1, 3, documents))
    with open(order_cache_file(str(tmp_path / "memory"), 2, 1, 3, documents), "rb") as a, \
            open(order_cache_file(str(tmp_path / "map"), 2, 1, 3, documents), "rb") as b:
        assert a.read() == b.read()


# -- another user of the cache (root runs them as other uids in a forked process) ----------------------------
TEAM_GID, ALICE, BOB = 4242, 50001, 50002


def _as_user(uid: int, call, *args):
    """``call(*args)`` in a forked process as ``uid`` (group ``TEAM_GID``, umask 022): ("ok", warnings) or
    (the error's type: text, warnings)."""
    import warnings

    if os.geteuid() != 0:
        pytest.skip("running as another user needs root")
    context = multiprocessing.get_context("fork")
    queue = context.Queue()

    def child() -> None:
        os.setgroups([TEAM_GID])
        os.setgid(TEAM_GID)
        os.setuid(uid)
        os.umask(0o022)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                call(*args)
                outcome = "ok"
            except Exception as exc:  # noqa: BLE001 - reported to the parent
                outcome = f"{type(exc).__name__}: {exc}"
        queue.put((outcome, [str(w.message) for w in seen]))

    proc = context.Process(target=child)
    proc.start()
    got = queue.get(timeout=60)
    proc.join(10)
    return got


@pytest.fixture
def shared_dir():
    """A directory outside root's private pytest tree that other uids can reach, removed afterwards."""
    import shutil
    import tempfile

    top = tempfile.mkdtemp(prefix="wlb-team-")
    os.chmod(top, 0o755)
    yield top
    shutil.rmtree(top, ignore_errors=True)


def _check_order(directory: str, documents: int) -> None:
    assert np.array_equal(cached_order(directory, 1, 0, 0, documents), shuffled_order(1, 0, 0, documents))


def test_a_team_shares_the_cache_and_its_lock(shared_dir):
    team = os.path.join(shared_dir, "cache")
    os.mkdir(team)
    os.chown(team, 0, TEAM_GID)
    os.chmod(team, 0o2775)  # the team's directory: group-writable, files keep its group
    assert _as_user(ALICE, _check_order, team, 1000) == ("ok", [])
    path = order_cache_file(team, 1, 0, 0, 1000)
    assert _as_user(BOB, _check_order, team, 1000) == ("ok", [])  # before: Alice's 0600 file, then her lock
    with open(path, "r+b") as f:  # damaged: Bob rebuilds it, through Alice's lock
        f.seek(ORDER_HEADER_BYTES + 40)
        f.write(b"\xff")
    outcome, warned = _as_user(BOB, _check_order, team, 1000)
    assert outcome == "ok" and any("the order's checksum fails; rebuilding it" in w for w in warned)
    assert os.stat(path).st_uid == BOB and check_order_file(path, 1, 0, 0, 1000) is None


def test_a_lock_this_user_cannot_write_is_taken_read_only_and_said(shared_dir):
    team = os.path.join(shared_dir, "cache")
    os.mkdir(team)
    os.chown(team, 0, TEAM_GID)
    os.chmod(team, 0o2775)
    lock = order_cache_file(team, 1, 0, 0, 1000) + ".lock"
    open(lock, "w").close()
    os.chmod(lock, 0o644)  # left by an older version, or a stricter umask
    outcome, warned = _as_user(BOB, _check_order, team, 1000)
    assert outcome == "ok", outcome
    assert any(f"lock {lock} is not writable by this user: locking it read-only" in w for w in warned), warned


def test_a_read_only_cache_directory_keeps_the_damage_reason(shared_dir):
    cache = os.path.join(shared_dir, "cache")
    path = order_cache_file(cache, 1, 0, 0, 1000)
    cached_order(cache, 1, 0, 0, 1000)  # built by root: the directory is not Bob's to write
    with open(path, "r+b") as f:
        f.seek(ORDER_HEADER_BYTES + 40)
        f.write(b"\xff")
    outcome, _ = _as_user(BOB, _check_order, cache, 1000)
    assert outcome.startswith(f"ValueError: --data-cache-path {cache}: cannot write the epoch order cache there "
                              "(Permission denied"), outcome
    assert f"{os.path.basename(path)}: the order's checksum fails" in outcome and "\n" not in outcome
    os.unlink(path + ".lock")  # with no lock to open: the same reasons
    outcome, _ = _as_user(BOB, _check_order, cache, 1000)
    assert "Permission denied" in outcome and "the order's checksum fails" in outcome, outcome
