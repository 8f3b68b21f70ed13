"""The Kubernetes manifests under deploy/kubernetes: valid against the schemas of a fixed Kubernetes version
(kubernetes-validate, strict: a misspelled field fails too, offline), and carrying what the daemon and its trainers
must share on a node (docs/kubernetes.md): the host's /dev/shm, the socket's directory, the checkpoint root, the
same uid; and what the daemon needs: hostPID, a grace period as long as the systemd unit's, a memory limit that
holds its shared-memory budget, a liveness probe that fails when nothing serves, a TOML that ckptd accepts."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from conftest import REPO

from ckptd.config import DaemonConfig, daemon_config

K8S = REPO / "deploy" / "kubernetes"
MANIFESTS = sorted(K8S.glob("*.yaml"))
K8S_VERSION = "1.33"  # kubernetes-validate ships this version's schemas: no network
UNIT = REPO / "systemd" / "ckptd.service"


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _one(kind: str, path: Path) -> dict[str, Any]:
    (doc,) = [d for d in _docs(path) if d["kind"] == kind]
    return doc


def _daemon_pod() -> dict[str, Any]:
    return _one("DaemonSet", K8S / "ckptd-daemonset.yaml")["spec"]["template"]["spec"]


def _trainer_pod() -> dict[str, Any]:
    return _one("Job", K8S / "trainer-example.yaml")["spec"]["template"]["spec"]


def _container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    (c,) = [c for c in pod["containers"] if c["name"] == name]
    return c


def _host_mounts(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """mountPath -> (the host path of its hostPath volume, read-only) for every hostPath mount of ``container``."""
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    paths = [m["mountPath"] for m in container["volumeMounts"]]
    assert len(paths) == len(set(paths)), f"two volumes at one path in {container['name']}: {paths}"
    return {m["mountPath"]: (host[m["name"]], m.get("readOnly", False)) for m in container["volumeMounts"] if m["name"] in host}


def _config_toml() -> str:
    return _one("ConfigMap", K8S / "ckptd-daemonset.yaml")["data"]["ckptd.toml"]


def _config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> DaemonConfig:
    """The ConfigMap's TOML as ckptd's own loader reads it, with no CKPTD_* variable of this environment mixed in."""
    for name in [n for n in os.environ if n.startswith("CKPTD_")]:
        monkeypatch.delenv(name)
    path = tmp_path / "ckptd.toml"
    path.write_text(_config_toml())
    return daemon_config(config_file=str(path))


def _bytes(quantity: str) -> int:
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|k|M|G|T)?", quantity)
    assert m, f"unexpected quantity {quantity!r}"
    unit = {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    return int(m.group(1)) * unit[m.group(2)]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_is_valid_kubernetes(path: Path) -> None:
    docs = _docs(path)
    assert docs
    for doc in docs:
        assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True) == K8S_VERSION, doc["kind"]


def test_the_validation_fails_on_a_broken_manifest() -> None:
    ds = _one("DaemonSet", K8S / "ckptd-daemonset.yaml")
    wrong_type, misspelled = copy.deepcopy(ds), copy.deepcopy(ds)
    wrong_type["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "300s"
    misspelled["spec"]["template"]["spec"]["hostPid"] = True
    for broken in (wrong_type, misspelled):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_the_configmap_toml_is_accepted_by_ckptd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert tomllib.loads(_config_toml())["root"]
    cfg = _config(tmp_path, monkeypatch)
    assert cfg.endpoint.startswith("ipc:///") and os.path.isabs(cfg.root)
    assert cfg.shm_budget is not None  # explicit: the default (half of /dev/shm) could pass the memory limit


def test_daemon_and_trainers_share_shm_socket_and_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _config(tmp_path, monkeypatch)
    socket_dir = os.path.dirname(cfg.endpoint.removeprefix("ipc://"))
    daemon, trainer = _daemon_pod(), _trainer_pod()
    served = _host_mounts(daemon, _container(daemon, "ckptd"))
    client = _container(trainer, "trainer")
    used = _host_mounts(trainer, client)
    # the same host directories at the same paths: the daemon names segments and step directories by path
    for path in ("/dev/shm", socket_dir, cfg.root):
        assert path in served and path in used, path
        assert served[path][0] == used[path][0], path
        assert not served[path][1], path
    assert served["/dev/shm"][0] == "/dev/shm"  # the host's shared memory, not a pod's own
    assert not used["/dev/shm"][1]  # the trainer maps its leased segments for writing
    assert used[socket_dir][1] and used[cfg.root][1]  # read-only: connecting and restoring need no more
    assert {e["name"]: e.get("value") for e in client["env"]}["CKPTD_ENDPOINT"] == cfg.endpoint
    assert "CKPTD_JOB" in {e["name"] for e in client["env"]}
    # the client trusts only a socket of its own uid: the trainers run as the daemon's user
    assert daemon["securityContext"]["runAsUser"] == trainer["securityContext"]["runAsUser"]
    assert "hostUsers" not in trainer


def test_daemon_pod_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _config(tmp_path, monkeypatch)
    pod = _daemon_pod()
    main = _container(pod, "ckptd")
    # liveness of trainers by pid (SO_PEERCRED, /proc): pids of other PID namespaces read as 0
    assert pod["hostPID"] is True
    stop = int(re.search(r"^TimeoutStopSec=(\d+)$", UNIT.read_text(), re.M).group(1))  # type: ignore[union-attr]
    assert pod["terminationGracePeriodSeconds"] >= stop >= 300
    # the segments are charged to the daemon's memory cgroup: the limit holds the budget and the process
    assert _bytes(main["resources"]["limits"]["memory"]) >= cfg.shm_budget + (1 << 30)  # type: ignore[operator]
    assert {e["name"]: e.get("value") for e in main["env"]}["CKPTD_ENDPOINT"] == cfg.endpoint  # for `kubectl exec ... ckptd status`
    # the config file the command names is the ConfigMap's
    config = main["command"][main["command"].index("--config") + 1]
    (mount,) = [m for m in main["volumeMounts"] if m["mountPath"] == os.path.dirname(config)]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == "ckptd-config" and os.path.basename(config) == "ckptd.toml"
    for probe in ("startupProbe", "livenessProbe"):
        assert main[probe]["exec"]["command"] == ["ckptd", "status", "--endpoint", cfg.endpoint], probe
        assert main[probe]["timeoutSeconds"] > 10  # status waits up to ~10 s for a daemon that does not answer
    # the init container hands the socket's directory and the root to the daemon's user
    uid, gid = pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]
    (init,) = pod["initContainers"]
    script = init["command"][-1]
    socket_dir = os.path.dirname(cfg.endpoint.removeprefix("ipc://"))
    assert f"chown {uid}:{gid} {socket_dir} {cfg.root}" in script and f"chmod 0700 {socket_dir} {cfg.root}" in script


def test_the_liveness_probe_fails_once_nothing_serves(make_daemon, short_tmp: Path) -> None:  # noqa: ANN001
    config = short_tmp / "ckptd.toml"
    config.write_text(_config_toml())
    d = make_daemon("--config", str(config), "--shm-budget", "64M")  # its own --root and --endpoint win over the file
    probe = _container(_daemon_pod(), "ckptd")["livenessProbe"]["exec"]["command"]
    cmd = [sys.executable, "-m", "ckptd", *probe[1:-1], d.endpoint]

    def run() -> int:
        return subprocess.run(cmd, capture_output=True, timeout=60, cwd=REPO).returncode

    assert run() == 0
    assert d.stop() == 0
    assert run() == 1
