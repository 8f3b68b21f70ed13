"""ckptd.config: the defaults, ``parse_size``, ``env_int`` / ``env_float``, job names and the default endpoint
and job, and ``daemon_config``: precedence flag > TOML file > ``CKPTD_*`` environment > default, the
``[remote]`` table (``RemoteConfig`` plus ``keep`` / ``keep_every`` / ``commit_timeout``) and errors that
name the file and the key. Called directly; tests/test_systemd.py checks a few errors through ``ckptd serve``.
"""

from __future__ import annotations

import dataclasses
import grp
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

from ckptd import config
from ckptd.config import DaemonConfig, daemon_config, default_endpoint, default_job, env_float, env_int, parse_size, validate_job
from ckptd.errors import CheckpointError
from ckptd.storage.s3 import RemoteConfig

ENV_NAMES = (
    "CKPTD_ROOT", "CKPTD_ENDPOINT", "CKPTD_JOB", "CKPTD_KEEP", "CKPTD_WORKERS", "CKPTD_WRITE_RATE_LIMIT", "CKPTD_NICE",
    "CKPTD_GROUP", "CKPTD_METRICS_PORT", "CKPTD_IDLE_PRIORITY", "CKPTD_TIMEOUT", "CKPTD_ALLOC_TIMEOUT", "TORCHELASTIC_RUN_ID",
    "CKPTD_LEASE_TIMEOUT", "CKPTD_TRUST_GROUP",
)  # fmt: skip
REMOTE_TIER_DEFAULTS = (config.REMOTE_KEEP, config.REMOTE_KEEP_EVERY, config.COMMIT_TIMEOUT_S)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No ``CKPTD_*`` or torchrun variable leaks in from the caller; the runtime dir is a private one."""
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))


def _toml(tmp_path: Path, text: str, name: str = "ckptd.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ---------------------------------------------------------------------------- defaults


def test_documented_defaults() -> None:
    """The values the README and systemd/ckptd.toml promise, held in one module."""
    assert (config.CLIENT_TIMEOUT_S, config.ALLOC_TIMEOUT_S) == (30.0, 600.0)
    assert (config.KEEP, config.WORKERS, config.NICE) == (3, 2, 10)
    assert (config.REMOTE_KEEP, config.REMOTE_KEEP_EVERY, config.COMMIT_TIMEOUT_S) == (3, 0, 600.0)


def test_daemon_config_defaults_come_from_the_constants(tmp_path: Path) -> None:
    cfg = daemon_config({"root": str(tmp_path)})
    assert cfg == DaemonConfig(root=str(tmp_path), endpoint=default_endpoint())
    assert cfg.shm_budget is None and cfg.remote is None and cfg.group is None
    assert (cfg.keep, cfg.workers, cfg.nice) == (config.KEEP, config.WORKERS, config.NICE)
    assert (cfg.remote_keep, cfg.remote_keep_every, cfg.commit_timeout) == REMOTE_TIER_DEFAULTS
    assert (cfg.write_rate_limit, cfg.metrics_port, cfg.idle_priority, cfg.log_level) == (0.0, 0, True, "INFO")
    assert isinstance(cfg.write_rate_limit, float) and isinstance(cfg.commit_timeout, float)


def test_serve_keys_are_the_daemon_settings_less_the_remote_table() -> None:
    fields = {f.name for f in dataclasses.fields(DaemonConfig)}
    assert len(set(config.SERVE_KEYS)) == len(config.SERVE_KEYS)
    assert fields - set(config.SERVE_KEYS) == {"remote", "remote_keep", "remote_keep_every", "commit_timeout"}
    assert set(config.SERVE_KEYS) <= fields


def test_default_shm_budget_is_half_the_shm_filesystem(monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptd.shm import SHM_DIR

    class FakeStat:
        f_frsize, f_blocks = 4096, 1001

    seen: list[str] = []
    monkeypatch.setattr(os, "statvfs", lambda path: seen.append(path) or FakeStat())
    assert config.default_shm_budget() == 4096 * 1001 // 2
    assert seen == [SHM_DIR]


# ---------------------------------------------------------------------------- parse_size


@pytest.mark.parametrize(
    "text,want",
    [
        ("0", 0),
        ("100", 100),
        ("100B", 100),
        ("64k", 64 << 10),
        ("64KiB", 64 << 10),
        ("64kb", 64 << 10),
        ("512M", 512 << 20),
        ("512MiB", 512 << 20),
        ("8G", 8 << 30),
        ("8gb", 8 << 30),
        ("8GiB", 8 << 30),
        ("2T", 2 << 40),
        ("1.5G", 3 << 29),
        (" 8g ", 8 << 30),
    ],
)
def test_parse_size(text: str, want: int) -> None:
    got = parse_size(text)
    assert got == want and isinstance(got, int)


@pytest.mark.parametrize("text", ["", "   ", "lots", "8X", "G", "MiB", "0.5", "8 G B", "1,5G", "nanG"])
def test_parse_size_refuses_and_names_the_text(text: str) -> None:
    with pytest.raises(ValueError, match="not a size") as e:
        parse_size(text)
    assert repr(text) in str(e.value)


# ---------------------------------------------------------------------------- env_int / env_float


def test_env_int(monkeypatch: pytest.MonkeyPatch) -> None:
    assert env_int("CKPTD_TEST_INT", 7) == 7  # unset
    monkeypatch.setenv("CKPTD_TEST_INT", "")
    assert env_int("CKPTD_TEST_INT", 7) == 7  # empty means unset
    monkeypatch.setenv("CKPTD_TEST_INT", "12")
    assert env_int("CKPTD_TEST_INT", 7) == 12
    monkeypatch.setenv("CKPTD_TEST_INT", "-3")
    assert env_int("CKPTD_TEST_INT", 7) == -3


@pytest.mark.parametrize("raw", ["1.5", "three", "0x10", "1e3"])
def test_env_int_error_names_the_variable_and_value(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("CKPTD_TEST_INT", raw)
    with pytest.raises(ValueError) as e:
        env_int("CKPTD_TEST_INT", 7)
    assert str(e.value) == f"CKPTD_TEST_INT={raw!r} is not an integer"


def test_env_float(monkeypatch: pytest.MonkeyPatch) -> None:
    assert env_float("CKPTD_TEST_FLOAT", 2.5) == 2.5
    monkeypatch.setenv("CKPTD_TEST_FLOAT", "")
    assert env_float("CKPTD_TEST_FLOAT", 2.5) == 2.5
    for raw, want in (("4", 4.0), ("0.25", 0.25), ("1e3", 1000.0)):
        monkeypatch.setenv("CKPTD_TEST_FLOAT", raw)
        assert env_float("CKPTD_TEST_FLOAT", 2.5) == want


@pytest.mark.parametrize("raw", ["fast", "1.2.3", "30s"])
def test_env_float_error_names_the_variable_and_value(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("CKPTD_TEST_FLOAT", raw)
    with pytest.raises(ValueError) as e:
        env_float("CKPTD_TEST_FLOAT", 2.5)
    assert str(e.value) == f"CKPTD_TEST_FLOAT={raw!r} is not a number"


BAD_ENV = [
    ("CKPTD_KEEP", "three"),
    ("CKPTD_WORKERS", "2.5"),
    ("CKPTD_NICE", "low"),
    ("CKPTD_METRICS_PORT", "http"),
    ("CKPTD_WRITE_RATE_LIMIT", "x"),
]


@pytest.mark.parametrize("name,raw", BAD_ENV)
def test_daemon_config_names_a_bad_environment_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, raw: str) -> None:
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=f"^{name}=") as e:
        daemon_config({"root": str(tmp_path)})
    assert repr(raw) in str(e.value)


# ---------------------------------------------------------------------------- job names, endpoint, job


@pytest.mark.parametrize("job", ["a", "0", "default", "job-1.2_x", "Run.7-b_c", "a." + "b" * 126])
def test_validate_job_accepts_safe_names(job: str) -> None:
    assert validate_job(job) == job


@pytest.mark.parametrize(
    "job", ["", ".", "..", "a..b", "-a", ".a", "_a", "a/b", "/a", "a\\b", "a b", "a\x00b", "a\tb", "é", "a" * 129, None, 5, b"job"]
)
def test_validate_job_refuses_unsafe_names(job: object) -> None:
    with pytest.raises(ValueError, match="invalid job name") as e:
        validate_job(job)
    assert repr(job) in str(e.value)


def test_default_endpoint_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTD_ENDPOINT", "tcp://127.0.0.1:5999")
    assert default_endpoint() == "tcp://127.0.0.1:5999"


def test_default_endpoint_is_per_user_under_the_runtime_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CKPTD_ENDPOINT", "")  # empty means unset
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    assert default_endpoint() == f"ipc://{tmp_path}/xdg/ckptd-{os.getuid()}/ckptd.sock"


@pytest.mark.parametrize("xdg", [None, ""])
def test_default_endpoint_falls_back_to_the_temp_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, xdg: str | None) -> None:
    if xdg is None:
        monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    else:
        monkeypatch.setenv("XDG_RUNTIME_DIR", xdg)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    assert default_endpoint() == f"ipc://{tmp_path}/tmp/ckptd-{os.getuid()}/ckptd.sock"


@pytest.mark.parametrize(
    "ckptd_job,run_id,want",
    [
        ("mine", None, "mine"),
        ("mine", "elastic-7", "mine"),  # CKPTD_JOB wins over torchrun's run id
        (None, "elastic-7", "elastic-7"),  # torchrun --rdzv-id=elastic-7
        ("", "elastic-7", "elastic-7"),  # empty CKPTD_JOB means unset
    ],
)
def test_default_job(monkeypatch: pytest.MonkeyPatch, ckptd_job: str | None, run_id: str | None, want: str) -> None:
    if ckptd_job is not None:
        monkeypatch.setenv("CKPTD_JOB", ckptd_job)
    if run_id is not None:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
    assert default_job() == want


@pytest.mark.parametrize("run_id", [None, "none", "0b8d2a4e-6f1c-4b7e-9a3d-2c5e8f1a7b90"])
def test_without_a_name_the_job_is_the_script_run_in_its_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, run_id: str | None
) -> None:
    """Plain torchrun (run id ``none``), torchrun --standalone (a fresh UUID per launch) and plain
    python: the same command in the same directory is the same job, launch after launch."""
    monkeypatch.delenv("CKPTD_JOB", raising=False)
    if run_id is not None:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
    script = tmp_path / "train llama.py"
    script.write_text("")
    job = default_job([str(script), "--lr", "1e-3"], cwd="/exp/1")
    assert job.startswith("train_llama-") and len(job) == len("train_llama-") + 8
    assert default_job([str(script), "--lr", "1e-3"], cwd="/exp/1") == job
    others = {default_job([str(script), "--lr", "3e-4"], cwd="/exp/1"), default_job([str(script), "--lr", "1e-3"], cwd="/exp/2")}
    assert job not in others and len(others) == 2
    # torch.distributed.launch and DeepSpeed give each rank its own --local-rank: every rank still agrees
    for r in range(2):
        assert default_job([str(script), f"--local-rank={r}", "--lr", "1e-3"], cwd="/exp/1") == job
        assert default_job([str(script), "--local_rank", str(r), "--lr", "1e-3"], cwd="/exp/1") == job


@pytest.mark.parametrize("argv", [[""], ["-c"], []])
def test_an_interactive_session_must_name_its_job(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> None:
    monkeypatch.delenv("CKPTD_JOB", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with pytest.raises(CheckpointError, match="interactive session or python -c.*CKPTD_JOB=<name>"):
        default_job(argv)


def test_a_job_spanning_nodes_must_name_its_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CKPTD_JOB", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(CheckpointError, match="every node agrees on.*torchrun --rdzv-id"):
        default_job([__file__])


@pytest.mark.parametrize("name,value", [("CKPTD_JOB", "../etc"), ("TORCHELASTIC_RUN_ID", "a/b"), ("CKPTD_JOB", "x" * 200)])
def test_default_job_is_validated(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="invalid job name"):
        default_job()


# ---------------------------------------------------------------------------- precedence

# key: (environment variable or None, its value, the TOML literal, the flag value, expected: env, file, flag, default)
PRECEDENCE: dict[str, tuple[str | None, str, str, Any, tuple[Any, Any, Any, Any]]] = {
    "root": ("CKPTD_ROOT", "/env/root", '"/file/root"', "/flag/root", ("/env/root", "/file/root", "/flag/root", None)),
    "endpoint": (
        "CKPTD_ENDPOINT",
        "ipc:///e.sock",
        '"ipc:///f.sock"',
        "tcp://127.0.0.1:5555",
        ("ipc:///e.sock", "ipc:///f.sock", "tcp://127.0.0.1:5555", "DEFAULT"),
    ),
    "keep": ("CKPTD_KEEP", "5", "6", 7, (5, 6, 7, config.KEEP)),
    "workers": ("CKPTD_WORKERS", "5", "6", 7, (5, 6, 7, config.WORKERS)),
    "nice": ("CKPTD_NICE", "5", "6", 7, (5, 6, 7, config.NICE)),
    "metrics_port": ("CKPTD_METRICS_PORT", "9001", "9002", 9003, (9001, 9002, 9003, 0)),
    "write_rate_limit": ("CKPTD_WRITE_RATE_LIMIT", "1000.5", '"2M"', 3, (1000.5, float(2 << 20), 3.0, 0.0)),
    "idle_priority": ("CKPTD_IDLE_PRIORITY", "0", "true", False, (False, True, False, True)),
    "direct_io": ("CKPTD_DIRECT_IO", "no", "true", False, (False, True, False, True)),
    "shm_budget": (None, "", '"64M"', 1 << 20, (None, 64 << 20, 1 << 20, None)),
    "log_level": (None, "", '"DEBUG"', "WARNING", (None, "DEBUG", "WARNING", "INFO")),
}


@pytest.mark.parametrize("key", sorted(PRECEDENCE))
def test_precedence_flag_over_file_over_env_over_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, key: str) -> None:
    var, env_value, literal, flag, (want_env, want_file, want_flag, want_default) = PRECEDENCE[key]
    base = {} if key == "root" else {"root": str(tmp_path / "root")}
    if want_default == "DEFAULT":
        want_default = f"ipc://{tmp_path}/run/ckptd-{os.getuid()}/ckptd.sock"

    def value(flags: dict[str, Any], config_file: str | None = None) -> Any:
        return getattr(daemon_config(flags, config_file), key)

    if key == "root":
        with pytest.raises(ValueError, match="no checkpoint root"):
            daemon_config({})
    else:
        assert value(dict(base)) == want_default
    if var is not None:
        monkeypatch.setenv(var, env_value)
        assert value(dict(base)) == want_env
    else:
        want_env = want_default
    assert value({**base, key: None}) == want_env  # a flag left at None is not given
    path = _toml(tmp_path, f"{key} = {literal}\n")
    assert value(dict(base), path) == want_file
    assert value({**base, key: flag}, path) == want_flag
    assert value({**base, key: None}, path) == want_file


def test_precedence_is_per_key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Each setting takes its own highest source: one file key does not hide another key's env value."""
    monkeypatch.setenv("CKPTD_ROOT", "/env/root")
    monkeypatch.setenv("CKPTD_KEEP", "5")
    monkeypatch.setenv("CKPTD_WORKERS", "4")
    monkeypatch.setenv("CKPTD_NICE", "3")
    path = _toml(tmp_path, "keep = 6\nworkers = 8\n")
    flags = {k: None for k in config.SERVE_KEYS} | {"workers": 9}  # what `ckptd serve --workers 9` passes
    cfg = daemon_config(flags, path)
    assert (cfg.root, cfg.keep, cfg.workers, cfg.nice, cfg.metrics_port) == ("/env/root", 6, 9, 3, 0)


