"""Thousands of random and mutated messages: every one gets an answer, the daemon keeps serving. Then the
attacks of a hostile client that speaks the protocol well: values at and beyond every bound, foreign
segments and paths, crossed leases and pins: each request gets exactly one answer, nothing hostile is
accepted, and the daemon ends as clean as it started."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import os
import random
import re
import secrets
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import zmq
from conftest import REPO, DaemonProc

from ckptd import shm
from ckptd.daemon.access import ROOT_LOCK
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


# ---------------------------------------------------------------------------- semantically hostile messages
#
# Well-formed requests (valid JSON, the right shape) whose values sit at and just beyond every bound, that name
# segments the sender was never leased or files that are no segments at all, and that cross two clients' leases
# and pins. The oracle below is the protocol as documented: a value out of bounds or of the wrong type is answered
# ``bad_request``; an in-bound request the daemon must not carry out is answered ``refused``; an in-bound harmless
# one is answered ``ok``. Every request gets exactly one answer, at once.

N_HOSTILE = 2000
ANSWER_S = 5.0  # a request unanswered this long counts as never answered
OK, BAD, REFUSED = "ok", "bad_request", "refused"
HELD = "held"  # a legal value the daemon may hold its answer for (a long timeout): only ever sent where it is refused
ESCAPE = "ckptd-fuzz-escape"  # what hostile job and segment names try to create outside the root
SHM_DIR = shm.SHM_DIR
_HEX = "0123456789abcdef"
_TOKEN_RE = re.compile(r"[0-9a-f]{32}")


def _pid_max() -> int:
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        return 1 << 22


PID_MAX = _pid_max()


class Peer:
    """One client with a DEALER socket (an identity) of its own. Each request must get exactly one answer
    within ``ANSWER_S``: the answer's ``id`` is the request's (``null`` only for a ``bad_request``), and
    :meth:`quiet` checks that nothing came twice."""

    def __init__(self, daemon: DaemonProc) -> None:
        self.daemon = daemon
        self.ctx = zmq.Context()
        self.s = self.ctx.socket(zmq.DEALER)
        self.s.setsockopt(zmq.LINGER, 0)
        self.s.connect(daemon.endpoint)
        self.ids = itertools.count(1000)
        # a failed test's Peer, collected in its traceback's reference cycle, must not hang the garbage collector
        # (zmq's Context.__del__ would term() while the socket is still open)
        self._finalizer = weakref.finalize(self, _close_peer, self.s, self.ctx)

    def _why(self, what: str) -> str:
        log = self.daemon.log.read_text(errors="replace")[-3000:] if self.daemon.log.exists() else ""
        return f"{what}\n--- daemon log (tail) ---\n{log}"

    def send(self, frames: list[bytes], req_id: object) -> dict:
        self.s.send_multipart(frames)
        assert self.s.poll(int(ANSWER_S * 1000)), self._why(f"no answer within {ANSWER_S} s to {_show(frames)}")
        parts = self.s.recv_multipart()
        assert len(parts) == 1, self._why(f"an answer of {len(parts)} frames to {_show(frames)}")
        rep = json.loads(parts[0])
        assert rep["v"] == 1 and isinstance(rep["ok"], bool), rep
        if rep["ok"] or rep.get("code") != BAD:
            assert rep["id"] == req_id, self._why(f"answer {str(rep)[:300]} is not the one to {_show(frames)} (a late or second answer?)")
        else:
            assert rep["id"] in (req_id, None), self._why(f"answer {str(rep)[:300]} is not the one to {_show(frames)}")
        return rep

    def ask(self, op: str, frames: tuple[bytes, ...] = (), **fields: object) -> dict:
        req_id = next(self.ids)
        return self.send([request(op, req_id, **fields), *frames], req_id)

    def ok(self, op: str, frames: tuple[bytes, ...] = (), **fields: object) -> dict:
        rep = self.ask(op, frames, **fields)
        assert rep["ok"], self._why(f"{op} {_short(fields)} was refused: {rep}")
        return rep

    def refused(self, op: str, code: str | None = None, frames: tuple[bytes, ...] = (), **fields: object) -> dict:
        """``op`` must be answered ``ok: false`` with ``code`` (``bad_request`` or ``refused`` when ``None``)."""
        rep = self.ask(op, frames, **fields)
        codes = (code,) if code else (BAD, REFUSED)
        assert rep["ok"] is False and rep["code"] in codes and rep["error"], self._why(f"{op} {_short(fields)} got {rep}, want {codes}")
        return rep

    def slots(self) -> dict:
        return self.ok("status")["slots"]

    def quiet(self, wait_s: float = 0.3) -> None:
        """No answer is left over: none came twice."""
        assert not self.s.poll(int(wait_s * 1000)), self._why(f"an answer nobody asked for: {self.s.recv()[:300]!r}")

    def close(self) -> None:
        self._finalizer()


def _close_peer(s: zmq.Socket, ctx: zmq.Context) -> None:
    s.close(0)
    ctx.term()


def _short(fields: dict) -> str:
    return {k: (v if len(repr(v)) < 80 else f"{repr(v)[:60]}... ({len(repr(v))} chars)") for k, v in fields.items()}.__repr__()


def _show(frames: list[bytes]) -> str:
    return f"{frames[0][:300]!r}{'...' if len(frames[0]) > 300 else ''} ({len(frames[0])} bytes, {len(frames)} frame(s))"


def _flip(rng: random.Random, s: str, start: int = 0) -> str:
    """``s`` with one hex digit (at or after ``start``) changed."""
    i = rng.choice([i for i in range(start, len(s)) if s[i] in _HEX])
    return s[:i] + rng.choice(_HEX.replace(s[i], "")) + s[i + 1 :]


def _token(rng: random.Random) -> str:
    return f"{rng.getrandbits(128):032x}"


def _wait_for(peer: Peer, pred: Callable[[dict], bool], what: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = peer.ok("status")
        if pred(st):
            return st
        assert time.monotonic() < deadline, peer._why(f"{what}: status is {st}")
        time.sleep(0.1)


def _escapes(d: DaemonProc) -> list[str]:
    """Whatever a hostile name created beside the root, in its parents, in /dev/shm or in the daemon's working directory."""
    found = []
    for where in (Path(d.root), d.base, d.base.parent, REPO, Path(SHM_DIR)):
        found += [str(where / e) for e in os.listdir(where) if ESCAPE in e]
    return found


