"""Every Python snippet of README.md and the guides (docs/*.md) runs in a test, so the docs cannot drift from the code.

Each snippet is extracted from its page when the test runs (never a copy pasted here) and executed as written against a
real daemon, in a process of its own: what a snippet expects the reader to have (``model``, ``data``) is defined before
it, tiny; what it did is checked after it (the steps the daemon holds, where a resume started, the state it restored).
``SNIPPETS`` names the test that runs each one; a snippet added to a page without an entry there fails
``test_every_python_snippet_in_the_docs_is_run_by_a_test``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from _poll import until
from conftest import REPO

TESTS = Path(__file__).resolve().parent

# ---------------------------------------------------------------------------- the snippets, and who runs them


@dataclass(frozen=True)
class Snippet:
    doc: str  # the page, relative to the repository
    line: int  # the page's line number of the snippet's first line
    code: str


@dataclass(frozen=True)
class RunElsewhere:
    """A snippet another test module runs: that test takes the first ``python`` block after ``heading``."""

    test: str  # tests/<file>.py::<test function>
    heading: str


# (page, a substring only that snippet of the page holds) -> the test of this module that runs it, or one elsewhere
README_QUICKSTART = ("README.md", 'extra={"step": step}')
GETTING_STARTED = ("docs/getting-started.md", "data.position")
MEMORY_TIER = ("docs/memory-tier.md", "CKPTD_PERSIST_EVERY")
DCP = ("docs/integrations.md", "ckptd.dcp.Writer(")
LIGHTNING = ("docs/integrations.md", "CkptdCheckpointIO(")
HF = ("docs/integrations.md", "CkptdCallback(")
TORCHTITAN = ("docs/integrations.md", "CkptdCheckpointManager.Config(")

SNIPPETS: dict[tuple[str, str], str | RunElsewhere] = {
    README_QUICKSTART: RunElsewhere("tests/test_readme.py::test_the_readme_quickstart_is_killed_and_resumes", "## Quickstart"),
    GETTING_STARTED: "test_getting_started_loop_resumes_where_its_last_snapshot_left_off",
    MEMORY_TIER: "test_memory_tier_loop_persists_one_step_in_50_and_resumes_from_the_newest",
    DCP: RunElsewhere("tests/test_dcp_writer.py::test_the_guides_dcp_snippet_runs", "## `torch.distributed.checkpoint`"),
    LIGHTNING: "test_lightning_snippet_resumes_a_killed_fit_from_last",
    HF: "test_hf_snippet_resumes_the_trainer_from_the_callbacks_step",
    TORCHTITAN: "test_torchtitan_snippet_config_saves_through_the_daemon_and_loads_back",
}

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,}|:{3,})[ \t]*(?P<info>[^`]*?)[ \t]*$")
_PYTHON = re.compile(r"^(?:\{(?:code-block|code|sourcecode|code-cell)\}[ \t]+)?(?:python3?|py)(?:$|[ \t])", re.IGNORECASE)
_RST_PYTHON = re.compile(r"^[ \t]*\.\.[ \t]+(?:code-block|code|sourcecode)::[ \t]*(?:python3?|py)\b", re.IGNORECASE)


def pages() -> list[Path]:
    """README.md and every page of the docs site (Sphinx's excluded ``_build`` and ``bench`` left out)."""
    docs = REPO / "docs"
    return [REPO / "README.md", *sorted(p for p in docs.rglob("*.md") if not {"_build", "bench"} & set(p.relative_to(docs).parts))]


def python_blocks(page: Path) -> list[Snippet]:
    """The page's fenced ``python`` blocks (also ``py``, ``{code-block} python``, indented in a list), dedented."""
    return blocks_in(page.relative_to(REPO).as_posix(), page.read_text())


def blocks_in(doc: str, text: str) -> list[Snippet]:
    """The fenced ``python`` blocks of ``text``, page ``doc``."""
    lines = text.splitlines()
    for n, line in enumerate(lines, 1):  # (also inside an {eval-rst} block)
        assert not _RST_PYTHON.match(line), f"{doc}:{n}: a python code-block in reStructuredText: teach blocks_in to read it"
    found, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        fence = m["fence"]
        close = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        end = next((j for j in range(i + 1, len(lines)) if close.match(lines[j])), None)
        assert end is not None, f"{doc}:{i + 1}: a code fence that never closes"
        if _PYTHON.match(m["info"]):
            first = i + 1
            if m["info"].startswith("{"):  # a directive's options (`:caption: x`) open its body
                while first < end and re.match(r"^[ \t]*:[\w-]+:", lines[first]):
                    first += 1
            found.append(Snippet(doc, first + 1, textwrap.dedent("\n".join(lines[first:end])) + "\n"))
        i = end + 1
    return found


def test_the_scanner_finds_python_blocks_in_every_form_myst_reads() -> None:
    page = """
intro
```python
a = 1
```
```sh
python -c 'print(1)'
```
~~~py
b = 2
~~~
- in a list:

  ```{code-block} python
  :caption: c.py
  c = 3
  ```
:::{code-block} python
d = 4
:::
````markdown
```python
not_a_snippet = 0
```
````
```pycon
>>> not_run = 0
```
"""
    got = blocks_in("page.md", page)
    assert [(s.line, s.code) for s in got] == [(4, "a = 1\n"), (10, "b = 2\n"), (16, "c = 3\n"), (19, "d = 4\n")]
    with pytest.raises(AssertionError, match="reStructuredText"):
        blocks_in("page.md", "```{eval-rst}\n.. code-block:: python\n\n   x = 1\n```\n")


def snippet(key: tuple[str, str]) -> Snippet:
    """The one python block of page ``key[0]`` that holds ``key[1]``."""
    doc, marker = key
    hits = [s for s in python_blocks(REPO / doc) if marker in s.code]
    assert len(hits) == 1, f"{doc}: {len(hits)} python blocks hold {marker!r} (lines {[s.line for s in hits]}): update SNIPPETS"
    return hits[0]


def test_every_python_snippet_in_the_docs_is_run_by_a_test() -> None:
    blocks = [s for page in pages() for s in python_blocks(page)]
    assert blocks, "no python block found in README.md or docs/: the scanner is broken"
    runs = {key: snippet(key) for key in SNIPPETS}  # every entry names exactly one block
    for s in blocks:
        keys = [k for k, found in runs.items() if found == s]
        first = s.code.strip().splitlines()[0] if s.code.strip() else ""
        assert keys, f"{s.doc}:{s.line} ({first!r}): no test runs this snippet: add a test and its entry in SNIPPETS"
        assert len(keys) == 1, f"{s.doc}:{s.line}: several SNIPPETS entries name this snippet: {keys}"
    for key, by in SNIPPETS.items():
        if isinstance(by, str):
            assert by.startswith("test_") and callable(globals().get(by)), f"{key}: no test {by} in this module"
            continue
        # run by a test of another module: it is still there, still looks for the block after the same heading,
        # and the first python block after that heading is still this one
        path, name = by.test.split("::")
        source = (REPO / path).read_text()
        assert f"def {name}(" in source, f"{key}: {by.test} is gone"
        assert by.heading in source, f"{key}: {by.test} no longer finds its snippet by {by.heading!r}"
        doc_lines = (REPO / key[0]).read_text().splitlines()
        at = next(n for n, line in enumerate(doc_lines, 1) if line.startswith(by.heading))
        after = [s for s in python_blocks(REPO / key[0]) if s.line > at]
        assert after and after[0] == runs[key], f"{key}: the first python block after {by.heading!r} is not this snippet"


# ---------------------------------------------------------------------------- running a snippet in a process of its own

# runs its files (before, the snippet, after) in one namespace; the snippet compiled under the page's path and line
# numbers, so that a traceback names the page's own lines. ``Stopped``, raised by what the test gave the snippet, ends
# it (``stopped`` is then true for ``after``). ``report(key=value)`` tells the test what happened.
_RUNNER = """
import json, os, sys

def report(**facts):
    with open(os.environ["SNIPPET_REPORT"], "a") as f:
        f.write(json.dumps(facts) + "\\n")

scope = {"__name__": "__main__", "report": report, "stopped": False}
for path, name, line in zip(sys.argv[1::3], sys.argv[2::3], sys.argv[3::3]):
    code = "\\n" * (int(line) - 1) + open(path).read()
    try:
        exec(compile(code, name, "exec"), scope)
    except Exception as e:
        if type(e).__name__ != "Stopped":
            raise
        scope["stopped"] = True
"""


def run_snippet(
    s: Snippet, cwd: Path, endpoint: str, job: str | None = None, before: str = "", after: str = "", expect: int = 0, **env: str
) -> dict:
    """Run ``before``, the snippet and ``after`` as one script in a new process, in ``cwd``, with ``CKPTD_ENDPOINT`` set
    (and ``CKPTD_JOB`` when ``job`` is given; no other ``CKPTD_*`` variable of this process) and ``env``. Returns what
    the script passed to ``report()``, merged into one dict."""
    files = []
    parts = (("before", textwrap.dedent(before), "<before>", 1), ("snippet", s.code, str(REPO / s.doc), s.line))
    for part, text, name, line in (*parts, ("after", textwrap.dedent(after), "<after>", 1)):
        (cwd / f"{part}.py").write_text(text)
        files += [str(cwd / f"{part}.py"), name, str(line)]
    reported = cwd / "report.jsonl"
    reported.unlink(missing_ok=True)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    environ.update(CKPTD_ENDPOINT=endpoint, PYTHONPATH=f"{REPO}{os.pathsep}{TESTS}", OMP_NUM_THREADS="1", **env)
    environ["SNIPPET_REPORT"] = str(reported)
    if job is not None:
        environ["CKPTD_JOB"] = job
    p = subprocess.run([sys.executable, "-c", _RUNNER, *files], env=environ, cwd=cwd, capture_output=True, text=True, timeout=150)
    assert p.returncode == expect, f"{s.doc}:{s.line} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    facts: dict = {}
    for line in reported.read_text().splitlines() if reported.exists() else ():
        facts.update(json.loads(line))
    return facts


def needs(*modules: str) -> None:
    """Skip unless ``modules`` are installed (found, not imported: only the snippet's own process imports them)."""
    for name in modules:
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{name} is not installed")


def tensors(obj: object, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state dict, by its path."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in tensors(value, f"{prefix}/{key}").items()}
    if isinstance(obj, list | tuple):
        return {k: v for i, value in enumerate(obj) for k, v in tensors(value, f"{prefix}/{i}").items()}
    return {}


def assert_same_state(a: Path, b: Path) -> None:
    """The tensors saved in files ``a`` and ``b`` (``torch.save`` of state dicts) are the same, bit for bit."""
    ta, tb = tensors(torch.load(a, weights_only=True)), tensors(torch.load(b, weights_only=True))
    assert ta and ta.keys() == tb.keys(), sorted(ta.keys() ^ tb.keys())
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), f"{k} differs"


# wraps ckptd.snapshot and ckptd.restore (the snippet looks them up on the module at each call): the state each snapshot
# saved goes to saved-<step>.pt, the state restore() put back to restored.pt
_RECORD_MODULE_CALLS = """
import ckptd, torch

_snapshot, _restore = ckptd.snapshot, ckptd.restore

def _state(model, optim):
    return {"model": model.state_dict(), "optim": optim.state_dict()}

def _recording_snapshot(model, optim=None, **kw):
    handle = _snapshot(model, optim, **kw)
    torch.save(_state(model, optim), f"saved-{kw['step']}.pt")  # a CPU state is copied before snapshot() returns
    return handle

def _recording_restore(model, optim=None, **kw):
    extra = _restore(model, optim, **kw)
    torch.save(_state(model, optim), "restored.pt")
    return extra

ckptd.snapshot, ckptd.restore = _recording_snapshot, _recording_restore
"""


# ---------------------------------------------------------------------------- the guides' own loops (module-level functions)


def test_getting_started_loop_resumes_where_its_last_snapshot_left_off(daemon, short_tmp: Path) -> None:  # noqa: ANN001
    before = """
    import os, torch

    class Batches:
        # the reader's data: an iterator of batches that knows, and takes back, its position
        def __init__(self):
            self.position = 0
        def __iter__(self):
            return self
        def __next__(self):
            self.position += 1
            return torch.randn(8, 16, generator=torch.Generator().manual_seed(self.position))

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = Batches()
    steps = int(os.environ["STEPS"])
    """
    before = textwrap.dedent(before) + _RECORD_MODULE_CALLS
    after = """
    report(start=start, position=data.position)
    """
    s = snippet(GETTING_STARTED)
    first = run_snippet(s, short_tmp, daemon.endpoint, "gs", before, after, STEPS="250")  # snapshots 0, 100, 200
    assert first == {"start": 0, "position": 250}
    with daemon.client("gs") as c:
        assert c.latest() == 200
    second = run_snippet(s, short_tmp, daemon.endpoint, "gs", before, after, STEPS="350")
    # resumed after step 200 with the data's position then (201 batches drawn), drew the batches of steps 201..349
    assert second == {"start": 201, "position": 350}
    assert_same_state(short_tmp / "restored.pt", short_tmp / "saved-200.pt")
    with daemon.client("gs") as c:
        assert c.latest() == 300


def test_memory_tier_loop_persists_one_step_in_50_and_resumes_from_the_newest(daemon, short_tmp: Path) -> None:  # noqa: ANN001
    after = """
    import os
    got = globals().get("extra")  # what the snippet's restore() returned, on a resume
    resumed = None if got is None else {"step": got.step, "source": got.source}
    report(start=start, persist_every=os.environ["CKPTD_PERSIST_EVERY"], resumed=resumed)
    """
    s = snippet(MEMORY_TIER)
    first = run_snippet(s, short_tmp, daemon.endpoint, "mt", _RECORD_MODULE_CALLS, after)
    assert first == {"start": 0, "persist_every": "50", "resumed": None}  # the snippet set the variable itself
    with daemon.client("mt") as c:
        assert c.latest() == 99  # ckptd.wait() at the end: the newest step is durable too
        assert c.status()["memory_steps_dropped"] >= 90  # of 100 steps, the ones between persisted steps stayed in memory only
    second = run_snippet(s, short_tmp, daemon.endpoint, "mt", _RECORD_MODULE_CALLS, after)
    assert second["start"] == 100 and second["resumed"] == {"step": 99, "source": "memory"}, second
    assert_same_state(short_tmp / "restored.pt", short_tmp / "saved-99.pt")
    with daemon.client("mt") as c:
        assert c.latest() == 199


# ---------------------------------------------------------------------------- integrations


@pytest.mark.slow
def test_lightning_snippet_resumes_a_killed_fit_from_last(daemon, short_tmp: Path) -> None:  # noqa: ANN001
    needs("pytorch_lightning")
    from ckptd.integrations.pointer import read_pointer

    # the reader's LightningModule and data (8 batches an epoch); SIGKILLed as epoch KILL_AT starts, when the
    # previous epoch's checkpoint was saved; its state there goes to killed.pt, its state when a fit starts to started.pt
    before = """
    import os, signal, torch
    from _lightning_app import Tiny, data as _data

    class MyModule(Tiny):
        def on_train_start(self):
            torch.save(self.state_dict(), "started.pt")
            report(started_at_epoch=self.current_epoch, started_at_step=self.trainer.global_step)

        def on_train_epoch_start(self):
            if self.current_epoch == int(os.environ.get("KILL_AT", -1)):
                torch.save(self.state_dict(), "killed.pt")
                os.kill(os.getpid(), signal.SIGKILL)

    model, data = MyModule(), _data()
    """
    after = """
    report(ended_at_step=trainer.global_step)
    """
    s = snippet(LIGHTNING)
    first = run_snippet(s, short_tmp, daemon.endpoint, None, before, after, expect=-9, KILL_AT="3")
    assert first == {"started_at_epoch": 0, "started_at_step": 0}  # ckpt_path="last" with no checkpoint yet: a fresh start
    assert read_pointer(short_tmp / "ckpts" / "last.ckpt") == ("my-job", 24)  # 3 epochs of 8 batches: the job the snippet names
    with daemon.client("my-job") as c:
        until(lambda: c.latest() == 24, 60, "step 24 durable")  # the daemon persists what the killed run saved
    second = run_snippet(s, short_tmp, daemon.endpoint, None, before, after)
    assert second == {"started_at_epoch": 3, "started_at_step": 24, "ended_at_step": 80}  # resumed from last.ckpt, 10 epochs in all
    assert_same_state(short_tmp / "started.pt", short_tmp / "killed.pt")  # the weights the killed run saved
    assert read_pointer(short_tmp / "ckpts" / "last.ckpt") == ("my-job", 80)
    with daemon.client("my-job") as c:
        until(lambda: c.latest() == 80, 60, "step 80 durable")


@pytest.mark.slow
def test_hf_snippet_resumes_the_trainer_from_the_callbacks_step(daemon, short_tmp: Path) -> None:  # noqa: ANN001
    needs("transformers", "accelerate")
    # the reader's model (any torch module that returns its loss) and dataset; the model's forward ends the run with
    # Stopped at its STOP_AT-th call, before that step's optimizer step: the state then goes to stopped-<run>.pt
    before = """
    import os, torch

    class Stopped(Exception):
        pass

    class Regression(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
            self.calls = 0

        def forward(self, x, labels):
            self.calls += 1
            if self.calls == int(os.environ["STOP_AT"]):
                raise Stopped
            return {"loss": torch.nn.functional.mse_loss(self.net(x), labels)}

    g = torch.Generator().manual_seed(1)
    model = Regression()
    data = [{"x": torch.randn(8, generator=g), "labels": torch.randn(1, generator=g)} for _ in range(4096)]
    """
    after = """
    optim = trainer.optimizer.optimizer  # accelerate's wrapper around the Trainer's AdamW
    state = {"model": trainer.model.state_dict(), "optim": optim.state_dict(), "scheduler": trainer.lr_scheduler.state_dict()}
    torch.save(state, f"stopped-{os.environ['RUN']}.pt")
    report(stopped=stopped, at_step=trainer.state.global_step)
    """
    s = snippet(HF)
    # step 501 begins: the callback snapshots step 500 (save_steps=500), then the model's forward stops the run
    first = run_snippet(s, short_tmp, daemon.endpoint, None, before, after, STOP_AT="501", RUN="1")
    assert first == {"stopped": True, "at_step": 500}
    with daemon.client("my-job") as c:
        until(lambda: c.latest() == 500, 60, "step 500 durable")  # the daemon persists it once the run is gone
    assert not (short_tmp / "out").exists() or not os.listdir(short_tmp / "out")  # nothing written while training
    # the restart: resume_checkpoint("out") writes out/checkpoint-500, the Trainer resumes there, stopped at its first step
    second = run_snippet(s, short_tmp, daemon.endpoint, None, before, after, STOP_AT="1", RUN="2")
    assert second == {"stopped": True, "at_step": 500}
    assert sorted(os.listdir(short_tmp / "out")) == ["checkpoint-500"]
    assert_same_state(short_tmp / "stopped-2.pt", short_tmp / "stopped-1.pt")  # weights, Adam moments, LR schedule


def test_torchtitan_snippet_config_saves_through_the_daemon_and_loads_back(daemon, short_tmp: Path) -> None:  # noqa: ANN001
    needs("torchtitan")
    # torchtitan's async mode saves over a process group: one rank of gloo
    before = """
    import os
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="file://" + os.path.abspath("pg"), rank=0, world_size=1)
    """
    # what torchtitan's trainer does with the config: builds the manager, saves every interval steps; then a restart's
    # manager, over a freshly initialized model and optimizer, loads the newest step
    after = """
    import torch
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    class TrainState:
        def __init__(self):
            self.step = 0
        def state_dict(self):
            return {"step": self.step}
        def load_state_dict(self, sd):
            self.step = sd["step"]

    def build(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        groups = [ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})]
        optimizers = OptimizersContainer.Config(implementation="for-loop", param_groups=groups).build(model_parts=[model])
        schedulers = LRSchedulersContainer.Config().build(optimizers=optimizers, training_steps=1000)
        train = TrainState()
        manager = checkpoint.build(
            dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
            states={"train_state": train}, sd_adapter=None, base_folder=os.getcwd(),
        )
        return model, optimizers, train, manager

    model, optimizers, train, manager = build(0)
    while train.step < 500:
        train.step += 1
        model(torch.randn(16, 8)).square().mean().backward()
        optimizers.step()
        optimizers.zero_grad()
        manager.save(curr_step=train.step, last_step=False)  # interval=500: step 500 only
    manager.maybe_wait_for_saving()
    manager.close()
    torch.save({"model": model.state_dict(), "optim": optimizers.state_dict()}, "saved.pt")

    model, optimizers, train, manager = build(1)
    loaded = manager.load()
    torch.save({"model": model.state_dict(), "optim": optimizers.state_dict()}, "loaded.pt")
    manager.close()
    report(loaded=loaded, step=train.step, folder=os.path.exists(checkpoint.folder))
    dist.destroy_process_group()
    """
    got = run_snippet(snippet(TORCHTITAN), short_tmp, daemon.endpoint, None, before, after)
    assert got == {"loaded": True, "step": 500, "folder": False}  # nothing went to torchtitan's own folder
    assert_same_state(short_tmp / "loaded.pt", short_tmp / "saved.pt")
    with daemon.client("my-job") as c:
        until(lambda: c.latest() == 500, 60, "step 500 durable")
