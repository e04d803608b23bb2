import threading

import pytest

from minicpmo_rt.runtime.snapshot import Snapshot, SnapshotClosed, SnapshotPublisher, SnapshotReader


def test_reader_sees_each_item_once_in_order():
    pub = SnapshotPublisher("t")
    r = SnapshotReader(pub)
    assert r.poll() == ()
    pub.publish(1, 2)
    snap = pub.latest()
    pub.publish(3)
    assert snap.items == (1, 2) and snap.version == 1  # an old snapshot never changes
    assert r.poll() == (1, 2, 3) and r.poll() == ()
    pub.close()
    assert r.poll() == () and r.closed
    with pytest.raises(SnapshotClosed):
        pub.publish(4)
    with pytest.raises(Exception):
        snap.items = ()  # frozen


def test_consumer_never_sees_a_half_updated_snapshot():
    """A producer publishes batches whose items must always arrive whole: batch k holds k
    copies of k, and the snapshot's version counts the batches. Readers on other threads
    check every snapshot they grab while the producer keeps going."""
    pub: SnapshotPublisher[int] = SnapshotPublisher("stress")
    batches = 400
    errors: list[str] = []
    seen_versions: list[int] = []

    def check(snap: Snapshot[int]) -> None:
        expect = tuple(x for k in range(1, snap.version + 1) for x in [k] * k)
        if snap.items != expect and not snap.closed:
            errors.append(f"version {snap.version}: {len(snap.items)} items, expected {len(expect)}")

    def poller():
        last = 0
        while True:
            snap = pub.latest()
            check(snap)
            if snap.version < last:
                errors.append("version went backwards")
            last = snap.version
            if snap.closed:
                seen_versions.append(last)
                return

    def follower():
        r = SnapshotReader(pub)
        got = list(r)  # blocking iteration until close
        if got != [x for k in range(1, batches + 1) for x in [k] * k]:
            errors.append("follower lost or duplicated items")

    # daemon: a thread stuck by a bug fails the assert below instead of keeping pytest from exiting
    threads = [threading.Thread(target=f, daemon=True) for f in (poller, poller, follower)]
    for t in threads:
        t.start()
    for k in range(1, batches + 1):
        pub.publish(*([k] * k))
    pub.close()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[:5]
    assert seen_versions == [batches + 1] * 2


def test_wait_newer_times_out_with_current():
    pub = SnapshotPublisher()
    assert pub.wait_newer(0, timeout=0.01).version == 0