def _end_clean(d: DaemonProc, peer: Peer, shm_dir: str, jobs: frozenset[str] = frozenset()) -> None:
    """The daemon lived through the attack: ``hello`` answers with the same pid, ``status`` works, a stop
    returns 0 and leaves no segment, no segment directory, nothing in its root but the ``jobs`` it was
    legitimately given (and its empty lock file), and nothing outside its root."""
    assert d.proc is not None and d.proc.poll() is None, peer._why("the daemon died")
    assert peer.ok("hello")["pid"] == d.proc.pid
    st = peer.ok("status")
    assert st["deferred_allocs"] == 0 and st["hot_pins"] == {}, st
    peer.quiet()
    peer.close()
    assert d.stop() == 0, d.log.read_text()[-3000:]
    assert d.segments() == []
    assert not os.path.exists(os.path.join(SHM_DIR, shm_dir))
    assert set(os.listdir(d.base)) == {"root", "daemon.log", "d.sock.lock"}  # the endpoint's (empty) lock file
    assert os.path.getsize(os.path.join(d.base, "d.sock.lock")) == 0
    assert set(os.listdir(d.root)) <= jobs | {ROOT_LOCK}, os.listdir(d.root)
    assert os.path.getsize(os.path.join(d.root, ROOT_LOCK)) == 0
    assert _escapes(d) == []


# each field's hostile values, as (value, verdict): OK within the protocol's bounds (the op may still refuse it for
# what it means: a segment that is not leased), BAD beyond them (answered bad_request), REFUSED within them but never
# to be granted (answered refused), HELD within them but answered only after a while (a timeout of 1e308)
_NAN, _INF = float("nan"), float("inf")
IDS = [(2**63 - 1, OK), (-(2**63 - 1), OK), (0, OK), (2**63, BAD), (-(2**63), BAD), (2**64, BAD), (1.5, BAD), (_NAN, BAD),
       (None, BAD), ("1", BAD), (True, BAD)]  # fmt: skip
PIDS = [(1, OK), (PID_MAX, OK), (0, BAD), (PID_MAX + 1, BAD), (2**31, BAD), (2**63, BAD), (2**64, BAD), (-1, BAD), (True, BAD),
        (1.0, BAD), ("1", BAD), (None, BAD)]  # fmt: skip
STEPS = [(0, OK), (2**63 - 1, OK), (2**63, BAD), (-1, BAD), (2**64, BAD), (1.0, BAD), ("1", BAD), (_INF, BAD)]
# (world_size, rank)
WORLDS = [((1, 0), OK), ((2, 1), OK), ((2**20, 2**20 - 1), OK), ((1, 1), BAD), ((2, 2), BAD), ((2**20, 2**20), BAD), ((0, 0), BAD),
          ((2**20 + 1, 0), BAD), ((2**40, 0), BAD), ((1, -1), BAD), ((-1, 0), BAD), ((True, 0), BAD)]  # fmt: skip
TIMEOUTS = [(0, OK), (0.0, OK), (-0.0, OK), (1e-300, OK), (_NAN, BAD), (_INF, BAD), (-_INF, BAD), (-1, BAD), (-1e-300, BAD),
            (1e308, HELD), (2**64, HELD), ("1", BAD), (True, BAD), (None, BAD)]  # fmt: skip
JOBS = [("a" * 128, OK), ("J.b_c-9", OK), ("0", OK), ("a" * 129, BAD), ("jöb", BAD), ("ジョブ", BAD), ("..", BAD), ("a..b", BAD),
        ("a/b", BAD), (f"../{ESCAPE}", BAD), (f"../../{ESCAPE}", BAD), (f"/tmp/{ESCAPE}", BAD), (f"{ESCAPE}/..", BAD), ("a\x00b", BAD),
        ("j\n", BAD), ("", BAD), (".hidden", BAD), ("-rf", BAD), ("a b", BAD), ("a\\b", BAD), ("etc/passwd", BAD), (None, BAD),
        (["j"], BAD)]  # fmt: skip


