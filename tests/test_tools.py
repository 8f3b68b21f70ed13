"""ckptd verify / export / ls, and the stale-step guard."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import psutil
import pytest
import torch
from _models import make, train_step
from conftest import REPO

import ckptd


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd", *args], capture_output=True, text=True, cwd=REPO, timeout=300)


@pytest.fixture
def ckpt(daemon) -> str:  # noqa: ANN001
    model, optim = make()
    train_step(model, optim, 0)
    with daemon.client("j") as c:
        return c.snapshot(model, optim, step=1).wait(30)


def _flip(path: str, offset_from_end: int) -> None:
    with open(path, "r+b") as f:
        f.seek(-offset_from_end, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))


def test_verify_sound_and_each_kind_of_damage(ckpt: str) -> None:
    r = _cli("verify", ckpt)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr
    assert _cli("verify", os.path.dirname(ckpt)).returncode == 0  # job dir: its newest step
    shard = os.path.join(ckpt, "rank-00000.safetensors")
    _flip(shard, 3)
    r = _cli("verify", ckpt)
    assert r.returncode == 1 and "rank-00000.safetensors: checksum mismatch in tensor" in r.stderr
    m2, o2 = make(seed=3)
    with pytest.raises(ckptd.FormatError, match="rank-00000.safetensors"):
        ckptd.restore(m2, o2, path=ckpt)
    _flip(shard, 3)  # repaired
    assert _cli("verify", ckpt).returncode == 0
    with open(shard, "r+b") as f:  # damage the header
        f.seek(20)
        f.write(b"\x00")
    r = _cli("verify", ckpt)
    assert r.returncode == 1 and "rank-00000.safetensors" in r.stderr
    os.truncate(shard, 50)
    assert _cli("verify", ckpt).returncode == 1
    with open(os.path.join(ckpt, "manifest.json"), "w") as f:
        f.write("{")
    r = _cli("verify", ckpt)
    assert r.returncode == 1 and "not valid JSON" in r.stderr
    os.unlink(os.path.join(ckpt, "manifest.json"))
    r = _cli("verify", ckpt)
    assert r.returncode == 1 and "neither a committed" in r.stderr


def test_verify_imports_no_torch(ckpt: str) -> None:
    """verify reads headers and checksums: importing torch cost each call 2.5 s on a 2-core machine."""
    code = "import sys\nfrom ckptd.cli import main\nrc = main(['verify', sys.argv[1]])\nprint(rc, 'torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code, ckpt], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.stdout.split()[-2:] == ["0", "False"], r.stdout + r.stderr


def test_verify_passes_a_step_whose_empty_chunks_share_a_byte_range(daemon) -> None:  # noqa: ANN001
    """FSDP2 leaves a rank an empty shard of any parameter whose first dimension is smaller than the world
    size (a ``Linear(h, 1)`` head on two ranks), and its Adam moments are empty too: several empty chunks
    at one offset. verify called them damaged ("do not match the shard header"), and a bucket download,
    which verifies, refused the step: it could never be restored from the bucket."""
    from ckptd.storage.verify import verify_checkpoint

    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.ones(3))
    model.head = torch.nn.Parameter(torch.empty(0))
    model.gate = torch.nn.Parameter(torch.empty(0, 4))
    optim = torch.optim.AdamW(model.parameters())
    (model.w.sum() + model.head.sum() + model.gate.sum()).backward()
    optim.step()
    with daemon.client("empty") as c:
        path = c.snapshot(model, optim, step=1, blocking=True).wait(30)
    assert verify_checkpoint(path) == []
    r = _cli("verify", path)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr


def test_stale_step_is_flagged(daemon) -> None:  # noqa: ANN001
    """Same bytes as the step before although the optimizer stepped: verify and restore warn."""
    model, optim = make(lr=0.0)
    optim.param_groups[0]["weight_decay"] = 0.0

    def idle_step() -> None:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optim.step()

    idle_step()
    with daemon.client("j") as c:
        c.snapshot(model, optim, step=1).wait(30)
        idle_step()  # the step counter advances, nothing else changes
        path = c.snapshot(model, optim, step=2).wait(30)
        r = _cli("verify", path)
        assert r.returncode == 0 and "bit-identical to step 1" in r.stderr
        with pytest.warns(UserWarning, match="bit-identical to step 1"):
            c.restore(*make(lr=0.0))
        train_step(model, optim, 5)  # a real change: no warning
        optim.param_groups[0]["lr"] = 1e-2
        train_step(model, optim, 6)
        path = c.snapshot(model, optim, step=3).wait(30)
        r = _cli("verify", path)
        assert r.returncode == 0 and "bit-identical" not in r.stderr


def test_ls(daemon, ckpt: str) -> None:  # noqa: ANN001
    r = _cli("ls", "--endpoint", daemon.endpoint)
    assert r.returncode == 0, r.stderr
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("j ")][0].split()
    assert line[1] == "1" and line[3] == "1"  # step 1, one rank
    assert _cli("ls", "--root", daemon.root, "--job", "j").stdout == r.stdout
    # mistakes: a wrong root printed an empty table and exited 0, as if there were no checkpoints
    r = _cli("ls", "--root", daemon.root + "-typo")
    assert r.returncode == 1 and "is not a directory" in r.stderr and r.stdout == ""
    r = _cli("ls", "--root", daemon.root, "--job", "../etc")
    assert r.returncode == 1 and "invalid job name" in r.stderr
    r = _cli("ls", "--root", daemon.root, "--job", "k")  # a typo of the job's name: an empty table and exit 0 before
    assert r.returncode == 1 and "no job 'k' under" in r.stderr and "(jobs there: j)" in r.stderr and r.stdout == ""


def _big_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=(i % 2 == 0)) for i in range(25)])


@pytest.mark.slow
def test_export_streams_and_loads_with_safetensors(daemon, short_tmp) -> None:  # noqa: ANN001
    from safetensors.torch import load_file

    model = _big_model()  # 105 M params: 1.26 GB of checkpoint with AdamW state
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optim.step()
    with daemon.client("big") as c:
        path = c.snapshot(model, optim, step=1, blocking=True).wait(120)
    ckpt_bytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    assert ckpt_bytes >= 0.5e9
    out = str(short_tmp / "model.safetensors")
    for what in ("model", "all"):
        proc = psutil.Popen([sys.executable, "-m", "ckptd", "export", path, "--out", out, "--what", what], cwd=REPO)
        peak = 0
        while proc.poll() is None:
            try:
                peak = max(peak, proc.memory_info().rss)
            except psutil.NoSuchProcess:
                break
            time.sleep(0.005)
        assert proc.returncode == 0
        print(f"export --what {what}: peak RSS {peak / 1e9:.3f} GB for a {ckpt_bytes / 1e9:.3f} GB checkpoint")
        assert peak < 0.5 * ckpt_bytes, f"export ({what}) peaked at {peak / 1e9:.2f} GB for a {ckpt_bytes / 1e9:.2f} GB checkpoint"
        got = load_file(out)
        if what == "model":
            want = model.state_dict()
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], want[k]) for k in want)
            _big_model().load_state_dict(got)  # loadable as is
        else:
            assert torch.equal(got["model.0.weight"], model[0].weight.detach())
            assert torch.equal(got["optim.state.24.weight.exp_avg_sq"], optim.state[model[24].weight]["exp_avg_sq"])
            assert got["optim.state.0.weight.step"].item() == 1
        del got


@pytest.mark.parametrize("layout", ["torchtitan", "lightning"])
def test_export_finds_the_model_and_optimizer_of_an_integrations_step(daemon, short_tmp, layout: str) -> None:  # noqa: ANN001
    """Steps saved through ckptd.dcp.Writer by torchtitan (the model's tensors at the top level, ``optimizer``) or by
    Lightning's CkptdCheckpointIO (``state_dict``, ``optimizer_states``) exported nothing with --what model or optim
    ("holds no model tensors"), though README says export treats every step alike. Found by a review of the tools."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    import ckptd.dcp
    from ckptd.dcp import shared

    model, optim = make()
    train_step(model, optim, 0)
    msd, osd = get_state_dict(model, optim, options=StateDictOptions(flatten_optimizer_state_dict=layout == "torchtitan"))
    if layout == "torchtitan":
        state = {**msd, "optimizer": osd, "train_state": {"step": 5}}
    else:
        state = {"state_dict": msd, "optimizer_states": [osd], "epoch": 1}
    try:
        dcp.save(state, storage_writer=ckptd.dcp.Writer(layout, endpoint=daemon.endpoint, durable=True), checkpoint_id="5", no_dist=True)
    finally:
        for c in shared._clients.values():
            c.close()
        shared._clients.clear()
    path = os.path.join(daemon.root, layout, "step-5")
    for what in ("model", "optim"):
        out = _cli("export", path, "--out", str(short_tmp / f"{what}.safetensors"), "--what", what)
        assert out.returncode == 0, out.stderr
    got = load_file(str(short_tmp / "model.safetensors"))
    want = model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    optim_keys = load_file(str(short_tmp / "optim.safetensors")).keys()
    assert any(k.endswith("exp_avg_sq") for k in optim_keys), sorted(optim_keys)[:4]


def test_export_torch_format_and_errors(ckpt: str, short_tmp) -> None:  # noqa: ANN001
    out = str(short_tmp / "m.pt")
    r = _cli("export", ckpt, "--out", out, "--format", "torch")
    assert r.returncode == 0, r.stderr
    sd = torch.load(out, weights_only=True)
    m2, _ = make(seed=5)
    m2.load_state_dict(sd)
    model, optim = make()
    train_step(model, optim, 0)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in sd.items())
    r = _cli("export", str(short_tmp / "nothing"), "--out", out)
    assert r.returncode == 1 and "neither a committed" in r.stderr
    assert not [n for n in os.listdir(short_tmp) if n.startswith(".") or n.endswith(".tmp")]  # no temporary left