def test_falsy_flags_still_win(tmp_path: Path) -> None:
    """0 and False are given values, not "unset": ``--nice 0`` beats ``nice = 5`` in the file."""
    path = _toml(tmp_path, f'root = "{tmp_path}"\nnice = 5\nmetrics_port = 9464\nwrite_rate_limit = "1M"\nidle_priority = true\n')
    cfg = daemon_config({"nice": 0, "metrics_port": 0, "write_rate_limit": 0, "idle_priority": False}, path)
    assert (cfg.nice, cfg.metrics_port, cfg.write_rate_limit, cfg.idle_priority) == (0, 0, 0.0, False)


def test_falsy_file_values_win_over_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CKPTD_NICE", "7")
    monkeypatch.setenv("CKPTD_METRICS_PORT", "9464")
    monkeypatch.setenv("CKPTD_IDLE_PRIORITY", "1")
    path = _toml(tmp_path, f'root = "{tmp_path}"\nnice = 0\nmetrics_port = 0\nidle_priority = false\n')
    cfg = daemon_config({}, path)
    assert (cfg.nice, cfg.metrics_port, cfg.idle_priority) == (0, 0, False)


@pytest.mark.parametrize("raw,want", [("0", False), ("false", False), ("no", False), ("1", True), ("yes", True), ("", True)])
def test_idle_priority_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, raw: str, want: bool) -> None:
    monkeypatch.setenv("CKPTD_IDLE_PRIORITY", raw)
    assert daemon_config({"root": str(tmp_path)}).idle_priority is want


