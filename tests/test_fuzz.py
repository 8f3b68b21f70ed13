"""Thousands of random and mutated messages: every one gets an answer, the daemon keeps serving."""

from __future__ import annotations

import json
import os
import random
import time

import zmq

from ckptd.protocol import request

N_MESSAGES = 3000


def _valid(rng: random.Random, seg: str, lease: str = "0" * 32) -> bytes:
    # every op but "wait" and "fetch_wait", whose reply a mutated timeout may hold back for up to 30 s by design
    choices = [
        request("hello", 1),
        request("latest", 1, job="j"),
        request("alloc", 1, job="j", rank=0, world_size=1, step=1, nbytes=rng.randrange(1 << 16), pid=os.getpid()),
        request("release", 1, segment=seg, lease=lease),
        request(
            "commit",
            1,
            job="j",
            rank=0,
            world_size=1,
            local_world_size=1,
            step=rng.randrange(5),
            segment=seg,
            lease=lease,
            nbytes=10,
            replicas={},
        ),
        request("status", 1),
        request("hot_open", 1, job="j", step=rng.choice([None, 1]), pid=os.getpid()),
        request("hot_close", 1, pin=lease, segments=[seg]),
        request("fetch", 1, job="j", step=rng.choice([None, 1])),
    ]
    return rng.choice(choices)


def _mutate(rng: random.Random, msg: bytes) -> bytes:
    b = bytearray(msg)
    for _ in range(rng.randrange(1, 6)):
        op = rng.randrange(4)
        if op == 0 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op == 1 and b:
            del b[rng.randrange(len(b))]
        elif op == 2:
            b.insert(rng.randrange(len(b) + 1), rng.randrange(256))
        else:
            obj = json.loads(msg)
            key = rng.choice(list(obj))
            obj[key] = rng.choice([None, -1, 2**70, "x" * rng.randrange(300), [], {}, True, 1.5, "../../etc"])
            b = bytearray(json.dumps(obj).encode())
    return bytes(b)


def test_fuzzed_messages_all_answered(daemon) -> None:  # noqa: ANN001
    rng = random.Random(1234)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(daemon.endpoint)
    seg = "ckptd-0-0123456789abcdef/" + "0" * 32
    answered = 0
    t0 = time.monotonic()
    try:
        for _ in range(N_MESSAGES):
            kind = rng.randrange(4)
            if kind == 0:
                frames = [os.urandom(rng.randrange(1, 200))]
            elif kind == 1:
                frames = [_mutate(rng, _valid(rng, seg))]
            elif kind == 2:
                frames = [_valid(rng, seg)] + [os.urandom(rng.randrange(50)) for _ in range(rng.randrange(3))]
            else:
                frames = [json.dumps({rng.choice(["v", "op", "id", "job"]): rng.random() for _ in range(3)}).encode()]
            s.send_multipart(frames)
            if s.poll(5000):
                reply = json.loads(s.recv())  # always a well-formed JSON reply
                assert reply["v"] == 1 and isinstance(reply["ok"], bool)
                answered += 1
                if reply["ok"] and "segment" in reply:  # a lease we got by chance: give it back
                    s.send_multipart([request("release", 2, segment=reply["segment"], lease=reply["lease"])])
                    assert s.poll(5000)
                    s.recv()
            assert time.monotonic() - t0 < 120, "fuzzing took too long"
        assert answered == N_MESSAGES
        s.send_multipart([request("hello", 99)])
        assert s.poll(5000) and json.loads(s.recv())["ok"]
        assert daemon.proc.poll() is None
    finally:
        s.close(0)
        ctx.term()
    assert daemon.stop() == 0
    assert daemon.segments() == []
