"""Native kernels are built from their source and the headers it includes, rebuilt when
either changes, and simply absent (PyTorch paths) when the source is."""

import shutil

import pytest

from libs.engine.model import native


@pytest.fixture
def kernels(tmp_path, monkeypatch):
    if shutil.which("cc") is None:
        pytest.skip("no C compiler here")
    sources = tmp_path / "src"
    sources.mkdir()
    monkeypatch.setattr(native, "SOURCES", sources)
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    native.load.cache_clear()
    yield sources
    native.load.cache_clear()


def built(tmp_path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "cache" / "kernels").glob("*.so"))


def test_a_header_change_rebuilds_the_kernel(kernels, tmp_path):
    (kernels / "answer.c").write_text('#include "value.h"\nint answer(void) { return VALUE; }\n')
    (kernels / "value.h").write_text("#define VALUE 41\n")
    assert native.load("answer").answer() == 41
    first = built(tmp_path)
    native.load.cache_clear()
    (kernels / "value.h").write_text("#define VALUE 42\n")
    assert native.load("answer").answer() == 42
    assert len(built(tmp_path)) == 2 and first[0] in built(tmp_path)


def test_a_missing_source_means_no_kernel(kernels, caplog):
    assert native.load("nowhere") is None
    assert "source missing" in caplog.text