def test_empty_environment_values_mean_unset(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ENV_NAMES:
        monkeypatch.setenv(name, "")
    cfg = daemon_config({"root": str(tmp_path)})
    assert cfg == DaemonConfig(root=str(tmp_path), endpoint=default_endpoint())
    monkeypatch.setenv("CKPTD_ROOT", "")
    with pytest.raises(ValueError, match="no checkpoint root"):
        daemon_config({})


def test_group_precedence_and_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    names = sorted({g.gr_name for g in grp.getgrall()})
    if len(names) < 3:
        pytest.skip("needs three groups on this machine")
    env_group, file_group, flag_group = names[:3]
    root = {"root": str(tmp_path)}
    monkeypatch.setenv("CKPTD_GROUP", env_group)
    assert daemon_config(root).group == env_group
    path = _toml(tmp_path, f'group = "{file_group}"\n')
    assert daemon_config(root, path).group == file_group
    assert daemon_config({**root, "group": flag_group}, path).group == flag_group
    assert daemon_config({**root, "group": str(os.getgid())}).group == str(os.getgid())  # a gid works too


@pytest.mark.parametrize("source", ["env", "file", "flag"])
def test_unknown_group_is_a_value_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, source: str) -> None:
    bogus = "ckptd-no-such-group-xyz"
    flags: dict[str, Any] = {"root": str(tmp_path)}
    path = None
    if source == "env":
        monkeypatch.setenv("CKPTD_GROUP", bogus)
    elif source == "file":
        path = _toml(tmp_path, f'group = "{bogus}"\n')
    else:
        flags["group"] = bogus
    with pytest.raises(ValueError, match=f"unknown group '{bogus}'"):
        daemon_config(flags, path)