@dataclasses.dataclass
class World:
    """What the hostile generator knows of the daemon under attack."""

    budget: int
    seg_b: str  # another client's real lease
    tok_b: str
    lease_b: dict
    shm_dir: str  # the daemon's private segment directory
    big_replicas: dict  # 10**5 well-formed entries
    bad_big_replicas: dict  # 10**5 entries, one digest not hex
    freed: list[str] = dataclasses.field(default_factory=list)  # segments leased and given back
    fetch: int | None = None  # the newest fetch, while no answer has consumed it

    def nbytes(self) -> list[tuple[object, str]]:
        fits = (self.budget - (2 << 20)) // (2 << 20) * (2 << 20)  # beside B's 2 MiB slot
        return [(0, OK), (1, OK), (fits, OK), (self.budget + 1, REFUSED), (2**50, REFUSED), (2**50 + 1, BAD), (-1, BAD), (2**64, BAD),
                (1.5, BAD), ("1", BAD)]  # fmt: skip

    def segments(self, rng: random.Random) -> list[tuple[object, str]]:
        d, f = self.seg_b.split("/")
        other = f"ckptd-{os.geteuid()}-{_token(rng)[:16]}/{_token(rng)}"
        out = [(self.seg_b, OK), (_flip(rng, self.seg_b, len(d) + 1), OK), (_flip(rng, self.seg_b), OK), (other, OK),
               (f"../{self.seg_b}", OK), (f"{d}/../{ESCAPE}/{f}", OK), ("../../etc/passwd", OK), ("/etc/passwd", OK),
               (f"{SHM_DIR}/{self.seg_b}", OK),
               (self.seg_b + shm.RECORD_SUFFIX, OK), (self.seg_b + "\x00", OK), (self.seg_b.upper(), OK), (d, OK), (f"{d}/.", OK),
               (f"{d}//{f}", OK), (f"{self.seg_b}/..", OK), ("", OK), ("x" * 256, OK), ("é" * 256, OK), ("x" * 257, BAD),
               (f"{self.seg_b}/{'a' * 300}", BAD), (None, BAD), ([self.seg_b], BAD), (5, BAD)]  # fmt: skip
        out += [(s, OK) for s in self.freed[-2:]]
        return out

    def tokens(self, rng: random.Random) -> list[tuple[object, str]]:
        t = self.tok_b
        cands = [t, _token(rng), "0" * 32, _flip(rng, t), t.upper(), t[:-1], t + "0", "", "g" * 32, t + "\n", " " + t[1:], "０" * 32]
        return [(c, OK if _TOKEN_RE.fullmatch(c) else BAD) for c in cands] + [(None, BAD), (int(t, 16), BAD), ([t], BAD)]

    def replicas(self) -> list[tuple[object, str]]:
        return [({}, OK), ({"c": "0123456789abcdef"}, OK), (self.big_replicas, OK), ({"c" * 4096: "0" * 16}, OK),
                ({"c": "0" * 15}, BAD), ({"c": "0" * 17}, BAD), ({"c": "g" * 16}, BAD), ({"c": "ABCDEF0123456789"}, BAD), ({"c": 5}, BAD),
                ({"c": None}, BAD), ({"c" * 4097: "0" * 16}, BAD), (self.bad_big_replicas, BAD), ([], BAD), (None, BAD)]  # fmt: skip

    def segment_lists(self, rng: random.Random) -> list[tuple[object, str]]:
        many = [f"{self.shm_dir}/{_token(rng)}" for _ in range(4097)]
        return [([], OK), ([self.seg_b], OK), ([self.seg_b] * 4096, OK), (many[:4096], OK), (many, BAD), (many * 2, BAD),
                (["x" * 257], BAD), ([1], BAD), ([None], BAD), ([[self.seg_b]], BAD), (self.seg_b, BAD), (None, BAD)]  # fmt: skip


