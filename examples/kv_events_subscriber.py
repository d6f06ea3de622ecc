"""Print vLLM's KV-cache events: blocks stored to and evicted from the CPU pool.

Start vLLM with the guide's ``KVEventsConfig`` (``publisher="zmq"``,
``endpoint="tcp://*:5555"``, ``topic="kv_events"``), e.g. the online example::

    bash examples/serve_kv_offload.sh --kv-events-config \\
        '{"enable_kv_cache_events": true, "publisher": "zmq",
          "endpoint": "tcp://*:5555", "topic": "kv_events"}'

then run this subscriber next to it::

    python examples/kv_events_subscriber.py --endpoint tcp://127.0.0.1:5555

vLLM's scheduler (in the engine-core process) publishes one ZeroMQ message
per engine step that produced events: three frames, the topic, an 8-byte
big-endian sequence number and a msgpack-encoded ``KVEventBatch`` (vLLM's
``vllm/distributed/kv_events.py``). This client decodes the batches with
vLLM's own types and prints, by default, the events of the CPU medium:
``BlockStored`` when offloaded blocks land in the CPU pool and
``BlockRemoved`` when the pool evicts them. ``--all-media`` adds the device
cache's own events (medium ``GPU``, also on an NPU or the CPU backend).

Stop it with Ctrl-C (or SIGTERM, or ``--timeout``); it then prints how many
events of each kind and medium it received.
"""

from __future__ import annotations

import argparse
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

CPU = "CPU"


@dataclass
class Message:
    """One published message: its topic, sequence number and event batch."""

    topic: str
    seq: int
    batch: KVEventBatch


def decoder() -> msgspec.msgpack.Decoder:
    """A decoder for vLLM's ``KVEventBatch`` payloads."""
    return msgspec.msgpack.Decoder(type=KVEventBatch)


def decode_message(frames: list[bytes], dec: msgspec.msgpack.Decoder) -> Message:
    """Decode the three frames ``(topic, seq, payload)`` of one message."""
    if len(frames) != 3:
        raise ValueError(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
    topic, seq, payload = frames
    return Message(
        topic=topic.decode("utf-8"),
        seq=int.from_bytes(seq, "big", signed=True),
        batch=dec.decode(payload),
    )


def subscribe(
    endpoint: str,
    topic: str = "",
    *,
    stop: threading.Event | None = None,
    poll_ms: int = 100,
) -> Iterator[Message]:
    """Yield decoded messages from a vLLM ZMQ publisher until ``stop`` is set.

    Connects a SUB socket to ``endpoint`` (the publisher binds). ZeroMQ keeps
    retrying the connection, so the subscriber may start before vLLM does;
    messages published before the subscription is established are lost.
    """
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt_string(zmq.SUBSCRIBE, topic)
    sock.connect(endpoint)
    dec = decoder()
    try:
        while stop is None or not stop.is_set():
            if sock.poll(poll_ms):
                yield decode_message(sock.recv_multipart(), dec)
    finally:
        sock.close(linger=0)
        ctx.term()


def format_hash(block_hash: bytes | int) -> str:
    """A block hash as (at most) 16 hex digits: vLLM publishes 64-bit ints
    by default, raw bytes with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``."""
    if isinstance(block_hash, bytes):
        return block_hash.hex()[:16]
    return f"{block_hash:016x}"


def describe(event: object, all_media: bool = False) -> str | None:
    """One line for ``event``, or None if it is filtered out."""
    if isinstance(event, AllBlocksCleared):
        return "AllBlocksCleared" if all_media else None
    if not isinstance(event, BlockStored | BlockRemoved):
        return f"unknown event {type(event).__name__}" if all_media else None
    if event.medium != CPU and not all_media:
        return None
    kind = "BlockStored " if isinstance(event, BlockStored) else "BlockRemoved"
    hashes = ", ".join(format_hash(h) for h in event.block_hashes)
    line = f"{kind} medium={event.medium} blocks={len(event.block_hashes)} [{hashes}]"
    if isinstance(event, BlockStored) and event.token_ids:
        line += f" tokens={len(event.token_ids)}"
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--endpoint",
        default="tcp://127.0.0.1:5555",
        help="the publisher's address (its endpoint with * replaced by a host)",
    )
    parser.add_argument("--topic", default="kv_events", help="topic to subscribe to")
    parser.add_argument(
        "--all-media",
        action="store_true",
        help="also print the device cache's events (medium GPU) and clears",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="stop after this many seconds (default: run until Ctrl-C)",
    )
    args = parser.parse_args()

    stop = threading.Event()
    # Ctrl-C or SIGTERM: stop after the current poll, then print the summary
    # (also when started in the background, where SIGINT is inherited ignored).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if args.timeout is not None:
        timer = threading.Timer(args.timeout, stop.set)
        timer.daemon = True
        timer.start()
    counts: Counter[str] = Counter()
    expected_seq = None
    print(f"subscribed to {args.endpoint} topic {args.topic!r}", flush=True)
    for msg in subscribe(args.endpoint, args.topic, stop=stop):
        if expected_seq is not None and msg.seq != expected_seq:
            print(f"! missed messages {expected_seq}..{msg.seq - 1}")
        expected_seq = msg.seq + 1
        for event in msg.batch.events:
            name = type(event).__name__
            counts[f"{name} {getattr(event, 'medium', '')}".strip()] += 1
            line = describe(event, args.all_media)
            if line is not None:
                stamp = time.strftime("%H:%M:%S", time.localtime(msg.batch.ts))
                print(f"{stamp} seq={msg.seq} {line}", flush=True)
    print("events received:", dict(sorted(counts.items())) or "none", flush=True)


if __name__ == "__main__":
    main()