@pytest.mark.parametrize("source", ["env", "flag"])
def test_keep_below_one_is_refused_from_any_source(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, source: str) -> None:
    flags: dict[str, Any] = {"root": str(tmp_path)}
    if source == "env":
        monkeypatch.setenv("CKPTD_KEEP", "0")
    else:
        flags["keep"] = -1
    with pytest.raises(ValueError, match="keep must be >= 1"):
        daemon_config(flags)


def test_a_flag_does_not_excuse_a_bad_file_value(tmp_path: Path) -> None:
    """The file is read whole first: a flag for a key does not excuse that key's wrong type in the file."""
    path = _toml(tmp_path, f'root = "{tmp_path}"\nworkers = "two"\n')
    with pytest.raises(ValueError, match="workers must be a int"):
        daemon_config({"workers": 2}, path)
    assert daemon_config({"keep": 1}, _toml(tmp_path, f'root = "{tmp_path}"\nkeep = 9\n', "ok.toml")).keep == 1


def test_missing_config_file_is_an_os_error_naming_it(tmp_path: Path) -> None:
    path = str(tmp_path / "absent.toml")
    with pytest.raises(OSError) as e:
        daemon_config({"root": str(tmp_path)}, path)
    assert path in str(e.value)


# ---------------------------------------------------------------------------- file errors