def _hostile(rng: random.Random, w: World) -> tuple[str, dict, list[bytes], str]:
    """One well-formed hostile request: ``(op, message, frames, the answer it must get)``. A valid request of a
    random op with one to three of its fields (or its id) replaced by hostile values."""
    me = os.getpid()
    base: dict[str, dict] = {
        "hello": {},
        "status": {},
        "latest": {"job": "fz"},
        "alloc": {"job": "fz", "world": (1, 0), "step": 1, "nbytes": 1, "pid": me},
        # B's segment and token, but this client's job, rank and step
        "commit": {
            "job": "fz",
            "world": (1, 0),
            "local_world_size": 1,
            "step": 1,
            "segment": w.seg_b,
            "lease": w.tok_b,
            "nbytes": 1,
            "replicas": {},
        },
        "release": {"segment": w.seg_b, "lease": "0" * 32},
        "wait": {"job": "fz", "step": 1, "timeout": 0},
        "hot_open": {"job": "fz", "step": None, "pid": me},
        "hot_close": {"pin": "0" * 32, "segments": [w.seg_b]},
        "fetch": {"job": "fz", "step": None},
        "fetch_wait": {"fetch": w.fetch if w.fetch is not None else 2**63 - 1, "timeout": 0},
        "fetch_close": {"fetch": w.fetch if w.fetch is not None else 2**63 - 1},  # any id: ok, released or not
    }
    op = rng.choice(list(base))
    fields = dict(base[op])
    tables: dict[str, Callable[[], list[tuple[object, str]]]] = {
        "id": lambda: IDS,
        "job": lambda: JOBS,
        "pid": lambda: PIDS,
        "step": lambda: STEPS + ([(None, OK)] if op in ("hot_open", "fetch", "alloc") else [(None, BAD)]),
        "world": lambda: WORLDS,
        "local_world_size": lambda: [(1, OK), (4096, OK), (0, BAD), (4097, BAD), (2**20, BAD), (2**20 + 1, BAD), (-1, BAD)],
        "nbytes": w.nbytes,
        "timeout": lambda: TIMEOUTS,
        "segment": lambda: w.segments(rng),
        "lease": lambda: w.tokens(rng),
        "pin": lambda: w.tokens(rng),
        "replicas": w.replicas,
        "segments": lambda: w.segment_lists(rng),
        "fetch": lambda: (
            [(0, BAD), (-1, BAD), (2**63, BAD), (2**64, BAD), (1.0, BAD), (None, BAD), (2**63 - 1, OK)]
            + ([(w.fetch, OK)] if w.fetch is not None else [])
        ),
    }
    # about half the requests stay within every bound (and must be refused or carried out for what they mean),
    # the others go beyond at least one
    beyond = rng.random() < 0.55
    verdicts: dict[str, str] = {}
    for i, name in enumerate(rng.sample([*fields, "id"], min(len(fields) + 1, rng.randint(1, 3)))):
        table = tables[name]()
        if i == 0 or not beyond:
            table = [x for x in table if (x[1] == BAD) == beyond]
        value, verdicts[name] = rng.choice(table)
        fields[name] = value
    msg_id = fields.pop("id", next(_ids))
    if "world" in fields:
        fields["world_size"], fields["rank"] = fields.pop("world")
    lws, ws = fields.get("local_world_size"), fields.get("world_size")
    if verdicts.get("world", OK) == OK and isinstance(lws, int) and isinstance(ws, int) and lws > ws:
        verdicts["local_world_size"] = BAD  # checked against the world size too
    # a structural wrong: an unknown field, a missing one, a frame too many or too few
    frames_extra = [b"{}"] if op == "commit" else []
    r = rng.random() if beyond else 1.0
    if r < 0.03:
        name = rng.choice([n for n in ("frames", "__proto__", "lease", "pid", "root", "v2") if n not in fields])
        fields[name] = rng.choice([[], {}, "x", 1])
        verdicts["unknown field"] = BAD
    elif r < 0.06 and fields:
        del fields[rng.choice(list(fields))]
        verdicts["missing field"] = BAD
    elif r < 0.08:
        frames_extra = [] if frames_extra else [b"{}"]
        verdicts["frames"] = BAD
    # the answer it must get
    if BAD in verdicts.values():
        expect = BAD
    elif op in ("commit", "release"):
        expect = REFUSED
        bs_own = fields.get("segment") == w.seg_b and fields.get("lease") == w.tok_b
        if bs_own and (op == "release" or all(fields.get(k) == v for k, v in w.lease_b.items())):
            fields["lease"] = _flip(rng, w.tok_b)  # that would be B's own legitimate request
    elif op == "alloc":
        expect = REFUSED if REFUSED in verdicts.values() else OK
    elif op == "fetch_wait":
        expect = OK if w.fetch is not None and fields["fetch"] == w.fetch else REFUSED
    else:
        expect = OK
    if HELD in verdicts.values() and expect == OK:
        fields["timeout"] = 0  # an answer held up to 30 s by design: sent only where the request is refused anyway
    msg = {"v": 1, "op": op, "id": msg_id, **fields}
    if "id" in verdicts and rng.random() < 0.5:
        msg = {"id": msg_id, **{k: v for k, v in msg.items() if k != "id"}}  # the envelope in another order
    raw = json.dumps(msg, separators=(",", ":"), ensure_ascii=rng.random() < 0.5).encode()  # NaN, Infinity: raw JSON tokens
    return op, msg, [raw, *frames_extra], expect


_ids = itertools.count(10**6)


def _lease(peer: Peer, nbytes: int = 4096, **lease: object) -> tuple[str, str]:
    rep = peer.ok("alloc", nbytes=nbytes, pid=os.getpid(), **lease)
    assert shm.NAME_RE.fullmatch(rep["segment"]) and _TOKEN_RE.fullmatch(rep["lease"]) and rep["size"] >= nbytes, rep
    return rep["segment"], rep["lease"]