def test_export_never_writes_through_a_link_planted_beside_its_output(ckpt: str, short_tmp) -> None:  # noqa: ANN001
    """Whoever can write in --out's directory planted OUT.tmp -> a file of the exporting user's (root: any file):
    the export truncated that file and wrote the checkpoint into it, then renamed the link over OUT."""
    victim = short_tmp / "authorized_keys"
    victim.write_text("ssh-ed25519 AAAA legit\n")
    for fmt, out in (("safetensors", short_tmp / "m.safetensors"), ("torch", short_tmp / "m.pt")):
        for planted in (f"{out}.tmp", f"{out}.st.tmp"):
            os.symlink(victim, planted)
        r = _cli("export", ckpt, "--out", str(out), "--format", fmt)
        assert r.returncode == 0, r.stderr
        assert victim.read_text() == "ssh-ed25519 AAAA legit\n" and out.is_file() and not out.is_symlink()
        assert stat.S_IMODE(os.stat(out).st_mode) == 0o666 & ~_umask()  # as a plain open() makes it
    hf = short_tmp / "hf"
    os.symlink(short_tmp / "elsewhere", f"{hf}.tmp")  # the hf export's old temporary directory name
    assert _cli("export", ckpt, "--out", str(hf), "--format", "hf").returncode == 0
    assert sorted(os.listdir(hf)) == ["model.safetensors"] and not (short_tmp / "elsewhere").exists()
    assert stat.S_IMODE(os.stat(hf).st_mode) == 0o777 & ~_umask()
    left = sorted(n for n in os.listdir(short_tmp) if n.startswith("."))
    assert left == [], left  # no temporary of the exports left


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_export_refuses_to_replace_what_is_not_a_regular_file(ckpt: str, short_tmp) -> None:  # noqa: ANN001
    # the export renames its temporary over --out: as root, "--out /dev/null" replaced the device node
    fifo = str(short_tmp / "pipe")
    os.mkfifo(fifo)
    (short_tmp / "adir").mkdir()
    for out, why in (("/dev/null", "not a regular file"), (fifo, "not a regular file"), (str(short_tmp / "adir"), "a directory")):
        r = _cli("export", ckpt, "--out", out)
        assert r.returncode == 1 and f"{out} is {why}" in r.stderr, r.stderr
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert os.listdir(short_tmp / "adir") == [] and not [n for n in os.listdir(short_tmp) if n.startswith(".")]
    link = short_tmp / "link.safetensors"
    link.symlink_to(short_tmp / "target.safetensors")  # dangling: the export replaces the link
    assert _cli("export", ckpt, "--out", str(link)).returncode == 0 and link.is_file() and not link.is_symlink()