@pytest.mark.parametrize(
    "text,msg",
    [
        ('root = "/x"\nshm-budget = "1G"\nkepe = 3\n', "unknown settings ['kepe', 'shm-budget']"),
        ("root = 5\n", "root must be a str, got 5"),
        ('root = "/x"\nendpoint = 5555\n', "endpoint must be a str, got 5555"),
        ('root = "/x"\nlog_level = 10\n', "log_level must be a str, got 10"),
        ('root = "/x"\nworkers = 2.5\n', "workers must be a int, got 2.5"),
        ('root = "/x"\nnice = true\n', "nice must be a int, got True"),
        ('root = "/x"\nmetrics_port = "9464"\n', "metrics_port must be a int, got '9464'"),
        ('root = "/x"\nidle_priority = 1\n', "idle_priority must be a bool, got 1"),
        ('root = "/x"\nidle_priority = "yes"\n', "idle_priority must be a bool, got 'yes'"),
        ('root = "/x"\nshm_budget = 1.5\n', "shm_budget must be a int, got 1.5"),
        ('root = "/x"\nwrite_rate_limit = "fast"\n', "write_rate_limit: not a size: 'fast'"),
        ('root = "/x"\nkeep = 2\nkeep = 3\n', "ckptd.toml: "),  # TOML itself refuses a duplicate key
    ],
)
def test_file_errors_name_the_file_and_key(tmp_path: Path, text: str, msg: str) -> None:
    path = _toml(tmp_path, text)
    with pytest.raises(ValueError) as e:
        daemon_config({}, path)
    assert str(e.value).startswith(f"{path}: ") and msg in str(e.value), str(e.value)


def test_file_size_keys_take_sizes_or_integers(tmp_path: Path) -> None:
    cfg = daemon_config({}, _toml(tmp_path, f'root = "{tmp_path}"\nshm_budget = "1.5G"\nwrite_rate_limit = 1048576\n'))
    assert (cfg.shm_budget, cfg.write_rate_limit) == (3 << 29, float(1 << 20))


