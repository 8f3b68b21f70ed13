"""The client's requests that touch no state of its own: the daemon's greeting and status, the job's latest step,
and the names that keep a step from retention. :class:`.client.Client` inherits them."""

from __future__ import annotations

from typing import Any

from ..protocol import reply_fields
from .options import JobName, check_step
from .rpc import Channel


class DaemonRequests:
    """Plain requests of one job's client (``_rpc``: its channel; ``job``: its name; ``_name``: how the name was chosen)."""

    _rpc: Channel
    job: str
    _name: JobName

    def hello(self) -> dict[str, Any]:
        """The daemon's greeting.

        Returns:
            Its ``server_version``, ``root``, ``pid`` and tiering policy (``tiering``)."""
        return self._rpc.call("hello")

    def status(self) -> dict[str, Any]:
        """The daemon's state, as ``ckptd status --json`` prints it.

        Returns:
            The status fields, as a dict."""
        return reply_fields(self._rpc.call("status"))

    def latest(self) -> int | None:
        """The latest complete step of this job, as :func:`ckptd.latest` (which lists its errors).

        Returns:
            The step committed last, or ``None``."""
        self._name.announce(self._rpc)
        return self._rpc.call("latest", job=self.job)["step"]

    def protect(self, step: int, name: str) -> None:
        """Keep ``step`` of this job from retention (the daemon's disk and bucket, however old) while ``name`` protects it.

        Naming it again moves it (``last.ckpt`` follows the newest save). A memory-only step is persisted (so is a rolled-back
        run's re-save of a protected number), one the bucket lost is uploaded again. Durable (``<root>/<job>/protected.json``) on return.

        Args:
            step: The step to keep: being saved, or complete on the node's disk.
            name: What protects it (a pointer file's path, say): up to 10,000 per job, no control characters; ``ckptd ls`` prints them.
        Raises:
            ProtocolError: The daemon refused it, saying why (a step neither being saved nor complete, too many names)."""
        check_step(step)
        self._rpc.call("protect", job=self.job, step=step, name=name)

    def unprotect(self, name: str) -> bool:
        """Let go of the step ``name`` protected: a retention pass runs at once.

        Args:
            name: The name :meth:`protect` was given.
        Returns:
            Whether ``name`` protected a step (``False`` also when a daemon restarted after carrying out this request is asked again)."""
        return self._rpc.call("unprotect", job=self.job, name=name)["before"] is not None
