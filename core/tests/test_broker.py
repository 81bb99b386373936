"""The embedded broker (core/broker.py) through kombu's own client, on real files."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from kombu import Connection

from core import broker


@pytest.fixture
def connection(tmp_path: Path):  # each test names its own queue: kombu remembers declarations per process
    broker.register()
    folder = tmp_path / "queue"
    folder.mkdir()
    (tmp_path / "control").mkdir()
    options = {
        "data_folder_in": str(folder),
        "data_folder_out": str(folder),
        "control_folder": str(tmp_path / "control"),
    }
    with Connection(f"{broker.SCHEME}://", transport_options=options) as conn:
        yield conn, folder


def test_a_message_goes_through_whole(connection) -> None:
    conn, folder = connection
    queue = conn.SimpleQueue("whole")
    queue.put({"task": "watchdog", "n": 1})
    message = queue.get(timeout=2)
    assert message.payload == {"task": "watchdog", "n": 1}
    message.ack()
    assert os.listdir(folder) == []
    queue.close()


def test_an_empty_message_file_is_dropped_and_the_next_one_read(connection) -> None:
    """What kombu's own writer leaves between creating a file and writing it; read then, it
    killed the worker (JSONDecodeError). Here it is dropped and the queue goes on."""
    conn, folder = connection  # names sort as text: "0_" comes before any put's "<monotonic ms>_"
    queue = conn.SimpleQueue("empty")
    (folder / "0_00000000-0000-0000-0000-000000000000.empty.msg").write_bytes(b"")
    (folder / "0_00000000-0000-0000-0000-000000000001.empty.msg").write_bytes(b'{"body": ')  # half-written
    queue.put({"n": 2})
    message = queue.get(timeout=2)
    assert message.payload == {"n": 2}
    message.ack()
    assert os.listdir(folder) == []
    queue.close()


def test_a_file_being_written_is_not_taken(connection) -> None:
    conn, folder = connection
    queue = conn.SimpleQueue("partial")
    partial = folder / (broker._PARTIAL + "1_00000000-0000-0000-0000-000000000000.partial.msg")
    partial.write_bytes(b'{"bo')
    with pytest.raises(queue.Empty):
        queue.get(timeout=0.2)
    assert partial.exists()
    queue.close()


def test_messages_written_while_read_all_arrive_intact(connection) -> None:
    conn, folder = connection
    count = 300
    writer_conn = conn.clone()

    def write() -> None:  # a publisher only (a SimpleQueue would consume too)
        with writer_conn:
            producer = writer_conn.Producer()
            for n in range(count):
                producer.publish({"n": n, "pad": "x" * 4096}, exchange="busy", routing_key="busy")

    queue = conn.SimpleQueue("busy")  # declared and bound first, as Celery's worker does at its start
    writer = threading.Thread(target=write)
    writer.start()
    seen = []
    while len(seen) < count:
        message = queue.get(timeout=10)
        assert message.payload["pad"] == "x" * 4096
        seen.append(message.payload["n"])
        message.ack()
    writer.join()
    assert sorted(seen) == list(range(count))
    assert os.listdir(folder) == []
    queue.close()