# ---------------------------------------------------------------------------- the [remote] table


def test_remote_table(tmp_path: Path) -> None:
    text = (
        f'root = "{tmp_path}"\nkeep = 4\n'
        "[remote]\n"
        'bucket = "my-checkpoints"\nprefix = "cluster-a/"\nendpoint_url = "http://127.0.0.1:9000"\nregion = "eu-west-1"\n'
        'max_bandwidth = "200M"\npart_size = "8M"\nmax_attempts = 2\nconnect_timeout = 3\nread_timeout = 4.5\n'
        "keep = 5\nkeep_every = 1000\ncommit_timeout = 90\n"
    )
    cfg = daemon_config({}, _toml(tmp_path, text))
    assert cfg.remote == RemoteConfig(
        bucket="my-checkpoints", prefix="cluster-a", endpoint_url="http://127.0.0.1:9000", region="eu-west-1",
        max_bandwidth=200 << 20, part_size=8 << 20, max_attempts=2, connect_timeout=3.0, read_timeout=4.5,
    )  # fmt: skip
    assert (cfg.remote_keep, cfg.remote_keep_every, cfg.commit_timeout) == (5, 1000, 90.0)
    assert isinstance(cfg.commit_timeout, float)
    assert cfg.keep == 4  # the top-level keep (local steps) is not the bucket's


def test_remote_table_with_only_a_bucket_takes_the_defaults(tmp_path: Path) -> None:
    cfg = daemon_config({}, _toml(tmp_path, f'root = "{tmp_path}"\n[remote]\nbucket = "abc"\n'))
    assert cfg.remote == RemoteConfig(bucket="abc")
    assert (cfg.remote_keep, cfg.remote_keep_every, cfg.commit_timeout) == REMOTE_TIER_DEFAULTS
    assert cfg.keep == config.KEEP