def test_hostile_well_formed_messages_are_answered_and_refused(make_daemon) -> None:  # noqa: ANN001
    """Attack: N_HOSTILE seeded, well-formed requests from client A, each a valid request of a random op with one
    to three fields replaced by a hostile value: integers at and just beyond their bounds (pid 0, 1, pid_max,
    pid_max+1, 2**31, 2**63, 2**64, -1; world_size 0 .. 2**40, rank = world_size, local_world_size > world_size;
    step 2**63; nbytes budget+1, 2**50+1; id ±2**63; fetch 0 and 2**63; timeout NaN, Infinity, -1, 1e308), strings at
    and beyond their limits (job names of 128 and 129 characters, unicode, "..", "a/b", NUL, escapes of the root;
    segment names in another directory, "../" paths, 257 characters, client B's real segment with one digit
    changed; tokens of the wrong length, in uppercase, B's real lease token), replicas of 10**5 entries or with a
    digest that is not hex, hot_close with 4097 names. B's lease survives it all, and B still releases it."""
    d = make_daemon("--shm-budget", "8M")
    a, b = Peer(d), Peer(d)
    lease_b = {"job": "jb", "rank": 1, "world_size": 2, "step": 7}
    seg_b, tok_b = _lease(b, nbytes=1, **lease_b)
    shm_dir = seg_b.split("/")[0]
    big = {f"chunk-{i}": f"{i:016x}" for i in range(10**5)}
    w = World(a.ok("status")["shm_budget"], seg_b, tok_b, lease_b, shm_dir, big, {**big, "chunk-7": "not-a-hex-digest"})
    rng = random.Random(20240611)
    seen: collections.Counter[tuple[str, str]] = collections.Counter()
    t0 = time.monotonic()
    for _ in range(N_HOSTILE):
        op, msg, frames, expect = _hostile(rng, w)
        rep = a.send(frames, msg["id"])
        what = f"{_show(frames)}: want {expect}, got {str(rep)[:400]}"
        assert rep.get("code") != "internal", a._why(f"the daemon failed on {what}")
        if expect == OK:
            assert rep["ok"] is True, a._why(f"refused {what}")
        else:
            assert rep["ok"] is False and rep["code"] == expect and rep["error"], a._why(f"wrongly answered {what}")
        seen[op, expect] += 1
        if rep["ok"] and op == "alloc":  # a lease of A's own: give it back at once
            assert rep["size"] >= msg["nbytes"] and shm.NAME_RE.fullmatch(rep["segment"]) and rep["segment"] != seg_b, rep
            a.ok("release", segment=rep["segment"], lease=rep["lease"])
            w.freed.append(rep["segment"])
        elif rep["ok"] and op == "fetch":
            w.fetch = rep["fetch"]
        elif rep["ok"] and op == "fetch_wait" and rep["state"] != "pending":
            w.fetch = None  # answered: forgotten by the daemon
        elif rep["ok"] and op == "hot_open":
            assert rep["step"] is None and rep["reason"], rep  # nothing of any job is durable here
    elapsed = time.monotonic() - t0
    assert elapsed < 60, f"{N_HOSTILE} hostile messages took {elapsed:.0f} s"
    # every kind of answer to every op came up
    for op in ("alloc", "commit", "release", "wait", "latest", "hot_open", "hot_close", "fetch", "fetch_wait", "fetch_close"):
        assert seen[op, BAD] > 0 and (seen[op, OK] + seen[op, REFUSED]) > 0, (op, seen)
    assert seen["alloc", REFUSED] > 0 and seen["alloc", OK] > 0 and seen["fetch_wait", OK] > 0, seen
    # B's lease survived everything A sent: still leased, still B's to give back
    st = a.ok("status")
    assert st["slots"].get("leased") == 1 and st["deferred_allocs"] == 0 and st["hot_pins"] == {}, st
    b.ok("release", segment=seg_b, lease=tok_b)
    b.refused("release", REFUSED, segment=seg_b, lease=tok_b)
    assert "leased" not in a.slots()
    # nbytes at the budget is granted once nothing else is leased; one byte more is refused
    seg, tok = _lease(a, nbytes=w.budget, job="fz", rank=0, world_size=1, step=1)
    a.refused("alloc", REFUSED, job="fz", rank=0, world_size=1, step=1, nbytes=w.budget + 1, pid=os.getpid())
    a.ok("release", segment=seg, lease=tok)
    b.quiet(0)
    b.close()
    _end_clean(d, a, shm_dir)


