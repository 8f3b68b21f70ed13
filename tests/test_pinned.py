"""Page-locked staging made on transparent huge pages (``ckptd.client.pinned``): the memory, its registration and
its release, with the CUDA calls stood in for (``tests/test_cuda.py`` runs the real ones on a GPU)."""

from __future__ import annotations

import mmap

import pytest
import torch

from ckptd.client import pinned

HUGE = pinned.HUGE_PAGE


def _mapped(addr: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


def _anon_huge_kb(addr: int) -> int:
    inside, kb = False, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "AnonHugePages:":
                kb = int(line.split()[1])
    return kb


class Registry:
    """Stands in for cudaHostRegister / cudaHostUnregister: what was registered, and whether to refuse."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse, self.live, self.calls = refuse, {}, []

    def register(self, addr: int, size: int) -> bool:
        self.calls.append((addr, size))
        if self.refuse:
            return False
        self.live[addr] = size
        return True

    def unregister(self, addr: int) -> None:
        del self.live[addr]


needs_thp = pytest.mark.skipif(not (pinned.huge_pages() and hasattr(mmap, "MADV_HUGEPAGE")), reason="no transparent huge pages here")


@needs_thp
def test_a_block_is_on_huge_pages_registered_whole_and_gone_once_released() -> None:
    reg = Registry()
    buf, release, how = pinned.page_locked(3 * HUGE + 5, reg.register, reg.unregister)
    addr = buf.data_ptr()
    assert how == "huge" and buf.numel() == 3 * HUGE + 5 and buf.dtype == torch.uint8
    assert addr % HUGE == 0 and reg.live == {addr: 4 * HUGE}  # registered from a huge page's start, in whole huge pages
    buf.fill_(9)
    assert int(buf[-1]) == 9 and _anon_huge_kb(addr) >= 2048  # at least some of it sits on huge pages
    del buf
    release()
    assert reg.live == {} and not _mapped(addr)


@needs_thp
def test_a_view_still_alive_at_release_keeps_the_memory_mapped_until_it_is_collected() -> None:
    reg = Registry()
    buf, release, _ = pinned.page_locked(HUGE, reg.register, reg.unregister)
    addr = buf.data_ptr()
    release()  # unregistered at once; the mapping lives on under the view (reading it stays safe)
    assert reg.live == {} and _mapped(addr) and int(buf.sum()) == 0
    del buf
    assert not _mapped(addr)


@needs_thp
def test_a_refused_registration_unmaps_the_block_and_falls_back_to_pin_memory(monkeypatch) -> None:  # noqa: ANN001
    reg = Registry(refuse=True)
    fallback = torch.zeros(HUGE, dtype=torch.uint8)
    monkeypatch.setattr(pinned, "_pin_memory", lambda n: fallback[:n])
    before = pinned.MADE.copy()
    buf, release, how = pinned.page_locked(HUGE, reg.register, reg.unregister)
    assert how == "pinned" and buf.data_ptr() == fallback.data_ptr() and pinned.MADE - before == {"pinned": 1}
    ((addr, _),) = reg.calls
    assert not _mapped(addr)  # the refused block did not stay behind
    release()


@pytest.mark.parametrize("mode", ["always madvise [never]", ""])
def test_without_transparent_huge_pages_it_is_pin_memory_and_no_registration(tmp_path, monkeypatch, mode: str) -> None:  # noqa: ANN001
    path = tmp_path / "enabled"
    if mode:
        path.write_text(mode + "\n")
    monkeypatch.setattr(pinned, "THP_ENABLED", str(path))  # (missing, when mode is empty)
    monkeypatch.setattr(pinned, "_pin_memory", lambda n: torch.zeros(n, dtype=torch.uint8))
    reg = Registry()
    buf, release, how = pinned.page_locked(4096, reg.register, reg.unregister)
    assert how == "pinned" and buf.numel() == 4096 and reg.calls == []
    release()


@pytest.mark.parametrize(
    "mode,huge", [("[always] madvise never", True), ("always [madvise] never", True), ("always madvise [never]", False)]
)
def test_huge_pages_reads_the_kernels_setting(tmp_path, monkeypatch, mode: str, huge: bool) -> None:  # noqa: ANN001
    (tmp_path / "enabled").write_text(mode + "\n")
    monkeypatch.setattr(pinned, "THP_ENABLED", str(tmp_path / "enabled"))
    assert pinned.huge_pages() is huge