def test_remote_keep_and_local_keep_do_not_cross(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``--keep`` and ``CKPTD_KEEP`` set the local retention only; ``[remote] keep`` the bucket's only."""
    monkeypatch.setenv("CKPTD_KEEP", "8")
    path = _toml(tmp_path, f'root = "{tmp_path}"\n[remote]\nbucket = "abc"\nkeep = 2\n')
    cfg = daemon_config({}, path)
    assert (cfg.keep, cfg.remote_keep) == (8, 2)
    cfg = daemon_config({"keep": 6}, path)
    assert (cfg.keep, cfg.remote_keep) == (6, 2)


@pytest.mark.parametrize(
    "key,least", [("keep", 1), ("keep_every", 0), ("commit_timeout", 1)]
)  # fmt: skip
def test_remote_tier_bounds(tmp_path: Path, key: str, least: int) -> None:
    field = {"keep": "remote_keep", "keep_every": "remote_keep_every", "commit_timeout": "commit_timeout"}[key]
    ok = daemon_config({}, _toml(tmp_path, f'root = "{tmp_path}"\n[remote]\nbucket = "abc"\n{key} = {least}\n', "ok.toml"))
    assert getattr(ok, field) == least
    for bad in (str(least - 1), "-5", "true", '"3"', "2.5"):
        path = _toml(tmp_path, f'root = "{tmp_path}"\n[remote]\nbucket = "abc"\n{key} = {bad}\n')
        with pytest.raises(ValueError) as e:
            daemon_config({}, path)
        assert str(e.value).startswith(f"{path}: remote.{key} must be an integer >= {least}, got "), str(e.value)


@pytest.mark.parametrize(
    "table,msg",
    [
        ('remote = "s3://bucket"\n', "[remote] must be a table"),
        ("[remote]\nprefix = 'p'\n", "'bucket' is required"),
        ("[remote]\nbucket = 'abc'\nsecret_key = 'x'\n", "unknown keys 'secret_key'"),
        ("[remote]\nbucket = 'Not_A_Bucket'\n", "invalid bucket name 'Not_A_Bucket'"),
        ("[remote]\nbucket = 'abc'\nprefix = '/abs'\n", "prefix '/abs' must not start with '/'"),
        ("[remote]\nbucket = 'abc'\nendpoint_url = 'minio:9000'\n", "endpoint_url 'minio:9000' must start with http"),
        ("[remote]\nbucket = 'abc'\npart_size = '1M'\n", "part_size must be between"),
        ("[remote]\nbucket = 'abc'\npart_size = 'big'\n", "remote.part_size: not a size: 'big'"),
        ("[remote]\nbucket = 'abc'\nmax_bandwidth = 'zz'\n", "remote.max_bandwidth: not a size: 'zz'"),
        ("[remote]\nbucket = 'abc'\nmax_bandwidth = 0\n", "max_bandwidth must be positive"),
        ("[remote]\nbucket = 'abc'\nmax_attempts = 0\n", "max_attempts must be at least 1"),
        ("[remote]\nbucket = 'abc'\nmax_attempts = '8'\n", "max_attempts must be int"),
        ("[remote]\nbucket = 'abc'\nread_timeout = 0\n", "read_timeout must be positive"),
    ],
)
def test_remote_errors_name_the_file_and_key(tmp_path: Path, table: str, msg: str) -> None:
    path = _toml(tmp_path, f'root = "{tmp_path}"\n{table}')
    with pytest.raises(ValueError) as e:
        daemon_config({}, path)
    assert str(e.value).startswith(f"{path}: ") and msg in str(e.value), str(e.value)


def test_a_remote_table_does_not_hide_unknown_top_level_keys(tmp_path: Path) -> None:
    path = _toml(tmp_path, f'root = "{tmp_path}"\nbogus = 1\n[remote]\nbucket = "abc"\n')
    with pytest.raises(ValueError, match=r"unknown settings \['bogus'\]"):
        daemon_config({}, path)


@pytest.mark.parametrize("text", ["infG", "-1G", "-5", "1e400K"])
def test_parse_size_refuses_negative_and_unbounded_sizes(text: str) -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


@pytest.mark.parametrize("job", ["a\n", "job\n", "x\r"])
def test_validate_job_refuses_a_trailing_newline(job: str) -> None:
    with pytest.raises(ValueError, match="invalid job name"):
        validate_job(job)


@pytest.mark.parametrize(
    "flags,msg",
    [
        ({"workers": 0}, "workers must be >= 1"),
        ({"shm_budget": 0}, "shm_budget must be >= 1"),
        ({"write_rate_limit": -1}, "write_rate_limit must be >= 0"),
        ({"metrics_port": -1}, "metrics_port must be >= 0"),
        ({"metrics_port": 70000}, "metrics_port must be a TCP port"),
    ],
)
def test_settings_that_cannot_run_are_refused_up_front(tmp_path: Path, flags: dict[str, Any], msg: str) -> None:
    """A daemon that could not start its threads, or would refuse every allocation, is a config error."""
    with pytest.raises(ValueError, match=msg):
        daemon_config({"root": str(tmp_path), **flags})


def test_environment_sizes_and_booleans_are_spelled_as_on_the_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTD_WRITE_RATE_LIMIT", "500M")
    monkeypatch.setenv("CKPTD_IDLE_PRIORITY", "False")
    cfg = daemon_config({"root": "/r"})
    assert cfg.write_rate_limit == 500 << 20 and cfg.idle_priority is False
    monkeypatch.setenv("CKPTD_IDLE_PRIORITY", "perhaps")
    with pytest.raises(ValueError, match="CKPTD_IDLE_PRIORITY='perhaps' is not a boolean"):
        daemon_config({"root": "/r"})
    monkeypatch.setenv("CKPTD_IDLE_PRIORITY", "1")
    monkeypatch.setenv("CKPTD_LEASE_TIMEOUT", "0")
    with pytest.raises(ValueError, match="lease_timeout must be >= 1"):
        daemon_config({"root": "/r"})


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"log_level": "bogus"}, "log_level must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL, got 'BOGUS'"),
        ({"lease_timeout": float("nan")}, "lease_timeout must be a finite number, got nan"),
        ({"persist_interval": float("inf")}, "persist_interval must be a finite number, got inf"),
        ({"write_rate_limit": float("nan")}, "write_rate_limit must be a finite number, got nan"),
    ],
)
def test_a_setting_no_logger_or_clock_can_use_is_refused_by_name(tmp_path: Path, flags: dict[str, Any], message: str) -> None:
    # the user's mistakes: a log level the logging module does not know (a traceback at start before), a NaN
    # lease timeout (every comparison false: leases never expired) or an infinite interval
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        daemon_config({"root": str(tmp_path), **flags})


def test_an_empty_group_means_no_group_and_a_private_umask(tmp_path: Path) -> None:
    # `group = ""` in the file (or --group "") was taken as a group: the daemon's umask became 027 with no group
    # set, so its primary group could read every checkpoint; it means no group, as an empty CKPTD_GROUP does
    cfg_file = tmp_path / "ckptd.toml"
    cfg_file.write_text(f'root = "{tmp_path}"\ngroup = ""\nlog_level = "debug"\n')
    cfg = daemon_config({}, str(cfg_file))
    assert cfg.group is None and cfg.log_level == "DEBUG"