def test_crossed_leases_are_refused(make_daemon) -> None:  # noqa: ANN001
    """Attack: two ranks of one job, each on its own socket, hold a lease; each tries the other's segment with
    its own token, with no token, with the other's real token but a wrong job, rank, world size or step, and its
    own segment with the other's token; then the owners' commit and release go through, after which a second
    release, a commit after the release, a commit after the commit, and the old token on the same segment leased
    anew are all refused."""
    d = make_daemon("--shm-budget", "8M")
    a, b = Peer(d), Peer(d)
    fields = {"job": "j", "world_size": 2, "local_world_size": 2, "step": 1, "nbytes": 4096, "replicas": {}}
    seg_a, tok_a = _lease(a, job="j", rank=0, world_size=2, step=1)
    seg_b, tok_b = _lease(b, job="j", rank=1, world_size=2, step=1)
    assert seg_a != seg_b and tok_a != tok_b
    assert a.slots() == {"leased": 2}
    tree = (b"{}",)
    for me, my_seg, my_tok, my_rank, their_seg, their_tok, their_rank in (
        (a, seg_a, tok_a, 0, seg_b, tok_b, 1),
        (b, seg_b, tok_b, 1, seg_a, tok_a, 0),
    ):
        # the other's segment with my own token
        me.refused("commit", REFUSED, tree, segment=their_seg, lease=my_tok, rank=their_rank, **fields)
        me.refused("commit", REFUSED, tree, segment=their_seg, lease=my_tok, rank=my_rank, **fields)
        me.refused("release", REFUSED, segment=their_seg, lease=my_tok)
        # the other's segment with no token
        me.refused("commit", BAD, tree, segment=their_seg, rank=their_rank, **fields)
        me.refused("release", BAD, segment=their_seg)
        # the other's segment with its real token, but not its lease's job, rank, world size or step
        for wrong in ({"rank": my_rank}, {"job": "k", "rank": their_rank}, {"step": 2, "rank": their_rank},
                      {"world_size": 3, "local_world_size": 3, "rank": their_rank}):  # fmt: skip
            me.refused("commit", REFUSED, tree, **{**fields, "segment": their_seg, "lease": their_tok, **wrong})
        # my own segment with the other's token, or my own token one digit off, in uppercase, cut short
        rng = random.Random(my_rank)
        me.refused("commit", REFUSED, tree, segment=my_seg, lease=their_tok, rank=my_rank, **fields)
        me.refused("release", REFUSED, segment=my_seg, lease=their_tok)
        me.refused("release", REFUSED, segment=my_seg, lease=_flip(rng, my_tok))
        for bad in {my_tok.upper(), my_tok[:-1], my_tok + "0"} - {my_tok}:
            me.refused("release", BAD, segment=my_seg, lease=bad)
        # my own token on the other's segment's name with one digit changed
        me.refused("release", REFUSED, segment=_flip(rng, their_seg, len(their_seg) - 32), lease=my_tok)
        assert me.slots() == {"leased": 2}  # both leases still held by their owners
    # the owners: A commits, B gives its slot back
    a.ok("commit", tree, segment=seg_a, lease=tok_a, rank=0, **fields)
    b.ok("release", segment=seg_b, lease=tok_b)
    b.refused("release", REFUSED, segment=seg_b, lease=tok_b)  # twice
    b.refused("commit", REFUSED, tree, segment=seg_b, lease=tok_b, rank=1, **fields)  # after the release
    a.refused("commit", REFUSED, tree, segment=seg_a, lease=tok_a, rank=0, **fields)  # after the commit
    a.refused("release", REFUSED, segment=seg_a, lease=tok_a)
    # B leases again (the next step) and gets its own slot back under a new token: the old one does not work on it
    seg_b2, tok_b2 = _lease(b, job="j", rank=1, world_size=2, step=2)
    assert seg_b2 == seg_b and tok_b2 != tok_b
    step2 = {**fields, "step": 2}
    b.refused("commit", REFUSED, tree, segment=seg_b, lease=tok_b, rank=1, **step2)
    a.refused("commit", REFUSED, tree, segment=seg_b, lease=tok_a, rank=1, **step2)
    a.refused("commit", REFUSED, tree, segment=seg_b, lease=tok_b, rank=1, **fields)  # B's old lease's step, with B's old token
    b.ok("commit", tree, segment=seg_b, lease=tok_b2, rank=1, **step2)
    # both shards are garbage: their steps fail on the persist threads, the slots come back free
    _wait_for(a, lambda st: st["slots"] == {"free": 2}, "both committed slots were not freed")
    b.quiet(0)
    b.close()
    _end_clean(d, a, seg_a.split("/")[0], frozenset({"j"}))