def test_export_to_torch_of_tensors_off_their_alignment(daemon, short_tmp) -> None:  # noqa: ANN001
    """A safetensors body is packed: BatchNorm1d(3)'s 12-byte bias puts the int64 counter after it off an
    8-byte boundary, and the torch export failed with a traceback (storage offset not divisible by 8)."""
    model = torch.nn.BatchNorm1d(3)
    model(torch.randn(4, 3))
    with daemon.client("bn") as c:
        path = c.snapshot(model, step=1, blocking=True).wait(30)
    out = str(short_tmp / "bn.pt")
    r = _cli("export", path, "--out", out, "--format", "torch")
    assert r.returncode == 0, r.stderr
    sd = torch.load(out, weights_only=True)
    assert sd.keys() == model.state_dict().keys() and all(torch.equal(sd[k], v) for k, v in model.state_dict().items())


def test_export_reports_progress_up_to_the_total(ckpt: str, short_tmp) -> None:  # noqa: ANN001
    from ckptd.tools.export import export_checkpoint

    seen: list[int] = []
    stats = export_checkpoint(ckpt, str(short_tmp / "m.safetensors"), what="all", progress=seen.append)
    assert len(seen) == stats["tensors"] and seen == sorted(seen) and seen[-1] == stats["bytes"]