def test_every_setting_is_listed_in_the_shipped_config_file() -> None:
    """README: "Every key is listed in systemd/ckptd.toml" (lease_timeout and the memory tier's were not)."""
    import re

    from ckptd.config import SERVE_KEYS
    from ckptd.s3config import RemoteConfig

    text = (Path(__file__).resolve().parents[1] / "systemd" / "ckptd.toml").read_text()
    listed = set(re.findall(r"^#?\s*([a-z_]+)\s*=", text, re.M))
    remote = {"keep", "keep_every", "commit_timeout"} | set(RemoteConfig.__dataclass_fields__)
    assert set(SERVE_KEYS) - listed == set() and remote - listed == set(), (set(SERVE_KEYS) | remote) - listed


@pytest.mark.parametrize("nice", [-20, -1, 20])
def test_a_nice_value_that_would_not_yield_to_training_is_refused(tmp_path: Path, nice: int) -> None:
    """``nice = -20`` was accepted: a daemon run as root would raise its persist and upload threads above training."""
    from ckptd.config import daemon_config

    with pytest.raises(ValueError, match=r"nice must be 0\.\.19"):
        daemon_config({"root": str(tmp_path), "nice": nice}, None)


# ---------------------------------------------------------------------------- the shared directory as the remote tier


def test_a_shared_directory_as_the_remote_tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptd.s3config import DirConfig

    conf = _toml(tmp_path, '[remote]\npath = "/lustre/ckpts/"\nkeep = 5\ncommit_timeout = 90\n')
    cfg = daemon_config({"root": "/r"}, conf)
    assert cfg.remote == DirConfig("/lustre/ckpts") and cfg.remote_keep == 5 and cfg.commit_timeout == 90.0
    # the flag replaces the file's directory (or bucket); the tier's keys stay
    cfg = daemon_config({"root": "/r", "remote_path": "/gpfs/other"}, conf)
    assert cfg.remote == DirConfig("/gpfs/other") and cfg.remote_keep == 5
    bucket = _toml(tmp_path, '[remote]\nbucket = "b-1"\n', "bucket.toml")
    assert daemon_config({"root": "/r", "remote_path": "/gpfs/x"}, bucket).remote == DirConfig("/gpfs/x")
    # the variable applies where the file names no [remote]; the file's wins over it
    monkeypatch.setenv("CKPTD_REMOTE_PATH", "/nfs/ckpts")
    assert daemon_config({"root": "/r"}).remote == DirConfig("/nfs/ckpts")
    assert isinstance(daemon_config({"root": "/r"}, bucket).remote, RemoteConfig)


@pytest.mark.parametrize(
    ("text", "flags", "message"),
    [
        ('[remote]\npath = "/a"\nbucket = "b-1"\n', {}, "'bucket' do not go with 'path'"),
        ('[remote]\npath = "relative/dir"\n', {}, "must be absolute"),
        ('[remote]\npath = ""\n', {}, "non-empty"),
        ("[remote]\npath = 3\n", {}, "must be a non-empty string"),
        ("", {"remote_path": "ckpts"}, "must be absolute"),
        ('remote_path = "/x"\n', {}, "unknown settings"),
    ],
)
def test_a_wrong_shared_directory_setting_is_refused_naming_it(tmp_path: Path, text: str, flags: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        daemon_config({"root": "/r", **flags}, _toml(tmp_path, text) if text else None)


def test_remote_keys_without_a_bucket_or_path_take_the_flag_and_a_root_inside_the_shared_directory_is_refused(
    tmp_path: Path,
) -> None:
    from ckptd.s3config import DirConfig

    conf = _toml(tmp_path, "[remote]\nkeep = 4\ncommit_timeout = 60\n")
    cfg = daemon_config({"root": "/r", "remote_path": "/shared"}, conf)
    assert cfg.remote == DirConfig("/shared") and cfg.remote_keep == 4 and cfg.commit_timeout == 60.0
    with pytest.raises(ValueError, match=r"names neither a bucket nor a path"):
        daemon_config({"root": "/r"}, conf)
    for root, shared in (("/shared", "/shared/"), ("/shared/node0", "/shared"), ("/data", "/data/shared")):
        with pytest.raises(ValueError, match="overlap"):
            daemon_config({"root": root, "remote_path": shared})
    assert daemon_config({"root": "/shared-local", "remote_path": "/shared"}).remote == DirConfig("/shared")