def test_a_lapsed_lease_cannot_be_committed(make_daemon) -> None:  # noqa: ANN001
    """Attack: a client sits on its lease past the lease timeout (3 s) and then commits or releases it, also once
    its memory has been leased to another client under a new token; the new holder's commit goes through.
    The lapsed segment is retired, never leased again: its holder may still write to it."""
    # room for one slot: the lapsed one's memory. 3 s: the second lease must outlive the ~8 calls made under it
    d = make_daemon("--lease-timeout", "3", "--shm-budget", "2M")
    a, b = Peer(d), Peer(d)
    fields = {"world_size": 1, "local_world_size": 1, "step": 1, "nbytes": 4096, "replicas": {}}
    seg, tok = _lease(a, job="ja", rank=0, world_size=1, step=1)
    t0 = time.monotonic()
    assert a.slots() == {"leased": 1}
    time.sleep(3.5)
    _wait_for(a, lambda st: st["slots"] == {}, "the lease did not lapse")  # the reaper runs every 0.5 s
    assert time.monotonic() - t0 > 3.0 and not os.path.exists(shm.path_of(seg))
    a.refused("commit", REFUSED, (b"{}",), job="ja", rank=0, segment=seg, lease=tok, **fields)
    a.refused("release", REFUSED, segment=seg, lease=tok)
    seg_b, tok_b = _lease(b, job="jb", rank=0, world_size=1, step=1)
    assert seg_b != seg and tok_b != tok
    for s in (seg, seg_b):
        a.refused("commit", REFUSED, (b"{}",), job="ja", rank=0, segment=s, lease=tok, **fields)
        a.refused("commit", REFUSED, (b"{}",), job="jb", rank=0, segment=s, lease=tok, **fields)
        a.refused("release", REFUSED, segment=s, lease=tok)
    assert a.slots() == {"leased": 1}
    b.ok("commit", (b"{}",), job="jb", rank=0, segment=seg_b, lease=tok_b, **fields)
    _wait_for(a, lambda st: st["slots"] == {"free": 1}, "the committed slot was not freed")
    b.quiet(0)
    b.close()
    _end_clean(d, a, seg_b.split("/")[0], frozenset({"jb"}))


def test_foreign_segments_and_paths_are_refused(make_daemon, tmp_path: Path) -> None:  # noqa: ANN001
    """Attack: commit, release and hot_close naming segments that exist but are not leased: one given back, a file
    planted in the daemon's own segment directory, a symlink planted there to a file outside, a look-alike
    directory in /dev/shm; and paths: absolute, "../", the segment's commit record, "//", ".", NUL. All are refused
    (hot_close, which refuses nothing, changes nothing), no file is touched, and the given-back segment still
    serves its owner, whose old token does not work on it."""
    d = make_daemon("--shm-budget", "8M")
    a = Peer(d)
    lease = {"job": "f", "rank": 0, "world_size": 1, "step": 1}
    seg, tok = _lease(a, **lease)
    a.ok("release", segment=seg, lease=tok)
    assert d.segments() == [seg] and a.slots() == {"free": 1}  # on disk, not leased
    shm_dir, file = seg.split("/")
    victim = tmp_path / "victim"
    victim.write_bytes(b"not a segment")
    planted, link = f"{shm_dir}/{'a' * 32}", f"{shm_dir}/{'b' * 32}"
    Path(SHM_DIR, planted).write_bytes(b"planted")
    os.symlink(victim, Path(SHM_DIR, link))
    other_dir = f"ckptd-{os.geteuid()}-{secrets.token_hex(8)}"
    os.mkdir(Path(SHM_DIR, other_dir), 0o700)
    other = f"{other_dir}/{file}"
    Path(SHM_DIR, other).write_bytes(b"another daemon's")
    files = [Path(SHM_DIR, planted), victim, Path(SHM_DIR, other), Path(SHM_DIR, seg)]
    before = {p: p.read_bytes() for p in files}
    try:
        names = [seg, planted, link, other, f"{SHM_DIR}/{seg}", f"{SHM_DIR}/{planted}", str(victim), f"../{seg}", f"{shm_dir}/../{other}",
                 "../../etc/passwd", "/etc/passwd", seg + shm.RECORD_SUFFIX, f"{shm_dir}//{file}", f"{shm_dir}/./{file}", shm_dir,
                 f"{shm_dir}/", seg + "\x00", seg + "\n", seg.upper(), f"{seg}/", f"./{seg}"]  # fmt: skip
        for name in names:
            for token in (tok, "0" * 32):
                a.refused("release", REFUSED, segment=name, lease=token)
                a.refused("commit", REFUSED, (b"{}",), segment=name, lease=token, local_world_size=1, nbytes=1, replicas={}, **lease)
            a.ok("hot_close", pin=tok, segments=[name])
        a.ok("hot_close", pin="0" * 32, segments=names)
        assert {p: p.read_bytes() for p in files} == before
        assert os.path.islink(Path(SHM_DIR, link))
        assert a.slots() == {"free": 1} and d.segments() == sorted([seg, planted, link])
    finally:
        for p in (Path(SHM_DIR, planted), Path(SHM_DIR, link), Path(SHM_DIR, other)):
            p.unlink(missing_ok=True)
        os.rmdir(Path(SHM_DIR, other_dir))
    # the given-back segment serves its owner again, under a new token only
    seg2, tok2 = _lease(a, **lease)
    assert seg2 == seg and tok2 != tok
    a.refused("commit", REFUSED, (b"{}",), segment=seg, lease=tok, local_world_size=1, nbytes=4096, replicas={}, **lease)
    a.ok("commit", (b"{}",), segment=seg, lease=tok2, local_world_size=1, nbytes=4096, replicas={}, **lease)
    _wait_for(a, lambda st: st["slots"] == {"free": 1}, "the committed slot was not freed")
    _end_clean(d, a, shm_dir, frozenset({"f"}))