def test_status_shows_an_upload_in_progress_as_a_bar() -> None:
    from ckptd.cli import format_status

    st = {
        "version": "0", "pid": 1, "uptime_s": 3725, "root": "/r", "remote": "s3://b/p", "shm_bytes": 2e9, "shm_budget": 8e9,
        "slots": {"free": 1, "committed": 1}, "staged_bytes": 1e9, "deferred_allocs": 0, "persisted_bytes": 4e9,
        "persist_seconds": 2.0, "persist_bytes_per_s": 2e9, "steps_committed": 4, "uploaded_bytes": 3e9, "upload_seconds": 30.0,
        "upload_bytes_per_s": 1e8, "steps_uploaded": 3, "upload_backlog": [["j", 5]], "errors": 0, "last_error": None,
        "uploading": {"job": "j", "step": 4, "bytes_done": 5e8, "bytes_total": 1e9, "seconds": 5.0},
        "jobs": {"j": {"in_flight": [5], "latest": 4, "uploaded": 3, "in_memory": 4}},
    }  # fmt: skip
    text = format_status(st)
    assert "up 1h02m" in text and "1 queued" in text
    assert "uploading   job j step 4: [############............]  50% 0.50 GB / 1.00 GB, 100 MB/s" in text
    assert text.splitlines()[-1].split() == ["j", "4", "3", "4", "5"]
    # steps protected by name (Lightning's kept checkpoints): README said status lists them; only --json did
    st["jobs"]["j"]["protected"] = [2, 4]
    assert format_status(st).splitlines()[-1].endswith("5  (protected: 2, 4)")