def test_hot_close_cannot_drop_another_readers_pin(make_daemon) -> None:  # noqa: ANN001
    """Attack: two readers pin the same held step; reader B tries to drop A's pin with forged pins (wrong shape:
    refused; well formed but not A's: answered, changing nothing), with its own pin on A's segments among 4096
    names, and closes its own pin twice. A's pin stays until A names it. (A pin, like a lease, is a bearer
    token: whoever names it closes it.)"""
    from _models import make

    d = make_daemon()
    model, optim = make()
    with d.client("hot") as c:
        c.snapshot(model, optim, step=1, blocking=True).wait(60)
    a, b = Peer(d), Peer(d)
    me = os.getpid()
    ra = a.ok("hot_open", job="hot", step=None, pid=me)
    rb = b.ok("hot_open", job="hot", step=1, pid=me)
    assert ra["step"] == rb["step"] == 1 and ra["pin"] != rb["pin"]
    segs = sorted(ra["segments"].values())
    assert segs == sorted(rb["segments"].values())

    def pins() -> dict:
        return a.ok("status")["hot_pins"]

    assert pins() == {s: [me, me] for s in segs}
    pin_a, rng = ra["pin"], random.Random(7)
    for bad in {pin_a.upper(), pin_a[:-1], pin_a + "0", "", "g" * 32, pin_a + "\n"} - {pin_a}:
        b.refused("hot_close", BAD, pin=bad, segments=segs)
    b.refused("hot_close", BAD, pin=rb["pin"], segments=segs * 4097)
    for forged in (_flip(rng, pin_a), "0" * 32, _token(rng)):
        b.ok("hot_close", pin=forged, segments=segs)  # hot_close refuses nothing: a pin it does not know is a no-op
    b.ok("hot_close", pin=rb["pin"], segments=["/etc/passwd", f"../{segs[0]}", _flip(rng, segs[0], len(segs[0]) - 32)])
    assert pins() == {s: [me, me] for s in segs}
    crowd = [*segs, *(f"{segs[0].split('/')[0]}/{_token(rng)}" for _ in range(4096 - len(segs)))]
    b.ok("hot_close", pin=rb["pin"], segments=crowd)
    assert pins() == {s: [me] for s in segs}  # B's pin gone, A's kept
    b.ok("hot_close", pin=rb["pin"], segments=segs)  # twice
    assert pins() == {s: [me] for s in segs}
    a.ok("hot_close", pin=pin_a, segments=segs)
    assert pins() == {}
    b.quiet(0)
    b.close()
    _end_clean(d, a, segs[0].split("/")[0], frozenset({"hot"}))


# ---------------------------------------------------------------------------- found by the attacks above (each went unanswered)


def _answered_bad_request(daemon: DaemonProc, frame: bytes) -> None:
    """Send ``frame`` on a socket of its own; the daemon must stay up and answer it with ``bad_request``."""
    attacker, checker = Peer(daemon), Peer(daemon)
    try:
        attacker.s.send(frame)
        answered = attacker.s.poll(2000)  # the daemon answers everything else in milliseconds
        # the daemon itself lives on: the attack only costs the attacker its answer
        assert checker.ok("hello")["pid"] == daemon.proc.pid
        assert answered, attacker._why(f"no answer within 2 s to {_show([frame])}")
        rep = json.loads(attacker.s.recv())
        assert rep["ok"] is False and rep["code"] == BAD, rep
        attacker.quiet()
    finally:
        attacker.close()
        checker.close()


def test_an_integer_of_5000_digits_is_answered(daemon) -> None:  # noqa: ANN001
    """Attack: an alloc whose pid is an integer of 5000 digits: valid JSON, the right type, far beyond pid_max.
    Python refuses to convert integers of more than 4300 digits (``sys.get_int_max_str_digits``)."""
    head = b'{"v":1,"op":"alloc","id":7,"job":"j","rank":0,"world_size":1,"step":1,"nbytes":1,"pid":'
    _answered_bad_request(daemon, head + b"9" * 5000 + b"}")


def test_deeply_nested_json_is_answered(daemon) -> None:  # noqa: ANN001
    """Attack: a commit whose replicas hold one chunk id mapped to arrays nested 100000 deep: valid JSON, 200 kB."""
    head = b'{"v":1,"op":"commit","id":8,"job":"j","rank":0,"world_size":1,"local_world_size":1,"step":1,"segment":"s",'
    head += b'"lease":"00000000000000000000000000000000","nbytes":1,"replicas":{"c":'
    _answered_bad_request(daemon, head + b"[" * 100_000 + b"]" * 100_000 + b"}}")


def test_a_version_of_the_wrong_type_is_refused(daemon) -> None:  # noqa: ANN001
    """Attack: the envelope's version as ``true`` or ``1.0``: the protocol refuses wrong types and guesses nothing."""
    peer = Peer(daemon)
    try:
        for v in (b"true", b"1.0"):
            req_id = next(peer.ids)
            rep = peer.send([b'{"v":' + v + b',"op":"hello","id":%d}' % req_id], req_id)
            assert rep["ok"] is False and rep["code"] == BAD, f"version {v.decode()} accepted: {rep}"
    finally:
        peer.close()
